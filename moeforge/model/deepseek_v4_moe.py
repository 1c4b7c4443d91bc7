"""DeepSeek-V4's MoE block: learned top-k or hash routing, clamped SwiGLU experts, one shared expert.

Dimension letters: T tokens, H hidden, E routed experts, K experts per token, V vocabulary.

    scores  = sqrt(softplus(x @ gate.weight^T))  (or sigmoid)                       [T, E] float32
    experts = top-K of scores + e_score_correction_bias           (a "moe" layer)    [T, K]
            = tid2eid[token id]                                   (a "hash_moe" layer: a frozen table [V, K])
    weights = scores at those experts / their sum * routed_scaling_factor           [T, K]
    out     = sum_k weights_k * expert_k(x) + shared_expert(x), every SwiGLU clamped to swiglu_limit
So the token ids reach every hash layer (an explicit input of the block). Exactly transformers' DeepseekV4TopKRouter /
DeepseekV4HashRouter / DeepseekV4Experts / DeepseekV4MLP; routed experts stacked as the other families' (gate_proj,
up_proj [E, I, H], down_proj [E, H, I]).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moeforge.core.config import ModelConfig
from moeforge.model.mlp import SwiGLU
from moeforge.model.moe import RoutedExperts, SlotTable, local_choices


class V4Router(nn.Module):
    """weight [E, H]; e_score_correction_bias [E] (top-k layers) or tid2eid [V, K] int64 (hash layers)."""

    e_score_correction_bias: torch.Tensor | None
    tid2eid: torch.Tensor | None

    def __init__(self, config: ModelConfig, hashed: bool) -> None:
        super().__init__()
        moe = config.moe
        assert moe is not None
        self.top_k, self.scoring, self.scaling = moe.num_experts_per_tok, moe.scoring_func, moe.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(moe.n_routed_experts, config.hidden_size))
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(config.vocab_size, moe.num_experts_per_tok, dtype=torch.int64))
            self.e_score_correction_bias = None
        else:
            self.register_buffer("e_score_correction_bias", torch.zeros(moe.n_routed_experts))
            self.tid2eid = None

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H], input_ids [T] -> expert ids [T, K] int64, weights [T, K] float32."""
        logits = F.linear(x.to(torch.float32), self.weight.to(torch.float32))  # [T, E]
        scores = F.softplus(logits).sqrt() if self.scoring == "sqrtsoftplus" else logits.sigmoid()
        if self.tid2eid is not None:
            ids = self.tid2eid[input_ids].long()
        else:
            assert self.e_score_correction_bias is not None
            ids = torch.topk(scores + self.e_score_correction_bias.to(torch.float32), self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        return ids, weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.scaling


class V4MoE(nn.Module):
    """out = sum_k w_k * expert_k(x) + shared_experts(x), experts picked by ``V4Router``. A tensor-parallel rank
    (``rank_model_v4.py``) holds some experts from ``first_expert`` (or a slice of each; with an expert placement,
    ``slot_table``: slots holding logical experts, replicas included) and sums the ranks' partial outputs with
    ``reduce``. The placement applies to hash-routed layers too: ``tid2eid`` names the same logical experts."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        moe = config.moe
        assert moe is not None and moe.swiglu_limit is not None
        self.gate = V4Router(config, hashed=layer_idx in moe.hash_layers)
        self.experts = RoutedExperts(moe.n_routed_experts, config.hidden_size, moe.moe_intermediate_size,
                                     moe.swiglu_limit)
        self.shared_experts = SwiGLU(config.hidden_size, moe.moe_intermediate_size, moe.swiglu_limit)
        self.num_routed = moe.n_routed_experts
        self.first_expert = 0
        self.slot_table: SlotTable | None = None
        self.reduce: nn.Module | None = None

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        # x [B, S, H], input_ids [B, S]
        flat = x.reshape(-1, x.shape[-1])
        expert_ids, weights = self.gate(flat, input_ids.reshape(-1))
        expert_ids, weights = local_choices(expert_ids, weights, routed=self.num_routed, held=self.experts.num_experts,
                                            first=self.first_expert, slot_table=self.slot_table)  # [T, K] local
        routed: torch.Tensor = self.experts(flat, expert_ids, weights).view_as(x)
        out: torch.Tensor = routed + self.shared_experts(x)
        return out if self.reduce is None else self.reduce(out)
