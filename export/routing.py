"""DeepSeek expert routing as one pure function (the torch reference of the MoE router op).

Dimension letters: T tokens, E routed experts, G expert groups, K experts per token.
"""

from __future__ import annotations

import torch

from moeforge.export.config import MoEConfig


def route_tokens(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    moe: MoEConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose experts for each token.

    router_logits: [T, E] float32 -> (expert ids [T, K] int64, weights [T, K] float32).

    Scores are softmax (V2) or sigmoid (V3). With noaux_tc the *choice* uses scores + bias, the
    *weights* use the unbiased scores. Group-limited routing keeps the best ``topk_group`` groups,
    scored by their max (V2) or the sum of their top-2 choice scores (V3); other experts are masked
    with -inf (a 0.0 mask can pick masked experts when biased scores are negative).
    """
    logits = router_logits.to(torch.float32)
    scores = logits.softmax(dim=-1) if moe.scoring_func == "softmax" else logits.sigmoid()
    choice = scores + correction_bias.to(torch.float32) if correction_bias is not None else scores

    if moe.topk_method != "greedy" and moe.n_group > 1:
        tokens, experts = choice.shape
        grouped = choice.view(tokens, moe.n_group, experts // moe.n_group)  # [T, G, E/G]
        if moe.group_scoring == "top2_sum":
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
        else:
            group_scores = grouped.max(dim=-1).values
        kept_groups = group_scores.topk(moe.topk_group, dim=-1, sorted=False).indices  # [T, topk_group]
        group_mask = torch.zeros_like(group_scores).scatter(1, kept_groups, 1.0).bool()
        expert_mask = group_mask.unsqueeze(-1).expand(-1, -1, experts // moe.n_group).reshape(tokens, experts)
        choice = choice.masked_fill(~expert_mask, float("-inf"))

    expert_ids = choice.topk(moe.num_experts_per_tok, dim=-1, sorted=False).indices  # [T, K]
    weights = scores.gather(1, expert_ids)
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return expert_ids, weights * moe.routed_scaling_factor
