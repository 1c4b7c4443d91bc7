"""Static activation ranges for ``--quant w8a8`` / ``w8a8-fp8``: calibration and the options that steer it.

The fp32 graph (before any weight is quantised) runs every ``--calib`` prompt through ONNX Runtime
(``GraphRunner``) and returns the activation input ``x`` of each MatMul that will get static Q/DQ. Per
tensor, one range ``amax`` of |x| over all prompts, tokens and channels:

- ``minmax``: max |x| (nothing is ever clipped; one outlier stretches the step for everything else);
- ``percentile``: the ``P``-th percentile of |x| (default 99.99; values above it are clipped).

Symmetric per-tensor scale: int8 ``amax / 127``, float8 e4m3fn ``amax / 448`` (zero point 0).

SmoothQuant (``--smooth-alpha``, int8 default 0.5, fp8 default off; Xiao et al. 2023): per input channel j,
``s_j = max|x_j|^alpha / max_n |W_jn|^(1 - alpha)`` (normalised so sqrt(max s * min s) = 1); the weight rows
are multiplied by s before quantising and a ``Mul(x, 1/s)`` feeds the Q/DQ (the AWQ hook of
``quant_weights``), so channel outliers move from the activation into the per-channel weight scales. The range
is then taken over x / s. MatMuls whose weight label contains a ``--act-keep-fp32`` pattern (int8 default
``down_proj``, the MLP output projection, where the "massive activations" of Llama-family models sit -- on
SmolLM2 max |x| reaches 3034 at the first token while its 99.99th percentile is 12; fp8 default none) keep
fp32 activations and their quantised weights (int8: lowered to MatMulNBits like ``--quant int8``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from moeforge.core.errors import MoeforgeError
from moeforge.passes.base import PassContext
from moeforge.passes.quant_math import FP8_MAX
from moeforge.passes.quant_weights import QuantTarget, quant_targets
from moeforge.quant.calibration import GraphRunner, runner_options
from moeforge.quant.schemes import SCHEMES

METHODS = ("minmax", "percentile")
DEFAULT_METHOD = "minmax"
DEFAULT_PERCENTILE = 99.99
DEFAULT_ALPHA = 0.5
DEFAULT_KEEP = ("down_proj",)
QMAX = {"int8": 127.0, "fp8": FP8_MAX}  # activation dtype -> largest code magnitude


class ActivationCalibrationError(MoeforgeError):
    """Bad ``--calib-method`` / ``--percentile`` input, or nothing to calibrate."""


@dataclass(frozen=True)
class ActivationSpec:
    """How activations are quantised: ``dtype`` int8 | fp8, ``method`` minmax | percentile, SmoothQuant
    ``alpha`` (None: no smoothing), and the weight-label patterns whose MatMuls keep fp32 activations."""

    dtype: str
    method: str = DEFAULT_METHOD
    percentile: float = DEFAULT_PERCENTILE
    alpha: float | None = None
    keep: tuple[str, ...] = ()

    def scale(self, amax: float) -> float:
        """Symmetric per-tensor scale; an all-zero tensor gets 1 (its codes are 0 either way)."""
        return float(amax) / QMAX[self.dtype] if amax > 0 else 1.0

    def keeps(self, label: str) -> bool:
        return any(pattern in label for pattern in self.keep)


def check_options(scheme: str, method: str | None, percentile: float | None, alpha: float | None = None,
                  keep: str | None = None) -> ActivationSpec | None:
    """Validate ``--calib-method`` / ``--percentile`` / ``--smooth-alpha`` / ``--act-keep-fp32`` for ``--quant
    scheme``; the spec for w8a8 schemes (defaults: minmax; int8: SmoothQuant alpha 0.5, down_proj kept fp32;
    fp8: neither)."""
    flags = (("--calib-method", method), ("--percentile", percentile), ("--smooth-alpha", alpha),
             ("--act-keep-fp32", keep))
    dtype = SCHEMES[scheme].activations if scheme in SCHEMES else None
    if dtype is None:
        for flag, value in flags:
            if value is not None:
                raise ActivationCalibrationError(
                    f"{flag} sets static activation scales, which only --quant w8a8 / w8a8-fp8 use "
                    f"(--quant {scheme} quantises weights only); drop {flag} or use --quant w8a8")
        return None
    method = method or DEFAULT_METHOD
    if method not in METHODS:
        raise ActivationCalibrationError(f"--calib-method {method!r} is unknown; choose one of {', '.join(METHODS)}")
    if percentile is not None and method != "percentile":
        raise ActivationCalibrationError("--percentile needs --calib-method percentile")
    p = DEFAULT_PERCENTILE if percentile is None else float(percentile)
    if not 50.0 < p <= 100.0:
        raise ActivationCalibrationError(f"--percentile {p:g} must be in (50, 100], e.g. 99.99 (100 = min-max)")
    # float8's exponent already spans SmolLM2's outliers: there smoothing and fp32 down_proj measured no better
    a = (DEFAULT_ALPHA if dtype == "int8" else 0.0) if alpha is None else float(alpha)
    if not 0.0 <= a <= 1.0:
        raise ActivationCalibrationError(f"--smooth-alpha {a:g} must be in [0, 1] (0 turns SmoothQuant off; "
                                         f"default {DEFAULT_ALPHA})")
    patterns: tuple[str, ...]
    if keep is None:
        patterns = DEFAULT_KEEP if dtype == "int8" else ()
    else:
        patterns = tuple(k.strip() for k in keep.split(",") if k.strip())
    return ActivationSpec(dtype, method, p, a or None, patterns)


FETCH_BUDGET = 256 * 2**20  # bytes of activations one calibration run returns (more: another run per group)


class _Activations:
    """The fp32 ``model`` in an ONNX Runtime session returning the values ``names``; ``rows()`` yields batches of
    name -> rows [tokens, K], each name once per prompt. Calibration streams over them: memory grows neither with the
    prompts nor with the layers, as a run returns a group of the values at most ``budget`` bytes for the longest
    prompt (every MatMul input of a 61-layer model for 256 tokens would be ~2.7 GB), one more run per group. The
    statistics taken from them (max, count, the largest values) do not depend on the batches' order."""

    def __init__(self, model: ir.Model, names: list[str], prompts: list[list[int]],
                 ctx: PassContext | None = None, budget: int | None = None) -> None:
        if not prompts:
            raise ActivationCalibrationError("static activation scales need calibration prompts: pass --calib FILE")
        self.names, self.prompts = list(dict.fromkeys(names)), prompts
        self.runner = GraphRunner(model, extra_outputs=tuple(self.names), **runner_options(ctx))
        longest = max(len(ids) for ids in prompts)
        widths = _widths(model, set(self.names))
        # A value without a static width counts as the widest known one (or one channel).
        default = max(widths.values(), default=1)
        self.groups = fetch_groups(self.names, {n: longest * widths.get(n, default) * 4 for n in self.names},
                                   FETCH_BUDGET if budget is None else budget)

    def rows(self) -> Iterator[dict[str, np.ndarray]]:
        for group in self.groups:
            for ids in self.prompts:
                outputs = self.runner.run(ids, extras=group)[1:]
                yield {name: v.reshape(-1, v.shape[-1]) for name, v in zip(group, outputs, strict=True)}


    def channel_max(self) -> tuple[dict[str, np.ndarray], dict[str, int]]:
        """Pass 1: max |x_j| per channel [K] and the number of values, per name."""
        cmax: dict[str, np.ndarray] = {}
        count = dict.fromkeys(self.names, 0)
        for batch in self.rows():
            for name, x in batch.items():
                m = np.abs(x).max(0)
                cmax[name] = np.maximum(cmax[name], m) if name in cmax else m
                count[name] += x.size
        return cmax, count

    def percentiles(self, keys: dict[str, tuple[str, np.ndarray | None]], count: dict[str, int],
                    percentile: float) -> dict[str, float]:
        """Pass 2: the exact ``percentile`` of |x / divisor| per key (key -> (name, divisor [K] or None)), keeping
        only each tensor's largest ``(1 - p/100) * n + 2`` values (np.percentile's linear interpolation)."""
        need = {key: top_count(count[name], percentile) for key, (name, _) in keys.items()}
        top: dict[str, np.ndarray] = {key: np.empty(0, np.float32) for key in keys}
        for batch in self.rows():
            for key, (name, divisor) in keys.items():
                if name not in batch:  # fetched in another group's runs
                    continue
                x = batch[name] if divisor is None else batch[name] / divisor
                values = np.concatenate([top[key], np.abs(x).ravel()])
                if len(values) > need[key]:
                    values = np.partition(values, len(values) - need[key])[len(values) - need[key]:]
                top[key] = values
        return {key: percentile_from_top(np.sort(top[key]), count[name], percentile)
                for key, (name, _) in keys.items()}


def fetch_groups(names: list[str], sizes: dict[str, int], budget: int) -> list[tuple[str, ...]]:
    """``names`` in order, cut into groups of at most ``budget`` bytes (``sizes``; a name alone may exceed it)."""
    groups: list[list[str]] = [[]]
    used = 0
    for name in names:
        if groups[-1] and used + sizes[name] > budget:
            groups.append([])
            used = 0
        groups[-1].append(name)
        used += sizes[name]
    return [tuple(g) for g in groups if g]


def _widths(model: ir.Model, names: set[str]) -> dict[str, int]:
    """The last dimension of each value in ``names`` that has a static one."""
    out = {}
    for node in model.graph:
        for value in node.outputs:
            if value.name in names and value.shape is not None and len(value.shape):
                last = value.shape[-1]
                if isinstance(last, int):
                    out[value.name] = last
    return out


def top_count(n: int, percentile: float) -> int:
    return min(n, n - int(np.floor((n - 1) * percentile / 100.0)) + 1)


def percentile_from_top(top: np.ndarray, n: int, percentile: float) -> float:
    """np.percentile(values, p) from the ascending largest ``len(top)`` of ``n`` values."""
    h = (n - 1) * percentile / 100.0
    lo, hi = int(np.floor(h)), int(np.ceil(h))
    first = n - len(top)  # rank of top[0] among all n values
    v_lo, v_hi = float(top[lo - first]), float(top[hi - first])
    return v_lo + (h - lo) * (v_hi - v_lo)


def calibrate(model: ir.Model, names: list[str], prompts: list[list[int]],
              spec: ActivationSpec, ctx: PassContext | None = None) -> dict[str, float]:
    """Per-tensor ``amax`` of each value in ``names`` over ``prompts`` (no smoothing)."""
    acts = _Activations(model, names, prompts, ctx)
    cmax, count = acts.channel_max()
    if spec.method == "minmax" or spec.percentile >= 100.0:
        return {name: float(cmax[name].max()) for name in acts.names}
    return acts.percentiles({name: (name, None) for name in acts.names}, count, spec.percentile)


def activation_name(target: QuantTarget) -> str:
    """The name of the activation a quantisable MatMul reads ("" if it has none)."""
    x = target.node.inputs[0]
    return x.name or "" if x is not None else ""


def weight_array(target: QuantTarget) -> np.ndarray:
    """The constant weight of a quantisable node (``quant_targets`` only yields constants)."""
    value = target.node.inputs[target.index]
    assert value is not None and value.const_value is not None, f"{target.name} is not a constant"
    return value.const_value.numpy()


def smooth_scales(channel_max: np.ndarray, weight: np.ndarray, alpha: float) -> np.ndarray:
    """SmoothQuant s [K] from max |x_j| [K] and the weight [K, N] (see the module docstring)."""
    cx = np.maximum(channel_max, 1e-5).astype(np.float64)
    cw = np.maximum(np.abs(weight).max(1), 1e-5).astype(np.float64)
    s = cx ** alpha / cw ** (1.0 - alpha)
    out: np.ndarray = (s / np.sqrt(s.max() * s.min())).astype(np.float32)
    return out


@dataclass
class ActivationPlan:
    """Calibrated ranges for one model, the passes that apply them and the manifest summary."""

    spec: ActivationSpec
    amax: dict[str, float]  # name of the value QuantizeLinear reads (x, or the smoothed ``<weight>.awq_input``)
    smoothing: dict[str, np.ndarray] = field(default_factory=dict)  # weight name -> SmoothQuant s [K]
    kept: list[str] = field(default_factory=list)  # labels of MatMuls whose activations stay fp32

    @classmethod
    def calibrate(cls, model: ir.Model, spec: ActivationSpec, prompts: list[list[int]],
                  keep: frozenset[str] = frozenset(), ctx: PassContext | None = None) -> ActivationPlan:
        """Ranges (and SmoothQuant scales) of every MatMul activation that will get Q/DQ, on the fp32 ``model``
        before weights are quantised: quantised MatMul weights except the LM head, the router, MoE experts,
        ``keep`` (``--keep-fp``) and labels matching ``spec.keep``."""
        candidates = [t for t in quant_targets(model)
                      if not t.routed_expert and not t.is_lm_head and t.name not in keep]
        targets = [(t, x) for t in candidates if not spec.keeps(t.label) and (x := activation_name(t))]
        if not targets:
            raise ActivationCalibrationError("the model has no MatMul whose activations can be quantised")
        acts = _Activations(model, [x for _, x in targets], prompts, ctx)
        cmax, count = acts.channel_max()
        plan = cls(spec, {}, kept=[t.label for t in candidates if spec.keeps(t.label)])
        keys: dict[str, tuple[str, np.ndarray | None]] = {}  # Q input name -> (activation, divisor s)
        for t, x in targets:
            if spec.alpha is None:
                keys[x] = (x, None)
            else:
                s = smooth_scales(cmax[x], weight_array(t), spec.alpha)
                plan.smoothing[t.name] = s
                keys[f"{t.name}.awq_input"] = (x, s)
        if spec.method == "minmax" or spec.percentile >= 100.0:  # max |x_j / s_j| needs no second pass
            plan.amax = {key: float((cmax[x] if s is None else cmax[x] / s).max()) for key, (x, s) in keys.items()}
        else:
            plan.amax = acts.percentiles(keys, count, spec.percentile)
        return plan

    @property
    def scales(self) -> dict[str, float]:
        return {name: self.spec.scale(amax) for name, amax in self.amax.items()}

    def summary(self, quantized: int) -> dict[str, object]:
        """The manifest's ``quantization.activations``."""
        scales = self.scales
        int8 = self.spec.dtype == "int8"
        return {
            "dtype": self.spec.dtype, "granularity": "per-tensor, symmetric (zero point 0)",
            "method": self.spec.method,
            "percentile": self.spec.percentile if self.spec.method == "percentile" else None,
            "smoothquant_alpha": self.spec.alpha,
            "tensors": quantized, "scale_range": [min(scales.values()), max(scales.values())],
            "scales": scales,
            "fp32_activations": {
                "patterns": list(self.spec.keep), "layers": self.kept,
                "always": ["lm_head", "router", "moe_experts (com.microsoft.MoE/QMoE take no quantised activations; "
                           "DeepSeek-V4's per-expert MatMuls alike: a prompt set need not reach every expert)"],
                "weights": "int8 per channel (MatMulNBits)" if int8 else "fp8 per channel"},
            "onnxruntime_cpu": ("MatMulIntegerToFloat (uint8 x uint8, zero point 128), fused by ONNX Runtime at "
                                "session load from the Q/DQ pairs" if int8 else
                                "float8e4m3fn QuantizeLinear/DequantizeLinear + fp32 MatMul (fake quantisation: "
                                "ORT CPU has no fp8 GEMM)"),
        }
