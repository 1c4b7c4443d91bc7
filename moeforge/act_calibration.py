"""Static activation ranges for ``--quant w8a8`` / ``w8a8-fp8``: calibration and the options that steer it.

The fp32 graph (before any weight is quantised) runs every ``--calib`` prompt through ONNX Runtime
(``GraphRunner``) and returns the activation input ``x`` of each MatMul that will get static Q/DQ. Per
tensor, one range ``amax`` of |x| over all prompts, tokens and channels:

- ``minmax``: max |x| (nothing is ever clipped; one outlier stretches the step for everything else);
- ``percentile``: the ``P``-th percentile of |x| (default 99.99; values above it are clipped).

Symmetric per-tensor scale: int8 ``amax / 127``, float8 e4m3fn ``amax / 448`` (zero point 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from moeforge.errors import MoeforgeError
from moeforge.graph_passes.quant_math import FP8_MAX

METHODS = ("minmax", "percentile")
DEFAULT_METHOD = "minmax"
DEFAULT_PERCENTILE = 99.99
QMAX = {"int8": 127.0, "fp8": FP8_MAX}  # activation dtype -> largest code magnitude
ACT_DTYPE = {"w8a8": "int8", "w8a8-fp8": "fp8"}  # --quant scheme -> activation dtype


class ActivationCalibrationError(MoeforgeError):
    """Bad ``--calib-method`` / ``--percentile`` input, or nothing to calibrate."""


@dataclass(frozen=True)
class ActivationSpec:
    """How activations are quantised: ``dtype`` int8 | fp8, ``method`` minmax | percentile."""

    dtype: str
    method: str = DEFAULT_METHOD
    percentile: float = DEFAULT_PERCENTILE

    def scale(self, amax: float) -> float:
        """Symmetric per-tensor scale; an all-zero tensor gets 1 (its codes are 0 either way)."""
        return float(amax) / QMAX[self.dtype] if amax > 0 else 1.0


def check_options(scheme: str, method: str | None, percentile: float | None) -> ActivationSpec | None:
    """Validate ``--calib-method`` / ``--percentile`` for ``--quant scheme``; the spec for w8a8 schemes."""
    if scheme not in ACT_DTYPE:
        for flag, value in (("--calib-method", method), ("--percentile", percentile)):
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
    return ActivationSpec(ACT_DTYPE[scheme], method, p)


def amax_of(values: np.ndarray, method: str, percentile: float = DEFAULT_PERCENTILE) -> float:
    """The range of |values|: the max (``minmax``) or the ``percentile``-th percentile (linear interpolation)."""
    a = np.abs(np.asarray(values, np.float32)).ravel()
    if a.size == 0:
        raise ActivationCalibrationError("no activation values to calibrate on")
    if method == "minmax" or percentile >= 100.0:
        return float(a.max())
    return float(np.percentile(a, percentile))


def calibrate(model: ir.Model, names: list[str], prompts: list[list[int]],
              spec: ActivationSpec) -> dict[str, float]:
    """Run the fp32 ``model`` on ``prompts``; per-tensor ``amax`` of each value in ``names``."""
    from moeforge.calibration import GraphRunner

    if not prompts:
        raise ActivationCalibrationError("static activation scales need calibration prompts: pass --calib FILE")
    names = list(dict.fromkeys(names))
    runner = GraphRunner(model, extra_outputs=tuple(names))
    # Per tensor: all |x| values for a percentile ([prompts x tokens x K] float32: ~2 MB per tensor for
    # SmolLM2 on 10 prompts), or one running max for min-max.
    values: dict[str, list[np.ndarray]] = {name: [] for name in names}
    running = dict.fromkeys(names, 0.0)
    for ids in prompts:
        for name, value in zip(names, runner.run(ids)[1:], strict=True):
            if spec.method == "minmax":
                running[name] = max(running[name], float(np.abs(value).max()))
            else:
                values[name].append(np.abs(value).ravel())
    if spec.method == "minmax":
        return running
    return {name: amax_of(np.concatenate(parts), spec.method, spec.percentile) for name, parts in values.items()}


@dataclass
class ActivationPlan:
    """Calibrated ranges for one model, the passes that apply them and the manifest summary."""

    spec: ActivationSpec
    amax: dict[str, float]  # activation value name -> calibrated range

    @classmethod
    def calibrate(cls, model: ir.Model, spec: ActivationSpec, prompts: list[list[int]],
                  keep: frozenset[str] = frozenset()) -> ActivationPlan:
        """Ranges of every MatMul activation that will get Q/DQ (run on the fp32 ``model``, before weights are
        quantised): MatMul weights that will be quantised, except the LM head, the router and MoE experts."""
        from moeforge.graph_passes.quant_weights import quant_targets

        targets = [t for t in quant_targets(model) if not t.is_moe and not t.is_lm_head and t.name not in keep]
        names = [t.node.inputs[0].name for t in targets if t.node.inputs[0].name]
        if not names:
            raise ActivationCalibrationError("the model has no MatMul whose activations can be quantised")
        return cls(spec, calibrate(model, names, prompts, spec))

    @property
    def scales(self) -> dict[str, float]:
        return {name: self.spec.scale(amax) for name, amax in self.amax.items()}

    def passes(self) -> list:  # type: ignore[type-arg]
        """Graph passes to run after the weights' Q/DQ and before ``QuantLowering``."""
        from moeforge.graph_passes.quant_activations import ActivationQuantization, OrtActivationLowering

        passes: list = [ActivationQuantization(self.scales, self.spec.dtype)]  # type: ignore[type-arg]
        if self.spec.dtype == "int8":  # exact re-encoding for ORT's non-saturating U8U8 kernel
            passes.append(OrtActivationLowering())
        return passes

    def summary(self, quantized: int) -> dict[str, object]:
        """The manifest's ``quantization.activations``."""
        scales = self.scales
        return {
            "dtype": self.spec.dtype, "granularity": "per-tensor, symmetric (zero point 0)",
            "method": self.spec.method,
            "percentile": self.spec.percentile if self.spec.method == "percentile" else None,
            "tensors": quantized, "scale_range": [min(scales.values()), max(scales.values())],
            "scales": scales,
            "weight_only": ["lm_head (int8 weights: MatMulNBits)" if self.spec.dtype == "int8" else "lm_head",
                            "moe_experts (com.microsoft.MoE/QMoE take no quantised activations)"],
            "onnxruntime_cpu": ("MatMulIntegerToFloat (uint8 x uint8, zero point 128), fused by ONNX Runtime at "
                                "session load from the Q/DQ pairs" if self.spec.dtype == "int8" else
                                "float8e4m3fn QuantizeLinear/DequantizeLinear + fp32 MatMul (fake quantisation: "
                                "ORT CPU has no fp8 GEMM)"),
        }
