"""Crafted configs and checkpoints (issue 13): every one is a ConfigError / CheckpointError naming the field or
tensor (the CLI's one-line exit 2), never a traceback, a hang or a MemoryError. Checkpoints are written here:
tiny HF folders (config.json + model.safetensors) and tiny F32 GGUFs."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import signal
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from moeforge.cli import main
from moeforge.core.config import ModelConfig
from moeforge.core.errors import CheckpointError, ConfigError
from moeforge.model.gguf_loader import read_gguf
from moeforge.model.loader import build_from_tensors, load_config, load_model
from moeforge.model.model import CausalLM
from moeforge.model.safetensors_loader import read_hf_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the GGUF factory
from gguf_factory import Vocab, write_gguf_file

LLAMA: dict[str, Any] = {
    "model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "max_position_embeddings": 128,
    "tie_word_embeddings": False, "rope_theta": 10000.0, "hidden_act": "silu", "bos_token_id": 1,
    "eos_token_id": 2,
}
DEEPSEEK_V3: dict[str, Any] = {
    "model_type": "deepseek_v3", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
    "moe_intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
    "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
    "first_k_dense_replace": 1, "q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 4, "v_head_dim": 8, "max_position_embeddings": 256, "routed_scaling_factor": 2.5,
    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1},
}


# ------------------------------------------------------------------------------------------ helpers
@contextlib.contextmanager
def within(seconds: float) -> Iterator[None]:
    """Fail (instead of hanging the suite) when the body runs longer than ``seconds``."""
    def expire(signum: int, frame: object) -> None:
        raise TimeoutError(f"took longer than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def tiny_tensors(hf: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights, HF-named, with the shapes our model has for ``hf`` (no transformers needed)."""
    with torch.device("meta"):
        model = CausalLM(ModelConfig.from_hf_dict(hf))
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(tuple(t.shape), generator=gen) * 0.1 for name, t in model.state_dict().items()}


def write_hf(folder: Path, config: Any = None, tensors: dict[str, torch.Tensor] | None = None,
             edit: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None) -> Path:
    """A tiny Llama folder: ``config`` (any JSON value) as config.json, weights from LLAMA unless given."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(LLAMA if config is None else config))
    weights = tiny_tensors(LLAMA) if tensors is None else tensors
    save_file(edit(weights) if edit else weights, str(folder / "model.safetensors"))
    return folder


def with_config(folder: Path, **changes: Any) -> Path:
    """Only a config.json (LLAMA with ``changes``): enough for `moeforge config`."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**LLAMA, **changes}))
    return folder


GGUF_KV: dict[str, Any] = {
    "llama.block_count": 2, "llama.context_length": 128, "llama.embedding_length": 32,
    "llama.feed_forward_length": 48, "llama.attention.head_count": 4, "llama.attention.head_count_kv": 2,
    "llama.rope.freq_base": 10000.0, "llama.attention.layer_norm_rms_epsilon": 1e-5, "general.name": "tiny",
}


def write_gguf(path: Path, kv: dict[str, Any] | None = None,
               edit: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]] | None = None) -> Path:
    """A tiny F32 Llama GGUF (random weights, so Q/K row order does not matter here); ``kv`` replaces or adds
    metadata, each value typed by its Python type (int u32, float f32, str string)."""
    rng = np.random.default_rng(0)

    def w(*shape: int) -> np.ndarray:
        return (0.1 * rng.standard_normal(shape)).astype(np.float32)

    tensors = {"token_embd.weight": w(64, 32), "output_norm.weight": w(32), "output.weight": w(64, 32)}
    for i in range(2):
        tensors |= {f"blk.{i}.{k}": v for k, v in {
            "attn_norm.weight": w(32), "ffn_norm.weight": w(32), "attn_q.weight": w(32, 32),
            "attn_k.weight": w(16, 32), "attn_v.weight": w(16, 32), "attn_output.weight": w(32, 32),
            "ffn_gate.weight": w(48, 32), "ffn_up.weight": w(48, 32), "ffn_down.weight": w(32, 48)}.items()}
    return write_gguf_file(path, "llama", metadata={**GGUF_KV, **(kv or {})},
                           tensors=edit(tensors) if edit else tensors,
                           vocab=Vocab([f"<t{i}>" for i in range(64)], model="gpt2", bos=1, eos=2))


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main(list(args))
    return code, capsys.readouterr().err


# ------------------------------------------------------------------------------ item 4: size bounds
@pytest.mark.parametrize(("base", "field", "value"), [
    (LLAMA, "num_hidden_layers", 10**9),
    (LLAMA, "hidden_size", 2**20),
    (LLAMA, "num_attention_heads", 10**5),
    (LLAMA, "vocab_size", 2**30),
    (LLAMA, "max_position_embeddings", 2**40),
    (LLAMA, "intermediate_size", 10**12),
    (LLAMA, "num_hidden_layers", -3),
    (DEEPSEEK_V3, "n_routed_experts", 10**6),
    (DEEPSEEK_V3, "kv_lora_rank", 10**7),
])
def test_sizes_beyond_bounds_are_refused(base: dict[str, Any], field: str, value: int) -> None:
    with pytest.raises(ConfigError, match=rf"{field} must be in \d+\.\.\d+, got {value}") as info:
        ModelConfig.from_hf_dict({**base, field: value})
    assert info.value.field == field


def test_billion_layers_config_exits_2_at_once(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    folder = with_config(tmp_path / "m", num_hidden_layers=10**9)
    with within(5):
        code, err = run_cli(capsys, "config", str(folder))
    assert code == 2
    assert "num_hidden_layers must be in 1..1024, got 1000000000" in err


def test_gguf_billion_blocks_is_refused_at_once(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "huge.gguf", {"llama.block_count": 10**9})
    with within(5), pytest.raises(ConfigError, match=r"llama\.block_count must be in 1\.\.1024") as info:
        read_gguf(path)
    assert info.value.field == "llama.block_count"


def test_gguf_block_count_above_the_blocks_present(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "more.gguf", {"llama.block_count": 1000})
    with pytest.raises(CheckpointError, match=r"block_count is 1000 but the file has tensors for 2 block"):
        read_gguf(path)


def test_hf_layer_count_above_the_layers_present(tmp_path: Path) -> None:
    folder = write_hf(tmp_path / "m", {**LLAMA, "num_hidden_layers": 1000})
    config = ModelConfig.from_hf_json(folder / "config.json")
    msg = r"num_hidden_layers=1000 but the checkpoint in .* has tensors for 2 layer\(s\) \(none for model\.layers\.2"
    with within(5), pytest.raises(CheckpointError, match=msg):
        read_hf_checkpoint(folder, config)


def test_hf_expert_count_above_the_experts_present(tmp_path: Path) -> None:
    weights = tiny_tensors(DEEPSEEK_V3)
    # Our stacked [E, ...] experts -> the per-expert layout DeepSeek ships.
    per_expert: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        if ".mlp.experts." in name:
            prefix, proj = name.rsplit(".", 1)
            per_expert |= {f"{prefix}.{e}.{proj}.weight": t[e].contiguous() for e in range(t.shape[0])}
        else:
            per_expert[name] = t
    folder = write_hf(tmp_path / "v3", {**DEEPSEEK_V3, "n_routed_experts": 8192, "n_group": 1},
                      tensors=per_expert)
    config = ModelConfig.from_hf_json(folder / "config.json")
    with pytest.raises(CheckpointError, match=r"n_routed_experts=8192 but .* per-expert tensors for 4 expert"):
        read_hf_checkpoint(folder, config)
    # The same folder with the right count loads: the check does not refuse good per-expert checkpoints.
    good = ModelConfig.from_hf_dict(DEEPSEEK_V3)
    assert len(read_hf_checkpoint(folder, good)) == len(weights)


# -------------------------------------------------------------- item 8: dtypes, NaN/Inf, bad numbers
def test_int32_header_over_float_data_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    key = "model.layers.1.mlp.down_proj.weight"
    folder = write_hf(tmp_path / "m", edit=lambda t: {**t, key: t[key].view(torch.int32)})
    code, err = run_cli(capsys, "compile", str(folder), "-o", str(tmp_path / "out"), "--quiet")
    assert code == 2, err
    assert key in err and "I32" in err and "floating-point" in err
    assert not (tmp_path / "out").exists()


def test_integer_tensor_is_refused_by_build_from_tensors() -> None:
    weights = tiny_tensors(LLAMA)
    weights["model.norm.weight"] = torch.ones(32, dtype=torch.int64)
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight' has dtype torch\.int64"):
        build_from_tensors(ModelConfig.from_hf_dict(LLAMA), weights.items())


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_hf_weights_are_refused_by_default(tmp_path: Path, bad: float) -> None:
    key = "model.layers.0.self_attn.k_proj.weight"

    def poison(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        t[key][3, 5] = bad
        return t

    folder = write_hf(tmp_path / "m", edit=poison)
    with pytest.raises(CheckpointError, match=rf"tensor '{key}' holds \d NaN and \d Inf value.*--no-weight-check"):
        load_model(str(folder))
    loaded = load_model(str(folder), check_finite=False)  # the opt-out loads it as it is
    assert not torch.isfinite(loaded.model.state_dict()[key]).all()


def test_non_finite_gguf_weights_are_refused(tmp_path: Path) -> None:
    def poison(t: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        t["blk.1.ffn_up.weight"][0, 0] = np.nan
        return t

    path = write_gguf(tmp_path / "nan.gguf", edit=poison)
    with pytest.raises(CheckpointError, match=r"'model\.layers\.1\.mlp\.up_proj\.weight' holds 1 NaN"):
        load_model(str(path))
    checkpoint = read_gguf(path)  # the opt-out (no tokenizer merges in this tiny file: build directly)
    build_from_tensors(checkpoint.config, checkpoint.tensors.items(), check_finite=False)


def test_cast_overflow_is_named() -> None:
    weights = tiny_tensors(LLAMA)
    weights["model.embed_tokens.weight"][0, 0] = 1e6  # finite in fp32, inf in fp16
    with pytest.raises(CheckpointError, match=r"embed_tokens.*1 Inf value.*after the cast to torch\.float16"):
        build_from_tensors(ModelConfig.from_hf_dict(LLAMA), weights.items(), dtype=torch.float16)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("rms_norm_eps", math.nan, "rms_norm_eps must be a finite number > 0, got nan"),
    ("rms_norm_eps", math.inf, "rms_norm_eps must be a finite number > 0, got inf"),
    ("rms_norm_eps", "abc", "rms_norm_eps must be a number, got 'abc' (str)"),
    ("hidden_size", True, "hidden_size must be an integer, got True (bool)"),
    ("hidden_size", 64.5, "hidden_size must be an integer, got 64.5 (float)"),
    ("num_hidden_layers", "2", "num_hidden_layers must be an integer, got '2' (str)"),
    ("rope_theta", math.nan, "rope_theta must be a finite number"),
    ("tie_word_embeddings", "false", "tie_word_embeddings must be true or false"),
    ("eos_token_id", ["2"], "eos_token_id must be an integer"),
    ("bos_token_id", -1, "bos_token_id must be in 0.."),
])
def test_mistyped_fields_name_the_field(capsys: pytest.CaptureFixture[str], tmp_path: Path, field: str,
                                        value: Any, message: str) -> None:
    folder = with_config(tmp_path / "m", **{field: value})
    with pytest.raises(ConfigError) as info:
        load_config(str(folder))
    assert info.value.field == field and message in str(info.value)
    code, err = run_cli(capsys, "config", str(folder))
    assert code == 2 and message in err


# ------------------------------------------------------------------ item 11: shapes of the JSON itself
@pytest.mark.parametrize(("document", "field", "message"), [
    ([LLAMA], "config.json", "holds a JSON list, not an object"),
    ("llama", "config.json", "holds a JSON str, not an object"),
    ({**LLAMA, "rope_parameters": "yarn"}, "rope_parameters", "rope_parameters must be a JSON object"),
    ({**LLAMA, "rope_scaling": [4.0]}, "rope_scaling", "rope_scaling must be a JSON object"),
    ({**LLAMA, "rope_scaling": {"rope_type": "yarn", "factor": "4", "original_max_position_embeddings": 64}},
     "rope_scaling.factor", "rope_scaling.factor must be a number"),
    ({**LLAMA, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64,
                                "low_freq_factor": 4.0, "high_freq_factor": 4.0}},
     "rope_scaling.low_freq_factor", "low_freq_factor (4.0) < high_freq_factor (4.0)"),
    ({**DEEPSEEK_V3, "q_lora_rank": "16"}, "q_lora_rank", "q_lora_rank must be an integer"),
    ({**DEEPSEEK_V3, "model_type": "deepseek_v2", "topk_method": ["greedy"]}, "topk_method",
     "topk_method ['greedy'] is not"),
    ({**DEEPSEEK_V3, "routed_scaling_factor": -1.0}, "routed_scaling_factor", "must be a finite number > 0"),
])
def test_malformed_config_json(capsys: pytest.CaptureFixture[str], tmp_path: Path, document: Any, field: str,
                               message: str) -> None:
    (tmp_path / "config.json").write_text(json.dumps(document))
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_hf_json(tmp_path / "config.json")
    assert info.value.field == field and message in str(info.value)
    code, err = run_cli(capsys, "config", str(tmp_path))
    assert code == 2 and message in err


def test_unreadable_json_text(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    for raw in (b"\xff\xfe{", b'{"vocab_size": ' + b"9" * 5000 + b"}", b"[" * 100_000):
        path.write_bytes(raw)
        with pytest.raises(ConfigError, match="is not valid JSON"):
            ModelConfig.from_hf_json(path)


@pytest.mark.parametrize(("key", "value"), [  # the value's Python type is its GGUF type: u32, u32, string, f32, f32
    ("llama.attention.head_count", 0),
    ("llama.attention.head_count_kv", 0),
    ("llama.embedding_length", "32"),
    ("llama.attention.layer_norm_rms_epsilon", math.nan),
    ("llama.rope.freq_base", -1.0),
])
def test_bad_gguf_metadata_names_the_key(capsys: pytest.CaptureFixture[str], tmp_path: Path, key: str,
                                         value: Any) -> None:
    path = write_gguf(tmp_path / "bad.gguf", {key: value})
    with pytest.raises(ConfigError) as info:
        read_gguf(path)
    assert info.value.field == key and key in str(info.value)
    code, err = run_cli(capsys, "config", str(path))
    assert code == 2 and key in err


def test_quantization_config_of_wrong_type(tmp_path: Path) -> None:
    folder = write_hf(tmp_path / "m", {**LLAMA, "quantization_config": "fp8"})
    with pytest.raises(CheckpointError, match="quantization_config must be a JSON object"):
        read_hf_checkpoint(folder, ModelConfig.from_hf_dict(LLAMA))


# ------------------------------------------------------------------------- item 15: no tokenizer
def test_hf_folder_without_tokenizer_warns_at_load(caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    folder = write_hf(tmp_path / "no_tok")
    with caplog.at_level(logging.WARNING, logger="moeforge.model.loader"):
        loaded = load_model(str(folder))
    assert loaded.tokenizer is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(str(folder) in m and "--prompt-ids" in m and "run" in m for m in warnings), warnings


# ---------------------------------------------------------------------------------------- fuzz
NASTY = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.sampled_from([0, -1, 10**9, 2**63, 10**300]),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6), st.sampled_from(["abc", "1", "yarn", ""]),
    st.lists(st.integers(-3, 3), max_size=3), st.dictionaries(st.sampled_from(["type", "factor", "x"]),
                                                             st.integers(-2, 2) | st.text(max_size=3), max_size=2),
)
FUZZ_KEYS = sorted({*LLAMA, *DEEPSEEK_V3, "rope_parameters", "head_dim", "sliding_window", "rope_interleave",
                    "use_sliding_window", "max_window_layers", "mlp_bias", "attention_bias", "topk_method",
                    "scoring_func", "quantization_config", "moe_layer_freq", "norm_topk_prob"})
ROPE_KEYS = ["type", "rope_type", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
             "mscale", "mscale_all_dim", "low_freq_factor", "high_freq_factor", "attention_factor", "truncate"]


@st.composite
def mutated_configs(draw: st.DrawFn) -> Any:
    if draw(st.integers(0, 19)) == 0:  # now and then the document is not an object at all
        return draw(NASTY)
    config: dict[str, Any] = json.loads(json.dumps(draw(st.sampled_from([LLAMA, DEEPSEEK_V3]))))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["delete", "set", "set", "rope"]))
        if op == "delete" and config:
            del config[draw(st.sampled_from(sorted(config)))]
        elif op == "set":
            config[draw(st.sampled_from(FUZZ_KEYS))] = draw(NASTY)
        else:
            rope = config.get("rope_scaling")
            rope = rope if isinstance(rope, dict) else {}
            rope[draw(st.sampled_from(ROPE_KEYS))] = draw(NASTY)
            config[draw(st.sampled_from(["rope_scaling", "rope_parameters"]))] = rope
    return config


@settings(max_examples=40, deadline=5000, suppress_health_check=[HealthCheck.too_slow])
@given(document=mutated_configs(), as_json=st.booleans())
def test_fuzzed_config_json_is_exit_0_or_2(document: Any, as_json: bool) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(document))  # NaN/Infinity literals included
        with within(5):
            code = main(["config", tmp, *(["--json"] if as_json else [])])
    assert code in (0, 2)


def test_cli_refuses_non_finite_weights_and_no_weight_check_skips_the_scan(tmp_path: Path, capsys) -> None:
    def poison(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        t["model.layers.0.mlp.up_proj.weight"][0, 0] = float("nan")
        return t

    folder = write_hf(tmp_path / "m", edit=poison)
    out = tmp_path / "artifact"
    assert main(["compile", str(folder), "-o", str(out), "--quiet", "--max-seq-len", "32"]) == 2
    assert "--no-weight-check" in capsys.readouterr().err and not out.exists()
    assert main(["compile", str(folder), "-o", str(out), "--quiet", "--max-seq-len", "32", "--no-weight-check"]) == 0
    assert (out / "manifest.json").is_file()
