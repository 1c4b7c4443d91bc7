"""Rotary position embedding with real cos/sin (export-friendly), YaRN / Llama-3 / linear scaling.

Dimension letters: B batch, S new tokens, H heads, D rotary dims (even).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from moeforge.core.config import ModelConfig, RopeConfig, yarn_mscale


def rope_inverse_frequencies(rope: RopeConfig, dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """Return (inv_freq [D/2] float32, amplitude applied to cos/sin) for the configured scaling."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    pos_freqs = rope.theta**exponents  # [D/2]
    inv_freq = 1.0 / pos_freqs
    if rope.frequency_factors is not None:  # llama.cpp's rope_freqs: theta_i / factor_i (default/linear only)
        inv_freq = inv_freq / torch.tensor(rope.frequency_factors, dtype=torch.float32)
    if rope.scaling == "default":
        return inv_freq, 1.0
    if rope.scaling == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.scaling == "llama3":
        return _llama3_frequencies(rope, inv_freq), 1.0
    return _yarn_frequencies(rope, dim, pos_freqs)


def _yarn_frequencies(rope: RopeConfig, dim: int, pos_freqs: torch.Tensor) -> tuple[torch.Tensor, float]:
    # YaRN: interpolate (divide by factor) the low frequencies, keep the high ones, blend linearly
    # over the dimensions whose wavelengths fall between beta_fast and beta_slow rotations.
    factor = rope.factor
    original = rope.original_max_position_embeddings
    assert original is not None  # validated in ModelConfig

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp  # 1 keeps the original frequency
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (1.0 / pos_freqs) * extrapolation_weight

    if rope.attention_factor is not None:
        amplitude = float(rope.attention_factor)
    elif rope.mscale and rope.mscale_all_dim:
        amplitude = yarn_mscale(factor, rope.mscale) / yarn_mscale(factor, rope.mscale_all_dim)
    else:
        amplitude = yarn_mscale(factor)
    return inv_freq, amplitude


def _llama3_frequencies(rope: RopeConfig, inv_freq: torch.Tensor) -> torch.Tensor:
    original = rope.original_max_position_embeddings
    assert original is not None
    low_freq_wavelen = original / rope.low_freq_factor
    high_freq_wavelen = original / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (original / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Computes cos/sin [B, S, D/2] from explicit positions; no tables sized by max length."""

    inv_freq: torch.Tensor  # a buffer

    def __init__(self, config: ModelConfig, rope: RopeConfig | None = None) -> None:
        # rope: a second RoPE setting of the same model (DeepSeek-V4's compressed layers); default config.rope.
        super().__init__()
        self.rope = config.rope if rope is None else rope
        self.dim = config.rope_dim
        self.max_position_embeddings = config.max_position_embeddings
        inv_freq, self.amplitude = rope_inverse_frequencies(self.rope, self.dim, self.max_position_embeddings)
        # Non-persistent: derived from the config, never read from a checkpoint.
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def reset_buffers(self) -> None:
        """Recompute ``inv_freq`` (after the model was built on the meta device)."""
        inv_freq, _ = rope_inverse_frequencies(self.rope, self.dim, self.max_position_embeddings)
        self.inv_freq = inv_freq.to(self.inv_freq.device if self.inv_freq.device.type != "meta" else "cpu")

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # position_ids: [B, S] int64 -> cos, sin: [B, S, D/2] float32
        freqs = position_ids[..., None].to(torch.float32) * self.inv_freq
        return freqs.cos() * self.amplitude, freqs.sin() * self.amplitude


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate x [B, S, H, D] by cos/sin [B, S, D/2].

    ``interleaved``: pairs are (x0, x1), (x2, x3), ... (DeepSeek weights); otherwise (x_i, x_{i+D/2})
    (HF "rotate_half"). The output keeps the input's layout, as ONNX RotaryEmbedding does.
    """
    cos = cos.unsqueeze(2).to(x.dtype)
    sin = sin.unsqueeze(2).to(x.dtype)
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return rotated.flatten(-2)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def apply_rotary_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing D dims of x [B, S, H, Dx] by cos/sin [B, S, D/2] (interleaved pairs), the leading Dx - D
    pass through: DeepSeek-V4's head layout [nope | rope]. With -sin it undoes the rotation (the conjugate)."""
    rope_dim = 2 * cos.shape[-1]
    turned = apply_rotary(x[..., x.shape[-1] - rope_dim:], cos, sin, interleaved=True)
    return torch.cat((x[..., : x.shape[-1] - rope_dim], turned), dim=-1)
