"""TensorRT-RTX (CPU-only ahead-of-time build) consumes the portable int4 and fp8 Q/DQ graphs of tiny-llama.

The graph is the standard-op export (opset 23 Attention, RMSNormalization) after cleanup, with the
weight Q/DQ pass applied: what a TensorRT target gets before any ONNX Runtime lowering. TensorRT 11
builds strongly typed networks, so precision must come from these DequantizeLinear nodes.
"""

from __future__ import annotations

import onnx_ir as ir
import pytest

from moeforge.passes.base import PassContext
from moeforge.passes.cleanup import Cleanup
from moeforge.passes.quant_weights import QuantConfig, WeightQuantization

trt = pytest.importorskip("tensorrt_rtx_bindings")


@pytest.mark.parametrize(("kind", "block"), [("int4", 32), ("fp8", 32)])
def test_tensorrt_rtx_builds_the_qdq_graph(fresh_model, tmp_path, kind, block):
    loaded, model = fresh_model("tiny-llama")
    Cleanup().apply(model, PassContext(config=loaded.config, max_seq_len=64))
    quantised = WeightQuantization(QuantConfig(kind, block)).apply(model, None)
    assert quantised == 15  # q, k, v, o, gate, up, down per layer (2 layers) + LM head
    path = tmp_path / "model.onnx"
    ir.save(model, path, external_data="model.onnx.data")

    logger = trt.Logger(trt.Logger.ERROR)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    assert parser.parse_from_file(str(path)), [parser.get_error(i).desc() for i in range(parser.num_errors)]
    layers = [network.get_layer(i) for i in range(network.num_layers)]
    dequantize = [layer for layer in layers if layer.type == trt.LayerType.DEQUANTIZE]
    assert len(dequantize) == quantised
    for layer in layers:
        if layer.type == trt.LayerType.ATTENTION_OUTPUT:
            # fp32 attention has no dedicated kernel; let TensorRT decompose it (the weights are the point here).
            layer.__class__ = trt.IAttentionOutputLayer
            layer.attention.decomposable = True
    config = builder.create_builder_config()
    config.num_compute_capabilities = 1
    config.set_compute_capability(trt.ComputeCapability.SM89, 0)  # ahead-of-time build, no GPU needed
    profile = builder.create_optimization_profile()
    for i in range(network.num_inputs):
        tensor = network.get_input(i)
        shapes = [[size if d == -1 else d for d in tensor.shape] for size in (1, 4, 16)]
        profile.set_shape(tensor.name, *shapes)
    config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    assert plan is not None and plan.nbytes > 0
