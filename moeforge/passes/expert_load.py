"""Expose the routing: a graph output ``expert_hits`` [L_moe, T, E] bool, the experts each token went to per MoE layer.

Serving wants the expert load (routed tokens per expert and layer, and its imbalance max/mean): the numbers that
decide expert parallelism and capacity. After ``moe_lowering`` each ``com.microsoft.MoE`` / ``QMoE`` node reads
``router_probs`` [T, E], which is -inf exactly where an expert was not chosen (moeforge/ops/moe_router/ort_lowering.py),
so per layer

    hits = Not(IsInf(router_probs, detect_positive=0))          [T, E] bool
    expert_hits = Concat(Unsqueeze(hits_0, 0), ...)            [L_moe, T, E]

Three cheap nodes per MoE layer, read from the router the graph already runs (no second routing computation).
The backend counts only the rows of real tokens (a contiguous decode batch has idle rows). Graphs without MoE
nodes, or whose MoE nodes are not the lowered ones, get no output.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from moeforge.core.kv_layout import EXPERT_HITS
from moeforge.passes.base import MS_DOMAIN, PassContext, add_initializer

MOE_OPS = {(MS_DOMAIN, "MoE"), (MS_DOMAIN, "QMoE")}


class ExpertLoadOutput:
    """Add the ``expert_hits`` output; returns the number of MoE layers it covers."""

    name = "expert_load"

    def apply(self, model: ir.Model, ctx: PassContext) -> int:
        graph = model.graph
        if any(value.name == EXPERT_HITS for value in graph.outputs):
            return 0
        moe_nodes = [n for n in graph if (n.domain, n.op_type) in MOE_OPS and len(n.inputs) > 1
                     and n.inputs[1] is not None]
        if not moe_nodes:
            return 0
        axis = add_initializer(graph, f"{EXPERT_HITS}/axis0", np.array([0], np.int64))
        layers = []
        for i, node in enumerate(moe_nodes):
            stem = f"{EXPERT_HITS}/{i}"
            is_inf = ir.node("IsInf", [node.inputs[1]], attributes={"detect_positive": 0, "detect_negative": 1},
                             name=f"{stem}/IsInf")
            chosen = ir.node("Not", [is_inf.outputs[0]], name=f"{stem}/Not")
            layer = ir.node("Unsqueeze", [chosen.outputs[0], axis], name=f"{stem}/Unsqueeze")
            for new, out in ((is_inf, "not_chosen"), (chosen, "chosen"), (layer, "layer")):
                new.outputs[0].name = f"{stem}/{out}"
            graph.insert_after(node, [is_inf, chosen, layer])
            layers.append(layer.outputs[0])
        concat = ir.node("Concat", layers, attributes={"axis": 0}, name=f"{EXPERT_HITS}/Concat")
        concat.outputs[0].name = EXPERT_HITS
        concat.outputs[0].dtype = ir.DataType.BOOL
        graph.append(concat)
        graph.outputs.append(concat.outputs[0])
        return len(moe_nodes)
