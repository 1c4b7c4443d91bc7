"""``HalfPrecision`` converts without serialising the weights: the graph it makes equals ONNX Runtime's fp16
converter run on the whole graph (types, casts and every initializer's bytes, fp16 and bf16), and no weight is read
until something reads the converted tensor (the artifact writer), one at a time."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST, convert_float_to_float16

from moeforge.passes.base import PassContext
from moeforge.passes.precision import FP32_OPS, KEEP_FP32_IO, HalfPrecision


def _eager(model: ir.Model, dtype: str) -> onnx.ModelProto:
    """The conversion as ONNX Runtime's tool does it on a graph holding every weight (the pass's reference)."""
    proto = ir.serde.serialize_model(model)
    keep = [v.name for v in list(proto.graph.input) + list(proto.graph.output) if v.name in KEEP_FP32_IO]
    converted = convert_float_to_float16(proto, keep_io_types=keep, op_block_list=[*DEFAULT_OP_BLOCK_LIST, *FP32_OPS],
                                         force_fp16_initializers=True)
    if dtype == "bf16":
        for tensor in converted.graph.initializer:
            if tensor.data_type == onnx.TensorProto.FLOAT16:
                array = onnx.numpy_helper.to_array(tensor).astype(np.float32).astype(ml_dtypes.bfloat16)
                tensor.CopyFrom(onnx.numpy_helper.from_array(array, tensor.name))
    return converted


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-deepseek-v3"])
def test_the_lazy_conversion_equals_the_converter_on_the_whole_graph(fresh_model, name: str, dtype: str) -> None:
    loaded, model = fresh_model(name)
    # Large values are clamped to the fp16 range by the converter; make sure some are there.
    first = next(v for v in model.graph.initializers.values() if v.const_value is not None
                 and v.const_value.dtype == ir.DataType.FLOAT and v.const_value.size > 100)
    big = first.const_value.numpy().copy()
    big.flat[:3] = [1e6, -1e6, 1e-9]
    first.const_value = ir.tensor(big, name=first.name)
    # Quantised codes (what --quant int8 leaves before this pass): not retyped, and not serialised either.
    codes = np.random.default_rng(0).integers(-128, 128, (64, 96)).astype(np.int8)
    model.graph.register_initializer(ir.Value(name="w.q", shape=ir.Shape(codes.shape), type=ir.TensorType(
        ir.DataType.INT8), const_value=ir.tensor(codes, name="w.q")))
    reference = _eager(model, dtype)

    reads: list[str] = []
    for value in model.graph.initializers.values():  # count reads of the source weights
        tensor = value.const_value
        if tensor is not None and (tensor.dtype == ir.DataType.FLOAT or tensor.nbytes > 4096):
            def compute(t: ir.TensorProtocol = tensor) -> ir.TensorProtocol:
                reads.append(t.name or "")
                return ir.tensor(t.numpy(), name=t.name)
            value.const_value = ir.LazyTensor(compute, tensor.dtype, tensor.shape, name=tensor.name)
    casts = HalfPrecision(dtype).apply(model, PassContext(loaded.config, 64))
    assert reads == []  # nothing read by the pass itself
    assert casts > 0

    ours = ir.serde.serialize_model(model)  # reads (and converts) each weight now
    assert sorted(reads) == sorted(t.name for t in reference.graph.initializer
                                   if t.name in set(reads))  # each float weight read once
    expected = {t.name: t for t in reference.graph.initializer}
    assert {t.name for t in ours.graph.initializer} == set(expected)
    for tensor in ours.graph.initializer:
        assert tensor.data_type == expected[tensor.name].data_type, tensor.name
        assert (onnx.numpy_helper.to_array(tensor).tobytes()
                == onnx.numpy_helper.to_array(expected[tensor.name]).tobytes()), tensor.name
    assert [n.op_type for n in ours.graph.node] == [n.op_type for n in reference.graph.node]
    clamped = onnx.numpy_helper.to_array(next(t for t in ours.graph.initializer if t.name == first.name))
    assert np.isfinite(clamped.astype(np.float32)).all()
