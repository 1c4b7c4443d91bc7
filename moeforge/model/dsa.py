"""DeepSeek Sparse Attention (DeepSeek-V3.2): the lightning indexer and the top-k row gather MLA attends over.

Exactly transformers' ``DeepseekV32Indexer`` (modular_deepseek_v32.py), with the selection made explicit: MLA
then reads only the K selected cache rows (``gather_rows``), so its cost per step follows K, not the context.
The selection and the sparse attention live in ``moeforge/ops/sparse_mla/reference.py`` (the ``moeforge.SparseMLA``
op's reference, which the exported graph carries as one node).

Dimension letters: B batch, S new tokens, L = cached + new tokens, Hi indexer heads, Di index_head_dim,
Dr qk_rope_head_dim (the first Dr of Di are rotated, half-split), K = min(index_topk, L), Q q_lora_rank.

index[b, s, t] = sum_h w[b, s, h] * relu(q[b, s, h] . k[b, t]) * Di^-0.5,  w = weights_proj(x) * Hi^-0.5
selected = top-K of index over the keys t <= position[b, s]; the indexer's key cache is k [B, L, Di].
"""

from __future__ import annotations

import torch
from torch import nn

from moeforge.core.config import ModelConfig
from moeforge.model.rope import apply_rotary
from moeforge.ops.sparse_mla.reference import gather_rows, select_topk, sparse_attention

__all__ = ["Indexer", "gather_rows", "sparse_attention"]

# DeepSeek-V3.2's indexer LayerNorm (k_norm) uses a fixed eps, with a bias.
INDEXER_NORM_EPS = 1e-6


class Indexer(nn.Module):
    """The lightning indexer: scores every cached token for every query and returns the top-k of them."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        dsa, mla = config.dsa, config.mla
        assert dsa is not None and mla is not None and mla.q_lora_rank is not None
        self.n_heads, self.head_dim, self.topk = dsa.index_n_heads, dsa.index_head_dim, dsa.index_topk
        self.rope_dim = mla.qk_rope_head_dim
        self.wq_b = nn.Linear(mla.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=INDEXER_NORM_EPS)
        self.weights_proj = nn.Linear(config.hidden_size, self.n_heads, bias=False)
        self.scale = float(self.head_dim**-0.5)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x [B, S, heads, Di]: half-split (NOT interleaved, unlike MLA) RoPE on the first Dr dims.
        turned = apply_rotary(x[..., : self.rope_dim], cos, sin, interleaved=False)
        return torch.cat((turned, x[..., self.rope_dim :]), dim=-1)

    def keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, S, H] -> the new tokens' indexer keys [B, S, Di] (what the indexer cache holds)."""
        k = self.k_norm(self.wk(x)).unsqueeze(2)  # [B, S, 1, Di]
        return self._rotate(k, cos, sin).squeeze(2)

    def query(self, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, S, H], q_resid [B, S, Q] -> rotated queries [B, S, Hi, Di] and head weights [B, S, Hi]."""
        b, s, _ = x.shape
        q = self._rotate(self.wq_b(q_resid).view(b, s, self.n_heads, self.head_dim), cos, sin)
        return q, self.weights_proj(x) * self.n_heads**-0.5

    def forward(self, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                keys: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, S, H], q_resid [B, S, Q], keys [B, L, Di] (cached + new), positions [B, S] (a query at position p
        sees cache rows 0..p) -> selected rows [B, S, K] int64 and whether each is allowed [B, S, K] bool."""
        q, w = self.query(x, q_resid, cos, sin)
        return select_topk(q, w, keys, positions, self.topk, self.scale)
