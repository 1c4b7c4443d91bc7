"""Per-weight quantisation sensitivity: quantise one weight at a time, measure the logit KL divergence.

For each quantisable weight, the fp32 graph runs the calibration prompts with only that weight replaced
by its fake-quantised value (dequantise(quantise(W))), and the mean KL(fp32 || that graph) over all
calibration positions is its sensitivity. Mixed precision keeps the most sensitive fraction in fp32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from moeforge.passes.base import PassContext
from moeforge.passes.quant_math import fake_quantize
from moeforge.passes.quant_weights import QuantTarget, quant_targets
from moeforge.quant.act_calibration import weight_array
from moeforge.quant.calibration import GraphRunner, mean_kl, runner_options


@dataclass(frozen=True)
class Sensitivity:
    name: str
    label: str
    kl: float


def fake_quantized(target: QuantTarget, kind: str, block_size: int | None) -> np.ndarray:
    """The weight as the quantised graph sees it (MoE [E, N, K]: per expert, blocks along K)."""
    w = weight_array(target)
    if target.is_moe:
        return np.stack([fake_quantize(w[e].T, kind, block_size).T for e in range(w.shape[0])]).astype(np.float32)
    return fake_quantize(w, kind, block_size).astype(np.float32)


def measure(model: ir.Model, prompts: list[list[int]], kind: str, block_size: int | None,
            ctx: PassContext | None = None) -> list[Sensitivity]:
    """Sensitivity of every quantisable weight, most sensitive first (``ctx``: a streamed compile's scratch folder,
    where the graph's weights are mapped from; one replaced weight is in memory at a time)."""
    targets = quant_targets(model)
    runner = GraphRunner(model, overridable=tuple(t.name for t in targets), **runner_options(ctx))
    reference = [runner.run(ids)[0] for ids in prompts]
    rows = []
    for target in targets:
        replaced = {target.name: fake_quantized(target, kind, block_size)}
        kls = [mean_kl(ref, runner.run(ids, replaced)[0]) for ids, ref in zip(prompts, reference, strict=True)]
        rows.append(Sensitivity(target.name, target.label, float(np.mean(kls))))
    return sorted(rows, key=lambda r: r.kl, reverse=True)


def choose_kept(rows: list[Sensitivity], fraction: float) -> list[Sensitivity]:
    """The ceil(fraction * count) most sensitive weights (``rows`` sorted most sensitive first)."""
    count = math.ceil(fraction * len(rows) - 1e-9) if fraction > 0 else 0
    return rows[:count]
