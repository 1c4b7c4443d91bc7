"""Projection packing: MatMuls that read the same activation with constant weights become one GEMM.

Dimension letters: B batch, S tokens, K input features, N_i output features of projection i.

q/k/v (and MLA's q_a / kv_a) read the normed hidden state; a SwiGLU's gate and up read the same
input. X [B,S,K] @ W_i [K,N_i] for i = 1..n  ->  X @ concat(W_i) [K, sum N_i] -> Split(N_1..N_n).
One larger GEMM uses the cores better than n small ones at decode (S = 1), and reads X once.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import onnx_ir as ir

from moeforge.ops.node_builder import lazy_tensor
from moeforge.passes.base import PassContext, required


class ProjectionPacking:
    """Pack sibling constant-weight MatMuls; returns the number of packed groups."""

    name = "packing"

    def apply(self, model: ir.Model, ctx: PassContext) -> int:
        groups: dict[int, list[ir.Node]] = defaultdict(list)
        for node in model.graph:
            if node.op_type == "MatMul" and node.domain == "" and _const_2d(node.inputs[1]) is not None:
                groups[id(node.inputs[0])].append(node)
        packed = 0
        for nodes in groups.values():
            if len(nodes) < 2:
                continue
            weights = [required(_const_2d(n.inputs[1]), f"{n.name}: constant weight") for n in nodes]
            if len({w.shape.numpy()[0] for w in weights}) != 1 or len({w.dtype for w in weights}) != 1:
                continue
            self._pack(model, nodes, weights)
            packed += 1
        return packed

    def _pack(self, model: ir.Model, nodes: list[ir.Node], weights: list[ir.TensorProtocol]) -> None:
        graph = model.graph
        sizes = [w.shape.numpy()[1] for w in weights]
        first = min(nodes, key=lambda n: list(graph).index(n))
        stem = nodes[0].outputs[0].name or "packed"
        shape = [weights[0].shape.numpy()[0], sum(sizes)]
        # Concatenated when the artifact is written (lazy): no packed copy beside the originals until then.
        packed = lazy_tensor(lambda: np.concatenate([w.numpy() for w in weights], axis=1), weights[0].dtype, shape,
                             f"{stem}.packed_weight")
        packed_weight = ir.Value(name=f"{stem}.packed_weight", shape=ir.Shape(shape),
                                 type=ir.TensorType(_weight_dtype(nodes[0])), const_value=packed)
        graph.register_initializer(packed_weight)
        matmul = ir.node("MatMul", [nodes[0].inputs[0], packed_weight])
        split_sizes = ir.Value(name=f"{stem}.split_sizes", shape=ir.Shape([len(sizes)]),
                               type=ir.TensorType(ir.DataType.INT64),
                               const_value=ir.tensor(np.array(sizes, np.int64)))
        graph.register_initializer(split_sizes)
        split = ir.node("Split", [matmul.outputs[0], split_sizes], attributes={"axis": -1}, num_outputs=len(sizes))
        graph.insert_before(first, [matmul, split])
        for node, out in zip(nodes, split.outputs, strict=True):
            out.shape, out.type = node.outputs[0].shape, node.outputs[0].type
            ir.convenience.replace_all_uses_with(node.outputs[0], out)
            old_weight = node.inputs[1]
            graph.remove(node, safe=True)
            if (old_weight is not None and not old_weight.uses()
                    and old_weight.name is not None and old_weight.name in graph.initializers):
                graph.initializers.pop(old_weight.name)


def _weight_dtype(node: ir.Node) -> ir.DataType:
    weight = required(node.inputs[1], f"{node.name}: weight input")
    return required(weight.dtype, f"{weight.name}: dtype")


def _const_2d(value: ir.Value | None) -> ir.TensorProtocol | None:
    """The constant 2-D weight's tensor (not read), else None."""
    if value is None or value.const_value is None or value.shape is None or len(value.shape) != 2:
        return None
    return value.const_value
