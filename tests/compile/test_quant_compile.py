"""`moeforge compile --quant` end to end on tiny presets: --check passes per precision, the manifest
records the choices, FP8 checkpoints keep their values, and bad input is refused with a clear error."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import transformers
from onnx import numpy_helper

from moeforge.cli import main
from moeforge.cli.inspect import op_counts
from moeforge.cli.parser import build_parser
from moeforge.compile.driver import CompileOptions, compile_model
from moeforge.core.artifact import load_artifact
from moeforge.core.errors import MoeforgeError
from moeforge.model.fp8 import dequantize_fp8_blockwise, quantize_fp8_blockwise
from moeforge.quant.calibration import CalibrationError
from moeforge.quant.spec import QuantError

DATA = Path(__file__).resolve().parents[1] / "data"
CALIB = DATA / "quant_calib_en.txt"


def _compile(tmp_path: Path, model: str, **kw) -> Path:
    options = CompileOptions.from_flags(model=model, output_dir=tmp_path / f"{model}-{kw.get('quant')}",
                                        max_seq_len=128, progress=False, **kw)
    return compile_model(options).output_dir


@pytest.mark.heavy
@pytest.mark.parametrize(("model", "quant", "block"), [
    ("tiny-llama", "int8", None), ("tiny-llama", "int4", None), ("tiny-llama", "fp8", 32),
    ("tiny-deepseek-v3", "int4", None),
])
def test_check_passes_per_precision(tmp_path, model, quant, block):
    result = compile_model(CompileOptions.from_flags(model=model, output_dir=tmp_path / "a", max_seq_len=128,
                                                     progress=False, check=True, quant=quant, block_size=block))
    assert result.parity is not None and result.parity.passed, result.parity.table()
    assert result.parity.precision == quant and result.parity.mean_kl > 0  # really quantised
    # The verdict comes with the thresholds it applied (a quantised artifact: top-1 and KL, not atol).
    limits = result.parity.thresholds
    assert result.parity.table().splitlines()[-1] == (f"thresholds ({quant}): top1 >= {limits.top1_agreement}, "
                                                      f"KL <= {limits.kl_max}")
    manifest = load_artifact(result.output_dir).manifest
    assert manifest.precision == quant
    q = manifest.quantization
    assert q["scheme"] == quant and q["symmetric"] and "router" in q["always_fp32"]
    head = "int8" if quant == "int4" else quant  # int4 schemes keep the LM head at int8
    assert q["lm_head"] == head
    assert [layer["precision"] for layer in q["layers"]] == [quant] * (len(q["layers"]) - 1) + [head]
    counts = op_counts(result.output_dir / "model.onnx")
    graph = onnx.load(str(result.output_dir / "model.onnx"), load_external_data=False).graph
    head_node = next(n for n in graph.node if "logits" in n.output)
    if quant != "fp8":
        bits = next(a.i for a in head_node.attribute if a.name == "bits")
        assert head_node.op_type == "MatMulNBits" and bits == 8 if head == "int8" else 4
    if quant == "fp8":
        assert counts.get("DequantizeLinear") == len(q["layers"])
    else:
        assert counts.get("com.microsoft.MatMulNBits", 0) > 0 and "DequantizeLinear" not in counts
    if model.startswith("tiny-deepseek"):
        # two MoE layers, each expert an If over MatMulNBits (sparse_experts): no QMoE, no float MoE
        assert "com.microsoft.QMoE" not in counts and "com.microsoft.MoE" not in counts
        assert sum(n.op_type == "If" and n.name.startswith("sparse_experts/") for n in graph.node) == 2 * 8


@pytest.mark.heavy
@pytest.mark.heavy
def test_int4_asym_check_passes(tmp_path):
    # int4-asym: every layer weight runs as MatMulNBits + its block offsets' share (exact), LM head int8.
    result = compile_model(CompileOptions.from_flags(model="tiny-llama", output_dir=tmp_path / "a", max_seq_len=128,
                                                     progress=False, check=True, quant="int4-asym"))
    assert result.parity is not None and result.parity.passed, result.parity.table()
    assert result.parity.precision == "int4-asym" and result.parity.mean_kl > 0
    q = load_artifact(result.output_dir).manifest.quantization
    assert q["scheme"] == "int4-asym" and q["symmetric"] is False and q["lm_head"] == "int8"
    graph = onnx.load(str(result.output_dir / "model.onnx"), load_external_data=False).graph
    nbits = [n for n in graph.node if n.op_type == "MatMulNBits"]
    offsets = [n for n in graph.node if n.op_type == "MatMul" and n.input[1].endswith(".block_offset")]
    assert len(offsets) == len(q["layers"]) - 1 == len(nbits) - 1  # all but the int8 head
    assert not any(len(n.input) > 3 and n.input[3] for n in nbits)  # no float zero points (slow on ORT CPU)
    assert not any(n.op_type == "DequantizeLinear" for n in graph.node)


def test_awq_and_keep_fp_through_the_cli(tmp_path, capsys):
    out = tmp_path / "awq"
    code = main(["compile", "tiny-llama", "-o", str(out), "--quiet", "--max-seq-len", "128", "--check",
                 "--quant", "int4-awq", "--calib", str(CALIB), "--keep-fp", "0.2"])
    assert code == 0, capsys.readouterr().err
    q = load_artifact(out).manifest.quantization
    kept = [layer for layer in q["layers"] if layer["precision"] == "fp32"]
    assert len(kept) == 2  # ceil(0.2 * 9)
    ranked = [row["name"] for row in q["sensitivity"]]
    assert {layer["name"] for layer in kept} == set(ranked[:2])  # the two most sensitive
    assert q["calibration_prompts"] == 10
    assert any("awq_alpha" in layer for layer in q["layers"])
    counts = op_counts(out / "model.onnx")
    # A kept fp32 LM head (here it is among the two) gets the certified argmax head: an If holding it, an int8
    # draft and two small MatMuls.
    head_kept = counts.get("If", 0)
    assert head_kept in (0, 1)
    assert counts.get("MatMul") == 2 + 2 * head_kept and counts.get("com.microsoft.MatMulNBits") == 7 + head_kept


def test_help_documents_the_calibration_file():
    help_text = build_parser()._subparsers._group_actions[0].choices["compile"].format_help()
    assert "one prompt per line" in help_text and "--keep-fp" in help_text and "--block-size" in help_text


# ------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(("kw", "match"), [
    ({"quant": "int4", "block_size": 64}, r"--block-size 64 does not divide the input dimension 160.*--block-size 32"),
    ({"quant": "int4", "block_size": 48}, "power of two"),
    ({"quant": "int4-asym", "block_size": 64}, r"--block-size 64 does not divide the input dimension 160"),
    ({"quant": "int4-awq"}, "needs calibration prompts"),
    ({"quant": "int4", "keep_fp": 0.1}, "needs calibration prompts"),
    ({"quant": "int4", "keep_fp": 1.5, "calib": CALIB}, "fraction"),
    ({"quant": "w8a8"}, "needs calibration prompts"),
    ({"block_size": 32}, "--block-size needs --quant"),
    ({"quant": "int5"}, "unknown"),
])
def test_bad_quant_options(tmp_path, kw, match):
    with pytest.raises(QuantError if "quant" in kw else MoeforgeError, match=match):
        _compile(tmp_path, "tiny-llama", **kw)
    assert not any(tmp_path.iterdir())  # nothing written


def test_missing_and_empty_calibration_files(tmp_path, capsys):
    with pytest.raises(CalibrationError, match="does not exist"):
        _compile(tmp_path, "tiny-llama", quant="int4-awq", calib=tmp_path / "nope.txt")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n   \n")
    with pytest.raises(CalibrationError, match="is empty; write one prompt per line"):
        _compile(tmp_path, "tiny-llama", quant="int4-awq", calib=empty)
    code = main(["compile", "tiny-llama", "-o", str(tmp_path / "x"), "--quant", "int4-awq", "--calib", str(empty)])
    assert code == 2 and "is empty" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ FP8 source
@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory) -> Path:
    """A Llama HF folder whose projections are FP8 with 128 x 128 block scales (DeepSeek-V3 layout)."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg).eval()
    folder = tmp_path_factory.mktemp("fp8ckpt")
    model.save_pretrained(folder)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    for key in list(tensors):
        if key.endswith("proj.weight"):
            tensors[key], tensors[key + "_scale_inv"] = quantize_fp8_blockwise(tensors[key].float() * 3)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.heavy
def test_fp8_checkpoint_weights_are_kept_exactly(tmp_path, fp8_checkpoint):
    from safetensors.torch import load_file

    out = _compile(tmp_path, str(fp8_checkpoint), quant="fp8")
    stored = load_file(str(fp8_checkpoint / "model.safetensors"))
    want = dequantize_fp8_blockwise(stored["model.layers.0.self_attn.o_proj.weight"],
                                    stored["model.layers.0.self_attn.o_proj.weight_scale_inv"]).numpy().T
    proto = onnx.load(str(out / "model.onnx"))
    inits = {i.name: i for i in proto.graph.initializer}
    found = False
    for node in proto.graph.node:
        if node.op_type == "DequantizeLinear" and tuple(inits[node.input[0]].dims) == want.shape:
            codes = numpy_helper.to_array(inits[node.input[0]]).astype(np.float32)
            scale = numpy_helper.to_array(inits[node.input[1]])
            got = codes * np.repeat(scale, 128, axis=0)
            found = found or np.array_equal(got, want)
    assert found, "the o_proj FP8 values did not survive exactly"


def test_fp8_checkpoint_to_int4_warns(tmp_path, fp8_checkpoint, caplog):
    with caplog.at_level(logging.WARNING, logger="moeforge.quant.plan"):
        _compile(tmp_path, str(fp8_checkpoint), quant="int4")
    assert any("stores FP8 weights" in r.message and "requantised to int4" in r.message for r in caplog.records)
