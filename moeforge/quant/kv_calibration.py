"""``compile --kv-quant int8``: calibrate per-head KV scales on ``--calib`` prompts, then quantise the cache.

The scales come from the cache contents themselves: the graph (already carrying its final weights,
quantised or not) is run on each calibration prompt and every layer's ``present`` output -- exactly the
keys/values (after rotary) the cache would hold -- is reduced to max |x| per head and channel (rotary key
pairs: their largest norm, the bound for any position).
``moeforge/passes/kv_quant.py`` then makes the caches int8. Not available: fp8 caches (ONNX Runtime 1.32's CPU
GroupQueryAttention has no float8e4m3fn kernel; its CUDA kernel does) and paged artifacts (the paged
attention op reads fp32 pools).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir

from moeforge.core.config import ModelConfig
from moeforge.core.kv_layout import cache_names
from moeforge.passes.base import PassContext
from moeforge.passes.kv_quant import KVCacheQuantization, KVScales, scales_from_amax
from moeforge.quant.calibration import GraphRunner, runner_options

# Per head (the MLA latent is one head): see moeforge/passes/kv_quant.py for why not per channel.
DEFAULT_GRANULARITY = "head"


def calibrate_kv_amax(model: ir.Model, ctx: PassContext, prompts: list[list[int]]) -> list[tuple[np.ndarray, ...]]:
    """Per layer, max |x| [H, D] of each cache buffer's contents over the prompts: (key, value) or (latent,)."""
    mla = ctx.config.mla is not None
    layers = [cache_names(i, mla) for i in range(ctx.config.num_hidden_layers)]
    outputs = tuple(name for names in layers for name in names.present[: 1 if mla else 2])
    runner = GraphRunner(model, extra_outputs=outputs, **runner_options(ctx))
    rotary = rotary_pairs(ctx.config)
    amax: list[np.ndarray] | None = None
    for ids in prompts:
        caches = runner.run(ids)[1:]  # each [1, H, S, D]: (key, value) per layer, or (latent,)
        step = [channel_amax(c, rotary if mla or i % 2 == 0 else None) for i, c in enumerate(caches)]
        amax = step if amax is None else [np.maximum(a, b) for a, b in zip(amax, step, strict=True)]
    assert amax is not None, "tokenize_prompts returns at least one prompt"
    per = 1 if mla else 2
    return [tuple(amax[i * per:(i + 1) * per]) for i in range(len(layers))]


def rotary_pairs(config: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """Channel indices (a, b) of the rotary pairs in a cached key (GQA: the whole head; MLA latent: its last
    Dr channels), in the model's layout: adjacent (DeepSeek) or halves (Llama's rotate_half)."""
    width = config.rope_dim
    start = config.mla.kv_lora_rank if config.mla is not None else 0
    half = np.arange(width // 2)
    if config.rope.interleaved:
        return start + 2 * half, start + 2 * half + 1
    return start + half, start + half + width // 2


def channel_amax(cache: np.ndarray, rotary: tuple[np.ndarray, np.ndarray] | None) -> np.ndarray:
    """max |x| per head and channel [H, D] of a cache [1, H, S, D]. On rotary pairs it is the pair's largest
    norm sqrt(a^2 + b^2), which no rotation exceeds: a position past the calibration prompts turns the
    pair to an angle never seen, and a per-channel max would let it saturate."""
    amax: np.ndarray = np.abs(cache).max(axis=(0, 2))
    if rotary is not None:
        a, b = rotary
        norm = np.sqrt(np.square(cache[..., a]) + np.square(cache[..., b])).max(axis=(0, 2))  # [H, pairs]
        amax[:, a] = norm
        amax[:, b] = norm
    return amax


class CalibratedKVQuantization:
    """Calibrate per-head scales on ``prompts`` and make the GroupQueryAttention caches int8 (one pass, so the
    scales are measured on the graph exactly as it stands, final weights included); returns the layers
    rewritten. ``summary`` holds the manifest's ``quantization.kv_cache`` once applied."""

    name = "kv_quant"

    def __init__(self, prompts: list[list[int]], granularity: str = DEFAULT_GRANULARITY) -> None:
        self.prompts, self.granularity = prompts, granularity
        self.summary: dict[str, Any] = {}

    def apply(self, model: ir.Model, ctx: PassContext) -> int:
        amax = calibrate_kv_amax(model, ctx, self.prompts)
        scales = []
        for layer in amax:
            key = scales_from_amax(layer[0], self.granularity)
            value = key if len(layer) == 1 else scales_from_amax(layer[1], self.granularity)
            scales.append(KVScales(key, value))
        matches = KVCacheQuantization(scales).apply(model, ctx)
        every = np.concatenate([np.concatenate([s.key.ravel(), s.value.ravel()]) for s in scales])
        self.summary = {
            "dtype": "int8", "granularity": self.granularity, "symmetric": True,
            "calibration_prompts": len(self.prompts),
            "method": f"max |x| of the cache contents per {self.granularity} / 127 (rotary key pairs: max pair norm)",
            "scale_range": [float(every.min()), float(every.max())],
            "per_layer_max_scale": [{"key": float(s.key.max()), "value": float(s.value.max())} for s in scales],
        }
        return matches
