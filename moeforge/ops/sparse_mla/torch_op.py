"""``torch.ops.moeforge.sparse_mla``: DSA's selection + sparse attention as a torch custom op, exported as one
``moeforge.SparseMLA`` node (``onnx_translation``; the node's local function comes from ``function.py``).

Eager calls run the reference (``reference.sparse_mla``).
"""

from __future__ import annotations

import onnxscript
import torch

from moeforge.ops.sparse_mla import reference
from moeforge.ops.sparse_mla.schema import DOMAIN, PLUGIN_NAMESPACE, PLUGIN_VERSION, VERSION, SparseMLAAttrs


@torch.library.custom_op("moeforge::sparse_mla", mutates_args=())
def sparse_mla(query: torch.Tensor, latent: torch.Tensor, index_q: torch.Tensor, index_w: torch.Tensor,
               index_k: torch.Tensor, positions: torch.Tensor, topk: int, scale: float, index_scale: float,
               kv_rank: int) -> torch.Tensor:
    """query [B, H, S, C], latent [B, L, C], index_q [B, S, Hi, Di], index_w [B, S, Hi], index_k [B, L, Di],
    positions [B, S] -> [B, H, S, R]."""
    return reference.sparse_mla(query, latent, index_q, index_w, index_k, positions, topk, scale, index_scale,
                                kv_rank)


@sparse_mla.register_fake
def _sparse_mla_fake(query: torch.Tensor, latent: torch.Tensor, *args: object) -> torch.Tensor:
    kv_rank = args[-1]
    assert isinstance(kv_rank, int)
    return query.new_empty((*query.shape[:3], kv_rank))


_opset = onnxscript.values.Opset(DOMAIN, VERSION)


def onnx_translation(  # type: ignore[no-untyped-def]  # tensors unannotated: the exporter reads annotations
    query, latent, index_q, index_w, index_k, positions, topk: int, scale: float, index_scale: float, kv_rank: int,
):
    """custom_translation_table entry: one ``moeforge.SparseMLA`` node."""
    return _opset.SparseMLA(query, latent, index_q, index_w, index_k, positions, topk=topk, scale=scale,
                            index_scale=index_scale, kv_rank=kv_rank, plugin_version=PLUGIN_VERSION,
                            plugin_namespace=PLUGIN_NAMESPACE)


def call(query: torch.Tensor, latent: torch.Tensor, index_q: torch.Tensor, index_w: torch.Tensor,
         index_k: torch.Tensor, positions: torch.Tensor, attrs: SparseMLAAttrs) -> torch.Tensor:
    """``torch.ops.moeforge.sparse_mla`` with typed attributes."""
    out: torch.Tensor = torch.ops.moeforge.sparse_mla(query, latent, index_q, index_w, index_k, positions,
                                                      attrs.topk, attrs.scale, attrs.index_scale, attrs.kv_rank)
    return out
