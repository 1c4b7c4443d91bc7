"""``compile --quant``: options, checks, and the quantisation stages run after the ONNX Runtime pipeline.

Order: (calibration: AWQ activation statistics, per-weight sensitivity for ``--keep-fp``) on the fp32
graph -> ``quant_weights`` (portable Q/DQ) -> ``quant_lowering`` (MatMulNBits / QMoE). The manifest
records the precision and, per weight, what it became.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from moeforge.errors import MoeforgeError
from moeforge.graph_passes.base import PassContext, PassReport
from moeforge.graph_passes.quant_lowering import QuantLowering
from moeforge.graph_passes.quant_weights import QuantConfig, WeightQuantization, quant_targets

log = logging.getLogger(__name__)

# scheme -> (weight kind, default block size; None = per output channel)
SCHEMES: dict[str, tuple[str, int | None]] = {
    "int8": ("int8", None), "int8-asym": ("int8", 32), "int4": ("int4", 32), "int4-asym": ("int4", 32),
    "int4-awq": ("int4", 32),
    "fp8": ("fp8", 128),
    # static per-tensor activation scales too (moeforge/act_calibration.py): weights per channel
    "w8a8": ("int8", None), "w8a8-fp8": ("fp8", None),
}
NOT_BUILT: dict[str, str] = {}
LM_HEAD_KINDS = ("int8", "int4", "fp8", "fp32")
CALIBRATED_SCHEMES = ("int4-awq", "w8a8", "w8a8-fp8")  # run the graph on --calib (moeforge/calibration.py)
CALIB_MAX_TOKENS = 256  # per prompt
AWQ_SAMPLE_ROWS = 512  # activation rows kept per MatMul for the AWQ scale search


class QuantError(MoeforgeError):
    """Bad ``--quant`` / ``--block-size`` / ``--calib`` / ``--keep-fp`` / ``--kv-quant`` input."""


@dataclass(frozen=True)
class QuantOptions:
    scheme: str
    block_size: int | None = None
    calib: Path | None = None
    keep_fp: float = 0.0
    accuracy_level: int = 4  # MatMulNBits/QMoE: 4 = int8 activations inside the kernel (fast), 0 = fp32
    lm_head: str | None = None  # int8 | int4 | fp8 | fp32; None: int8 under int4 schemes, else the scheme's kind
    calib_method: str | None = None  # w8a8: minmax | percentile (moeforge/act_calibration.py)
    percentile: float | None = None
    smooth_alpha: float | None = None  # w8a8: SmoothQuant alpha (None: 0.5; 0: off)
    act_keep_fp32: str | None = None  # w8a8: comma-separated weight-label patterns (None: "down_proj")

    @property
    def kind(self) -> str:
        return SCHEMES[self.scheme][0]

    @property
    def asymmetric(self) -> bool:
        """int4-asym / int8-asym: min-max blocks with float offsets (ONNX Runtime only, not TensorRT)."""
        return self.scheme.endswith("-asym")

    @property
    def calibration_use(self) -> str | None:
        """What runs the graph on the --calib prompts: the scheme (int4-awq, w8a8, w8a8-fp8), --keep-fp, or None."""
        if self.scheme in CALIBRATED_SCHEMES:
            return self.scheme
        return "--keep-fp" if self.keep_fp > 0 else None

    @property
    def block(self) -> int | None:
        return self.block_size if self.block_size is not None else SCHEMES[self.scheme][1]


@dataclass
class QuantResult:
    precision: str
    reports: list[PassReport]
    summary: dict[str, Any] = field(default_factory=dict)  # manifest "quantization"


def validate(options: QuantOptions) -> None:
    """Checks that need no model (run before the expensive stages)."""
    if options.scheme in NOT_BUILT:
        raise QuantError(f"--quant {options.scheme}: {NOT_BUILT[options.scheme]}")
    if options.scheme not in SCHEMES:
        raise QuantError(f"--quant {options.scheme!r} is unknown; choose one of {', '.join(SCHEMES)}")
    from moeforge.act_calibration import check_options

    activations = check_options(options.scheme, options.calib_method, options.percentile, options.smooth_alpha,
                                options.act_keep_fp32)
    if activations is not None and options.block_size is not None:
        raise QuantError(f"--quant {options.scheme} keeps weights per output channel (the static-activation GEMMs, "
                         "ORT MatMulIntegerToFloat and TensorRT, take per-channel weight scales); drop --block-size")
    block = options.block_size
    if block is not None and (block < 16 or block > 256 or block & (block - 1)):
        raise QuantError(f"--block-size {block} must be a power of two from 16 to 256 (e.g. 32, 64, 128)")
    if options.lm_head is not None:
        if options.lm_head not in LM_HEAD_KINDS:
            raise QuantError(f"--lm-head {options.lm_head!r} is unknown; choose one of {', '.join(LM_HEAD_KINDS)}")
        if options.lm_head == "int4" and options.scheme.startswith("w8a8"):
            raise QuantError(f"--lm-head int4 is not available with --quant {options.scheme} (its weights are per "
                             "channel); use --lm-head int8 or fp32")
        if options.lm_head == "int4" and options.block is None:
            raise QuantError(f"--lm-head int4 needs blocks but --quant {options.scheme} is per channel: "
                             "add --block-size 32 (or 64, 128)")
    if options.accuracy_level not in (0, 1, 2, 3, 4):
        raise QuantError(f"--accuracy-level {options.accuracy_level} must be 0 (fp32), 1 (fp32), 2 (fp16), 3 (bf16) "
                         "or 4 (int8): MatMulNBits' compute type for the activations")
    if not 0.0 <= options.keep_fp < 1.0:
        raise QuantError(f"--keep-fp {options.keep_fp} must be a fraction in [0, 1)")
    what = options.calibration_use
    if what is not None and options.calib is None:
        raise QuantError(f"{what} needs calibration prompts: pass --calib FILE (one prompt per line)")
    if options.calib is not None:
        from moeforge.calibration import read_prompts

        read_prompts(options.calib)  # missing / empty file -> CalibrationError now, not after the export


def in_features(config) -> list[int]:  # type: ignore[no-untyped-def]
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


def check_block_size(options: QuantOptions, dims: list[int], where: str) -> None:
    """Refuse a block size that does not divide every input dimension, suggesting one that does."""
    block = options.block
    bad = [d for d in dims if block is not None and d % block]
    if bad:
        fits = [b for b in (256, 128, 64, 32, 16) if all(d % b == 0 for d in dims)]
        hint = f"use --block-size {fits[0]}" if fits else "no block size from 16 to 256 divides them all"
        raise QuantError(f"--block-size {block} does not divide the input dimension {bad[0]} of {where} "
                         f"(input dimensions: {dims}); {hint}")


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


def quantize_model(model: ir.Model, ctx: PassContext, options: QuantOptions, tokenizer=None,  # type: ignore[no-untyped-def]
                   fp8_source: bool = False) -> QuantResult:
    """Quantise the ORT-pipeline graph in place; returns the pass reports and the manifest summary."""
    import time

    kind, block = options.kind, options.block
    targets = quant_targets(model)
    heads = {t.name for t in targets if t.is_lm_head}  # before lowering renames the nodes' outputs
    check_block_size(options, sorted({t.in_features for t in targets}), "a weight")
    if fp8_source and kind != "fp8":
        log.warning("the checkpoint stores FP8 weights: they were dequantised to fp32 and are requantised to %s "
                    "(a second rounding); --quant fp8 keeps the checkpoint's FP8 values exactly", kind)
    reports: list[PassReport] = []
    prompts: list[list[int]] = []
    if options.calib is not None:
        from moeforge.calibration import read_prompts, tokenize_prompts

        prompts = tokenize_prompts(read_prompts(options.calib), tokenizer, min(CALIB_MAX_TOKENS, ctx.max_seq_len))
    start = time.perf_counter()
    kept: list[dict[str, Any]] = []
    keep_names: frozenset[str] = frozenset()
    if options.keep_fp > 0:
        from moeforge.sensitivity import choose_kept, measure

        rows = measure(model, prompts, kind, block)
        chosen = choose_kept(rows, options.keep_fp)
        keep_names = frozenset(r.name for r in chosen)
        kept = [{"name": r.name, "label": r.label, "kl": r.kl} for r in rows]
        reports.append(PassReport("quant_sensitivity", len(rows), time.perf_counter() - start))
    awq: dict[str, np.ndarray] = {}
    alphas: dict[str, float] = {}
    if options.scheme == "int4-awq":
        start = time.perf_counter()
        awq, alphas = _awq_scales(model, prompts, kind, block, keep_names)
        reports.append(PassReport("quant_awq", len(awq), time.perf_counter() - start))
    # int4 schemes keep the LM head at int8 (same blocks), as llama.cpp keeps output.weight at 6-8 bits:
    # on SmolLM2 an int4 head alone costs more top-1 agreement than all int4 decoder layers together.
    # --lm-head int4 trades that for speed (the head is ~20% of SmolLM2's weights).
    head_kind = options.lm_head or ("int8" if kind == "int4" else kind)
    if head_kind == "fp32":
        keep_names = keep_names | heads
    # Asymmetric schemes keep an int8 head symmetric (blocks of 32 reproduce a GGUF Q8_0 tied embedding
    # exactly; min-max blocks do not); an int4 head is min-max like the layers (symmetric int4 is far worse).
    head_asym = options.asymmetric and head_kind == kind == "int4"
    head_label = f"{head_kind}-asym" if head_asym else head_kind
    act_passes: list = []  # type: ignore[type-arg]
    act_plan = None
    if options.scheme in ("w8a8", "w8a8-fp8"):  # static activation ranges, on the fp32 graph
        from moeforge.act_calibration import ActivationPlan, check_options

        start = time.perf_counter()
        spec = check_options(options.scheme, options.calib_method, options.percentile, options.smooth_alpha,
                             options.act_keep_fp32)
        assert spec is not None
        act_plan = ActivationPlan.calibrate(model, spec, prompts, keep_names)
        act_passes, awq = act_plan.passes(), act_plan.smoothing
        reports.append(PassReport("quant_act_calibration", len(act_plan.amax), time.perf_counter() - start))
    config = QuantConfig(kind=kind, block_size=block, keep=keep_names, awq_scales=awq,
                         exact_fp8=fp8_source and kind == "fp8", head_kind=head_kind,
                         asymmetric=options.asymmetric, head_asymmetric=head_asym)
    for graph_pass in (WeightQuantization(config), *act_passes, QuantLowering(options.accuracy_level)):
        start = time.perf_counter()
        matches = graph_pass.apply(model, ctx)
        reports.append(PassReport(graph_pass.name, matches, time.perf_counter() - start))
    layers = [{"name": t.name, "label": t.label, "shape": list(t.shape),
               "precision": "fp32" if t.name in keep_names else (head_label if t.name in heads else options.scheme),
               **({"awq_alpha": alphas[t.name]} if t.name in alphas else {})} for t in targets]
    summary = {
        "scheme": options.scheme, "weights": kind, "block_size": block, "symmetric": not options.asymmetric,
        "accuracy_level": options.accuracy_level, "keep_fp": options.keep_fp, "lm_head": head_label,
        "calibration_prompts": len(prompts), "always_fp32": ["norms", "softmax", "router", "embedding lookup"],
        "sensitivity": kept, "layers": layers,
    }
    if act_plan is not None:
        summary["activations"] = act_plan.summary(next(r.matches for r in reports if r.name == "quant_activations"))
        for layer, target in zip(layers, targets, strict=True):  # weight-only: MoE experts, --act-keep-fp32
            if layer["precision"] == options.scheme and (target.is_moe or target.label in act_plan.kept):
                layer["precision"] = kind
    return QuantResult(options.scheme, reports, summary)


def _awq_scales(model: ir.Model, prompts: list[list[int]], kind: str, block: int | None,
                skip: frozenset[str]) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """AWQ per-input-channel scales for every 2D MatMul weight (MoE experts stay RTN)."""
    from moeforge.calibration import GraphRunner
    from moeforge.graph_passes.quant_math import awq_search

    # MoE experts stay RTN; the LM head is int8 under int4 schemes, which needs no AWQ.
    targets = [t for t in quant_targets(model) if not t.is_moe and not t.is_lm_head and t.name not in skip]
    inputs = tuple(dict.fromkeys(t.node.inputs[0].name for t in targets))
    runner = GraphRunner(model, extra_outputs=inputs)
    rows: dict[str, list[np.ndarray]] = {name: [] for name in inputs}
    for ids in prompts:
        for name, value in zip(inputs, runner.run(ids)[1:], strict=True):
            rows[name].append(value.reshape(-1, value.shape[-1]))
    rng = np.random.default_rng(0)
    scales, alphas = {}, {}
    for target in targets:
        x = np.concatenate(rows[target.node.inputs[0].name])
        sample = x[rng.permutation(len(x))[:AWQ_SAMPLE_ROWS]]
        weight = target.node.inputs[1].const_value.numpy()
        s, alpha = awq_search(weight, sample, np.abs(x).mean(0), kind, block)
        if alpha > 0:
            scales[target.name] = s
        alphas[target.name] = alpha
    return scales, alphas
