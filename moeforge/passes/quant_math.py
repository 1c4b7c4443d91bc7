"""Symmetric weight quantisers (numpy) shared by the Q/DQ pass, its lowering and calibration.

All schemes are symmetric (zero point 0): TensorRT only takes symmetric Q/DQ, and ONNX Runtime's
MatMulNBits / QMoE express the same values with their default zero points (8 for 4 bits, 128 for 8).

Layout: a MatMul weight W is [K, N] (y = x @ W); blocks run along K (the reduction axis), so a
block scale is [K / block, N]. Per-channel int8 has one scale per output column, [N].
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

FP8_MAX = 448.0  # largest finite float8 e4m3fn
KINDS = ("int8", "int4", "fp8")


@dataclass(frozen=True)
class QuantizedWeight:
    """``values`` [K, N] (int8 holding int4/int8 codes, or float8_e4m3fn); ``scale`` [N] (per channel)
    or [K / block, N] (block-wise). ``dequantize()`` gives the fp32 weight the graph computes with."""

    kind: str  # int8 | int4 | fp8
    values: np.ndarray
    scale: np.ndarray
    block_size: int | None  # None: per output channel

    def dequantize(self) -> np.ndarray:
        values = self.values.astype(np.float32)
        scale = self.scale[None, :] if self.block_size is None else np.repeat(self.scale, self.block_size, axis=0)
        weight: np.ndarray = values * scale
        return weight


def quantize(weight: np.ndarray, kind: str, block_size: int | None) -> QuantizedWeight:
    """Round-to-nearest quantisation of ``weight`` [K, N]; ``block_size`` must divide K."""
    w = np.asarray(weight, np.float32)
    k, n = w.shape
    if block_size is not None and k % block_size:
        raise ValueError(f"block size {block_size} does not divide K={k}")
    blocks = w.reshape(k // block_size, block_size, n) if block_size else w.reshape(1, k, n)
    if kind == "int4":
        # amax maps to +-7.5: all 16 codes are used ([-8, 7]), the scale stays positive (TensorRT wants
        # that), and every value is within half a step (+7.5 rounds to 8, clipped to 7).
        scale = np.abs(blocks).max(axis=1, keepdims=True) / 7.5
        codes = np.clip(np.rint(blocks / _nonzero(scale)), -8, 7).astype(np.int8)
    elif kind == "int8":
        scale = np.abs(blocks).max(axis=1, keepdims=True) / 127.0
        codes = np.clip(np.rint(blocks / _nonzero(scale)), -127, 127).astype(np.int8)
    elif kind == "fp8":
        scale = np.abs(blocks).max(axis=1, keepdims=True) / FP8_MAX
        codes = (blocks / _nonzero(scale)).astype(ml_dtypes.float8_e4m3fn)
    else:
        raise ValueError(f"unknown weight kind {kind!r}; kinds: {', '.join(KINDS)}")
    scale = np.where(scale == 0, 1.0, scale).astype(np.float32)  # all-zero block: any scale, codes are 0
    values = codes.reshape(k, n)
    return QuantizedWeight(kind, values, scale[:, 0, :] if block_size else scale[0, 0, :], block_size)


@dataclass(frozen=True)
class AsymWeight:
    """Asymmetric min-max blocks along K: ``codes`` uint8 [K, N] in 0..2^bits-1, ``scale`` and ``offset``
    (the block minimum) [K / block, N]; w ~= codes * scale + offset. ONNX Runtime's MatMulNBits takes it
    as a float zero point ``-offset / scale`` (``zero_point()``)."""

    codes: np.ndarray
    scale: np.ndarray
    offset: np.ndarray
    block_size: int

    def dequantize(self) -> np.ndarray:
        def rep(a: np.ndarray) -> np.ndarray:
            return np.repeat(a, self.block_size, axis=0)

        weight: np.ndarray = self.codes.astype(np.float32) * rep(self.scale) + rep(self.offset)
        return weight

    def zero_point(self) -> np.ndarray:
        zero_point: np.ndarray = (-self.offset / self.scale).astype(np.float32)
        return zero_point


def quantize_asym(weight: np.ndarray, block_size: int, bits: int = 4) -> AsymWeight:
    """Min-max asymmetric blocks (ONNX Runtime's default weight-only scheme; at 4 bits llama.cpp's Q4_1): per
    block scale = (max - min) / (2^bits - 1), codes = round((w - min) / scale). A weight dequantised from Q4_1
    blocks of the same size comes back exactly (up to fp32 rounding) at 4 bits and at 8 (255 = 15 * 17: each
    Q4_1 level lands on every 17th 8-bit code)."""
    if bits not in (4, 8):
        raise ValueError(f"asymmetric blocks are 4 or 8 bits, not {bits}")
    levels = float((1 << bits) - 1)
    w = np.asarray(weight, np.float32)
    k, n = w.shape
    if k % block_size:
        raise ValueError(f"block size {block_size} does not divide K={k}")
    blocks = w.reshape(k // block_size, block_size, n)
    low, high = blocks.min(axis=1, keepdims=True), blocks.max(axis=1, keepdims=True)
    scale = np.where(high > low, (high - low) / levels, 1.0).astype(np.float32)  # constant block: codes 0
    codes = np.clip(np.rint((blocks - low) / scale), 0, levels).astype(np.uint8)
    return AsymWeight(codes.reshape(k, n), scale[:, 0, :], low[:, 0, :].astype(np.float32), block_size)


def _nonzero(scale: np.ndarray) -> np.ndarray:
    return np.where(scale == 0, 1.0, scale)


def fake_quantize(weight: np.ndarray, kind: str, block_size: int | None) -> np.ndarray:
    """``dequantize(quantize(weight))``: what the quantised graph multiplies by."""
    return quantize(weight, kind, block_size).dequantize()


def awq_search(weight: np.ndarray, x_sample: np.ndarray, x_mean_abs: np.ndarray, kind: str, block_size: int,
               grid: int = 20) -> tuple[np.ndarray, float]:
    """AWQ-style per-input-channel scales s [K] (weights x s, activations / s) minimising the output error.

    s = mean|x|^alpha, normalised so sqrt(max * min) = 1; alpha is searched on a grid of ``grid`` + 1 points
    in [0, 1] against ``x_sample`` [M, K] (calibration activations). alpha = 0 is plain RTN (s = 1).
    Returns (s, alpha).
    """
    w = np.asarray(weight, np.float32)
    x = np.asarray(x_sample, np.float32)
    reference = x @ w
    best: tuple[float, np.ndarray, float] | None = None
    mean = np.maximum(np.asarray(x_mean_abs, np.float32), 1e-8)
    for step in range(grid + 1):
        alpha = step / grid
        s = mean ** alpha
        s = s / np.sqrt(s.max() * s.min())
        approx = (x / s) @ fake_quantize(w * s[:, None], kind, block_size)
        err = float(np.square(approx - reference).mean())
        if best is None or err < best[0]:
            best = (err, s.astype(np.float32), alpha)
    assert best is not None
    return best[1], best[2]


def pack_nbits(codes_nk: np.ndarray, bits: int, block_size: int) -> np.ndarray:
    """Signed codes [N, K] -> MatMulNBits B [N, K / block, block * bits / 8] uint8 (unsigned, offset 2^(bits-1);
    4-bit: element 2j in the low nibble, 2j+1 in the high nibble)."""
    n, k = codes_nk.shape
    unsigned: np.ndarray = (codes_nk.astype(np.int16) + (1 << (bits - 1))).astype(np.uint8)
    if bits == 4:
        unsigned = unsigned[:, 0::2] | (unsigned[:, 1::2] << 4)
    elif bits != 8:
        raise ValueError(f"bits {bits} not packed here")
    return unsigned.reshape(n, k // block_size, block_size * bits // 8)


def pack_rows(codes: np.ndarray, bits: int) -> np.ndarray:
    """Signed codes [..., K] -> uint8 [..., K * bits / 8] (QMoE's expert layout, same nibble order)."""
    unsigned: np.ndarray = (codes.astype(np.int16) + (1 << (bits - 1))).astype(np.uint8)
    if bits == 4:
        unsigned = unsigned[..., 0::2] | (unsigned[..., 1::2] << 4)
    return unsigned


def quantize_fp8_exact(weight: np.ndarray, block_size: int | None) -> QuantizedWeight:
    """FP8 blocks that reproduce ``weight`` [K, N] exactly when it was dequantised from FP8 blocks.

    A checkpoint's FP8 block (DeepSeek: 128 x 128 over [out, in], one scale) restricted to one column
    and one K-block of ours shares one scale s with codes q: weight = fl(q * s). The plain amax/448
    scale finds s when the column's largest value is the block's; otherwise s = amax / v for the fp8
    value v of that element (and its fp32 neighbours) does. Slices with no exact scale keep round-to-
    nearest, so any weight still quantises (with ordinary rounding loss there).
    """
    q = quantize(weight, "fp8", block_size)
    w = np.asarray(weight, np.float32)
    k, n = w.shape
    bs = block_size or k
    blocks = w.reshape(k // bs, bs, n)
    scale = q.scale.reshape(k // bs, n).copy()
    codes = q.values.reshape(k // bs, bs, n).copy()
    bad = ~np.all(codes.astype(np.float32) * scale[:, None, :] == blocks, axis=1)  # [nb, N]
    if bad.any():
        candidates = np.unique(np.abs(np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
                                      .astype(np.float32)))
        candidates = candidates[np.isfinite(candidates) & (candidates >= 1.0)][::-1]  # large codes first
        bi, ni = np.nonzero(bad)
        slices = blocks[bi, :, ni]  # [M, bs]
        amax = np.abs(slices).max(axis=1)
        found = np.zeros(len(bi), bool)
        for v in candidates:
            base = (amax / v).astype(np.float32)
            for s in (base, np.nextafter(base, np.float32(np.inf)), np.nextafter(base, np.float32(0))):
                todo = ~found & (s > 0)
                if not todo.any():
                    break
                trial = (slices[todo] / s[todo, None]).astype(ml_dtypes.float8_e4m3fn)
                ok = np.all(trial.astype(np.float32) * s[todo, None] == slices[todo], axis=1)
                idx = np.nonzero(todo)[0][ok]
                codes[bi[idx], :, ni[idx]] = trial[ok]
                scale[bi[idx], ni[idx]] = s[idx]
                found[idx] = True
            if found.all():
                break
    values = codes.reshape(k, n)
    return QuantizedWeight("fp8", values, scale if block_size else scale[0], block_size)
