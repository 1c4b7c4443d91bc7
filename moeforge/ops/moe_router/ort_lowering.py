"""What ONNX Runtime CPU runs for ``moeforge.MoERouter``: the inputs of the com.microsoft.MoE / QMoE kernels.

Those kernels route by themselves, with a fixed rule: softmax over ``router_probs`` [T, E], top-k,
renormalise (``normalize_routing_weights=1``). DeepSeek routing (sigmoid, a bias that steers only
the choice, group-limited top-k) does not fit that rule, so the choice is made here in standard ops
(the same nodes as the function body, ``function.scores_and_choice``) and the kernel gets a
``router_probs`` whose softmax over the chosen experts is exactly the reference's renormalised
weights:

    router_probs = Where(chosen, Log(scores), -inf)     [T, E]  (chosen: the K experts TopK picks)
    softmax(router_probs)[chosen] = s_k / sum_chosen(s)

The rest of the reference's weight is a per-token factor the caller applies to the kernel output
(``KernelRouting``): routed_scaling_factor (constant; the MoE lowering folds it into fc2) and, when
``norm_topk_prob`` is off, sum_chosen(s) [T, 1]. The kernel's own top-k sees the K chosen entries
finite and every other entry -inf, so it picks the same set (order is irrelevant to a sum).
Edge: a chosen score that underflows to 0 has Log = -inf and weight 0 either way; if all K do, the
kernel's softmax is undefined (the reference gives 0) -- unreachable with fp32 logits in [-80, 80].
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir

from moeforge.ops.moe_router.function import NEG_INF, scatter_true, scores_and_choice
from moeforge.ops.moe_router.schema import DOMAIN, OP_TYPE, RouterAttributes, RouterOpError
from moeforge.ops.node_builder import NodeBuilder


@dataclass(frozen=True)
class KernelRouting:
    """Routing handed to com.microsoft.MoE/QMoE (k = attrs.top_k, normalize_routing_weights=1).

    reference output = kernel output * routed_scaling_factor * (output_scale if not None else 1)
    """

    router_probs: ir.Value  # [T, E] float32: Log(unbiased score) on chosen experts, -inf elsewhere
    output_scale: ir.Value | None  # [T, 1] sum of the chosen unbiased scores (norm_topk_prob off), else None
    routed_scaling_factor: float
    top_k: int


def router_attributes(node: ir.Node) -> RouterAttributes:
    """Typed, validated attributes of a ``moeforge.MoERouter`` node."""
    if (node.domain, node.op_type) != (DOMAIN, OP_TYPE):
        raise RouterOpError(f"{node.name}: expected a {DOMAIN}.{OP_TYPE} node, got {node.domain}.{node.op_type}")
    return RouterAttributes.from_mapping({k: a.value for k, a in node.attributes.items()})


def lower_router(b: NodeBuilder, node: ir.Node, num_experts: int) -> KernelRouting:
    """Emit (into ``b``) the kernel routing that reproduces a ``moeforge.MoERouter`` node."""
    attrs = router_attributes(node)
    attrs.validate(num_experts)
    logits = node.inputs[0]
    if logits is None:
        raise RouterOpError(f"{node.name}: MoERouter needs router_logits")
    bias = node.inputs[1] if len(node.inputs) > 1 else None
    scores, choice = scores_and_choice(b, logits, bias, attrs)

    if attrs.top_k == num_experts:
        chosen = None  # every expert is chosen, whatever the groups say
    else:
        _, idx = b.op_multi("TopK", [choice, b.const_i64([attrs.top_k])], {"axis": -1}, ("topk_vals", "topk_idx"))
        chosen = scatter_true(b, choice, idx, "chosen")  # [T, E] bool

    # Log of the scores (not the raw logits, even for softmax): one formula for both scorings.
    log_scores = b.op("Log", [scores], None, "log_scores")
    if chosen is None:
        router_probs = log_scores
    else:
        router_probs = b.op("Where", [chosen, log_scores, b.const_f32(NEG_INF)], None, "router_probs")

    output_scale = None
    if not attrs.norm_topk_prob:
        # The kernel always renormalises over the chosen experts; undo it with the chosen scores' sum.
        picked = scores if chosen is None else b.op("Where", [chosen, scores, b.const_f32(0.0)], None, "chosen_scores")
        output_scale = b.op("ReduceSum", [picked, b.const_i64([-1])], {"keepdims": 1}, "chosen_score_sum")  # [T, 1]
    return KernelRouting(router_probs, output_scale, attrs.routed_scaling_factor, attrs.top_k)
