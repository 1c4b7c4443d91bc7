"""DeepSeek-V4's compressed sparse attention (CSA) selection: the lightning indexer over compressed entries.

Dimension letters: B batch, S new tokens, T compressed entries, m = csa_rate, Hi indexer heads, Di index_head_dim,
Q q_lora_rank, K = min(index_topk, T).

The indexer is a second ``KVCompressor`` (width Di, the same windows with overlap) whose entries are keys; its queries
come from the attention's q-LoRA residual:
    q      = rope_tail(q_b_proj(q_resid).view(B, S, Hi, Di))       compressed layers' RoPE at the query positions
    w      = weights_proj(x) * Hi^-0.5                              [B, S, Hi]
    index  = sum_h w[h] * relu(q[h] . k_t) * Di^-0.5                [B, S, T]
A query at absolute token index p may read entry t only when its window is closed, t < (p + 1) // m; the indexer keeps
the top K of index over those (a pick beyond them is dropped), and the attention reads only the picked entries.
Exactly transformers' DeepseekV4Indexer (names compressor.indexer.{kv_proj, gate_proj, position_bias, kv_norm, q_b_proj,
scorer.weights_proj}); its top-k is torch.topk over the same scores, so ties break alike.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moeforge.core.config import ModelConfig
from moeforge.model.kv_compressor import CompressorState, KVCompressor
from moeforge.model.rope import apply_rotary_tail


class IndexScorer(nn.Module):
    """The per-head weights of the index: weights_proj [Hi, H] (transformers' DeepseekV4IndexerScorer)."""

    def __init__(self, config: ModelConfig, n_heads: int) -> None:
        super().__init__()
        self.weights_proj = nn.Linear(config.hidden_size, n_heads, bias=False)

    def forward(self, q: torch.Tensor, keys: torch.Tensor, x: torch.Tensor, scale: float) -> torch.Tensor:
        """q [B, S, Hi, Di], keys [B, T, Di], x [B, S, H] -> index [B, S, T] float32."""
        scores = F.relu(torch.matmul(q.float(), keys.transpose(-1, -2).float().unsqueeze(1))) * scale  # [B, S, Hi, T]
        weights = self.weights_proj(x).float() * q.shape[2] ** -0.5  # [B, S, Hi]
        index: torch.Tensor = (scores * weights.unsqueeze(-1)).sum(dim=2)
        return index


class LightningIndexer(KVCompressor):
    """A compressor of Di-wide keys plus q_b_proj [Hi*Di, Q] and the scorer; picks entries per query."""

    def __init__(self, config: ModelConfig) -> None:
        attn = config.compressed_attention
        assert attn is not None
        ix = attn.indexer
        super().__init__(config, ix.index_head_dim, attn.csa_rate, overlap=True)
        self.n_heads, self.topk, self.scale = ix.index_n_heads, ix.index_topk, float(ix.index_head_dim**-0.5)
        self.q_b_proj = nn.Linear(attn.q_lora_rank, ix.index_n_heads * ix.index_head_dim, bias=False)
        self.scorer = IndexScorer(config, ix.index_n_heads)

    def select(self, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor,
               first_token: int) -> torch.Tensor:
        """The entries each query reads: x [B, S, H], q_resid [B, S, Q], cos/sin [B, S, Dr/2], keys [B, T, Di] (after
        this step's windows closed), ``first_token`` the absolute index of the first new token -> mask [B, S, T]."""
        b, s, _ = x.shape
        t = keys.shape[1]
        q = apply_rotary_tail(self.q_b_proj(q_resid).view(b, s, self.n_heads, self.width), cos, sin)
        index = self.scorer(q, keys, x, self.scale)  # [B, S, T]
        closed = closed_entries(first_token, s, t, self.rate, x.device)  # [S, T]
        index = index.masked_fill(~closed, float("-inf"))
        picked = index.topk(min(self.topk, t), dim=-1).indices  # [B, S, K]
        # A pick beyond the closed windows (a query with fewer than K readable entries) reads nothing: it goes to a
        # spare column T, dropped.
        readable = closed.expand(b, -1, -1).gather(-1, picked)  # [B, S, K]
        spare = torch.where(readable, picked, t)
        mask = torch.zeros(b, s, t + 1, dtype=torch.bool, device=x.device)
        return mask.scatter(-1, spare, True)[..., :t]


def closed_entries(first_token: int, new_tokens: int, entries: int, rate: int, device: torch.device) -> torch.Tensor:
    """[S, T] bool: query i (absolute token first_token + i) may read entry t, i.e. t < (first_token + i + 1) // m."""
    tokens = torch.arange(new_tokens, device=device) + first_token + 1  # [S]
    return torch.arange(entries, device=device)[None, :] < torch.div(tokens, rate, rounding_mode="floor")[:, None]


class SparseCompressor(KVCompressor):
    """CSA's compressor (head_dim entries, overlapping windows) with its indexer (transformers' names: compressor.*,
    compressor.indexer.*)."""

    def __init__(self, config: ModelConfig) -> None:
        attn = config.compressed_attention
        assert attn is not None
        super().__init__(config, config.head_dim, attn.csa_rate, overlap=True)
        self.indexer = LightningIndexer(config)

    def step(self, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             state: CompressorState, index_state: CompressorState,
             first_token: int) -> tuple[CompressorState, CompressorState, torch.Tensor]:
        """Both compressors advance over x [B, S, H], then the indexer picks: (state, index state, mask [B, S, T])."""
        state, index_state = self(x, state), self.indexer(x, index_state)
        return state, index_state, self.indexer.select(x, q_resid, cos, sin, index_state[0], first_token)
