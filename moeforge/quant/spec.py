"""What to quantise (``QuantSpec``: weights, activations, LM head, KV cache) and the one place that checks it
(``validate``) against the target and the KV-cache layout, before any expensive stage runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from moeforge.core.errors import MoeforgeError
from moeforge.quant.act_calibration import ActivationSpec, check_options
from moeforge.quant.calibration import read_prompts
from moeforge.quant.schemes import (
    ACCURACY_LEVELS,
    ASYM_OFFSETS,
    DEFAULT_ACCURACY_LEVEL,
    KV_CHOICES,
    KV_SCHEMES,
    LM_HEAD_KINDS,
    SCHEMES,
    Scheme,
)

BLOCK_SIZES = (16, 32, 64, 128, 256)
ACTIVATION_FLAGS = ("--calib-method", "--percentile", "--smooth-alpha", "--act-keep-fp32")


class QuantError(MoeforgeError):
    """Bad ``--quant`` / ``--block-size`` / ``--calib`` / ``--keep-fp`` / ``--lm-head`` input."""


class KVQuantError(QuantError):
    """Bad ``--kv-quant`` input."""


@dataclass(frozen=True)
class ActivationOptions:
    """w8a8's static activation scales (``moeforge/quant/act_calibration.py``); None: the scheme's default."""

    method: str | None = None  # minmax | percentile
    percentile: float | None = None
    smooth_alpha: float | None = None  # SmoothQuant alpha (0: off)
    keep_fp32: str | None = None  # comma-separated weight-label patterns whose activations stay fp32

    def flags(self) -> dict[str, object]:
        return {"--calib-method": self.method, "--percentile": self.percentile,
                "--smooth-alpha": self.smooth_alpha, "--act-keep-fp32": self.keep_fp32}


@dataclass(frozen=True)
class QuantSpec:
    """Everything ``compile`` quantises. ``weights``: a ``SCHEMES`` name (None: fp32 weights); ``kv_cache``: a
    ``KV_SCHEMES`` name (None: the cache keeps the activations' type); ``calib``: calibration prompts, one per
    line, for calibrated schemes, ``--keep-fp`` and the KV scales."""

    weights: str | None = None
    block_size: int | None = None
    lm_head: str | None = None  # int8 | int4 | fp8 | fp32; None: the scheme's ``lm_head_default``
    accuracy_level: int | None = None  # None: DEFAULT_ACCURACY_LEVEL
    asym_offsets: str | None = None  # exact | digit (ASYM_OFFSETS); None: exact
    keep_fp: float = 0.0  # fraction of weights, the most sensitive on --calib, kept fp32
    activations: ActivationOptions = field(default_factory=ActivationOptions)
    kv_cache: str | None = None
    calib: Path | None = None

    @property
    def scheme(self) -> Scheme | None:
        return SCHEMES[self.weights] if self.weights is not None else None

    @property
    def block(self) -> int | None:
        """Block along the input dimension (None: per output channel)."""
        scheme = self.scheme
        return self.block_size if self.block_size is not None else (scheme.default_block if scheme else None)

    @property
    def level(self) -> int:
        return DEFAULT_ACCURACY_LEVEL if self.accuracy_level is None else self.accuracy_level

    @property
    def head_kind(self) -> str:
        assert self.scheme is not None
        return self.lm_head or self.scheme.lm_head_default

    @property
    def calibration_use(self) -> str | None:
        """What runs the graph on the --calib prompts for the weights: the scheme, --keep-fp, or None."""
        if self.scheme is not None and self.scheme.calibrated:
            return self.scheme.name
        return "--keep-fp" if self.keep_fp > 0 else None

    def activation_spec(self) -> ActivationSpec | None:
        """The resolved static-activation choices of a w8a8 scheme (None for weight-only schemes)."""
        a = self.activations
        return check_options(self.weights or "fp32", a.method, a.percentile, a.smooth_alpha, a.keep_fp32)


def validate(spec: QuantSpec, *, target: str, kv_cache: str, kv_layout: str | None = None) -> None:
    """Refuse every combination that cannot be built, naming the problem and the fix. Needs no model: run it
    before the expensive stages. ``target``: ort | trt; ``kv_cache``: contiguous | paged; ``kv_layout``: the model's
    cache layout (``core.kv_layout.KVLayout``, from its config) where the caller knows it, None where not."""
    scheme = spec.scheme if spec.weights in SCHEMES else None
    if spec.weights is not None and scheme is None:
        raise QuantError(f"--quant {spec.weights!r} is unknown; choose one of {', '.join(SCHEMES)}")
    if scheme is None:
        _refuse_weight_flags_without_scheme(spec)
    else:
        _check_weights(spec, scheme, target)
    if spec.kv_cache is not None:
        _check_kv_cache(spec, target=target, paged=kv_cache == "paged", kv_layout=kv_layout)
    what = spec.calibration_use
    if what is not None and kv_cache == "paged":
        what = what if what == "--keep-fp" else f"--quant {what}"
        raise QuantError(f"{what} calibrates on the contiguous-cache graph, which a paged artifact does not have; "
                         "use --kv-cache contiguous, or a scheme without calibration (" +
                         ", ".join(s.name for s in SCHEMES.values() if not s.calibrated) + ")")
    if what is not None and spec.calib is None:
        raise QuantError(f"{what} needs calibration prompts: pass --calib FILE (one prompt per line)")
    if spec.calib is not None:
        read_prompts(spec.calib)  # missing / empty file -> CalibrationError now, not after the export


def _refuse_weight_flags_without_scheme(spec: QuantSpec) -> None:
    # --kv-quant alone (fp32 weights, int8 cache) is fine; it brings its own --calib.
    flags: dict[str, object] = {"--block-size": spec.block_size, "--calib": None if spec.kv_cache else spec.calib,
                                "--keep-fp": spec.keep_fp or None, "--lm-head": spec.lm_head,
                                "--accuracy-level": spec.accuracy_level, "--asym-offsets": spec.asym_offsets,
                                **spec.activations.flags()}
    for flag, value in flags.items():
        if value is not None:
            which = [s.name for s in SCHEMES.values() if s.activations or flag not in ACTIVATION_FLAGS]
            raise MoeforgeError(f"{flag} needs --quant ({', '.join(which[:-1])} or {which[-1]})")


def _check_weights(spec: QuantSpec, scheme: Scheme, target: str) -> None:
    if target not in scheme.targets:
        others = [s.name for s in SCHEMES.values() if target in s.targets]
        raise QuantError(f"--quant {scheme.name} is built for ONNX Runtime (--target ort); --target {target} takes "
                         f"the symmetric weight-only schemes {', '.join(others)}")
    activations = spec.activation_spec()
    if activations is not None and spec.block_size is not None:
        raise QuantError(f"--quant {scheme.name} keeps weights per output channel (the static-activation GEMMs, "
                         "ORT MatMulIntegerToFloat and TensorRT, take per-channel weight scales); drop --block-size")
    block = spec.block_size
    if block is not None and block not in BLOCK_SIZES:
        raise QuantError(f"--block-size {block} must be a power of two from 16 to 256 (e.g. 32, 64, 128)")
    if spec.lm_head is not None:
        if spec.lm_head not in LM_HEAD_KINDS:
            raise QuantError(f"--lm-head {spec.lm_head!r} is unknown; choose one of {', '.join(LM_HEAD_KINDS)}")
        if spec.lm_head == "int4" and activations is not None:
            raise QuantError(f"--lm-head int4 is not available with --quant {scheme.name} (its weights are per "
                             "channel); use --lm-head int8 or fp32")
        if spec.lm_head == "int4" and spec.block is None:
            raise QuantError(f"--lm-head int4 needs blocks but --quant {scheme.name} is per channel: "
                             "add --block-size 32 (or 64, 128)")
    if spec.level not in ACCURACY_LEVELS:
        levels = " or ".join(f"{level} ({what})" for level, what in ACCURACY_LEVELS.items())
        raise QuantError(f"--accuracy-level {spec.level} must be {levels}: MatMulNBits' compute type for the "
                         "activations (ONNX Runtime's levels 1-3 compute in fp32 on CPU, like 0)")
    if spec.asym_offsets is not None:
        if spec.asym_offsets not in ASYM_OFFSETS:
            raise QuantError(f"--asym-offsets {spec.asym_offsets!r} is unknown; choose one of "
                             f"{', '.join(ASYM_OFFSETS)}")
        if not scheme.asymmetric:
            asym = [s.name for s in SCHEMES.values() if s.asymmetric]
            raise QuantError(f"--asym-offsets applies to the min-max schemes with float offsets ({', '.join(asym)}), "
                             f"not --quant {scheme.name}; drop it")
    if not 0.0 <= spec.keep_fp < 1.0:
        raise QuantError(f"--keep-fp {spec.keep_fp} must be a fraction in [0, 1)")
    if target == "trt" and (spec.keep_fp or spec.lm_head == "fp32"):
        raise QuantError("--keep-fp / --lm-head fp32 are not wired for --target trt; drop them")


def _check_kv_cache(spec: QuantSpec, *, target: str, paged: bool, kv_layout: str | None) -> None:
    kv = KV_SCHEMES.get(spec.kv_cache or "")
    if kv is None:
        raise KVQuantError(f"--kv-quant {spec.kv_cache!r} is unknown; choose one of {', '.join(KV_CHOICES)}")
    if kv.unavailable is not None:
        raise KVQuantError(f"--kv-quant {kv.name} is not available: {kv.unavailable}; use --kv-quant int8")
    if kv_layout == "v4_hybrid":
        raise KVQuantError(f"--kv-quant {kv.name} stores GroupQueryAttention's per-head key/value caches as {kv.dtype} "
                           "with calibrated scales; DeepSeek-V4's cache (layout v4_hybrid: sliding-window rings, the "
                           "compressors' pending rows and compressed entries, read and written by its own step graph) "
                           "has no such cache to quantise: drop --kv-quant (the cache stays float32; --quant still "
                           "quantises the weights)")
    if paged:
        raise KVQuantError(f"--kv-quant {kv.name} needs --kv-cache contiguous: the paged attention op reads "
                           "fp32 pools")
    if target != "ort":
        raise KVQuantError("--kv-quant is built for --target ort (ONNX Runtime GroupQueryAttention int8 caches)")
    if spec.calib is None:
        raise KVQuantError(f"--kv-quant {kv.name} needs calibration prompts for its per-head scales: pass --calib "
                           "FILE (one prompt per line)")
