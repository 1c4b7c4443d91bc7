"""FP4 (e2m1) routed-expert weights as DeepSeek-V4 ships them (``quantization_config.expert_dtype`` "fp4").

A weight W [..., out, K] is stored packed, two e2m1 values per byte along K: ``packed`` [..., out, K/2] (safetensors
I8 or U8; or F4, torch.float4_e2m1fn_x2, whose header shape counts values: [..., out, K]). Byte j holds value 2j in
its low nibble and value 2j+1 in its high nibble; a nibble is sign (bit 3) then a 3-bit magnitude code indexing
0, 0.5, 1, 1.5, 2, 3, 4, 6. ``scale`` [..., out, ceil(K/32)] (float8_e8m0fnu powers of two, "ue8m0", or float32)
holds one factor per 32 values along K (a last partial group when K is not a multiple of 32). transformers reads the
same layout (``integrations/finegrained_fp8.py``: ``FP8Experts`` with expert_dtype fp4, ``Fp8Dequantize``).

Dequantised exactly: every product of an e2m1 value and a power-of-two (or float32) scale is one float32 rounding.
"""

from __future__ import annotations

import math

import torch

FP4_GROUP = 32  # values of K per scale
# e2m1 code -> value: codes 0..7 positive, 8..15 the same magnitudes negated (bit 3 is the sign).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def fp4_scale_shape(shape: tuple[int, ...] | torch.Size) -> tuple[int, ...]:
    """Shape of the scale of an FP4 weight whose values have ``shape`` [..., out, K] (K unpacked)."""
    if len(shape) < 2 or shape[-1] % 2:
        raise ValueError(f"an FP4 weight needs >= 2 dims and an even K, got shape {tuple(shape)}")
    return (*shape[:-1], math.ceil(shape[-1] / FP4_GROUP))


def as_bytes(packed: torch.Tensor) -> torch.Tensor:
    """The packed bytes [..., K/2] as uint8, whatever dtype held them (int8, uint8, float4_e2m1fn_x2)."""
    return packed if packed.dtype == torch.uint8 else packed.view(torch.uint8)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """``packed`` [..., K/2] (two e2m1 values per byte, low nibble first) -> float32 [..., K]."""
    u8 = as_bytes(packed)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    values = torch.stack((table[(u8 & 0xF).long()], table[(u8 >> 4).long()]), dim=-1)  # [..., K/2, 2]
    return values.reshape(*u8.shape[:-1], 2 * u8.shape[-1])


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``packed`` [..., out, K/2] with ``scale`` [..., out, ceil(K/32)] -> the weight [..., out, K] in ``dtype``.
    Raises ``ValueError`` when ``scale`` has the wrong shape."""
    values = unpack_fp4(packed)  # [..., out, K]
    k = values.shape[-1]
    want = fp4_scale_shape(values.shape)
    if tuple(scale.shape) != want:
        raise ValueError(f"FP4 scale has shape {tuple(scale.shape)} but a weight of {tuple(values.shape)} values "
                         f"(one scale per {FP4_GROUP} along K) needs {want}")
    per_value = scale.to(torch.float32).repeat_interleave(FP4_GROUP, dim=-1)[..., :k]  # [..., out, K]
    return (values * per_value).to(dtype).contiguous()
