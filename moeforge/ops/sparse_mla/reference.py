"""The torch reference of ``moeforge.SparseMLA``: the lightning indexer's top-k selection and attention over the
selected latent rows only. ``moeforge/model/dsa.py`` (the model) calls these same functions.

Dimension letters: see schema.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def select_topk(index_q: torch.Tensor, index_w: torch.Tensor, index_k: torch.Tensor, positions: torch.Tensor,
                topk: int, index_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """index_q [B, S, Hi, Di], index_w [B, S, Hi] (already x Hi^-0.5), index_k [B, L, Di], positions [B, S] ->
    rows [B, S, K] int64 and allowed [B, S, K] bool (a query with fewer than K rows <= its position gets masked
    rows to fill its K).

    index[b, s, t] = sum_h index_w[b, s, h] * relu(index_q[b, s, h] . index_k[b, t]) * index_scale.
    """
    scores = F.relu(torch.einsum("bshd,btd->bsht", index_q, index_k)) * index_scale  # [B, S, Hi, L]
    index = torch.einsum("bsh,bsht->bst", index_w, scores)  # [B, S, L]
    length = index_k.shape[1]
    allowed = torch.arange(length, device=index.device)[None, None, :] <= positions[:, :, None]  # [B, S, L]
    index = index.masked_fill(~allowed, float("-inf"))
    # sym_min: L is symbolic under export, and min() would specialise the graph to one side of the comparison.
    k: int = torch.sym_min(topk, length)  # type: ignore[no-untyped-call]
    top, rows = index.topk(k, dim=-1)  # [B, S, K]
    return rows, top > float("-inf")


def gather_rows(cache: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """cache [B, L, *D], rows [B, S, K] -> cache[b, rows[b, s, k]] as [B, S, K, *D]: one Gather over B*L rows,
    so its cost is B*S*K rows whatever L is."""
    b, length = cache.shape[:2]
    flat = cache.reshape(b * length, *cache.shape[2:])  # [B*L, *D]
    offsets = (torch.arange(b, device=rows.device) * length)[:, None, None]  # [B, 1, 1]
    picked = flat.index_select(0, (rows + offsets).reshape(-1))  # [B*S*K, *D]
    return picked.view(*rows.shape, *cache.shape[2:])


def sparse_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Attention of each query over its own K gathered rows.

    query [B, H, S, Dk]; keys [B, S, K, Hk, Dk] and values [B, S, K, Hk, Dv] with Hk = H, or 1 (shared by every
    head: absorbed MLA); allowed [B, S, K] -> out [B, H, S, Dv]. Rows not allowed get no weight.
    """
    if keys.shape[3] == 1:
        scores = torch.einsum("bhsd,bskd->bhsk", query, keys[:, :, :, 0])
    else:
        scores = torch.einsum("bhsd,bskhd->bhsk", query, keys)
    scores = scores.masked_fill(~allowed[:, None], float("-inf")) * scale  # [B, H, S, K]
    probs = torch.softmax(scores, dim=-1)
    if values.shape[3] == 1:
        return torch.einsum("bhsk,bskd->bhsd", probs, values[:, :, :, 0])
    return torch.einsum("bhsk,bskhd->bhsd", probs, values)


def sparse_mla(query: torch.Tensor, latent: torch.Tensor, index_q: torch.Tensor, index_w: torch.Tensor,
               index_k: torch.Tensor, positions: torch.Tensor, topk: int, scale: float, index_scale: float,
               kv_rank: int) -> torch.Tensor:
    """The op over all rows: query [B, H, S, C], latent [B, L, C], index_k [B, L, Di] -> out [B, H, S, R]."""
    rows, allowed = select_topk(index_q, index_w, index_k, positions, topk, index_scale)
    picked = gather_rows(latent, rows).unsqueeze(3)  # [B, S, K, 1, C]
    return sparse_attention(query, picked, picked[..., :kv_rank], allowed, scale)
