"""`compile --quant ... --lm-head / --accuracy-level`, and `--quant int8-asym`: what was asked is in the graph and
the manifest."""

from __future__ import annotations

import sys
from pathlib import Path

import onnx
import pytest

from moeforge.compile.driver import CompileOptions, compile_model
from moeforge.core.artifact import load_artifact
from moeforge.core.errors import MoeforgeError
from moeforge.quant.spec import QuantError

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from peers import artifact_label  # the benchmarks' label of an artifact (benchmarks/peers.py)

CALIB = Path(__file__).resolve().parents[1] / "data" / "quant_calib_en.txt"


def _head(path):
    graph = onnx.load(str(path / "model.onnx"), load_external_data=False).graph
    # Paged graphs: the head writes logits_3d, which a Squeeze turns into logits.
    node = next(n for n in graph.node if {"logits", "logits_3d"} & set(n.output) and n.op_type != "Squeeze")
    bits = next((a.i for a in node.attribute if a.name == "bits"), None)
    return node.op_type, bits


@pytest.mark.parametrize(("quant", "lm_head", "op", "bits", "label", "kv_cache"), [
    ("int4", None, "MatMulNBits", 8, "int8", "contiguous"),  # the default keeps an int4 model's head at int8
    ("int4", None, "MatMulNBits", 8, "int8", "paged"),  # the paged head (logits_3d) is found too
    ("int4", "int4", "MatMulNBits", 4, "int4", "contiguous"),
    ("int4-asym", "int4", "Add", None, "int4-asym", "contiguous"),  # MatMulNBits + the block offsets' share
    ("int4", "fp32", "If", None, "fp32", "contiguous"),  # a float32 head gets the certified argmax head
])
def test_lm_head_precision(tmp_path, quant, lm_head, op, bits, label, kv_cache):
    out = compile_model(CompileOptions.from_flags(model="tiny-llama", output_dir=tmp_path / "a", max_seq_len=64,
                                                  progress=False,
                                                  quant=quant, lm_head=lm_head, kv_cache=kv_cache)).output_dir
    assert _head(out) == (op, bits)
    q = load_artifact(out).manifest.quantization
    assert q["lm_head"] == label
    assert q["layers"][-1]["label"] == "lm_head" and q["layers"][-1]["precision"] == label
    assert all(layer["precision"] == quant for layer in q["layers"][:-1])


def test_int8_asym_with_fp32_activations(tmp_path):
    result = compile_model(CompileOptions.from_flags(model="tiny-llama", output_dir=tmp_path / "a", max_seq_len=64,
                                                     progress=False, check=True, quant="int8-asym", accuracy_level=0))
    assert result.parity is not None and result.parity.passed and result.parity.precision == "int8-asym"
    graph = onnx.load(str(result.output_dir / "model.onnx"), load_external_data=False).graph
    nbits = [n for n in graph.node if n.op_type == "MatMulNBits"]
    attrs = [{a.name: a.i for a in n.attribute if a.type == onnx.AttributeProto.INT} for n in nbits]
    assert nbits and all(a["bits"] == 8 and a["accuracy_level"] == 0 for a in attrs)
    offsets = [n for n in graph.node if n.op_type == "MatMul" and n.input[1].endswith(".block_offset")]
    q = load_artifact(result.output_dir).manifest.quantization
    assert len(offsets) == len(q["layers"]) - 1  # every layer but the symmetric LM head carries offsets
    assert q["scheme"] == "int8-asym" and not q["symmetric"] and q["lm_head"] == "int8" and q["accuracy_level"] == 0


def test_int4_asym_digit_offsets_check_passes(tmp_path):
    # --asym-offsets digit: every layer weight is ONE MatMulNBits (integer zero points, the residual offsets as an
    # extra code per block over the block sums), no offset MatMul or Add; --check against PyTorch passes.
    result = compile_model(CompileOptions.from_flags(model="tiny-llama", output_dir=tmp_path / "a", max_seq_len=64,
                                                     progress=False, check=True, quant="int4-asym",
                                                     asym_offsets="digit"))
    assert result.parity is not None and result.parity.passed, result.parity.table()
    q = load_artifact(result.output_dir).manifest.quantization
    assert q["scheme"] == "int4-asym" and q["asym_offsets"] == "digit"
    graph = onnx.load(str(result.output_dir / "model.onnx"), load_external_data=False).graph
    nbits = [n for n in graph.node if n.op_type == "MatMulNBits"]
    assert len([n for n in nbits if len(n.input) == 4]) == len(q["layers"]) - 1  # all but the symmetric int8 head
    assert not any(n.op_type == "MatMul" and n.input[1].endswith(".block_offset") for n in graph.node)
    assert artifact_label(result.output_dir) == ("moeforge int4-asym digit", "int4")  # its own row in comparisons


@pytest.mark.parametrize(("kw", "error", "match"), [
    ({"quant": "int8", "lm_head": "int4"}, QuantError, "needs blocks.*--block-size 32"),
    ({"lm_head": "int4"}, MoeforgeError, "--lm-head needs --quant"),
    ({"quant": "int4", "accuracy_level": 5}, QuantError, "--accuracy-level 5 must be 0"),
    ({"accuracy_level": 0}, MoeforgeError, "--accuracy-level needs --quant"),
    ({"quant": "w8a8", "calib": CALIB, "lm_head": "int4"}, QuantError, "not available with --quant w8a8"),
    ({"quant": "int4-awq", "calib": CALIB, "kv_cache": "paged"}, QuantError, "use --kv-cache contiguous"),
    ({"quant": "int8", "calib": CALIB, "keep_fp": 0.1, "kv_cache": "paged"}, QuantError, "--keep-fp calibrates"),
    ({"quant": "int4", "asym_offsets": "digit"}, QuantError, "--asym-offsets applies to .*int4-asym.*not --quant int4"),
    ({"quant": "int4-asym", "asym_offsets": "nibble"}, QuantError, "--asym-offsets 'nibble' is unknown"),
    ({"asym_offsets": "digit"}, MoeforgeError, "--asym-offsets needs --quant"),
])
def test_bad_lm_head_options(tmp_path, kw, error, match):
    with pytest.raises(error, match=match):
        compile_model(CompileOptions.from_flags(model="tiny-llama", output_dir=tmp_path / "a", progress=False, **kw))
    assert not any(tmp_path.iterdir())
