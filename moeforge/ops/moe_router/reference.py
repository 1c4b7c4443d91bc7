"""Torch reference of ``moeforge.MoERouter``: the one routing implementation eager code runs.

Deterministic by construction: every selection (groups, then experts) is a *stable* descending
sort, so equal scores keep their index order and the lower index wins a tie -- the rule ONNX TopK
states and ONNX Runtime implements. ``torch.topk`` makes no such promise, so it is not used for a
selection. Dimension letters: T tokens, E experts, G groups (n_group), K = top_k.
"""

from __future__ import annotations

import torch

from moeforge.ops.moe_router.schema import RouterAttributes, RouterOpError


def _top_indices(values: torch.Tensor, k: int) -> torch.Tensor:
    # Indices of the k largest along the last axis, descending, ties -> lower index first.
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[..., :k]


def route(
    router_logits: torch.Tensor, correction_bias: torch.Tensor | None, attrs: RouterAttributes
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] (+ correction_bias [E]) -> expert_ids [T, K] int32, expert_weights [T, K] float32.

    scores = softmax | sigmoid (fp32); choice = scores + bias. With n_group > 1 each group is scored
    by its max or the sum of its top-2 choice scores, the best topk_group groups are kept and every
    other expert's choice score becomes -inf. The K best choice scores give the ids (descending,
    ties -> lower id); the weights are the *unbiased* scores there, divided by their sum (+1e-20)
    when norm_topk_prob, times routed_scaling_factor.
    """
    if router_logits.dim() != 2:
        raise RouterOpError(f"MoERouter: router_logits must be [T, E], got shape {tuple(router_logits.shape)}")
    tokens, experts = router_logits.shape
    attrs.validate(experts)
    logits = router_logits.to(torch.float32)
    scores = logits.softmax(dim=-1) if attrs.scoring == "softmax" else logits.sigmoid()  # [T, E]
    choice = scores
    if correction_bias is not None:
        if correction_bias.shape != (experts,):
            raise RouterOpError(f"MoERouter: correction_bias must be [E={experts}], got {tuple(correction_bias.shape)}")
        choice = scores + correction_bias.to(torch.float32)

    if attrs.n_group > 1:
        grouped = choice.view(tokens, attrs.n_group, experts // attrs.n_group)  # [T, G, E/G]
        n_top = 2 if attrs.group_scoring == "top2_sum" else 1
        # Values only (no index choice): sum of the group's n_top best, largest first.
        best = torch.sort(grouped, dim=-1, descending=True).values[..., :n_top]
        group_scores = best[..., 0] + best[..., 1] if n_top == 2 else best[..., 0]  # [T, G]
        kept = torch.zeros_like(group_scores, dtype=torch.bool)
        kept.scatter_(1, _top_indices(group_scores, attrs.topk_group), True)  # [T, G]
        choice = grouped.masked_fill(~kept.unsqueeze(-1), float("-inf")).view(tokens, experts)

    ids = _top_indices(choice, attrs.top_k)  # [T, K]
    weights = scores.gather(1, ids)
    if attrs.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids.to(torch.int32), weights * attrs.routed_scaling_factor
