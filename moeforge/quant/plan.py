"""The passes that apply a ``QuantSpec`` (ONNX Runtime target), in the order they join the pass list after
``ort_pipeline``:

1. quant_sensitivity      (``--keep-fp``) per-weight KL on ``--calib``: the most sensitive stay fp32.
2. quant_awq              (``int4-awq``) activation-aware scales per input channel, on the fp32 graph.
3. quant_act_calibration  (w8a8) static activation ranges (+ SmoothQuant scales), on the fp32 graph.
4. quant_weights          portable Q/DQ of every weight (moeforge/passes/quant_weights.py).
5. quant_activations      (w8a8) Q/DQ on activations; quant_act_lowering (int8) ORT's uint8 form.
6. quant_lowering         Q/DQ -> MatMulNBits / QMoE (moeforge/passes/quant_lowering.py).
   shared_embedding       a tied table the LM head's codes hold exactly is read from them
                          (moeforge/passes/shared_embedding.py).
7. kv_quant               (``--kv-quant int8``) per-head cache scales on the final graph, int8 caches.

Calibration steps 1-3 must see the fp32 graph and 7 the final one, hence this order. The passes of one compile
share a ``QuantPlan``: what the earlier ones decided (kept weights, AWQ scales, activation ranges), handed on
explicitly, and the manifest's ``quantization`` summary built from it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import onnx_ir as ir

from moeforge.core.config import ModelConfig
from moeforge.passes.base import GraphPass, PassContext
from moeforge.passes.quant_activations import ActivationQuantization, OrtActivationLowering
from moeforge.passes.quant_lowering import QuantLowering
from moeforge.passes.quant_math import awq_search
from moeforge.passes.quant_weights import (
    QuantConfig,
    QuantTarget,
    WeightQuantization,
    always_fp32_weights,
    quant_targets,
)
from moeforge.passes.shared_embedding import SharedEmbedding
from moeforge.passes.sparse_experts import SparseExperts
from moeforge.quant.act_calibration import ActivationPlan, activation_name, fetch_groups, weight_array
from moeforge.quant.calibration import GraphRunner, runner_options
from moeforge.quant.kv_calibration import CalibratedKVQuantization
from moeforge.quant.schemes import SCHEMES
from moeforge.quant.sensitivity import choose_kept, measure
from moeforge.quant.spec import BLOCK_SIZES, QuantError, QuantSpec

log = logging.getLogger(__name__)

CALIB_MAX_TOKENS = 256  # per prompt
AWQ_SAMPLE_ROWS = 512  # activation rows kept per MatMul for the AWQ scale search
AWQ_SAMPLE_BUDGET = 256 * 2**20  # bytes of sample rows gathered at once (more targets: another pass per group)


def in_features(config: ModelConfig) -> list[int]:
    """Input dimensions (K) of the model's quantised weights, from its config (checked before export)."""
    dims = {config.hidden_size, config.intermediate_size}
    if config.moe is not None:
        dims.add(config.moe.moe_intermediate_size)
    if config.mla is not None:
        dims |= {config.mla.kv_lora_rank, config.num_attention_heads * config.mla.v_head_dim}
        if config.mla.q_lora_rank:
            dims.add(config.mla.q_lora_rank)
    else:
        dims.add(config.num_attention_heads * config.head_dim)
    return sorted(dims)


def resolve_block_size(spec: QuantSpec, dims: list[int], where: str) -> int | None:
    """The block the weights of ``dims`` (their input dimensions) get: ``--block-size`` when given, else the
    scheme's default, or the largest smaller block size that divides every dimension when the default does not.
    Raises ``QuantError`` when an explicit ``--block-size`` does not divide them all, or when no block size does."""
    block, scheme = spec.block, spec.scheme
    if block is None or not [d for d in dims if d % block]:
        return block
    fits = [b for b in sorted(BLOCK_SIZES, reverse=True) if all(d % b == 0 for d in dims)]
    bad = next(d for d in dims if d % block)
    if spec.block_size is not None or scheme is None:
        hint = f"use --block-size {fits[0]}" if fits else _no_block_fits(dims)
        raise QuantError(f"--block-size {block} does not divide the input dimension {bad} of {where} "
                         f"(input dimensions: {dims}); {hint}")
    smaller = [b for b in fits if b < block]
    if not smaller:
        raise QuantError(f"--quant {scheme.name} quantises in blocks along the input dimension, but neither its "
                         f"default block size {block} nor a smaller one down to {min(BLOCK_SIZES)} divides the input "
                         f"dimension {bad} of {where} (input dimensions: {dims}); {_no_block_fits(dims)}")
    return smaller[0]


def _no_block_fits(dims: list[int]) -> str:
    per_channel = [s.name for s in SCHEMES.values() if s.default_block is None]
    return (f"no block size from {min(BLOCK_SIZES)} to {max(BLOCK_SIZES)} divides them all: use a per-channel "
            f"scheme ({', '.join(per_channel)})")


def check_block_size(spec: QuantSpec, dims: list[int], where: str) -> None:
    """Refuse, before the export, a block size that cannot be used (see ``resolve_block_size``)."""
    resolve_block_size(spec, dims, where)


def resolved_spec(spec: QuantSpec, dims: list[int], where: str) -> QuantSpec:
    """``spec`` with the block ``resolve_block_size`` picks, warning when it is not the scheme's default."""
    block = resolve_block_size(spec, dims, where)
    if block == spec.block:
        return spec
    assert spec.scheme is not None
    log.warning("--quant %s: the default block size %d does not divide every input dimension of %s (%s); using "
                "block size %d, the largest that does (the manifest's quantization.block_size records it)",
                spec.scheme.name, spec.block, where, dims, block)
    return replace(spec, block_size=block)


def checkpoint_is_fp8(source_location: str) -> bool:
    """True when the source is an HF folder whose config.json declares FP8 weights."""
    config = Path(source_location) / "config.json"
    if not config.is_file():
        return False
    try:
        quant = json.loads(config.read_text()).get("quantization_config") or {}
    except (OSError, ValueError):
        return False
    return str(quant.get("quant_method", "")).lower() == "fp8"


def trt_weight_config(spec: QuantSpec, dims: list[int] | None = None, where: str = "the model") -> QuantConfig | None:
    """The TensorRT target's weight quantisation: symmetric weight-only Q/DQ (what strongly typed TensorRT takes;
    ``validate`` refused the rest). ``dims``: the input dimensions (``in_features``), to resolve the block size."""
    scheme = spec.scheme
    if scheme is None:
        return None
    if dims is not None:
        spec = resolved_spec(spec, dims, where)
    return QuantConfig(kind=scheme.weights, block_size=spec.block, head_kind=spec.head_kind)


@dataclass
class QuantPlan:
    """What the quantisation passes of one compile decide and hand each other, and the manifest summary."""

    spec: QuantSpec
    prompts: list[list[int]]
    fp8_source: bool = False
    targets: list[QuantTarget] = field(default_factory=list)
    heads: frozenset[str] = frozenset()  # LM head weight names, found before lowering renames the nodes' outputs
    chosen: frozenset[str] = frozenset()  # --keep-fp: the most sensitive weights
    sensitivity: list[dict[str, Any]] = field(default_factory=list)
    awq: dict[str, np.ndarray] = field(default_factory=dict)  # weight -> AWQ or SmoothQuant scales [K]
    alphas: dict[str, float] = field(default_factory=dict)
    activations: ActivationPlan | None = None
    activations_quantized: int = 0
    embedding: str = "fp32"  # the embedding lookup's table: fp32, or the LM head's codes (shared_embedding)
    fp32_kinds: list[str] = field(default_factory=list)  # weights kept fp32 beside the router (mHC, indexer)
    prepared: bool = False

    def prepare(self, model: ir.Model) -> None:
        """Find the quantisable weights (once, on the fp32 graph) and check the block size against them."""
        if self.prepared:
            return
        self.targets = quant_targets(model)
        self.fp32_kinds = always_fp32_weights(model)
        self.heads = frozenset(t.name for t in self.targets if t.is_lm_head)
        self.spec = resolved_spec(self.spec, sorted({t.in_features for t in self.targets}), "the weights")
        if self.fp8_source and self.kind != "fp8":
            log.warning("the checkpoint stores FP8 weights: they were dequantised to fp32 and are requantised to %s "
                        "(a second rounding); --quant fp8 keeps the checkpoint's FP8 values exactly", self.kind)
        self.prepared = True

    @property
    def kind(self) -> str:
        assert self.spec.scheme is not None
        return self.spec.scheme.weights

    @property
    def keep(self) -> frozenset[str]:
        """Weights left fp32: the sensitive ones, and the LM head under ``--lm-head fp32``."""
        return self.chosen | (self.heads if self.spec.head_kind == "fp32" else frozenset())

    @property
    def head_asymmetric(self) -> bool:
        """Asymmetric schemes keep an int8 head symmetric (blocks of 32 reproduce a GGUF Q8_0 tied embedding
        exactly; min-max blocks do not); an int4 head is min-max like the layers (symmetric int4 is far worse)."""
        assert self.spec.scheme is not None
        return self.spec.scheme.asymmetric and self.spec.head_kind == self.kind == "int4"

    def weight_config(self) -> QuantConfig:
        assert self.spec.scheme is not None
        return QuantConfig(kind=self.kind, block_size=self.spec.block, keep=self.keep, awq_scales=self.awq,
                           exact_fp8=self.fp8_source and self.kind == "fp8", head_kind=self.spec.head_kind,
                           asymmetric=self.spec.scheme.asymmetric, head_asymmetric=self.head_asymmetric)

    def summary(self) -> dict[str, Any]:
        """The manifest's ``quantization`` (scheme, blocks, per-weight precision)."""
        scheme = self.spec.scheme
        assert scheme is not None
        head_label = f"{self.spec.head_kind}-asym" if self.head_asymmetric else self.spec.head_kind
        keep = self.keep
        layers = [{"name": t.name, "label": t.label, "shape": list(t.shape),
                   "precision": "fp32" if t.name in keep else (head_label if t.name in self.heads else scheme.name),
                   **({"awq_alpha": self.alphas[t.name]} if t.name in self.alphas else {})} for t in self.targets]
        summary: dict[str, Any] = {
            "scheme": scheme.name, "weights": self.kind, "block_size": self.spec.block,
            "symmetric": not scheme.asymmetric, "accuracy_level": self.spec.level, "keep_fp": self.spec.keep_fp,
            **({"asym_offsets": self.spec.asym_offsets or "exact"} if scheme.asymmetric else {}),
            "lm_head": head_label, "calibration_prompts": len(self.prompts),
            "always_fp32": ["norms", "softmax", "router", *self.fp32_kinds,
                            *(["embedding lookup"] if self.embedding == "fp32" else [])],
            "embedding": self.embedding,
            "sensitivity": self.sensitivity, "layers": layers,
        }
        if self.activations is not None:
            summary["activations"] = self.activations.summary(self.activations_quantized)
            for layer, target in zip(layers, self.targets, strict=True):  # weight-only: MoE experts, --act-keep-fp32
                weight_only = target.routed_expert or target.label in self.activations.kept
                if layer["precision"] == scheme.name and weight_only:
                    layer["precision"] = self.kind
        return summary


@dataclass
class _PlannedPass:
    """A quantisation pass that reads and writes its compile's ``QuantPlan``."""

    plan: QuantPlan
    name: ClassVar[str] = ""

    def apply(self, model: ir.Model, ctx: PassContext) -> int:
        self.plan.prepare(model)
        return self.run(model, ctx)

    def run(self, model: ir.Model, ctx: PassContext) -> int:
        raise NotImplementedError


class WeightSensitivity(_PlannedPass):
    """``--keep-fp``: quantise one weight at a time on the calibration prompts; the most sensitive stay fp32."""

    name = "quant_sensitivity"

    def run(self, model: ir.Model, ctx: PassContext) -> int:
        plan = self.plan
        rows = measure(model, plan.prompts, plan.kind, plan.spec.block, ctx)
        plan.chosen = frozenset(r.name for r in choose_kept(rows, plan.spec.keep_fp))
        plan.sensitivity = [{"name": r.name, "label": r.label, "kl": r.kl} for r in rows]
        return len(rows)


class AwqScales(_PlannedPass):
    """``int4-awq``: per-input-channel scales for every 2D MatMul weight (routed experts stay RTN; the LM head is
    int8 under int4 schemes, which needs no AWQ)."""

    name = "quant_awq"

    def run(self, model: ir.Model, ctx: PassContext) -> int:
        plan = self.plan
        targets = [t for t in plan.targets if not t.routed_expert and not t.is_lm_head and t.name not in plan.chosen]
        names = {t.name: activation_name(t) for t in targets}
        runner = GraphRunner(model, extra_outputs=tuple(dict.fromkeys(names.values())), **runner_options(ctx))
        # Statistics without holding every activation row: counts and means first, then each target's seeded
        # sample of rows, gathered for a group of targets at a time (one more pass over the prompts per group).
        count, means = activation_totals(runner, plan.prompts)
        rng = np.random.default_rng(0)
        chosen = {t.name: rng.permutation(count[names[t.name]])[:AWQ_SAMPLE_ROWS] for t in targets}
        by_name = {t.name: t for t in targets}
        block = plan.spec.block
        assert block is not None, "AWQ schemes quantise in blocks"
        sample_bytes = {t.name: len(chosen[t.name]) * len(means[names[t.name]]) * 4 for t in targets}
        for group in fetch_groups(list(by_name), sample_bytes, AWQ_SAMPLE_BUDGET):
            samples = gather_rows(runner, {t: names[t] for t in group}, chosen, plan.prompts)
            for name in group:
                s, alpha = awq_search(weight_array(by_name[name]), samples.pop(name), means[names[name]], plan.kind,
                                      block)
                if alpha > 0:
                    plan.awq[name] = s
                plan.alphas[name] = alpha
        return len(plan.awq)


def activation_totals(runner: GraphRunner, prompts: list[list[int]]) -> tuple[dict[str, int], dict[str, np.ndarray]]:
    """Pass 1 of AWQ's statistics, per extra output of ``runner`` (an activation [.., K]): its number of rows over
    ``prompts`` and its mean |x| per channel [K] (summed in float64), holding one prompt's activations at a time."""
    inputs = list(runner.extra_outputs)
    count = dict.fromkeys(inputs, 0)
    total: dict[str, np.ndarray] = {}
    for ids in prompts:
        for name, value in zip(inputs, runner.run(ids)[1:], strict=True):
            x = np.abs(value.reshape(-1, value.shape[-1]))  # [rows, K]
            total[name] = total[name] + x.sum(0, dtype=np.float64) if name in total else x.sum(0, dtype=np.float64)
            count[name] += len(x)
    return count, {name: (total[name] / count[name]).astype(np.float32) for name in inputs}


def gather_rows(runner: GraphRunner, names: dict[str, str], chosen: dict[str, np.ndarray],
                prompts: list[list[int]]) -> dict[str, np.ndarray]:
    """Pass 2: per target (target -> the activation its MatMul reads), the rows ``chosen[target]`` (indices into
    all of the activation's rows over ``prompts``, in prompt order) in that order [len(chosen), K]; only these
    targets' activations are fetched."""
    extras = tuple(dict.fromkeys(names.values()))
    samples: dict[str, np.ndarray] = {}
    offset = dict.fromkeys(extras, 0)
    for ids in prompts:
        values = {name: v.reshape(-1, v.shape[-1]) for name, v in zip(extras, runner.run(ids, extras=extras)[1:],
                                                                        strict=True)}
        for target, x in names.items():
            block, rows = values[x], chosen[target]  # this prompt's rows are [offset, offset + len(block))
            if target not in samples:
                samples[target] = np.empty((len(rows), block.shape[1]), np.float32)
            here = (rows >= offset[x]) & (rows < offset[x] + len(block))
            samples[target][here] = block[rows[here] - offset[x]]
        for name in extras:
            offset[name] += len(values[name])
    return samples


class ActivationRanges(_PlannedPass):
    """w8a8: static activation ranges (and SmoothQuant scales) on the fp32 graph."""

    name = "quant_act_calibration"

    def run(self, model: ir.Model, ctx: PassContext) -> int:
        plan = self.plan
        spec = plan.spec.activation_spec()
        assert spec is not None
        plan.activations = ActivationPlan.calibrate(model, spec, plan.prompts, plan.keep, ctx)
        plan.awq = plan.activations.smoothing
        return len(plan.activations.amax)


class PlannedWeightQuantization(_PlannedPass):
    """``quant_weights`` with what the calibration passes decided."""

    name = WeightQuantization.name

    def run(self, model: ir.Model, ctx: PassContext) -> int:
        return WeightQuantization(self.plan.weight_config()).apply(model, ctx)


class PlannedSharedEmbedding(_PlannedPass):
    """``shared_embedding``, noting in the plan what the lookup reads."""

    name = SharedEmbedding.name

    def run(self, model: ir.Model, ctx: PassContext) -> int:
        matches = SharedEmbedding().apply(model, ctx)
        if matches:
            self.plan.embedding = f"{self.plan.spec.head_kind} (the LM head's codes, equal to the table)"
        return matches


class PlannedActivationQuantization(_PlannedPass):
    """``quant_activations`` with the calibrated scales."""

    name = ActivationQuantization.name

    def run(self, model: ir.Model, ctx: PassContext) -> int:
        activations = self.plan.activations
        assert activations is not None, "ActivationRanges runs first"
        matches = ActivationQuantization(activations.scales, activations.spec.dtype).apply(model, ctx)
        self.plan.activations_quantized = matches
        return matches


def quant_passes(spec: QuantSpec, prompts: list[list[int]], *,
                 fp8_source: bool = False) -> tuple[list[GraphPass], QuantPlan | None, CalibratedKVQuantization | None]:
    """The ONNX Runtime target's quantisation passes for ``spec`` in order (see the module docstring), the plan
    they share (None without weight quantisation) and the KV-cache pass (None without ``--kv-quant``), whose
    ``summary`` feeds the manifest. ``prompts``: the tokenised ``--calib`` prompts ([] without)."""
    passes: list[GraphPass] = []
    plan = None
    scheme = spec.scheme
    if scheme is not None:
        plan = QuantPlan(spec, prompts, fp8_source)
        if spec.keep_fp > 0:
            passes.append(WeightSensitivity(plan))
        if scheme.awq:
            passes.append(AwqScales(plan))
        if scheme.activations is not None:
            passes.append(ActivationRanges(plan))
        passes.append(PlannedWeightQuantization(plan))
        if scheme.activations is not None:
            passes.append(PlannedActivationQuantization(plan))
            if scheme.activations == "int8":  # exact re-encoding for ORT's non-saturating U8U8 kernel
                passes.append(OrtActivationLowering())
        passes.append(QuantLowering(spec.level, asym_offsets=spec.asym_offsets or "exact"))
        passes.append(SparseExperts(spec.level))
        passes.append(PlannedSharedEmbedding(plan))
    kv = CalibratedKVQuantization(prompts) if spec.kv_cache is not None else None
    if kv is not None:
        passes.append(kv)
    return passes, plan, kv
