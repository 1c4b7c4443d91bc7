"""MLA's absorbed per-head products: ``Einsum`` over a slice of ``kv_b_proj`` -> ``MatMul`` over a constant.

The exporter writes absorbed MLA (moeforge/model/mla.py) as two Einsums per layer whose weight operand is a view of
the ``kv_b_proj`` initializer computed on every run:

    w_uk = Slice(Reshape(kv_b [H * (nope + v), r], [H, nope + v, r]), 0:nope, axis 1)     [H, nope, r]
    w_uv = Slice(..., nope:, axis 1)                                                        [H, v, r]
    q_latent = Einsum("bshd,hdr->bhsr", q_nope, w_uk)
    out      = Einsum("bhsr,hvr->bshv", attn_latent, w_uv)

ONNX Runtime's CPU Einsum transposes its operands into a GEMM layout on every call, the weight included: on a
DeepSeek-V3-shaped model (H 16, r 512) the two Einsums were 22% of a decode step's kernel time, more than the
attention. This pass evaluates each weight view once, when the artifact is written (``[H, d, r]`` for the first,
``[H, r, v]`` transposed for the second), and emits a batched MatMul over it:

    q_latent = MatMul(Transpose(q_nope, [0, 2, 1, 3]), w_uk)                               [b, h, s, r]
    out      = Transpose(MatMul(attn_latent, w_uv^T), [0, 2, 1, 3])                        [b, s, h, v]

Same products, same float32 values (the view is copied, not rounded). An Einsum whose weight is not a constant
view of initializers (Reshape / Slice / Transpose / Squeeze / Unsqueeze chains) is left alone.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from moeforge.passes.base import PassContext, add_initializer

# equation -> (operand transpose before the MatMul, weight transpose, output transpose after)
_PATTERNS: dict[str, tuple[list[int] | None, tuple[int, ...] | None, list[int] | None]] = {
    "bshd,hdr->bhsr": ([0, 2, 1, 3], None, None),
    "bhsr,hvr->bshv": (None, (0, 2, 1), [0, 2, 1, 3]),
}


class AbsorbedEinsum:
    """Rewrite the absorbed-MLA Einsums (``_PATTERNS``) over constant weight views into MatMul; returns how many."""

    name = "absorbed_einsum"

    def apply(self, model: ir.Model, ctx: PassContext) -> int:
        graph = model.graph
        count = 0
        for node in list(graph):
            if node.op_type != "Einsum" or node.domain != "":
                continue
            equation = node.attributes.get("equation")
            pattern = _PATTERNS.get(equation.as_string().replace(" ", "")) if equation is not None else None
            weight = node.inputs[1] if len(node.inputs) == 2 else None
            compute = _constant_view(weight) if weight is not None else None
            if pattern is None or compute is None or weight is None or weight.shape is None:
                continue
            before, weight_perm, after = pattern
            shape = [int(d) for d in weight.shape.numpy()]
            if weight_perm is not None:
                shape = [shape[i] for i in weight_perm]

            def made(compute: Callable[[], np.ndarray] = compute,
                     perm: tuple[int, ...] | None = weight_perm) -> ir.TensorProtocol:
                array = compute()
                return ir.tensor(np.ascontiguousarray(array.transpose(perm) if perm else array, np.float32))

            stem = node.name or f"absorbed_einsum_{count}"
            constant = add_initializer(graph, f"{stem}.weight",
                                       ir.LazyTensor(made, ir.DataType.FLOAT, ir.Shape(shape)))
            new: list[ir.Node] = []
            operand = node.inputs[0]
            if before is not None:
                new.append(ir.node("Transpose", [operand], {"perm": before}, name=f"{stem}/transpose_in"))
                operand = new[-1].outputs[0]
            new.append(ir.node("MatMul", [operand, constant], name=f"{stem}/matmul"))
            if after is not None:
                new.append(ir.node("Transpose", [new[-1].outputs[0]], {"perm": after}, name=f"{stem}/transpose_out"))
            for item in new:
                item.outputs[0].name = item.name
            result, old = new[-1].outputs[0], node.outputs[0]
            result.dtype, result.shape = old.dtype or ir.DataType.FLOAT, old.shape
            graph.insert_before(node, new)
            old.replace_all_uses_with(result, replace_graph_outputs=True)
            name, old.name = old.name, None
            graph.remove(node, safe=True)
            result.name = name
            _drop_dead(graph, weight)
            count += 1
        return count


def _drop_dead(graph: ir.Graph, value: ir.Value) -> None:
    """Remove the view chain that computed ``value`` and the initializer under it once nothing reads them (the
    view's source, kv_b_proj, would otherwise stay in the artifact beside the constants made from it)."""
    if value.uses() or value.is_graph_output():
        return
    node = value.producer()
    if node is None:
        if value.name is not None and value.name in graph.initializers and value.const_value is not None:
            graph.initializers.pop(value.name)
        return
    if any(out.uses() or out.is_graph_output() for out in node.outputs):
        return
    inputs = [i for i in node.inputs if i is not None]
    graph.remove(node, safe=True)
    for item in inputs:
        _drop_dead(graph, item)


def _ints(value: ir.Value | None) -> list[int] | None:
    if value is None or value.const_value is None:
        return None
    return [int(v) for v in value.const_value.numpy().reshape(-1)]


def _constant_view(value: ir.Value) -> Callable[[], np.ndarray] | None:
    """A function computing ``value`` when it is an initializer or a Reshape / Slice / Transpose / Squeeze /
    Unsqueeze chain over one (with constant shapes, bounds and axes); None otherwise. Nothing is read here."""
    if value.const_value is not None:
        tensor = value.const_value
        return lambda: np.asarray(tensor.numpy())
    node = value.producer()
    if node is None or node.domain != "" or not node.inputs or node.inputs[0] is None:
        return None
    source = _constant_view(node.inputs[0])
    if source is None:
        return None
    if node.op_type == "Reshape":
        shape = _ints(node.inputs[1] if len(node.inputs) > 1 else None)
        if shape is None:
            return None
        return lambda: _reshape(source(), shape)
    if node.op_type == "Slice":
        starts, ends = (_ints(node.inputs[i] if len(node.inputs) > i else None) for i in (1, 2))
        axes = _ints(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3] is not None else None
        steps = _ints(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] is not None else None
        if starts is None or ends is None:
            return None
        return lambda: _slice(source(), starts, ends, axes, steps)
    if node.op_type == "Transpose":
        perm = node.attributes.get("perm")
        order = list(perm.as_ints()) if perm is not None else None
        return lambda: np.transpose(source(), order)
    if node.op_type in ("Squeeze", "Unsqueeze"):
        axes = _ints(node.inputs[1]) if len(node.inputs) > 1 else None
        if axes is None:
            return None
        if node.op_type == "Squeeze":
            return lambda: np.squeeze(source(), tuple(axes))
        return lambda: _unsqueeze(source(), axes)
    return None


def _reshape(array: np.ndarray, shape: list[int]) -> np.ndarray:
    target = [array.shape[i] if d == 0 else d for i, d in enumerate(shape)]  # ONNX: 0 copies the dimension
    return array.reshape(target)


def _slice(array: np.ndarray, starts: list[int], ends: list[int], axes: list[int] | None,
           steps: list[int] | None) -> np.ndarray:
    index = [slice(None)] * array.ndim
    for i, axis in enumerate(axes if axes is not None else range(len(starts))):
        index[axis] = slice(starts[i], ends[i], steps[i] if steps is not None else 1)
    return array[tuple(index)]


def _unsqueeze(array: np.ndarray, axes: list[int]) -> np.ndarray:
    for axis in sorted(a % (array.ndim + len(axes)) for a in axes):
        array = np.expand_dims(array, axis)
    return array
