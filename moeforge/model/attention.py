"""Grouped-query attention (Llama/Qwen2/Mistral, Qwen3-MoE/GLM-4.5/Mixtral/OLMoE) and the causal mask shared by
all attention kinds.

Dimension letters: B batch, S new tokens, P cached tokens, L = P + S, Hq query heads,
Hkv key/value heads, D head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moeforge.core.config import ModelConfig
from moeforge.model.norm import RMSNorm
from moeforge.model.rope import apply_rotary

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
    """Multi-head / grouped-query attention; cache = (key [B, Hkv, L, D], value [B, Hkv, L, D]).

    Options (``ModelConfig``): q/k RMSNorm before RoPE per head (``q_norm``/``k_norm`` weight [D]) or over the
    whole projection ([Hq*D], [Hkv*D]); q/k/v clamped to ``clip_qkv``; RoPE on the first ``rope_dim`` dims only.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.rotary_dim = config.rope_dim
        self.scale = config.softmax_scale
        self.interleaved = config.rope.interleaved
        self.qk_norm = config.qk_norm
        self.clip_qkv = config.clip_qkv
        h, d = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=config.qkv_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=config.qkv_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=config.o_proj_bias)
        if config.qk_norm != "none":
            per_head = config.qk_norm == "head"
            self.q_norm = RMSNorm(d if per_head else self.num_heads * d, config.rms_norm_eps)
            self.k_norm = RMSNorm(d if per_head else self.num_kv_heads * d, config.rms_norm_eps)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, S, H] -> q [B, S, Hq, D], k and v [B, S, Hkv, D], normed and clamped, before RoPE."""
        b, s, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # [B, S, heads*D]
        if self.qk_norm == "projection":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(b, s, self.num_heads, self.head_dim)
        k = k.view(b, s, self.num_kv_heads, self.head_dim)
        v = v.view(b, s, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        return q, k, v

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x [B, S, heads, D]: partial rotary turns the first rotary_dim dims and passes the rest through.
        if self.rotary_dim == self.head_dim:
            return apply_rotary(x, cos, sin, self.interleaved)
        turned = apply_rotary(x[..., : self.rotary_dim], cos, sin, self.interleaved)
        return torch.cat((turned, x[..., self.rotary_dim :]), dim=-1)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                past: LayerCache | None) -> tuple[torch.Tensor, LayerCache]:
        # x: [B, S, H]; cos/sin: [B, S, rotary_dim/2]; mask: [S, L]
        b, s, _ = x.shape
        q, k, v = self._project(x)
        q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, S, D]
        if past is not None:
            k = torch.cat((past[0], k), dim=2)  # [B, Hkv, L, D]
            v = torch.cat((past[1], v), dim=2)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads
        )  # [B, Hq, S, D]
        out = out.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim)
        return self.o_proj(out), (k, v)
