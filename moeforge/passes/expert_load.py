"""Expose the routing: a graph output ``expert_hits`` [L_moe, T, E] bool, the experts each token went to per MoE layer.

Serving wants the expert load (routed tokens per expert and layer, and its imbalance max/mean): the numbers that
decide expert parallelism and capacity. After ``moe_lowering`` each ``com.microsoft.MoE`` / ``QMoE`` node reads
``router_probs`` [T, E], which is -inf exactly where an expert was not chosen (moeforge/ops/moe_router/ort_lowering.py),
so per layer

    hits = Not(IsInf(router_probs, detect_positive=0))          [T, E] bool
    expert_hits = Concat(Unsqueeze(hits_0, 0), ...)            [L_moe, T, E]

Three cheap nodes per MoE layer, read from the router the graph already runs (no second routing computation).
The backend counts only the rows of real tokens (a contiguous decode batch has idle rows).

An expert-parallel rank's ``moeforge.MoEExperts`` nodes are lowered too (over its own S experts or placement slots;
moe_lowering's ``_lower_local``): the same rule reads the tokens its experts (slots) computed, [L_moe, T, S]. A node
left unlowered (the TensorRT target; ids of no static K) has its hits read from its local ids (``0 .. S - 1`` its
experts, ``S`` another rank's):

    hits = Cast(ReduceMax(Cast(Equal(Unsqueeze(ids, 2), Range(S)), int32), axes=[1]), bool)      [T, S]

DeepSeek-V4's step graph (``v4_pipeline``; its MoE exported from torch, no MoE node) runs each routed expert (or slot)
``e`` of a layer on ``NonZero(Equal(ids, e))``: ``per_expert_loops`` reads a layer's hits from those ids, one layer per
group of ``Equal`` nodes on one ids tensor [T, K] against the constants 0 .. S - 1 (S its stacked experts, ``S`` on an
expert-parallel rank another rank's), by the rule above.

Graphs without MoE nodes get no output.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from moeforge.core.kv_layout import EXPERT_HITS
from moeforge.model import moe_op
from moeforge.passes.base import MS_DOMAIN, PassContext, add_initializer

MOE_OPS = {(MS_DOMAIN, "MoE"), (MS_DOMAIN, "QMoE")}
_IDS, _GATE = moe_op.INPUTS.index("expert_ids"), moe_op.INPUTS.index("gate_proj")
_INTEGERS = (ir.DataType.INT64, ir.DataType.INT32)


class ExpertLoadOutput:
    """Add the ``expert_hits`` output; returns the number of MoE layers it covers. ``per_expert_loops``: read them
    from the per-expert ``Equal`` loops of a graph without MoE nodes (DeepSeek-V4's step graph)."""

    name = "expert_load"

    def __init__(self, per_expert_loops: bool = False) -> None:
        self.per_expert_loops = per_expert_loops

    def apply(self, model: ir.Model, ctx: PassContext) -> int:
        graph = model.graph
        if any(value.name == EXPERT_HITS for value in graph.outputs):
            return 0
        if self.per_expert_loops:
            return _add_output(graph, [(node, len(group)) for node, group in _expert_loops(graph)], loops=True)
        moe_nodes = [n for n in graph if (n.domain, n.op_type) in MOE_OPS and len(n.inputs) > 1
                     and n.inputs[1] is not None]
        local_nodes = [n for n in graph if (n.domain, n.op_type) == (moe_op.DOMAIN, moe_op.OP_TYPE)]
        if moe_nodes and local_nodes:  # one numbering per graph: never mix a layer's experts with another's slots
            return 0
        return _add_output(graph, [(n, 0) for n in moe_nodes or local_nodes], loops=False)


def _add_output(graph: ir.Graph, layers_from: list[tuple[ir.Node, int]], loops: bool) -> int:
    """``expert_hits`` from one node per MoE layer: a lowered MoE node (its router_probs), an unlowered
    ``moeforge.MoEExperts`` (its ids), or (``loops``) the last ``Equal`` of a layer's expert loop with its S."""
    if not layers_from:
        return 0
    lowered = (layers_from[0][0].domain, layers_from[0][0].op_type) in MOE_OPS
    axis = add_initializer(graph, f"{EXPERT_HITS}/axis0", np.array([0], np.int64))
    layers = []
    for i, (node, experts) in enumerate(layers_from):
        stem = f"{EXPERT_HITS}/{i}"
        if loops:
            ids = node.inputs[0]
            assert ids is not None  # an expert loop's Equal reads its ids (``_expert_loops``)
            new_nodes = _ids_hits(graph, ids, experts, stem)
        else:
            new_nodes = _lowered_hits(node, stem) if lowered else _local_hits(graph, node, stem)
        layer = ir.node("Unsqueeze", [new_nodes[-1].outputs[0], axis], name=f"{stem}/Unsqueeze")
        layer.outputs[0].name = f"{stem}/layer"
        graph.insert_after(node, [*new_nodes, layer])
        layers.append(layer.outputs[0])
    concat = ir.node("Concat", layers, attributes={"axis": 0}, name=f"{EXPERT_HITS}/Concat")
    concat.outputs[0].name = EXPERT_HITS
    concat.outputs[0].dtype = ir.DataType.BOOL
    graph.append(concat)
    graph.outputs.append(concat.outputs[0])
    return len(layers)


def _expert_loops(graph: ir.Graph) -> list[tuple[ir.Node, list[ir.Node]]]:
    """Per MoE layer in graph order: the last node of its expert loop and the loop's ``Equal`` nodes, one per expert
    (``Equal(ids [T, K], e)`` feeding ``NonZero``, the constants e exactly 0 .. S - 1)."""
    groups: dict[ir.Value, list[ir.Node]] = {}
    for node in graph:
        if node.op_type != "Equal" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
            continue
        ids, const = node.inputs
        value = None if const is None else ir.convenience.get_const_tensor(const)
        if (ids is None or value is None or value.shape.dims != () or value.dtype not in _INTEGERS
                or ids.shape is None or ids.shape.rank() != 2
                or not any(user.op_type == "NonZero" for user, _ in node.outputs[0].uses())):
            continue
        groups.setdefault(ids, []).append(node)
    loops = []
    for group in groups.values():
        experts = sorted(_scalar(n.inputs[1]) for n in group)
        if experts == list(range(len(group))) and len(group) > 1:
            loops.append((group[-1], group))
    return loops


def _lowered_hits(node: ir.Node, stem: str) -> list[ir.Node]:
    """[T, E] bool from a lowered MoE node's ``router_probs`` (-inf where an expert was not chosen)."""
    is_inf = ir.node("IsInf", [node.inputs[1]], attributes={"detect_positive": 0, "detect_negative": 1},
                     name=f"{stem}/IsInf")
    chosen = ir.node("Not", [is_inf.outputs[0]], name=f"{stem}/Not")
    is_inf.outputs[0].name, chosen.outputs[0].name = f"{stem}/not_chosen", f"{stem}/chosen"
    return [is_inf, chosen]


def _scalar(value: ir.Value | None) -> int:
    tensor = None if value is None else ir.convenience.get_const_tensor(value)
    assert tensor is not None
    return int(tensor.numpy())


def _local_hits(graph: ir.Graph, node: ir.Node, stem: str) -> list[ir.Node]:
    """[T, S] bool from an unlowered ``moeforge.MoEExperts`` node's local ids [T, K] (S: its stacked experts)."""
    ids, gate = node.inputs[_IDS], node.inputs[_GATE]
    experts = gate.shape[0] if gate is not None and gate.shape is not None else None
    if ids is None or not isinstance(experts, int):
        raise ValueError(f"{node.name}: expert_hits needs the ids and a static expert count (gate_proj [S, I, H])")
    return _ids_hits(graph, ids, experts, stem)


def _ids_hits(graph: ir.Graph, ids: ir.Value, experts: int, stem: str) -> list[ir.Node]:
    """[T, S] bool from local ids [T, K] (0 .. S - 1 the block's experts, S another rank's)."""
    slots = add_initializer(graph, f"{stem}/slots", np.arange(experts, dtype=np.int64))  # [S]
    last = add_initializer(graph, f"{stem}/axis2", np.array([2], np.int64))
    over_k = add_initializer(graph, f"{stem}/axis1", np.array([1], np.int64))
    ids64 = ir.node("Cast", [ids], attributes={"to": ir.DataType.INT64}, name=f"{stem}/Cast_ids")
    column = ir.node("Unsqueeze", [ids64.outputs[0], last], name=f"{stem}/Unsqueeze_ids")  # [T, K, 1]
    equal = ir.node("Equal", [column.outputs[0], slots], name=f"{stem}/Equal")  # [T, K, S]
    as_int = ir.node("Cast", [equal.outputs[0]], attributes={"to": ir.DataType.INT32}, name=f"{stem}/Cast_int")
    any_k = ir.node("ReduceMax", [as_int.outputs[0], over_k], attributes={"keepdims": 0}, name=f"{stem}/ReduceMax")
    chosen = ir.node("Cast", [any_k.outputs[0]], attributes={"to": ir.DataType.BOOL}, name=f"{stem}/chosen")
    new = [ids64, column, equal, as_int, any_k, chosen]
    for item in new:
        item.outputs[0].name = item.name
    return new
