"""`moeforge compile --target trt --quant int4|fp8|int8`: TensorRT-RTX builds the symmetric weight Q/DQ graph on CPU,
the plan carries DEQUANTIZE layers, and the golden logits (ONNX Runtime on the same graph) track PyTorch."""

from __future__ import annotations

from collections import Counter

import onnx
import pytest
import torch

from moeforge.compile.driver import CompileOptions, compile_model
from moeforge.core.artifact import load_artifact
from moeforge.core.errors import MoeforgeError
from moeforge.model.loader import load_model
from moeforge.quant.calibration import mean_kl
from moeforge.verify.golden import load_golden

from .conftest import MAX_SEQ_LEN, needs_trt_rtx

pytestmark = needs_trt_rtx


@pytest.mark.parametrize(("quant", "block", "codes"), [
    ("int4", None, onnx.TensorProto.INT4), ("fp8", 32, onnx.TensorProto.FLOAT8E4M3FN),
    ("int8", None, onnx.TensorProto.INT8),  # per output channel
])
def test_quantised_tiny_llama_engine(tmp_path, quant, block, codes):
    result = compile_model(CompileOptions.from_flags(model="tiny-llama", output_dir=tmp_path / quant, target="trt",
                                                     max_seq_len=MAX_SEQ_LEN, trt_impl="tensorrt-rtx", sm=89,
                                          max_prefill_tokens=32, progress=False, quant=quant, block_size=block))
    manifest = load_artifact(result.output_dir).manifest
    q = manifest.quantization
    assert manifest.precision == "fp16" and q["scheme"] == quant and q["symmetric"]
    assert q["lm_head"] == ("int8" if quant == "int4" else quant)
    # q/k/v packed, o, gate/up packed, down per layer (2 layers) + the LM head; all DequantizeLinear in the plan.
    assert q["quantized_weights"] == 9
    assert Counter(manifest.engine["layer_types"])["DEQUANTIZE"] == 9
    graph = onnx.load(str(result.output_dir / "model.onnx"), load_external_data=False).graph
    dqs = [n for n in graph.node if n.op_type == "DequantizeLinear"]
    assert len(dqs) == 9 and all(len(n.input) == 2 for n in dqs)  # symmetric: no zero points
    inits = {i.name: i for i in graph.initializer}
    assert sum(inits[n.input[0]].data_type == codes for n in dqs) == (8 if quant == "int4" else 9)  # int4: head int8
    assert all(inits[n.input[1]].data_type == onnx.TensorProto.FLOAT16 for n in dqs)  # half scales
    feeds, golden = load_golden(result.output_dir)
    with torch.no_grad():
        ref = load_model("tiny-llama").model(torch.tensor(feeds["input_ids"]), torch.tensor(feeds["position_ids"]),
                                             None).logits.numpy()
    assert mean_kl(ref[0], golden[0]) < 0.05  # int4 blocks on a random tiny model: KL ~1e-2


@pytest.mark.parametrize(("kw", "match"), [
    ({"quant": "int4-asym"}, "built for ONNX Runtime"),
    ({"quant": "int4", "lm_head": "fp32"}, "not wired for --target trt"),
])
def test_onnx_runtime_only_schemes_are_refused(tmp_path, kw, match):
    with pytest.raises(MoeforgeError, match=match):
        compile_model(CompileOptions.from_flags(model="tiny-llama", output_dir=tmp_path / "x", target="trt",
                                                progress=False, trt_impl="tensorrt-rtx", sm=89, **kw))
    assert not (tmp_path / "x").exists()
