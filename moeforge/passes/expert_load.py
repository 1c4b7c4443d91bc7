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


class ExpertLoadOutput:
    """Add the ``expert_hits`` output; returns the number of MoE layers it covers."""

    name = "expert_load"

    def apply(self, model: ir.Model, ctx: PassContext) -> int:
        graph = model.graph
        if any(value.name == EXPERT_HITS for value in graph.outputs):
            return 0
        moe_nodes = [n for n in graph if (n.domain, n.op_type) in MOE_OPS and len(n.inputs) > 1
                     and n.inputs[1] is not None]
        local_nodes = [n for n in graph if (n.domain, n.op_type) == (moe_op.DOMAIN, moe_op.OP_TYPE)]
        if not moe_nodes and not local_nodes:
            return 0
        if moe_nodes and local_nodes:  # one numbering per graph: never mix a layer's experts with another's slots
            return 0
        axis = add_initializer(graph, f"{EXPERT_HITS}/axis0", np.array([0], np.int64))
        layers = []
        for i, node in enumerate(moe_nodes or local_nodes):
            stem = f"{EXPERT_HITS}/{i}"
            new_nodes = _lowered_hits(node, stem) if moe_nodes else _local_hits(graph, node, stem)
            layer = ir.node("Unsqueeze", [new_nodes[-1].outputs[0], axis], name=f"{stem}/Unsqueeze")
            layer.outputs[0].name = f"{stem}/layer"
            graph.insert_after(node, [*new_nodes, layer])
            layers.append(layer.outputs[0])
        concat = ir.node("Concat", layers, attributes={"axis": 0}, name=f"{EXPERT_HITS}/Concat")
        concat.outputs[0].name = EXPERT_HITS
        concat.outputs[0].dtype = ir.DataType.BOOL
        graph.append(concat)
        graph.outputs.append(concat.outputs[0])
        return len(moe_nodes or local_nodes)


def _lowered_hits(node: ir.Node, stem: str) -> list[ir.Node]:
    """[T, E] bool from a lowered MoE node's ``router_probs`` (-inf where an expert was not chosen)."""
    is_inf = ir.node("IsInf", [node.inputs[1]], attributes={"detect_positive": 0, "detect_negative": 1},
                     name=f"{stem}/IsInf")
    chosen = ir.node("Not", [is_inf.outputs[0]], name=f"{stem}/Not")
    is_inf.outputs[0].name, chosen.outputs[0].name = f"{stem}/not_chosen", f"{stem}/chosen"
    return [is_inf, chosen]


def _local_hits(graph: ir.Graph, node: ir.Node, stem: str) -> list[ir.Node]:
    """[T, S] bool from an unlowered ``moeforge.MoEExperts`` node's local ids [T, K] (S: its stacked experts)."""
    ids, gate = node.inputs[_IDS], node.inputs[_GATE]
    experts = gate.shape[0] if gate is not None and gate.shape is not None else None
    if ids is None or not isinstance(experts, int):
        raise ValueError(f"{node.name}: expert_hits needs the ids and a static expert count (gate_proj [S, I, H])")
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
