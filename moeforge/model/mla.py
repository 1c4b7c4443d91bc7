"""Multi-head latent attention (DeepSeek-V2/V3) in its naive and absorbed forms.

Dimension letters: B batch, S new tokens, P cached, L = P + S, H heads, R kv_lora_rank,
Dn qk_nope_head_dim, Dr qk_rope_head_dim, Dv v_head_dim.

naive:  cache (key [B, H, L, Dn+Dr], value [B, H, L, Dv]): what HF and optimum cache.
absorb: cache (latent [B, L, R+Dr],): c_kv and the shared rope key only. W_UK is folded into the
        query and W_UV applied after attention, making it multi-query attention with key dim R+Dr
        and value = the first R dims of the key.
DSA (DeepSeek-V3.2, ``config.dsa``): each layer's cache gains the indexer's keys [B, L, Di] as its last
        entry; the indexer picks K rows per query and attention reads only those (``moeforge/model/dsa.py``).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from moeforge.core.config import ModelConfig
from moeforge.model.attention import LayerCache
from moeforge.model.dsa import Indexer, gather_rows, sparse_attention
from moeforge.model.norm import RMSNorm
from moeforge.model.rope import apply_rotary
from moeforge.ops.sparse_mla import torch_op as sparse_mla_op
from moeforge.ops.sparse_mla.schema import SparseMLAAttrs

# DeepSeek's latent norms (q_a_layernorm, kv_a_layernorm) use a fixed eps, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6

MLAImpl = Literal["absorb", "naive"]


class MLAttention(nn.Module):
    """MLA with q (optionally low-rank) and a compressed kv latent."""

    def __init__(self, config: ModelConfig, impl: MLAImpl) -> None:
        super().__init__()
        mla = config.mla
        assert mla is not None
        self.impl = impl
        self.num_heads = config.num_attention_heads
        self.nope_dim, self.rope_dim, self.v_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
        self.kv_rank = mla.kv_lora_rank
        self.scale = config.softmax_scale
        self.interleaved = config.rope.interleaved
        h, n = config.hidden_size, self.num_heads
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(h, n * mla.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, mla.q_lora_rank, bias=config.qkv_bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, n * mla.qk_head_dim, bias=False)
        self.q_lora = mla.q_lora_rank is not None
        self.kv_a_proj_with_mqa = nn.Linear(h, mla.latent_dim, bias=config.qkv_bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(mla.kv_lora_rank, n * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False)
        self.o_proj = nn.Linear(n * mla.v_head_dim, h, bias=config.o_proj_bias)
        self.indexer = Indexer(config) if config.dsa is not None else None
        # Set by the ONNX exporter: DSA's selection + attention as one moeforge.SparseMLA node (ops/sparse_mla).
        self.export_op = False

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                past: LayerCache | None, positions: torch.Tensor | None = None) -> tuple[torch.Tensor, LayerCache]:
        # x: [B, S, H]; cos/sin: [B, S, Dr/2]; mask: [S, L]; positions [B, S] (DSA only)
        b, s, _ = x.shape
        if self.q_lora:
            q_resid = self.q_a_layernorm(self.q_a_proj(x))  # [B, S, Q]
            q = self.q_b_proj(q_resid)
        else:
            q = self.q_proj(x)
        q = q.view(b, s, self.num_heads, self.nope_dim + self.rope_dim)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)  # [B, S, H, Dn], [B, S, H, Dr]
        q_pe = apply_rotary(q_pe, cos, sin, self.interleaved)

        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_rank, self.rope_dim], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)  # [B, S, R]
        k_pe = apply_rotary(k_pe.unsqueeze(2), cos, sin, self.interleaved).squeeze(2)  # [B, S, Dr]

        if self.indexer is not None:
            assert positions is not None, "DSA needs the query positions"
            keys = self.indexer.keys(x, cos, sin)  # [B, S, Di]
            if self.export_op and self.impl == "absorb" and past is None:
                out, cache = self._sparse_op(x, q_resid, q_nope, q_pe, c_kv, k_pe, cos, sin, keys, positions)
                return self.o_proj(out.reshape(b, s, self.num_heads * self.v_dim)), cache
            if past is not None:
                keys = torch.cat((past[-1], keys), dim=1)  # [B, L, Di]
            rows, allowed = self.indexer(x, q_resid, cos, sin, keys, positions)  # [B, S, K] each
            if self.impl == "absorb":
                out, cache = self._absorbed_sparse(q_nope, q_pe, c_kv, k_pe, rows, allowed, past)
            else:
                out, cache = self._naive_sparse(q_nope, q_pe, c_kv, k_pe, rows, allowed, past)
            cache = (*cache, keys)
        elif self.impl == "absorb":
            out, cache = self._absorbed(q_nope, q_pe, c_kv, k_pe, mask, past)
        else:
            out, cache = self._naive(q_nope, q_pe, c_kv, k_pe, mask, past)
        return self.o_proj(out.reshape(b, s, self.num_heads * self.v_dim)), cache

    def _sparse_op(self, x: torch.Tensor, q_resid: torch.Tensor, q_nope: torch.Tensor, q_pe: torch.Tensor,
                   c_kv: torch.Tensor, k_pe: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor,
                   positions: torch.Tensor) -> tuple[torch.Tensor, LayerCache]:
        """The export form of absorbed DSA (no past: the cache passes add it to the node)."""
        assert self.indexer is not None
        latent = torch.cat((c_kv, k_pe), dim=-1)  # [B, S, R+Dr]
        index_q, index_w = self.indexer.query(x, q_resid, cos, sin)  # [B, S, Hi, Di], [B, S, Hi]
        attrs = SparseMLAAttrs(self.indexer.topk, self.scale, self.indexer.scale, self.kv_rank)
        out = sparse_mla_op.call(self._absorbed_query(q_nope, q_pe), latent, index_q, index_w, keys, positions,
                                 attrs)  # [B, H, S, R]
        return self._absorbed_output(out), (latent, keys)

    def _naive_kv(self, c_kv: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """c_kv [B, S, R], k_pe [B, S, Dr] -> per-head key [B, H, S, Dn+Dr] and value [B, H, S, Dv]."""
        b, s = c_kv.shape[:2]
        kv = self.kv_b_proj(c_kv).view(b, s, self.num_heads, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat((k_nope, k_pe.unsqueeze(2).expand(-1, -1, self.num_heads, -1)), dim=-1)
        return k.transpose(1, 2), v.transpose(1, 2)

    def _naive_sparse(self, q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                      rows: torch.Tensor, allowed: torch.Tensor,
                      past: LayerCache | None) -> tuple[torch.Tensor, LayerCache]:
        k, v = self._naive_kv(c_kv, k_pe)  # [B, H, S, *]
        if past is not None:
            k, v = torch.cat((past[0], k), dim=2), torch.cat((past[1], v), dim=2)  # [B, H, L, *]
        q = torch.cat((q_nope, q_pe), dim=-1).transpose(1, 2)  # [B, H, S, Dn+Dr]
        k_sel = gather_rows(k.transpose(1, 2), rows)  # [B, S, K, H, Dn+Dr]
        v_sel = gather_rows(v.transpose(1, 2), rows)  # [B, S, K, H, Dv]
        out = sparse_attention(q, k_sel, v_sel, allowed, self.scale)  # [B, H, S, Dv]
        return out.transpose(1, 2), (k, v)

    def _absorbed_sparse(self, q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                         rows: torch.Tensor, allowed: torch.Tensor,
                         past: LayerCache | None) -> tuple[torch.Tensor, LayerCache]:
        latent = torch.cat((c_kv, k_pe), dim=-1)  # [B, S, R+Dr]
        if past is not None:
            latent = torch.cat((past[0], latent), dim=1)  # [B, L, R+Dr]
        query = self._absorbed_query(q_nope, q_pe)  # [B, H, S, R+Dr]
        picked = gather_rows(latent, rows).unsqueeze(3)  # [B, S, K, 1, R+Dr]
        out = sparse_attention(query, picked, picked[..., : self.kv_rank], allowed, self.scale)  # [B, H, S, R]
        return self._absorbed_output(out), (latent,)

    def _absorbed_query(self, q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
        """W_UK folded into the query: [B, S, H, Dn], [B, S, H, Dr] -> [B, H, S, R+Dr]."""
        w_uk = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_rank)[:, : self.nope_dim]
        q_latent = torch.einsum("bshd,hdr->bhsr", q_nope, w_uk)  # [B, H, S, R]
        return torch.cat((q_latent, q_pe.transpose(1, 2)), dim=-1)

    def _absorbed_output(self, out: torch.Tensor) -> torch.Tensor:
        """W_UV after attention: [B, H, S, R] -> [B, S, H, Dv]."""
        w_uv = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_rank)[:, self.nope_dim :]
        return torch.einsum("bhsr,hvr->bshv", out, w_uv)

    def _naive(self, q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
               mask: torch.Tensor, past: LayerCache | None) -> tuple[torch.Tensor, LayerCache]:
        b, s = c_kv.shape[:2]
        kv = self.kv_b_proj(c_kv).view(b, s, self.num_heads, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat((k_nope, k_pe.unsqueeze(2).expand(-1, -1, self.num_heads, -1)), dim=-1)
        q = torch.cat((q_nope, q_pe), dim=-1).transpose(1, 2)  # [B, H, S, Dn+Dr]
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, H, S, *]
        if past is not None:
            k = torch.cat((past[0], k), dim=2)
            v = torch.cat((past[1], v), dim=2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)  # [B, H, S, Dv]
        return out.transpose(1, 2), (k, v)

    def _absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                  mask: torch.Tensor, past: LayerCache | None) -> tuple[torch.Tensor, LayerCache]:
        latent = torch.cat((c_kv, k_pe), dim=-1)  # [B, S, R+Dr]
        if past is not None:
            latent = torch.cat((past[0], latent), dim=1)  # [B, L, R+Dr]
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_rank)
        w_uk, w_uv = w[:, : self.nope_dim], w[:, self.nope_dim :]  # [H, Dn, R], [H, Dv, R]
        q_latent = torch.einsum("bshd,hdr->bhsr", q_nope, w_uk)  # [B, H, S, R]
        query = torch.cat((q_latent, q_pe.transpose(1, 2)), dim=-1)  # [B, H, S, R+Dr]
        key = latent.unsqueeze(1)  # [B, 1, L, R+Dr]
        value = key[..., : self.kv_rank]  # [B, 1, L, R]: the value is the latent itself
        # One latent "kv head" shared by the H query heads; with H == 1 (a tensor-parallel rank holding one head)
        # it is plain attention, and the ONNX exporter refuses enable_gqa without more query than kv heads.
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=self.scale,
                                             enable_gqa=self.num_heads > 1)
        out = torch.einsum("bhsr,hvr->bshv", out, w_uv)  # [B, S, H, Dv]
        return out, (latent,)
