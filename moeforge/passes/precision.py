"""Precision pass: fp32 graph -> fp16 or bf16 with explicit casts (TensorRT builds strongly typed networks).

Dimension letters: B batch, S new tokens, V vocabulary.

Everything runs in the half type except the islands that overflow or lose routing decisions in fp16,
which keep fp32 inputs, weights and outputs with a Cast on each side:
- RMSNormalization / SimplifiedLayerNormalization (the mean of squares overflows fp16),
- Softmax outside attention, and the MoE node (``moeforge.MoERouter`` / ``moeforge.MoEExperts``: routing
  scores, top-k and the expert mix in fp32).
Attention's own softmax runs in fp32 inside TensorRT's fused kernels. Graph inputs (KV caches) become
the half type; ``logits`` [B, S, V] stays float32 (a Cast at the end), so samplers see fp32.

The fp16 conversion is ONNX Runtime's ``float16.convert_float_to_float16`` (inserts the casts, clamps
initializers to the fp16 range); bf16 is the same graph with every float16 type and tensor retyped.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST, convert_float_to_float16

from moeforge.passes.base import PassContext

FP32_OPS = ("RMSNormalization", "SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", "Softmax",
            "MoE", "MoERouter", "MoEExperts")
KEEP_FP32_IO = ("logits",)
HALF_TYPES = {"fp16": onnx.TensorProto.FLOAT16, "bf16": onnx.TensorProto.BFLOAT16}


class HalfPrecision:
    """Retype the graph to fp16/bf16 with fp32 islands; returns the number of Cast nodes inserted."""

    name = "precision"

    def __init__(self, dtype: str) -> None:
        if dtype not in HALF_TYPES:
            raise ValueError(f"precision {dtype!r}: expected one of {', '.join(HALF_TYPES)}")
        self.dtype = dtype

    def apply(self, model: ir.Model, ctx: PassContext) -> int:
        proto = ir.serde.serialize_model(model)
        casts_before = _count_casts(proto)
        keep = [v.name for v in list(proto.graph.input) + list(proto.graph.output) if v.name in KEEP_FP32_IO]
        converted = convert_float_to_float16(
            proto, keep_io_types=keep, op_block_list=[*DEFAULT_OP_BLOCK_LIST, *FP32_OPS], force_fp16_initializers=True,
        )
        if self.dtype == "bf16":
            retype_floats(converted, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)
        new = ir.serde.deserialize_model(converted)
        model.graph = new.graph  # the opset imports live on the graph
        model.functions.clear()
        model.functions.update(new.functions)
        return _count_casts(converted) - casts_before


def _count_casts(proto: onnx.ModelProto) -> int:
    return sum(1 for n in proto.graph.node if n.op_type == "Cast")


def retype_floats(proto: onnx.ModelProto, source: int, target: int) -> None:
    """Every ``source`` float type (an onnx.TensorProto data type), Cast target and tensor of the graph ->
    ``target``, in place; values go through float32 (fp16 -> bf16 for bf16 engines; bf16 -> fp32 to run a bf16
    graph on ONNX Runtime's CPU kernels, which have no bf16 arithmetic)."""
    numpy_target = ml_dtypes.bfloat16 if target == onnx.TensorProto.BFLOAT16 else \
        onnx.helper.tensor_dtype_to_np_dtype(target)

    def convert(tensor: onnx.TensorProto) -> None:
        if tensor.data_type == source:
            array = onnx.numpy_helper.to_array(tensor).astype(np.float32).astype(numpy_target)
            tensor.CopyFrom(onnx.numpy_helper.from_array(array, tensor.name))

    graph = proto.graph
    for value_info in [*graph.input, *graph.output, *graph.value_info]:
        if value_info.type.tensor_type.elem_type == source:
            value_info.type.tensor_type.elem_type = target
    for tensor in graph.initializer:
        convert(tensor)
    for node in graph.node:
        for attr in node.attribute:
            if attr.name == "to" and attr.i == source:
                attr.i = target
            if attr.type == onnx.AttributeProto.TENSOR:
                convert(attr.t)
