"""Every quantisation scheme, declared once. The CLI's choices, validation, the passes, the manifest's
precision, parity's thresholds and the targets all read this table.

Adding a weight scheme: one ``Scheme`` entry here, plus its rewrite in ``moeforge/passes/quant_weights.py`` when its
numbers are new (an existing ``weights`` kind with other flags needs no new pass).
"""

from __future__ import annotations

from dataclasses import dataclass

INF = float("inf")


@dataclass(frozen=True)
class Thresholds:
    """Pass/fail limits for one precision, plus cosine, top-1 and greedy limits.

    Every logit must satisfy |ours - ref| <= atol + rtol * max|ref row|: the error of a logit grows
    with the scale of its whole row (it comes out of reductions over the hidden state), not with its
    own value, so a logit near zero in a row of large logits gets the row's allowance."""

    atol: float
    rtol: float
    cosine_min: float
    top1_agreement: float
    greedy_match: bool
    kl_max: float = INF  # mean KL(PyTorch || artifact) over all positions, in nats


def _judged_by_agreement(top1: float, kl: float) -> Thresholds:
    """Quantised artifacts are judged by top-1 agreement and KL, not by atol: the rounding error is the point.
    Cosine is not judged: on the tiny random presets one flipped MoE expert choice moves a whole row."""
    return Thresholds(atol=INF, rtol=0.0, cosine_min=0.0, top1_agreement=top1, greedy_match=False, kl_max=kl)


# fp32: atol 1e-4 (optimum's bar for ONNX Runtime exports) and exact greedy tokens. The rtol term
# covers real models: SmolLM2 (30 layers, logits up to ~33) in PyTorch fp32 is itself 8e-5 away from
# the same model in float64, and an ONNX Runtime fp32 graph lands 1-2e-4 from PyTorch fp32.
FP32_THRESHOLDS = Thresholds(atol=1e-4, rtol=1e-5, cosine_min=0.99999, top1_agreement=1.0, greedy_match=True)


@dataclass(frozen=True)
class Scheme:
    """One ``--quant`` choice.

    ``weights``: the stored weight kind (int8 | int4 | fp8), ``default_block`` along the input dimension
    (None: per output channel); ``asymmetric``: min-max blocks with float offsets; ``awq``: activation-aware
    scales searched on ``--calib``; ``activations``: static per-tensor activation dtype (w8a8); ``targets``:
    where it is built; ``thresholds``: its parity limits. Limits hold for the tiny random presets (flat logits,
    the hardest case for top-1: KL carries it there) and real models alike (benchmarks/quant_accuracy.py).
    """

    name: str
    weights: str
    default_block: int | None
    thresholds: Thresholds
    help: str
    asymmetric: bool = False
    awq: bool = False
    activations: str | None = None
    targets: tuple[str, ...] = ("ort",)

    @property
    def calibrated(self) -> bool:
        """It runs the graph on the ``--calib`` prompts."""
        return self.awq or self.activations is not None

    @property
    def lm_head_default(self) -> str:
        """int4 schemes keep the LM head at int8 (same blocks), as llama.cpp keeps output.weight at 6-8 bits:
        on SmolLM2 an int4 head alone costs more top-1 agreement than all int4 decoder layers together."""
        return "int8" if self.weights == "int4" else self.weights


SCHEMES: dict[str, Scheme] = {s.name: s for s in (
    Scheme("int8", "int8", None, _judged_by_agreement(0.85, 0.01), "int8 per output channel",
           targets=("ort", "trt")),
    Scheme("int8-asym", "int8", 32, _judged_by_agreement(0.85, 0.01),
           "int8 min-max blocks with float offsets (ONNX Runtime)", asymmetric=True),
    Scheme("int4", "int4", 32, _judged_by_agreement(0.4, 0.15), "int4 blocks, symmetric round-to-nearest",
           targets=("ort", "trt")),
    Scheme("int4-asym", "int4", 32, _judged_by_agreement(0.4, 0.15),
           "int4 min-max blocks with float offsets (ONNX Runtime; llama.cpp's Q4_1)", asymmetric=True),
    Scheme("int4-awq", "int4", 32, _judged_by_agreement(0.4, 0.15), "int4 blocks with AWQ scales from --calib",
           awq=True),
    Scheme("fp8", "fp8", 128, _judged_by_agreement(0.8, 0.02), "fp8 e4m3 blocks", targets=("ort", "trt")),
    # Measured on tiny-llama / tiny-deepseek-v3 (minmax, percentile 99.99 and 99.9): int8 top-1 0.88..0.97, KL
    # 6e-4..1.8e-2; fp8 (3 mantissa bits on weights and activations) top-1 0.75..0.97, KL 2e-3..2.4e-2.
    Scheme("w8a8", "int8", None, _judged_by_agreement(0.8, 0.03),
           "int8 weights per channel + static per-tensor int8 activation scales from --calib", activations="int8"),
    Scheme("w8a8-fp8", "fp8", None, _judged_by_agreement(0.7, 0.04), "w8a8 in float8 e4m3", activations="fp8"),
)}
LM_HEAD_KINDS = ("int8", "int4", "fp8", "fp32")  # --lm-head
# MatMulNBits/QMoE ``accuracy_level`` (--accuracy-level): the least precise type the kernel may compute the
# activations in. ONNX Runtime's levels 1-3 (fp32, fp16, bf16) fall back to the most accurate type its CPU kernels
# have, fp32 on x86 (measured: outputs identical to level 0), so only 0 and 4 are offered.
ACCURACY_LEVELS: dict[int, str] = {
    0: "fp32 activations, exact w.r.t. the quantised weights",
    4: "int8 activations, quantised per block inside the kernel (fastest)",
}
DEFAULT_ACCURACY_LEVEL = 4  # int8 activations inside the kernel: the fast path

# How the lowering runs the asymmetric schemes' float block offsets on ONNX Runtime (--asym-offsets;
# moeforge/passes/quant_lowering.py, measured in docs/performance.md, "Where int4 stands").
ASYM_OFFSETS: dict[str, str] = {
    "exact": "the weights exactly: MatMulNBits + the block sums' MatMul with the offsets + Add",
    "digit": "integer zero points in the MatMulNBits, the residual offsets (< half a step) as one more code per "
             "block over the block sums: one node fewer per projection, 9-12%% faster decode on SmolLM2, held-out "
             "KL 4.5e-3 vs 3.2e-3",
}


@dataclass(frozen=True)
class KVScheme:
    """One ``--kv-quant`` choice: the cache ``dtype``; ``unavailable`` says why it cannot be built here;
    ``fp32_weights_judged_as``: the scheme whose parity limits an fp32-weight artifact with this cache gets."""

    name: str
    dtype: str
    fp32_weights_judged_as: str
    unavailable: str | None = None

    @property
    def suffix(self) -> str:
        """What it adds to the manifest's precision, e.g. ``int4+kv-int8``."""
        return f"+kv-{self.name}"


KV_SCHEMES: dict[str, KVScheme] = {s.name: s for s in (
    KVScheme("int8", "int8", "int8"),
    KVScheme("fp8", "float8_e4m3fn", "fp8",
             unavailable="ONNX Runtime 1.32's CPU GroupQueryAttention has no float8e4m3fn cache kernel (only its CUDA "
                         "kernel has one)"),
)}
KV_CHOICES = tuple(s.name for s in KV_SCHEMES.values() if s.unavailable is None)  # what --kv-quant offers

THRESHOLDS: dict[str, Thresholds] = {"fp32": FP32_THRESHOLDS, **{s.name: s.thresholds for s in SCHEMES.values()}}


def precision_name(weights: str | None, kv_cache: str | None) -> str:
    """The manifest's precision of an ONNX Runtime artifact: the scheme (or fp32), plus ``+kv-int8``."""
    return (weights or "fp32") + (KV_SCHEMES[kv_cache].suffix if kv_cache else "")


def thresholds_for(precision: str) -> Thresholds:
    """Limits for a manifest precision. A quantised KV cache rounds every cached key/value, so fp32 weights
    with an int8 cache are judged like int8 weights; quantised weights keep their own (looser) limits."""
    weights, kv = precision, None
    for scheme in KV_SCHEMES.values():
        if precision.endswith(scheme.suffix):
            weights, kv = precision.removesuffix(scheme.suffix), scheme
    if weights not in THRESHOLDS:
        raise ValueError(f"no parity thresholds for precision {precision!r}; known: {', '.join(THRESHOLDS)}")
    return THRESHOLDS[kv.fp32_weights_judged_as] if kv is not None and weights == "fp32" else THRESHOLDS[weights]
