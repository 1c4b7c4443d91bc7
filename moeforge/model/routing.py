"""Expert routing for a model's MoEConfig (every MoE family): a thin adapter over the MoERouter op's reference.

Dimension letters: T tokens, E routed experts, K experts per token. The semantics (scores, bias on
the choice only, -inf group mask, tie rule) live in ``moeforge.ops.moe_router.reference``.
"""

from __future__ import annotations

import torch

from moeforge.core.config import MoEConfig
from moeforge.ops.moe_router.reference import route
from moeforge.ops.moe_router.schema import RouterAttributes, RouterOpError


def router_attributes(moe: MoEConfig) -> RouterAttributes:
    """The MoERouter attributes of a model's MoE config (greedy routing is one group)."""
    grouped = moe.topk_method != "greedy"
    scoring = moe.scoring_func
    if scoring == "sqrtsoftplus":  # DeepSeek-V4 routes in moeforge/model/deepseek_v4_moe.py, not through the op yet
        raise RouterOpError("MoERouter: scoring 'sqrtsoftplus' (DeepSeek-V4) is not an attribute of the op yet")
    return RouterAttributes(
        scoring=scoring, top_k=moe.num_experts_per_tok,
        n_group=moe.n_group if grouped else 1, topk_group=moe.topk_group if grouped else 1,
        group_scoring=moe.group_scoring, norm_topk_prob=moe.norm_topk_prob,
        routed_scaling_factor=float(moe.routed_scaling_factor),
    )


def route_tokens(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    moe: MoEConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose experts for each token.

    router_logits: [T, E] float32 -> (expert ids [T, K] int64, weights [T, K] float32); ids are in
    descending choice-score order, ties to the lower expert id. The bias steers the choice only.
    """
    ids, weights = route(router_logits, correction_bias, router_attributes(moe))
    return ids.long(), weights
