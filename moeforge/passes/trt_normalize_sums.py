"""Small normalising sums as MatMuls: what keeps TensorRT-RTX from compiling DeepSeek-V4's Sinkhorn loop into one
exponentially large kernel.

Letters: M, N the last two dims of the normalised tensor x [..., M, N].

DeepSeek-V4's hyper-connections (``model/hyper_connections.py``) make each mixing matrix doubly stochastic by
Sinkhorn-Knopp, ``sinkhorn_iters`` (20) unrolled rounds of ``x = x / (x.sum(-1 or -2, keepdim) + eps)`` on [T, 4, 4].
Each round reads x twice (its sum and the division), and TensorRT-RTX 1.7's Myelin compiler fuses the whole chain of
reductions and divisions into one generated kernel, expanding the shared x at every round: measured on CPU for SM89
(one [T, 4, 4] chain, T <= 64) the plan grows 0.15, 0.25, 1.5, 15 MB for 1, 2, 3, 4 rounds, and tiny-deepseek-v4
(9 such chains of 39 rounds) ends in ``std::bad_alloc`` in Myelin's code generator after minutes and 8-23 GB.

A MatMul is a kernel boundary for Myelin. So ``x / (ReduceSum(x, axis, keepdims) + c)`` over one of the last two
axes, static and at most ``MAX_AXIS`` long, has its sum rewritten as a product with a matrix of ones, which is the
same sum already broadcast along the reduced axis (the division broadcast it anyway):
    axis -1:  x @ ones[N, N]     (row sums, every column)
    axis -2:  ones[M, M] @ x     (column sums, every row)
The 20-round chain then builds in linear size (3.2 MB, 0.4 s for 20 rounds). Values: the same sums of the same
terms (a GEMM may add them in another order, ~1 ulp).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from moeforge.ops.node_builder import const_array
from moeforge.passes.base import PassContext

MAX_AXIS = 64  # larger axes are no Sinkhorn matrix: a MatMul with ones would cost N times a sum


class SumsAsMatMul:
    """Rewrite the sums of ``x / (ReduceSum(x) + c)`` (one small static axis of the last two) as MatMuls with ones;
    returns the number rewritten."""

    name = "sums_as_matmul"

    def apply(self, model: ir.Model, ctx: PassContext) -> int:
        graph = model.graph
        ones: dict[tuple[int, ir.DataType], ir.Value] = {}
        count = 0
        for node in list(graph):
            match = _normalising_sum(node)
            if match is None:
                continue
            x, axis, size = match
            dtype = x.dtype
            assert dtype is not None  # _normalising_sum checked it
            key = (size, dtype)
            if key not in ones:
                value = ir.Value(name=f"sum_ones_{size}x{size}_{dtype.name.lower()}", shape=ir.Shape([size, size]),
                                 type=ir.TensorType(dtype),
                                 const_value=ir.tensor(np.ones((size, size), dtype.numpy()), dtype=dtype))
                graph.register_initializer(value)
                ones[key] = value
            inputs = [x, ones[key]] if axis == -1 else [ones[key], x]
            matmul = ir.node("MatMul", inputs, name=f"{node.name}_as_matmul")
            matmul.outputs[0].shape, matmul.outputs[0].type = x.shape, x.type
            graph.insert_before(node, matmul)
            node.outputs[0].replace_all_uses_with(matmul.outputs[0])
            add = next(iter(matmul.outputs[0].consumers()))
            add.outputs[0].shape = x.shape  # the sum is now broadcast: the Add's result has x's shape
            graph.remove(node, safe=True)
            count += 1
        return count


def _normalising_sum(node: ir.Node) -> tuple[ir.Value, int, int] | None:
    """(x, axis as -1 | -2, its size) when ``node`` is the ReduceSum of ``x / (ReduceSum(x) + c)``, c a scalar
    constant, the sum and the Add used only there, over a static axis <= MAX_AXIS of x's last two; else None."""
    if node.op_type != "ReduceSum" or node.domain != "" or len(node.inputs) < 2:
        return None
    keepdims = node.attributes.get("keepdims")
    if keepdims is not None and keepdims.as_int() != 1:
        return None
    x, axes_value = node.inputs[0], node.inputs[1]
    if x is None or axes_value is None or x.shape is None or x.dtype is None or len(x.shape) < 2:
        return None
    axes = const_array(axes_value)
    if axes is None or axes.size != 1:
        return None
    rank = len(x.shape)
    axis = int(axes.reshape(-1)[0])
    axis = axis - rank if axis >= 0 else axis
    if axis not in (-1, -2):
        return None
    size = x.shape[axis]
    if not isinstance(size, int) or not 1 <= size <= MAX_AXIS:
        return None
    total = node.outputs[0]
    if len(total.uses()) != 1 or total.is_graph_output():
        return None
    add = next(iter(total.consumers()))
    if add.op_type != "Add" or add.domain != "" or len(add.inputs) != 2:
        return None
    constant = add.inputs[1] if add.inputs[0] is total else add.inputs[0]
    c = const_array(constant) if constant is not None else None
    if c is None or c.size != 1 or len(add.outputs[0].uses()) != 1 or add.outputs[0].is_graph_output():
        return None
    div = next(iter(add.outputs[0].consumers()))
    if div.op_type != "Div" or div.domain != "" or div.inputs[0] is not x or div.inputs[1] is not add.outputs[0]:
        return None
    return x, axis, size
