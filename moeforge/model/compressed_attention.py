"""DeepSeek-V4 attention: shared-KV multi-query attention over a sliding window, plus compressed entries (CSA / HCA).

Dimension letters: B batch, S new tokens, Hn heads, D head_dim, Dr rotary dims (the trailing ones of a head),
Q q_lora_rank, G o_groups, R o_lora_rank, W sliding_window, Lw window tokens held (<= W - 1), T compressed entries,
m tokens per entry.

    q_resid = q_a_norm(q_a_proj(x))                                   [B, S, Q]   (CSA's indexer reads it too)
    q  = rope_tail(rms_normalize(q_b_proj(q_resid).view(.., Hn, D)))   [B, S, Hn, D]  normalised per head, no weight
    kv = rope_tail(kv_norm(kv_proj(x)))                               [B, S, D]   one head, read as key AND value
    keys = [held window ; kv ; entries]  mask: window (the last W tokens including the query's own, from shapes) and
           the readable entries (HCA: every closed window; CSA: the indexer's top-k of them)
    out  = softmax([q.k * D^-0.5 ; sink_h]) without the sink column . keys      [B, S, Hn, D]
    out  = rope_tail(out, cos, -sin)   (the values carried their keys' rotation: the conjugate leaves it relative)
    y    = o_b_proj(o_a_proj(out.view(.., G, Hn*D/G)).flatten())     grouped low-rank output projection
Sliding layers rotate with the main RoPE, compressed layers (and their entries and indexer) with the compressed one.

Cache per layer (``LayerCache``, a tuple; every tensor is an explicit input and output):
    sliding_attention             (window [B, Lw, D],)
    heavily_compressed_attention  (window, entries [B, T, D], pending [B, P, 2D])
    compressed_sparse_attention   (window, entries, pending [B, P, 4D], overlap [B, m, 2D],
                                   index entries [B, T, Di], index pending [B, P, 4Di], index overlap [B, m, 2Di])
``window`` holds the last W - 1 tokens' rotated kv; the compressor state is ``moeforge/model/kv_compressor.py``'s. The
absolute index of the first new token is T*m + P (shapes again: positions only feed RoPE). Exactly transformers'
DeepseekV4Attention with its DeepseekV4{HCA,CSA}Cache.
"""

from __future__ import annotations

import torch
from torch import nn

from moeforge.core.config import ModelConfig
from moeforge.model.attention import LayerCache, causal_mask
from moeforge.model.kv_compressor import KVCompressor
from moeforge.model.lightning_indexer import SparseCompressor, closed_entries
from moeforge.model.norm import RMSNorm, rms_normalize
from moeforge.model.rope import apply_rotary_tail


class GroupedLinear(nn.Module):
    """G independent projections in one weight [G*R, I]: x [..., G, I] -> [..., G, R] (block-diagonal)."""

    def __init__(self, in_per_group: int, out_features: int, groups: int) -> None:
        super().__init__()
        self.groups = groups
        self.weight = nn.Parameter(torch.empty(out_features, in_per_group))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.view(self.groups, -1, x.shape[-1])  # [G, R, I]
        y = torch.bmm(x.reshape(-1, self.groups, x.shape[-1]).transpose(0, 1), w.transpose(1, 2))  # [G, N, R]
        return y.transpose(0, 1).reshape(*x.shape[:-1], -1)


class CompressedAttention(nn.Module):
    """One DeepSeek-V4 attention layer of kind ``config.compressed_attention.layer_types[layer_idx]``."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        attn = config.compressed_attention
        assert attn is not None and config.sliding_window is not None
        self.kind = attn.layer_types[layer_idx]
        h, n, d = config.hidden_size, config.num_attention_heads, config.head_dim
        self.num_heads, self.head_dim, self.window, self.groups = n, d, config.sliding_window, attn.o_groups
        self.scale, self.norm_eps = float(d**-0.5), config.rms_norm_eps
        self.q_a_proj = nn.Linear(h, attn.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(attn.q_lora_rank, config.rms_norm_eps)
        self.q_b_proj = nn.Linear(attn.q_lora_rank, n * d, bias=False)
        self.kv_proj = nn.Linear(h, d, bias=False)
        self.kv_norm = RMSNorm(d, config.rms_norm_eps)
        self.o_a_proj = GroupedLinear(n * d // attn.o_groups, attn.o_groups * attn.o_lora_rank, attn.o_groups)
        self.o_b_proj = nn.Linear(attn.o_groups * attn.o_lora_rank, h, bias=False)
        self.sinks = nn.Parameter(torch.empty(n))
        self.compressor: KVCompressor | None = None
        if self.kind == "compressed_sparse_attention":
            self.compressor = SparseCompressor(config)
        elif self.kind == "heavily_compressed_attention":
            self.compressor = KVCompressor(config, d, attn.hca_rate, overlap=False)

    def empty_cache(self, x: torch.Tensor) -> LayerCache:
        """The layer's cache before any token, for a batch like x [B, S, H]."""
        window = x.new_zeros(x.shape[0], 0, self.head_dim)
        if self.compressor is None:
            return (window,)
        if isinstance(self.compressor, SparseCompressor):
            return (window, *self.compressor.empty_state(x), *self.compressor.indexer.empty_state(x))
        return (window, *self.compressor.empty_state(x))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                past: LayerCache | None) -> tuple[torch.Tensor, LayerCache]:
        # x [B, S, H] (normed); cos/sin [B, S, Dr/2] of this layer's RoPE; past: the layout above, or None
        b, s, _ = x.shape
        past = self.empty_cache(x) if past is None else past
        q_resid = self.q_a_norm(self.q_a_proj(x))  # [B, S, Q]
        q = rms_normalize(self.q_b_proj(q_resid).view(b, s, self.num_heads, self.head_dim), self.norm_eps)
        q = apply_rotary_tail(q, cos, sin)  # [B, S, Hn, D]
        kv = apply_rotary_tail(self.kv_norm(self.kv_proj(x)).unsqueeze(2), cos, sin).squeeze(2)  # [B, S, D]

        held = past[0].shape[1]
        keys = torch.cat((past[0], kv), dim=1)  # [B, Lw + S, D]
        mask = causal_mask(held, s, self.window, x.device).expand(b, s, -1)  # [B, S, Lw + S]
        window = keys[:, keys.shape[1] - min(self.window - 1, keys.shape[1]):]  # the last W - 1 tokens
        present: LayerCache = (window,)
        if self.compressor is not None:
            entries, pending = past[1], past[2]
            first_token = entries.shape[1] * self.compressor.rate + pending.shape[1]
            if isinstance(self.compressor, SparseCompressor):
                state, index_state, readable = self.compressor.step(x, q_resid, cos, sin, past[1:4], past[4:7],
                                                                    first_token)
                present = (window, *state, *index_state)
            else:
                state = self.compressor(x, past[1:3])
                readable = closed_entries(first_token, s, state[0].shape[1], self.compressor.rate,
                                          x.device).expand(b, s, -1)
                present = (window, *state)
            keys = torch.cat((keys, state[0]), dim=1)  # [B, Lw + S + T, D]
            mask = torch.cat((mask, readable), dim=-1)

        out = apply_rotary_tail(self._attend(q, keys, mask), cos, -sin)  # [B, S, Hn, D]
        grouped = self.o_a_proj(out.reshape(b, s, self.groups, -1))  # [B, S, G, R]
        return self.o_b_proj(grouped.flatten(2)), present

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q [B, S, Hn, D], keys [B, L, D] (also the values), mask [B, S, L] -> [B, S, Hn, D]; a learned sink logit
        per head joins the softmax and is dropped after it."""
        b, s = q.shape[:2]
        kv = keys.unsqueeze(1)  # [B, 1, L, D]: one head shared by all
        scores = torch.matmul(q.transpose(1, 2), kv.transpose(-1, -2)) * self.scale  # [B, Hn, S, L]
        scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf"))
        sinks = self.sinks.to(scores.dtype).view(1, -1, 1, 1).expand(b, -1, s, 1)
        logits = torch.cat((scores, sinks), dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = torch.softmax(logits, dim=-1)[..., :-1]
        return torch.matmul(probs.to(kv.dtype), kv).transpose(1, 2)
