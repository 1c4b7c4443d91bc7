"""The torch reference of ``moeforge::PagedAttention``: a per-sequence loop, written for clarity.

Shapes: q [T, Hq, Dk], k [T, Hkv, Dk], v [T, Hkv, Dv] (None in latent mode), pools
[N, Bs, Hkv, D], block_tables [B, M], seq_lens [B], query_start_loc [B+1].
"""

from __future__ import annotations

import torch

from moeforge.ops.paged_attention.schema import PagedAttentionAttrs


def paged_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor | None,
    key_cache: torch.Tensor, value_cache: torch.Tensor | None,
    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
    attrs: PagedAttentionAttrs,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Return (output [T, Hq, Dv], key_cache_out, value_cache_out or None); the inputs are not modified."""
    bs, dv = attrs.block_size, attrs.head_size_v
    group = attrs.num_heads // attrs.num_kv_heads
    key_cache = key_cache.clone()
    if attrs.latent:
        value_cache = None
    elif value is None or value_cache is None:
        raise ValueError("PagedAttention: value and value_cache are required outside latent mode")
    else:
        value_cache = value_cache.clone()
    out = query.new_zeros(query.shape[0], attrs.num_heads, dv)
    for b in range(block_tables.shape[0]):
        lo, hi = int(query_start_loc[b]), int(query_start_loc[b + 1])
        total = int(seq_lens[b])
        past = total - (hi - lo)
        table = block_tables[b].long()
        for i in range(hi - lo):  # write first: the sequence's own new tokens are attended to
            p = past + i
            key_cache[table[p // bs], p % bs] = key[lo + i]
            if value_cache is not None and value is not None:
                value_cache[table[p // bs], p % bs] = value[lo + i]
        positions = torch.arange(total)
        blocks, offsets = table[positions // bs], positions % bs
        keys = key_cache[blocks, offsets]  # [L, Hkv, Dk]
        values = keys[..., :dv] if value_cache is None else value_cache[blocks, offsets]  # [L, Hkv, Dv]
        keys = keys.repeat_interleave(group, dim=1).float()  # [L, Hq, Dk]: query head h reads kv head h // G
        values = values.repeat_interleave(group, dim=1).float()
        for i in range(hi - lo):
            p = past + i
            visible = positions <= p
            if attrs.sliding_window:
                visible &= positions > p - attrs.sliding_window
            scores = torch.einsum("hd,lhd->hl", query[lo + i].float(), keys) * attrs.scale  # [Hq, L]
            scores = scores.masked_fill(~visible, float("-inf"))
            out[lo + i] = torch.einsum("hl,lhd->hd", scores.softmax(-1), values).to(out.dtype)
    return out, key_cache, value_cache
