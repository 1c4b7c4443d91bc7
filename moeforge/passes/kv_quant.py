"""KV-cache quantisation: the GroupQueryAttention caches become int8 with static per-head scales.

After ``kv_cache`` every layer's attention is ``com.microsoft.GroupQueryAttention`` reading and writing a
cache buffer [B, Hkv, L, D] in place (absorbed MLA: one latent buffer [B, 1, L, R+Dr] bound to both
past inputs). This pass makes the cache inputs/outputs int8 and gives each node its ``k_scale`` /
``v_scale`` (inputs 12 and 13) with ``k_quant_type = v_quant_type = "PER_CHANNEL"`` and
``kv_cache_bit_width = 8``: the kernel quantises the new keys/values as it writes them
(code = saturate(round(x / scale))) and dequantises the cache as it reads it, so nothing in the graph
ever holds an fp32 copy of the cache.

Scales are per KV head, shaped [1, Hkv, 1, D] (the kernel's per-channel form; a head's D entries are
equal). One head's scale is its largest |value| over the calibration prompts / 127 (``moeforge/kv_quant.py``
counts rotary key pairs by their norm); the MLA latent is one head. ``granularity="channel"`` (one scale per
channel) exists but is not the default: it leaves no headroom for a channel that a prompt pushes past its
calibration maximum, and the kernel saturates it (SmolLM2 top-1 0.966 per channel vs 0.972 per head).
K and V of an MLA layer are the same latent written twice into one buffer, so they share one scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from moeforge.core.kv_layout import cache_names
from moeforge.passes.base import MS_DOMAIN, PassContext, add_initializer

K_SCALE_INPUT, V_SCALE_INPUT = 12, 13  # GroupQueryAttention input slots (ONNX Runtime >= 1.22)
INT8_MAX = 127.0
GRANULARITIES = ("head", "channel")


@dataclass(frozen=True)
class KVScales:
    """One layer's scales, each [Hkv, D] (MLA: ``key`` is ``value``, [1, R+Dr])."""

    key: np.ndarray
    value: np.ndarray


def scales_from_amax(amax: np.ndarray, granularity: str) -> np.ndarray:
    """Symmetric int8 scales [H, D] from per-channel max |x| [H, D]: per head (max over D) or per channel."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity {granularity!r} is not one of {GRANULARITIES}")
    amax = np.asarray(amax, np.float32)
    if granularity == "head":
        amax = np.broadcast_to(amax.max(axis=1, keepdims=True), amax.shape)
    # A channel that never moved (all zeros) gets a harmless scale instead of 0 (division by zero).
    scales: np.ndarray = (np.maximum(amax, 1e-6) / INT8_MAX).astype(np.float32)
    return scales


class KVCacheQuantization:
    """Every GroupQueryAttention cache -> int8 with the given per-layer scales; returns the layers rewritten."""

    name = "kv_quant"

    def __init__(self, scales: list[KVScales]) -> None:
        self.scales = scales

    def apply(self, model: ir.Model, ctx: PassContext) -> int:
        graph = model.graph
        nodes = [n for n in graph if n.op_type == "GroupQueryAttention" and n.domain == MS_DOMAIN]
        if len(nodes) != len(self.scales):
            raise ValueError(f"{len(self.scales)} layers of KV scales for {len(nodes)} GroupQueryAttention nodes "
                             "(run the kv_cache pass first; paged artifacts have no GroupQueryAttention)")
        mla = ctx.config.mla is not None
        inputs = {v.name: v for v in graph.inputs}
        by_past_key = {cache_names(i, mla).past[0]: i for i in range(len(self.scales))}
        for node in nodes:
            # The layer is the one whose cache the node reads (past_key, input 3), not the node's position.
            past_key = node.inputs[3].name if len(node.inputs) > 3 and node.inputs[3] is not None else None
            if past_key not in by_past_key:
                raise ValueError(f"GroupQueryAttention {node.name!r} reads {past_key!r}, not a layer cache input")
            layer = by_past_key[past_key]
            scales = self.scales[layer]
            for name in cache_names(layer, mla).past:
                inputs[name].type = ir.TensorType(ir.DataType.INT8)
            for output in node.outputs[1:3]:
                output.type = ir.TensorType(ir.DataType.INT8)
            k_scale = add_initializer(graph, f"kv_quant.{layer}.k_scale", _per_head(scales.key))
            v_scale = k_scale if mla else add_initializer(graph, f"kv_quant.{layer}.v_scale", _per_head(scales.value))
            _set_input(node, K_SCALE_INPUT, k_scale)
            _set_input(node, V_SCALE_INPUT, v_scale)
            for attr in ("k_quant_type", "v_quant_type"):
                node.attributes[attr] = ir.AttrString(attr, "PER_CHANNEL")
            node.attributes["kv_cache_bit_width"] = ir.AttrInt64("kv_cache_bit_width", 8)
        return len(nodes)


def _per_head(scale: np.ndarray) -> np.ndarray:
    """[H, D] -> [1, H, 1, D] float32, the shape GroupQueryAttention broadcasts over its cache [B, H, L, D]."""
    heads, dim = scale.shape
    return scale.reshape(1, heads, 1, dim).astype(np.float32)


def _set_input(node: ir.Node, index: int, value: ir.Value) -> None:
    """Set optional input ``index``, padding the unused optional inputs before it with None."""
    if len(node.inputs) <= index:
        node.resize_inputs(index + 1)
    node.replace_input_with(index, value)
