"""Grouped-query attention (Llama/Qwen2/Mistral) and the causal mask shared by all attention kinds.

Dimension letters: B batch, S new tokens, P cached tokens, L = P + S, Hq query heads,
Hkv key/value heads, D head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moeforge.export.config import ModelConfig
from moeforge.export.rope import apply_rotary

LayerCache = tuple[torch.Tensor, ...]


def causal_mask(
    past_len: int, new_len: int, sliding_window: int | None, device: torch.device
) -> torch.Tensor:
    """Boolean mask [S, L] (True = attend): query i sits at cache index P + i.

    Built from shapes only, bottom-right aligned (SDPA's is_causal is top-left aligned, wrong
    for a chunk that follows a cache). With a sliding window a query sees the last
    ``sliding_window`` keys including itself.
    """
    query_pos = torch.arange(new_len, device=device) + past_len  # [S]
    key_pos = torch.arange(new_len + past_len, device=device)  # [L]
    mask = key_pos[None, :] <= query_pos[:, None]
    if sliding_window is not None:
        mask = mask & (key_pos[None, :] > query_pos[:, None] - sliding_window)
    return mask


class GQAAttention(nn.Module):
    """Multi-head / grouped-query attention; cache = (key [B, Hkv, L, D], value [B, Hkv, L, D])."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.softmax_scale
        self.interleaved = config.rope.interleaved
        h, d = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=config.qkv_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=config.qkv_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=config.o_proj_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                past: LayerCache | None) -> tuple[torch.Tensor, LayerCache]:
        # x: [B, S, H]; cos/sin: [B, S, D/2]; mask: [S, L]
        b, s, _ = x.shape
        q = apply_rotary(self.q_proj(x).view(b, s, self.num_heads, self.head_dim), cos, sin, self.interleaved)
        k = apply_rotary(self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim), cos, sin, self.interleaved)
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, S, D]
        if past is not None:
            k = torch.cat((past[0], k), dim=2)  # [B, Hkv, L, D]
            v = torch.cat((past[1], v), dim=2)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads
        )  # [B, Hq, S, D]
        out = out.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim)
        return self.o_proj(out), (k, v)
