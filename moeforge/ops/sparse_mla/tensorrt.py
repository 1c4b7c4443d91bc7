"""TensorRT IPluginV3 for ``moeforge.SparseMLACache`` and ``moeforge.SparseMLAPaged`` (plugin names = op types,
version "1", namespace "moeforge"): the two cached forms the TensorRT target emits (trt_kv_cache.py, paged_kv).

Contract: README.md (letters there). Inputs 0-5 query [B, H, S, C], latent [B, S, C], index_q [B, S, Hi, Di],
index_w [B, S, Hi], index_k [B, S, Di], positions int64 [B, S]; then
    SparseMLACache  past_latent [B, 1, Lmax, C], past_index [B, 1, Lmax, Di], attention_mask int64 [B, L]
                    (only its width L is read: rows 0..L-1 are attended over)
    SparseMLAPaged  latent_pool [N, Bs, 1, C], index_pool [N, Bs, 1, Di], block_tables int32 [B', M],
                    seq_lens int32 [B'], query_start_loc int32 [B'+1] (B = T packed tokens, S = 1)
Outputs: output [B, H, S, R], then the two caches (aliases of inputs 6 and 7: the new rows are written in place).
Attributes: topk, scale, index_scale, kv_rank (``SparseMLAAttrs``).

The "kernel" is torch on the device pointers: the new rows are written into the caches, then the shared torch
reference (reference.py: indexer scores, top-k, Gather of the K picked rows, attention over them) runs over each
query's readable rows. Checked on CPU against the reference over whole sequences
(tests/trt/test_trt_sparse_mla_plugin.py);
building the plugin into an engine needs full TensorRT on a GPU (TensorRT-RTX 1.7's parser aborts on Python
plugins, plugins/tensorrt_plugin.register), and without it TensorRT inlines the nodes' local functions.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from moeforge.ops.sparse_mla.reference import sparse_mla
from moeforge.ops.sparse_mla.schema import CACHED_OP_TYPE, PAGED_OP_TYPE, PLUGIN_NAMESPACE, PLUGIN_VERSION
from moeforge.ops.sparse_mla.schema import SparseMLAAttrs as SparseMLAAttrs
from moeforge.ops.tensorrt_plugin import (
    PluginSpec,
    creator_class,
    desc_tensor,
    linear_formats,
    plugin_base,
)
from moeforge.ops.tensorrt_plugin import register as register_plugin

_INT_FIELDS, _FLOAT_FIELDS = ("topk", "kv_rank"), ("scale", "index_scale")


def _attend(query: torch.Tensor, latent: torch.Tensor, index_q: torch.Tensor, index_w: torch.Tensor,
            index_k: torch.Tensor, positions: torch.Tensor, attrs: SparseMLAAttrs) -> torch.Tensor:
    """The reference in fp32 (indexer scores and top-k in fp32 whatever the engine's type) -> [B, H, S, R]."""
    out = sparse_mla(query.float(), latent.float(), index_q.float(), index_w.float(), index_k.float(),
                     positions.long(), attrs.topk, attrs.scale, attrs.index_scale, attrs.kv_rank)
    return out.to(query.dtype)


def sparse_mla_cached(query: torch.Tensor, latent: torch.Tensor, index_q: torch.Tensor, index_w: torch.Tensor,
                      index_k: torch.Tensor, positions: torch.Tensor, past_latent: torch.Tensor,
                      past_index: torch.Tensor, length: int, attrs: SparseMLAAttrs) -> torch.Tensor:
    """``SparseMLACache``: write row (b, s) at buffer row positions[b, s] of both buffers [B, 1, Lmax, *] (in
    place), then attend over rows 0..length-1 (each query reads rows <= its position) -> output [B, H, S, R]."""
    batch = torch.arange(positions.shape[0], device=positions.device)[:, None].expand_as(positions)  # [B, S]
    past_latent[batch, 0, positions] = latent.to(past_latent.dtype)
    past_index[batch, 0, positions] = index_k.to(past_index.dtype)
    return _attend(query, past_latent[:, 0, :length], index_q, index_w, past_index[:, 0, :length], positions, attrs)


def sparse_mla_paged(query: torch.Tensor, latent: torch.Tensor, index_q: torch.Tensor, index_w: torch.Tensor,
                     index_k: torch.Tensor, positions: torch.Tensor, latent_pool: torch.Tensor,
                     index_pool: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     query_start_loc: torch.Tensor, attrs: SparseMLAAttrs) -> torch.Tensor:
    """``SparseMLAPaged``: T packed tokens (S = 1); sequence b owns tokens query_start_loc[b]..[b+1]-1. Write each
    token's rows at pool slot (block_tables[b, p // Bs], p % Bs), p its position (in place), then attend each token
    over its sequence's rows 0..p -> output [T, H, 1, R]. As the engine feeds it: every position < seq_lens[b] (the
    sequence's tokens after this step); rows past T's last sequence (padding) get output 0."""
    block = latent_pool.shape[1]
    out = torch.zeros((*query.shape[:3], attrs.kv_rank), dtype=query.dtype, device=query.device)
    starts = query_start_loc.tolist()
    for b, total in enumerate(seq_lens.tolist()):
        lo, hi = starts[b], starts[b + 1]
        if hi == lo:
            continue
        table = block_tables[b].long()
        new = positions[lo:hi, 0]  # [n]
        latent_pool[table[new // block], new % block, 0] = latent[lo:hi, 0].to(latent_pool.dtype)
        index_pool[table[new // block], new % block, 0] = index_k[lo:hi, 0].to(index_pool.dtype)
        every = torch.arange(total, device=query.device)  # the sequence's rows after this step's writes
        slots = (table[every // block], every % block)
        rows = latent_pool[slots[0], slots[1], 0][None]  # [1, total, C]
        keys = index_pool[slots[0], slots[1], 0][None]  # [1, total, Di]
        # one batch entry of n queries: query [n, H, 1, C] -> [1, H, n, C]
        seq_out = _attend(query[lo:hi, :, 0].transpose(0, 1)[None], rows, index_q[lo:hi, 0][None],
                          index_w[lo:hi, 0][None], keys, new[None], attrs)  # [1, H, n, R]
        out[lo:hi, :, 0] = seq_out[0].transpose(0, 1)
    return out


def attrs_from_fields(fields: Any) -> SparseMLAAttrs:
    values: dict[str, Any] = {}
    for field in fields:
        if field.name in _FLOAT_FIELDS:
            values[field.name] = float(np.asarray(field.data).reshape(-1)[0])
        elif field.name in _INT_FIELDS:
            values[field.name] = int(np.asarray(field.data).reshape(-1)[0])
    missing = sorted({*_INT_FIELDS, *_FLOAT_FIELDS} - values.keys())
    if missing:
        raise ValueError(f"SparseMLA plugin: the node has no {', '.join(missing)} field(s); re-export the model with "
                         "moeforge compile, which writes topk, scale, index_scale and kv_rank on every SparseMLA node")
    attrs = SparseMLAAttrs(**values)
    if attrs.topk < 1 or attrs.kv_rank < 1:
        raise ValueError(f"SparseMLA plugin: topk {attrs.topk} and kv_rank {attrs.kv_rank} must be >= 1")
    return attrs


def attrs_to_fields(trt: Any, attrs: SparseMLAAttrs) -> tuple[Any, list[np.ndarray]]:
    """(PluginFieldCollection, its arrays): keep the arrays alive with the collection."""
    kind = trt.PluginFieldType
    arrays = [np.array([getattr(attrs, n)], np.float32) for n in _FLOAT_FIELDS]
    arrays += [np.array([getattr(attrs, n)], np.int32) for n in _INT_FIELDS]
    kinds = [kind.FLOAT32] * len(_FLOAT_FIELDS) + [kind.INT32] * len(_INT_FIELDS)
    fields = [trt.PluginField(n, a, k) for n, a, k in zip((*_FLOAT_FIELDS, *_INT_FIELDS), arrays, kinds, strict=True)]
    return trt.PluginFieldCollection(fields), arrays


_DEFAULT = SparseMLAAttrs(topk=2048, scale=1.0, index_scale=1.0, kv_rank=512)
SPECS = {op: PluginSpec(name=op, num_outputs=3, default_attrs=_DEFAULT, from_fields=attrs_from_fields,
                        to_fields=attrs_to_fields, version=PLUGIN_VERSION, namespace=PLUGIN_NAMESPACE)
         for op in (CACHED_OP_TYPE, PAGED_OP_TYPE)}


@functools.cache
def plugin_classes(trt: Any, op_type: str = CACHED_OP_TYPE) -> tuple[type, type]:
    """(plugin class, creator class) of ``op_type`` (SparseMLACache or SparseMLAPaged) for the TensorRT module."""
    base: Any = plugin_base(trt, trt.IPluginV3OneBuildV2)  # V2: aliased outputs (the caches, written in place)
    paged = op_type == PAGED_OP_TYPE
    int_inputs = {5: trt.DataType.INT64, **({8: trt.DataType.INT32, 9: trt.DataType.INT32, 10: trt.DataType.INT32}
                                            if paged else {8: trt.DataType.INT64})}

    class SparseMLAPlugin(base):
        SPEC = SPECS[op_type]

        def get_output_data_types(self, input_types: Any) -> list[Any]:
            return [input_types[0], input_types[6], input_types[7]]

        def get_output_shapes(self, inputs: Any, shape_inputs: Any, expr_builder: Any) -> list[Any]:
            out = trt.DimsExprs(4)
            out[0], out[1], out[2] = inputs[0][0], inputs[0][1], inputs[0][2]  # B, H, S
            out[3] = expr_builder.constant(self.attrs.kv_rank)
            return [out, trt.DimsExprs(inputs[6]), trt.DimsExprs(inputs[7])]

        def get_aliased_input(self, output_index: int) -> int:
            return {1: 6, 2: 7}.get(output_index, -1)  # caches are updated in place

        def supports_format_combination(self, pos: int, in_out: Any, num_inputs: int) -> bool:
            return linear_formats(trt, in_out, pos, int_inputs)

        def enqueue(self, input_desc: Any, output_desc: Any, inputs: Any, outputs: Any, workspace: Any,
                    stream: int) -> None:
            external = torch.cuda.ExternalStream(stream)  # type: ignore[no-untyped-call]  # unannotated in torch
            with torch.cuda.stream(external):
                t = [desc_tensor(d, p) for d, p in zip(input_desc, inputs, strict=True)]
                if paged:  # writes the pools: the buffers of the aliased outputs
                    out = sparse_mla_paged(t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7], t[8], t[9], t[10],
                                           self.attrs)
                else:  # writes the buffers; attention_mask's width is L
                    out = sparse_mla_cached(t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7], int(input_desc[8].dims[1]),
                                            self.attrs)
                desc_tensor(output_desc[0], outputs[0]).copy_(out)

    SparseMLAPlugin.__name__ = SparseMLAPlugin.__qualname__ = f"{op_type}Plugin"
    return SparseMLAPlugin, creator_class(trt, SparseMLAPlugin)


def register(trt: Any, allow_rtx: bool = False) -> list[Any]:
    """Register both creators with ``trt.get_plugin_registry()`` (once per module; refused for TensorRT-RTX unless
    ``allow_rtx``, see ``plugins/tensorrt_plugin.register``); return them."""
    return [register_plugin(trt, SPECS[op], functools.partial(_creator, trt, op), allow_rtx)
            for op in (CACHED_OP_TYPE, PAGED_OP_TYPE)]


def _creator(trt: Any, op_type: str) -> type:
    return plugin_classes(trt, op_type)[1]
