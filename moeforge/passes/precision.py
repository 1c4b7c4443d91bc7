"""Precision pass: fp32 graph -> fp16 or bf16 with explicit casts (TensorRT builds strongly typed networks).

Dimension letters: B batch, S new tokens, V vocabulary.

Everything runs in the half type except the islands that overflow or lose routing decisions in fp16,
which keep fp32 inputs, weights and outputs with a Cast on each side:
- RMSNormalization / SimplifiedLayerNormalization (the mean of squares overflows fp16),
- Softmax outside attention, and the MoE node (``moeforge.MoERouter`` / ``moeforge.MoEExperts``: routing
  scores, top-k and the expert mix in fp32);
- with ``keep_fp32_modules``, every node the torch exporter made inside one of those module classes (its
  ``pkg.torch.onnx.class_hierarchy`` metadata): DeepSeek-V4's router, exported as plain ops, whose near-tied
  scores flip experts in fp16 (each flip changes that token's cache rows for every later token).
Attention's own softmax runs in fp32 inside TensorRT's fused kernels. Graph inputs (KV caches) become
the half type; ``logits`` [B, S, V] stays float32 (a Cast at the end), so samplers see fp32.

The fp16 conversion is ONNX Runtime's ``float16.convert_float_to_float16`` (inserts the casts, clamps
initializers to the fp16 range); bf16 is the same graph with every float16 type and tensor retyped.

Weights are never serialised whole: the converter runs on the graph with every float initializer replaced by an
external-data placeholder (name, type and shape; no bytes), so it decides types and casts only; each converted
initializer is then a lazy tensor that reads its source (itself lazy in a streamed compile) and applies the same
conversion (``convert_np_to_float16``: clamped to the fp16 range; bf16 through float32) when the artifact writer
reads it. Memory: one tensor, whatever the model's size; the bytes equal the eager conversion's.
"""

from __future__ import annotations

from unittest import mock

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
from onnxruntime.transformers import float16

from moeforge.ops.expert_stack import map_tensor
from moeforge.passes.base import PassContext

FP32_OPS = ("RMSNormalization", "SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", "Softmax",
            "MoE", "MoERouter", "MoEExperts")
KEEP_FP32_IO = ("logits",)
CLASS_HIERARCHY = "pkg.torch.onnx.class_hierarchy"  # the torch exporter's node metadata: "['pkg.Outer', 'pkg.Inner']"
HALF_TYPES = {"fp16": onnx.TensorProto.FLOAT16, "bf16": onnx.TensorProto.BFLOAT16}


class HalfPrecision:
    """Retype the graph to fp16/bf16 with fp32 islands; returns the number of Cast nodes inserted."""

    name = "precision"

    def __init__(self, dtype: str, keep_fp32_modules: tuple[str, ...] = ()) -> None:
        """``keep_fp32_modules``: qualified torch module class names (``moeforge.model.deepseek_v4_moe.V4Router``)
        whose exported nodes stay float32."""
        if dtype not in HALF_TYPES:
            raise ValueError(f"precision {dtype!r}: expected one of {', '.join(HALF_TYPES)}")
        self.dtype = dtype
        self.keep_fp32_modules = keep_fp32_modules

    def apply(self, model: ir.Model, ctx: PassContext) -> int:
        sources = _placeholder_sources(model.graph)
        try:  # serialised with placeholders: types and shapes, no weight read
            for name, tensor in sources.items():
                model.graph.initializers[name].const_value = _placeholder(tensor)
            proto = ir.serde.serialize_model(model)
        finally:
            for name, tensor in sources.items():
                model.graph.initializers[name].const_value = tensor
        casts_before = _count_casts(proto)
        keep = [v.name for v in list(proto.graph.input) + list(proto.graph.output) if v.name in KEEP_FP32_IO]
        # The converter takes a value's shape from its data (numpy_helper.to_array); a placeholder's is its dims.
        with mock.patch.object(float16, "make_value_info_from_tensor", _value_info_from_dims):
            converted = float16.convert_float_to_float16(
                proto, keep_io_types=keep, op_block_list=[*float16.DEFAULT_OP_BLOCK_LIST, *FP32_OPS],
                node_block_list=_nodes_of_modules(proto, self.keep_fp32_modules), force_fp16_initializers=True,
            )
        if self.dtype == "bf16":
            retype_floats(converted, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)
        new = ir.serde.deserialize_model(converted)
        for name, value in new.graph.initializers.items():
            if name in sources:
                assert value.dtype is not None, f"initializer {name} has no type after the conversion"
                value.const_value = _converted(sources[name], value.dtype)
        model.graph = new.graph  # the opset imports live on the graph
        model.functions.clear()
        model.functions.update(new.functions)
        return _count_casts(converted) - casts_before


_PLACEHOLDER = "moeforge-precision-placeholder"  # an external-data location never read (every one is replaced)


_SMALL_BYTES = 4096  # other initializers up to this size (shapes, axes) go to the converter as they are


def _placeholder_sources(graph: ir.Graph) -> dict[str, ir.TensorProtocol]:
    """The initializers the converter gets as placeholders, by name; nothing read: every float32 one (those it
    retypes) and every other large one (quantised codes it leaves alone, which must not be serialised either)."""
    return {name: value.const_value for name, value in graph.initializers.items()
            if value.const_value is not None
            and (value.const_value.dtype == ir.DataType.FLOAT or value.const_value.nbytes > _SMALL_BYTES)}


def _placeholder(tensor: ir.TensorProtocol) -> ir.ExternalTensor:
    return ir.ExternalTensor(_PLACEHOLDER, offset=0, length=tensor.nbytes, dtype=tensor.dtype,
                             shape=ir.Shape(tensor.shape.numpy()), name=tensor.name or "")


def _converted(source: ir.TensorProtocol, dtype: ir.DataType) -> ir.TensorProtocol:
    """``source`` as the converter typed it: unchanged (any type it left alone), or float32 made fp16 (clamped) or
    bf16 (fp16 then bf16); a stacked-experts ``ExpertStack`` stays one, converted expert by expert."""
    if dtype == source.dtype:
        return source
    if source.dtype != ir.DataType.FLOAT or dtype not in (ir.DataType.FLOAT16, ir.DataType.BFLOAT16):
        raise AssertionError(f"the fp16 conversion retyped initializer {source.name} from {source.dtype} to {dtype}")

    def convert(array: np.ndarray) -> np.ndarray:
        flat = array.reshape(-1)  # as the converter reads raw_data (it rejects 0-d arrays)
        half = float16.convert_np_to_float16(flat).reshape(array.shape)  # its clamping and bounds
        out: np.ndarray = half if dtype == ir.DataType.FLOAT16 else half.astype(np.float32).astype(ml_dtypes.bfloat16)
        return out

    return map_tensor(source, convert, dtype, tuple(source.shape.numpy()), source.name)


def _nodes_of_modules(proto: onnx.ModelProto, modules: tuple[str, ...]) -> list[str]:
    """Names of the nodes the torch exporter made inside a module of one of these classes (its class-hierarchy
    metadata lists the classes of the modules around the node, outermost first)."""
    if not modules:
        return []
    names = []
    for node in proto.graph.node:
        hierarchy = next((m.value for m in node.metadata_props if m.key == CLASS_HIERARCHY), "")
        if node.name and any(repr(module) in hierarchy for module in modules):
            names.append(node.name)
    return names


def _value_info_from_dims(tensor: onnx.TensorProto) -> onnx.ValueInfoProto:
    return onnx.helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims))


def _count_casts(proto: onnx.ModelProto) -> int:
    return sum(1 for n in proto.graph.node if n.op_type == "Cast")


def retype_floats(proto: onnx.ModelProto, source: int, target: int) -> None:
    """Every ``source`` float type (an onnx.TensorProto data type), Cast target and tensor of the graph ->
    ``target``, in place; values go through float32 (fp16 -> bf16 for bf16 engines; bf16 -> fp32 to run a bf16
    graph on ONNX Runtime's CPU kernels, which have no bf16 arithmetic)."""
    numpy_target = ml_dtypes.bfloat16 if target == onnx.TensorProto.BFLOAT16 else \
        onnx.helper.tensor_dtype_to_np_dtype(target)

    def convert(tensor: onnx.TensorProto) -> None:
        if tensor.data_type == source and tensor.data_location == onnx.TensorProto.EXTERNAL:
            tensor.data_type = target  # a placeholder (HalfPrecision): its values are converted when read
        elif tensor.data_type == source:
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
