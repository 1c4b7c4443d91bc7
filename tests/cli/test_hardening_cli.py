"""Hardening of the command line and what it reads: hostile chat templates, TensorRT artifacts on a CPU host, help
that offers only what can be built, flag names in messages, block sizes that fit small models, a quiet export."""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from moeforge.cli import main
from moeforge.cli.parser import build_parser
from moeforge.compile import onnx_export
from moeforge.core.errors import TokenizerError
from moeforge.model.chat_template import CHAT_TEMPLATE_MAX_CHARS, CHAT_TEMPLATE_TIME_LIMIT_S
from moeforge.model.tokenizer import Tokenizer
from moeforge.quant.plan import resolve_block_size
from moeforge.quant.schemes import KV_SCHEMES
from moeforge.quant.spec import KVQuantError, QuantError, QuantSpec, validate

CALIB = Path(__file__).resolve().parents[1] / "data" / "quant_calib_en.txt"


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def tiny_artifact(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """tiny-llama compiled for ONNX Runtime by the command line in a child process (torch's log handler holds the
    stderr of its process: pytest cannot capture it in this one), and what the compile printed to stderr."""
    out = tmp_path_factory.mktemp("hardening_cli") / "tiny"
    proc = subprocess.run([sys.executable, "-m", "moeforge.cli", "compile", "tiny-llama", "-o", str(out),
                           "--max-seq-len", "64", "--quiet"], capture_output=True, text=True, timeout=600,
                          cwd=out.parent)  # as a user runs it, outside the checkout
    assert proc.returncode == 0, proc.stderr
    return out, proc.stderr


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


# ------------------------------------------------------------------------------------ 6. chat templates
def _render(template: str) -> str:
    tokenizer = Tokenizer.byte_level(300, 256, 257)
    tokenizer.chat_template = template
    return tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(("template", "limit"), [
    ("{% for i in range(10**9) %}x{% endfor %}", "size limit"),
    ('{{ "x" * 10**10 }}', "size limit"),
    ('{{ "x"|center(10**10) }}', "size limit"),
    ('{{ "{:>9999999999}".format("x") }}', "size limit"),
    ('{{ ("x" * 999999).replace("", "y" * 999999) }}', "size limit"),
    ('{% set ns = namespace(s="x") %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}',
     "size limit"),
    ('{% for i in range(100000) %}{{ "y" * 100 }}{% endfor %}', "size limit"),  # the output itself
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "time limit"),
    ('{% set s = "x" * 100000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}', "time limit"),
])
def test_hostile_chat_templates_fail_fast_with_the_limit(template: str, limit: str) -> None:
    start = time.perf_counter()
    with pytest.raises(TokenizerError, match=f"chat template rendering exceeded its {limit}"):
        _render(template)
    assert time.perf_counter() - start < CHAT_TEMPLATE_TIME_LIMIT_S + 2.0


def test_ordinary_chat_templates_still_render() -> None:
    assert _render("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
                   "{% if add_generation_prompt %}<|assistant|>{% endif %}") == "<|user|>hi<|assistant|>"
    assert _render("{% for i in range(3) %}{{ loop.index }}{{ loop.last }}{% else %}none{% endfor %}"
                   "{{ '%3d'|format(7) }}{{ '{:>3}'.format('a') }}{{ 'ab'.replace('a', 'c') }}") == \
        "1False2False3True  7  acb"
    assert _render('{{ "x" * 1000 }}') == "x" * 1000
    # The limit is on what the template adds: a long message passes through.
    tokenizer = Tokenizer.byte_level(300, 256, 257)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    long = "z" * (CHAT_TEMPLATE_MAX_CHARS + 10)
    assert tokenizer.apply_chat_template([{"role": "user", "content": long}]) == long


def test_template_errors_are_tokenizer_errors() -> None:
    for template in ("{{ 1/0 }}", "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}"):
        with pytest.raises(TokenizerError, match="chat template failed"):
            _render(template)


# ------------------------------------------------------------------------------------ 13. TensorRT on CPU
def test_tensorrt_artifact_on_a_cpu_host_says_what_works(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("tensorrt_rtx_bindings")  # TensorRT-RTX builds the engine on CPU (~10 s here)
    out = str(tmp_path / "trt")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["compile", "tiny-llama", "-o", out, "--target", "trt", "--trt-impl", "tensorrt-rtx",
                 "--max-seq-len", "32"]) == 0
    # The compile itself says the result cannot run on this host.
    assert "note: this host cannot run it (it needs a CUDA GPU" in capsys.readouterr().out
    for args, why in [(["run", out, "--prompt-ids", "1,2"], "needs a CUDA GPU"),
                      (["run", out, "--prompt-ids", "1,2", "--backend", "onnxruntime"],
                       "the onnxruntime backend does not run it"),
                      (["parity", out], "parity against PyTorch runs ONNX graphs token by token, not engines"),
                      (["parity", out, "--backend", "tensorrt"], "needs a CUDA GPU")]:
        code, _, err = _run(capsys, *args)
        assert code == 2, err
        assert why in err and "compile it for ONNX Runtime: moeforge compile tiny-llama -o DIR --target ort" in err
        assert f"moeforge parity {out} --backend tensorrt" in err
        assert "model.onnx with ONNX Runtime" not in err  # the old advice, which did not work


def test_parity_backend_tensorrt_on_an_onnxruntime_artifact(tiny_artifact: tuple[Path, str],
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, "parity", str(tiny_artifact[0]), "--backend", "tensorrt")
    assert code == 2 and "ONNX Runtime artifact (no engine)" in err


# ------------------------------------------------------------------------------------ 14. help and messages
def _subparser(name: str) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = build_parser()._subparsers._group_actions[0].choices[name]
    return parser


def _help(command: str | None = None) -> str:
    return (build_parser() if command is None else _subparser(command)).format_help()


def test_help_offers_what_can_be_built_and_shows_defaults() -> None:
    top = _help()
    assert "``" not in top and "TensorRT" in top and "Exit codes" in top
    compile_help = " ".join(_help("compile").split())
    kv_quant = next(a for a in _subparser("compile")._actions if "--kv-quant" in a.option_strings)
    assert list(kv_quant.choices or ()) == ["int8"] and "fp8" not in (kv_quant.help or "")
    assert "--accuracy-level {0,4}" in compile_help and "0 = fp32 activations" in compile_help
    assert "default 16, DeepSeek-V4: the smallest multiple" in compile_help  # --kv-block-size
    run_help = " ".join(_help("run").split())
    assert "(default: 32)" in run_help and "(default: 1.0)" in run_help and "(default: None)" not in run_help
    assert "(default: 16)" in " ".join(_help("parity").split())


def test_kv_quant_fp8_is_not_offered_but_its_reason_stays(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["compile", "tiny-llama", "-o", str(tmp_path / "x"), "--kv-quant", "fp8", "--calib", str(CALIB)])
    assert exit_.value.code == 2 and "invalid choice: 'fp8'" in capsys.readouterr().err
    assert KV_SCHEMES["fp8"].unavailable is not None
    with pytest.raises(KVQuantError, match="no float8e4m3fn cache kernel"):
        validate(QuantSpec(kv_cache="fp8", calib=CALIB), target="ort", kv_cache="contiguous")
    with pytest.raises(QuantError, match=r"--accuracy-level 2 must be 0 .* or 4"):
        validate(QuantSpec(weights="int4", accuracy_level=2), target="ort", kv_cache="contiguous")


def test_config_prints_parameters_with_units(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "config", "tiny-llama")
    assert code == 0 and "152K parameters" in out and "0.000" not in out
    code, out, _ = _run(capsys, "config", "deepseek-v3")
    assert code == 0 and "671B parameters" in out


def test_max_new_tokens_is_named_as_the_flag(tiny_artifact: tuple[Path, str],
                                             capsys: pytest.CaptureFixture[str]) -> None:
    artifact = str(tiny_artifact[0])
    for model, value in [("tiny-llama", "-1"), (artifact, "0"), ("tiny-llama", "5000"), (artifact, "5000")]:
        code, _, err = _run(capsys, "run", model, "--prompt-ids", "1", "--max-new-tokens", value)
        assert code == 2 and "--max-new-tokens" in err, err
        assert "max_tokens" not in err and "max_new_tokens" not in err, err


# ------------------------------------------------------------------------------------ 15. block size
def _odd_llama(folder: Path) -> Path:
    """An HF Llama whose input dimensions (48, 80) are multiples of 16 but not of int4's default block 32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=80, num_hidden_layers=1,
                                 num_attention_heads=3, num_key_value_heads=1)).save_pretrained(folder)
    return folder


def test_default_block_size_falls_back_to_one_that_fits(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                        caplog: pytest.LogCaptureFixture) -> None:
    model = str(_odd_llama(tmp_path / "m"))
    with caplog.at_level(logging.WARNING, logger="moeforge.quant.plan"):
        code, _, err = _run(capsys, "compile", model, "-o", str(tmp_path / "a"), "--quant", "int4",
                            "--max-seq-len", "32", "--quiet")
    assert code == 0, err
    assert json.loads((tmp_path / "a" / "manifest.json").read_text())["quantization"]["block_size"] == 16
    assert any("default block size 32 does not divide" in r.getMessage() and "using block size 16" in r.getMessage()
               for r in caplog.records)
    # An explicit block size that does not fit is still refused, before anything is written.
    code, _, err = _run(capsys, "compile", model, "-o", str(tmp_path / "b"), "--quant", "int4", "--block-size", "32")
    assert code == 2 and "--block-size 32 does not divide the input dimension 48" in err and "--block-size 16" in err
    assert not (tmp_path / "b").exists()


def test_block_size_resolution() -> None:
    assert resolve_block_size(QuantSpec("int4"), [64, 160], "m") == 32
    assert resolve_block_size(QuantSpec("int4"), [64, 48], "m") == 16
    assert resolve_block_size(QuantSpec("fp8"), [64, 96], "m") == 32
    assert resolve_block_size(QuantSpec("int8"), [40], "m") is None  # per channel
    with pytest.raises(QuantError, match=r"neither its default block size 32 nor a smaller one.*per-channel scheme"):
        resolve_block_size(QuantSpec("int4"), [64, 40], "m")
    with pytest.raises(QuantError, match=r"--block-size 64 does not divide the input dimension 48.*--block-size 16"):
        resolve_block_size(QuantSpec("int4", block_size=64), [64, 48], "m")


# ------------------------------------------------------------------------------------ 16. quiet export
def test_compile_prints_no_torchvision_warnings(tiny_artifact: tuple[Path, str]) -> None:
    stderr = tiny_artifact[1]
    assert "torchvision" not in stderr and "Skipping" not in stderr, stderr


def test_only_the_exporters_torchvision_skips_are_silenced() -> None:
    logger = logging.getLogger(onnx_export._REGISTRATION_LOGGER)
    records = _Records()
    logger.addHandler(records)
    try:
        with onnx_export._quiet_torchvision_skips():
            logger.warning("torchvision is not installed. Skipping %s", "torchvision::nms")
            logger.warning("another exporter warning")
        logger.warning("torchvision is not installed. Skipping %s", "outside the export")
    finally:
        logger.removeHandler(records)
    assert records.messages == ["another exporter warning", "torchvision is not installed. Skipping outside the export"]


def test_a_closed_pipe_ends_quietly(tiny_artifact: tuple[Path, str], tmp_path: Path) -> None:
    """`moeforge inspect DIR | head -1`: the reader closes the pipe; no BrokenPipeError traceback, exit 0."""
    code = "import sys; from moeforge.cli import main; sys.exit(main(sys.argv[1:]))"
    with subprocess.Popen([sys.executable, "-c", code, "inspect", "--json", str(tiny_artifact[0])], cwd=tmp_path,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE) as child:
        assert child.stdout is not None and child.stderr is not None
        child.stdout.close()  # like `head` exiting: closed before the child (still importing) writes anything
        err = child.stderr.read().decode()
        child.wait(timeout=60)
    assert "Traceback" not in err and "BrokenPipeError" not in err
    assert child.returncode == 0
