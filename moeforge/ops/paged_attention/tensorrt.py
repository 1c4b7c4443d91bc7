"""TensorRT IPluginV3 for ``moeforge.PagedAttention`` (plugin name PagedAttention, version "1", namespace "moeforge").

Dimension letters: T new tokens of all sequences (packed), B sequences, Hq/Hkv heads, Dk/Dv head sizes,
NB cache blocks, BS tokens per block, R + Dr latent width (MLA).

Contract (the ONNX node also carries a local function for runtimes without the plugin):
    inputs   query [T, Hq, Dk], key [T, Hkv, Dk], value [T, Hkv, Dv] (empty in latent/MLA mode),
             key_cache [NB, BS, Hkv, Dk], value_cache [NB, BS, Hkv, Dv] (empty in latent mode: key_cache
             is the latent pool [NB, BS, 1, R+Dr] and the value is its first Dv dims),
             block_tables int32 [B, max_blocks], seq_lens int32 [B] (tokens after this step),
             query_start_loc int32 [B+1]
    attrs    scale, num_heads, num_kv_heads, block_size, sliding_window (0 = none), head_size_v
    outputs  output [T, Hq, Dv], key_cache_out, value_cache_out (aliases of the cache inputs: the new
             keys/values are written into their slots in place)
Sequence b's new tokens are query rows query_start_loc[b] .. query_start_loc[b+1]-1 at positions
seq_lens[b] - n_b .. seq_lens[b] - 1; token at position p lives in block block_tables[b, p // BS], row p % BS.
Query at position p sees keys at positions j <= p (and j > p - sliding_window with a window).

The "kernel" is torch on the device pointers (``paged_attention`` below, checked on CPU against dense
attention); plugin classes are built per TensorRT module by ``plugin_classes`` on the shared boilerplate of
moeforge/ops/tensorrt_plugin.py.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from moeforge.ops.tensorrt_plugin import (
    PluginSpec,
    creator_class,
    desc_tensor,
    linear_formats,
    plugin_base,
)
from moeforge.ops.tensorrt_plugin import register as register_plugin

PLUGIN_NAME, PLUGIN_VERSION, PLUGIN_NAMESPACE = "PagedAttention", "1", "moeforge"
_INT_ATTRS = ("num_heads", "num_kv_heads", "block_size", "sliding_window", "head_size_v")


@dataclass(frozen=True)
class PagedAttentionAttrs:
    scale: float
    num_heads: int
    num_kv_heads: int
    block_size: int
    sliding_window: int = 0
    head_size_v: int = 0


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                    value_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, attrs: PagedAttentionAttrs) -> torch.Tensor:
    """Write the new keys/values into the caches (in place) and attend; returns output [T, Hq, Dv]."""
    latent = value.numel() == 0
    dv = attrs.head_size_v
    group = attrs.num_heads // attrs.num_kv_heads
    out = torch.empty((query.shape[0], attrs.num_heads, dv), dtype=query.dtype, device=query.device)
    starts = query_start_loc.tolist()
    for b, total in enumerate(seq_lens.tolist()):
        lo, hi = starts[b], starts[b + 1]
        new = hi - lo
        if new == 0:
            continue
        positions = torch.arange(total - new, total, device=query.device)
        blocks = block_tables[b].long()[positions // attrs.block_size]
        rows = positions % attrs.block_size
        key_cache[blocks, rows] = key[lo:hi].to(key_cache.dtype)
        if not latent:
            value_cache[blocks, rows] = value[lo:hi].to(value_cache.dtype)
        every = torch.arange(total, device=query.device)
        all_blocks, all_rows = block_tables[b].long()[every // attrs.block_size], every % attrs.block_size
        keys = key_cache[all_blocks, all_rows].float()  # [total, Hkv, Dk]
        values = keys[..., :dv] if latent else value_cache[all_blocks, all_rows].float()
        keys = keys.repeat_interleave(group, dim=1)  # [total, Hq, Dk]
        values = values.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", query[lo:hi].float(), keys) * attrs.scale  # [Hq, new, total]
        visible = every[None, :] <= positions[:, None]
        if attrs.sliding_window:
            visible &= every[None, :] > positions[:, None] - attrs.sliding_window
        scores = scores.masked_fill(~visible[None], float("-inf"))
        out[lo:hi] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).to(out.dtype)
    return out


def attrs_from_fields(fields: Any) -> PagedAttentionAttrs:
    values: dict[str, Any] = {}
    for field in fields:
        if field.name == "scale":
            values["scale"] = float(np.asarray(field.data).reshape(-1)[0])
        elif field.name in _INT_ATTRS:
            values[field.name] = int(np.asarray(field.data).reshape(-1)[0])
    return PagedAttentionAttrs(**values)


def attrs_to_fields(trt: Any, attrs: PagedAttentionAttrs) -> tuple[Any, list[np.ndarray]]:
    """(PluginFieldCollection, its arrays): keep the arrays alive with the collection."""
    kind = trt.PluginFieldType
    arrays = [np.array([attrs.scale], np.float32)] + [np.array([getattr(attrs, n)], np.int32) for n in _INT_ATTRS]
    fields = [trt.PluginField("scale", arrays[0], kind.FLOAT32)]
    fields += [trt.PluginField(n, a, kind.INT32) for n, a in zip(_INT_ATTRS, arrays[1:], strict=True)]
    return trt.PluginFieldCollection(fields), arrays



SPEC = PluginSpec(name=PLUGIN_NAME, num_outputs=3, default_attrs=PagedAttentionAttrs(1.0, 1, 1, 16),
                  from_fields=attrs_from_fields, to_fields=attrs_to_fields, version=PLUGIN_VERSION,
                  namespace=PLUGIN_NAMESPACE)


@functools.cache
def plugin_classes(trt: Any) -> tuple[type, type]:
    """(PagedAttentionPlugin, PagedAttentionCreator) for the TensorRT module ``trt``."""
    base: Any = plugin_base(trt, trt.IPluginV3OneBuildV2)  # V2: aliased outputs (the pools, written in place)

    class PagedAttentionPlugin(base):
        SPEC = SPEC

        def get_output_data_types(self, input_types: Any) -> list[Any]:
            return [input_types[0], input_types[3], input_types[4]]

        def get_output_shapes(self, inputs: Any, shape_inputs: Any, expr_builder: Any) -> list[Any]:
            out = trt.DimsExprs(3)
            out[0], out[1] = inputs[0][0], inputs[0][1]  # T, Hq
            out[2] = expr_builder.constant(self.attrs.head_size_v)
            return [out, trt.DimsExprs(inputs[3]), trt.DimsExprs(inputs[4])]

        def get_aliased_input(self, output_index: int) -> int:
            return {1: 3, 2: 4}.get(output_index, -1)  # caches are updated in place

        def supports_format_combination(self, pos: int, in_out: Any, num_inputs: int) -> bool:
            int32 = trt.DataType.INT32  # block_tables, seq_lens, query_start_loc
            return linear_formats(trt, in_out, pos, {5: int32, 6: int32, 7: int32})

        def enqueue(self, input_desc: Any, output_desc: Any, inputs: Any, outputs: Any, workspace: Any,
                    stream: int) -> None:
            external = torch.cuda.ExternalStream(stream)  # type: ignore[no-untyped-call]  # unannotated in torch
            with torch.cuda.stream(external):
                query, key, value, key_cache, value_cache, tables, lens, starts = (
                    desc_tensor(d, p) for d, p in zip(input_desc, inputs, strict=True))
                # Writes key_cache / value_cache: the buffers of the aliased outputs.
                out = paged_attention(query, key, value, key_cache, value_cache, tables, lens, starts, self.attrs)
                desc_tensor(output_desc[0], outputs[0]).copy_(out)

    return PagedAttentionPlugin, creator_class(trt, PagedAttentionPlugin)


def register(trt: Any, allow_rtx: bool = False) -> Any:
    """Register the creator with ``trt.get_plugin_registry()`` (once per module; refused for TensorRT-RTX unless
    ``allow_rtx``, see ``plugins/tensorrt_plugin.register``); return it."""
    return register_plugin(trt, SPEC, lambda: plugin_classes(trt)[1], allow_rtx)
