"""Every constant weight as ``MatMul(x, W [K, N])``: the form the quantisation passes match (``quant_weights``).

Dimension letters: T tokens, K input features, N output features, E routed experts, G groups, I / R a group's
input / output features.

DeepSeek-V4's step graph (``moeforge/compile/v4_export.py``) runs on flattened tokens, so its weights reach the
exporter's graph in three other forms, rewritten here:

- ``Gemm(x [T, K], W [N, K], transB=1)`` (an ``nn.Linear`` on [T, K])  ->  ``MatMul(x, W^T [K, N])``;
- ``Gemm(x, Gather(stack [E, N, K], e), transB=1)`` (routed expert ``e`` of a stacked weight: ``moe.apply_experts``'
  static loop over experts)  ->  ``MatMul(x, stack[e]^T [K, N])``, one initializer per expert; the stack goes once
  nothing reads it (same bytes in all);
- ``MatMul(x [G, T, I], W [G, I, R])`` (the grouped output projection ``o_a_proj``, one batched GEMM)  ->
  ``Split`` of x into its G groups, ``MatMul(x_g [1, T, I], W[g] [I, R])`` each, ``Concat`` -> [G, T, R].

The new weights are lazy (``node_builder.lazy_tensor``: made when the artifact is written, an expert of a streamed
stack read alone). The products are the same, by other kernels: fp32 parity is unchanged. New nodes keep the
exporter's metadata (module scopes), so quantisation labels and the manifest still name the module.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from moeforge.ops.expert_stack import experts_of
from moeforge.ops.node_builder import const_array, lazy_tensor
from moeforge.passes.base import PassContext, add_initializer

# The initializer one routed expert's MatMul reads: ``<stack>.<e>.T`` (``<stack>`` a stacked expert weight, e.g.
# ``model.model.layers.1.mlp.experts.gate_proj``). ``quant_weights`` treats these as the MoE ops' experts are treated.
ROUTED_EXPERT = re.compile(r"\.experts\.(gate|up|down)_proj\.\d+(\.T)?$")


class WeightMatMuls:
    """Gemm over a constant (or one expert of a constant stack) and batched MatMuls over a constant [G, I, R] become
    MatMuls over 2-D initializers; returns the number of nodes rewritten."""

    name = "weight_matmuls"

    def apply(self, model: ir.Model, ctx: PassContext) -> int:
        graph = model.graph
        count = 0
        for node in list(graph):
            if node.domain == "" and node.op_type == "Gemm":
                count += _gemm(graph, node)
            elif node.domain == "" and node.op_type == "MatMul":
                count += _grouped(graph, node)
        return count


def _gemm(graph: ir.Graph, node: ir.Node) -> int:
    """Gemm(x, B) with alpha 1, no C and x not transposed -> MatMul(x, B [K, N] as an initializer)."""
    attrs = node.attributes
    if (len(node.inputs) > 2 and node.inputs[2] is not None) or attrs.get_int("transA") \
            or attrs.get_float("alpha") not in (None, 1.0):
        return 0
    x, b = node.inputs[0], node.inputs[1]
    if x is None or b is None:
        return 0
    weight = _matrix(graph, b, transposed=bool(attrs.get_int("transB")))
    if weight is None:
        return 0
    matmul = ir.node("MatMul", [x, weight], metadata_props=dict(node.metadata_props))
    graph.insert_before(node, matmul)
    _replace(graph, node, matmul.outputs[0])
    _drop_unused(graph, b)
    return 1


def _matrix(graph: ir.Graph, b: ir.Value, *, transposed: bool) -> ir.Value | None:
    """Gemm's B as a [K, N] initializer: B itself (``transposed`` False), B^T, or expert e of a stack read by
    ``Gather(stack, e)`` (transposed if asked); None when B is neither a 2-D constant nor such a Gather."""
    tensor = _initializer(b)
    if tensor is not None and len(tensor.shape) == 2:
        if not transposed:
            return b
        n, k = (int(d) for d in tensor.shape.numpy())
        return _lazy(graph, f"{b.name}.T", lambda: np.ascontiguousarray(tensor.numpy().T), tensor.dtype, (k, n))
    gather = b.producer()
    if gather is None or gather.domain != "" or gather.op_type != "Gather" or gather.attributes.get_int("axis"):
        return None
    stack, index = gather.inputs[0], gather.inputs[1]
    if stack is None or index is None:
        return None
    return _expert(graph, stack, index, transposed=transposed)


def _expert(graph: ir.Graph, stack: ir.Value, index: ir.Value, *, transposed: bool) -> ir.Value | None:
    """``Gather(stack [E, N, K] const, e const scalar)`` as an initializer (transposed: [K, N]), else None."""
    tensor = _initializer(stack)
    e = const_array(index)
    if tensor is None or e is None or e.ndim != 0 or len(tensor.shape) != 3:
        return None
    experts, n, k = (int(d) for d in tensor.shape.numpy())
    expert = int(e) % experts  # Gather takes negative indices from the end
    read = experts_of(tensor)  # a streamed stack: one expert read alone

    def matrix() -> np.ndarray:
        array = np.asarray(read(expert) if read is not None else tensor.numpy()[expert])  # [N, K]
        return np.ascontiguousarray(array.T if transposed else array)

    return _lazy(graph, f"{stack.name}.{expert}" + (".T" if transposed else ""), matrix, tensor.dtype,
                 (k, n) if transposed else (n, k))


def _grouped(graph: ir.Graph, node: ir.Node) -> int:
    """MatMul(x [G, T, I], W const [G, I, R]) -> Concat_g(MatMul(x_g, W[g])) along axis 0."""
    x, w = node.inputs[0], node.inputs[1]
    tensor = _initializer(w) if w is not None else None
    if x is None or w is None or tensor is None or len(tensor.shape) != 3 or x.shape is None or len(x.shape) != 3:
        return 0
    groups, i, r = (int(d) for d in tensor.shape.numpy())
    if x.shape[0] != groups:
        return 0
    metadata = dict(node.metadata_props)
    stem = _module(node) or w.name or "grouped"
    split = ir.node("Split", [x], attributes={"axis": 0, "num_outputs": groups}, num_outputs=groups,
                    metadata_props=metadata)
    matmuls = []
    for g, part in enumerate(split.outputs):
        part.shape, part.type = ir.Shape([1, x.shape[1], i]), x.type

        def matrix(g: int = g) -> np.ndarray:
            return np.ascontiguousarray(tensor.numpy()[g])  # [I, R]

        weight = _lazy(graph, f"{stem}.group{g}", matrix, tensor.dtype, (i, r))
        matmul = ir.node("MatMul", [part, weight], metadata_props=metadata)
        matmul.outputs[0].shape, matmul.outputs[0].type = ir.Shape([1, x.shape[1], r]), x.type
        matmuls.append(matmul)
    concat = ir.node("Concat", [m.outputs[0] for m in matmuls], attributes={"axis": 0}, metadata_props=metadata)
    graph.insert_before(node, [split, *matmuls, concat])
    _replace(graph, node, concat.outputs[0])
    _drop_unused(graph, w)
    return 1


def _replace(graph: ir.Graph, node: ir.Node, value: ir.Value) -> None:
    """``value`` (inserted already) in place of ``node``'s output, with its name, shape and type; ``node`` removed."""
    out = node.outputs[0]
    value.shape, value.type = out.shape, out.type
    ir.convenience.replace_all_uses_with(out, value, replace_graph_outputs=True)
    graph.remove(node, safe=True)
    value.name = out.name


def _initializer(value: ir.Value) -> ir.TensorProtocol | None:
    """The value's tensor when it is an initializer (not a graph input), else None; nothing read."""
    return value.const_value if value.const_value is not None and not value.is_graph_input() else None


def _lazy(graph: ir.Graph, name: str, compute: Callable[[], np.ndarray], dtype: ir.DataType,
          shape: tuple[int, ...]) -> ir.Value:
    """Initializer ``name`` computed when read (the same one if an earlier rewrite made it)."""
    if name in graph.initializers:
        return graph.initializers[name]
    return add_initializer(graph, name, lazy_tensor(compute, dtype, shape))


def _drop_unused(graph: ir.Graph, value: ir.Value) -> None:
    """Remove ``value``'s producer (a Gather of one expert) and the initializers it read, once nothing uses them."""
    if value.uses():
        return
    producer = value.producer()
    if producer is not None:
        inputs = [v for v in producer.inputs if v is not None]
        graph.remove(producer, safe=True)
        for source in inputs:
            _drop_unused(graph, source)
    elif value.name is not None and value.name in graph.initializers and not value.is_graph_input():
        graph.initializers.pop(value.name)


def _module(node: ir.Node) -> str | None:
    """The module path the exporter recorded for ``node`` (its innermost dotted name scope), e.g.
    ``model.model.layers.0.self_attn.o_a_proj``; None without one."""
    scopes = node.metadata_props.get("pkg.torch.onnx.name_scopes")
    if not scopes:
        return None
    try:
        names = ast.literal_eval(scopes)
    except (ValueError, SyntaxError):
        return None
    dotted = [s for s in names if isinstance(s, str) and "." in s] if isinstance(names, list) else []
    return dotted[-1] if dotted else None
