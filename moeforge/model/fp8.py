"""Block-wise FP8 (float8_e4m3fn) weights as DeepSeek-V3 ships them.

A weight W [..., out, in] is stored as ``q`` (float8_e4m3fn, same shape) plus ``scale_inv`` (float32,
[..., ceil(out/B), ceil(in/B)]): block (i, j) of B x B elements dequantises to ``q_block *
scale_inv[i, j]``. Edge blocks are partial when a dimension is not a multiple of B. Leading dims
(e.g. the expert dim of a fused [E, 2I, H] tensor) are batch dims with their own scales.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max: scale = amax / 448 uses the full range

Block = int | tuple[int, int]


def _block_dims(block: Block) -> tuple[int, int]:
    bo, bi = (block, block) if isinstance(block, int) else block
    if bo <= 0 or bi <= 0:
        raise ValueError(f"block size must be positive, got {block!r}")
    return int(bo), int(bi)


def fp8_scale_shape(weight_shape: tuple[int, ...] | torch.Size, block: Block = 128) -> tuple[int, ...]:
    """Shape of the ``scale_inv`` that goes with a weight of ``weight_shape`` ([..., out, in])."""
    if len(weight_shape) < 2:
        raise ValueError(f"block-wise FP8 needs a weight with >= 2 dims, got shape {tuple(weight_shape)}")
    bo, bi = _block_dims(block)
    *batch, out, inn = weight_shape
    return (*batch, math.ceil(out / bo), math.ceil(inn / bi))


def _to_blocks(w: torch.Tensor, bo: int, bi: int) -> torch.Tensor:
    """Zero-pad float32 [..., out, in] to whole blocks and view it as [..., out/bo, bo, in/bi, bi]."""
    *batch, out, inn = w.shape
    ob, ib = math.ceil(out / bo), math.ceil(inn / bi)
    pad_o, pad_i = ob * bo - out, ib * bi - inn
    if pad_o or pad_i:
        w = F.pad(w, (0, pad_i, 0, pad_o))
    return w.view(*batch, ob, bo, ib, bi)


def _from_blocks(blocks: torch.Tensor, out: int, inn: int) -> torch.Tensor:
    """Inverse of ``_to_blocks``: [..., ob, bo, ib, bi] -> [..., out, in] (drops the padding)."""
    *batch, ob, bo, ib, bi = blocks.shape
    return blocks.reshape(*batch, ob * bo, ib * bi)[..., :out, :inn]


def dequantize_fp8_blockwise(
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block: Block = 128,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Dequantise ``weight`` [..., out, in] with per-block ``scale_inv`` [..., ceil(out/B), ceil(in/B)].

    Each element is ``float32(weight) * scale_inv[block]`` computed in float32 (one rounding), then
    cast to ``dtype``. Raises ``ValueError`` when ``scale_inv`` has the wrong shape.
    """
    bo, bi = _block_dims(block)
    want = fp8_scale_shape(weight.shape, (bo, bi))
    if tuple(scale_inv.shape) != want:
        raise ValueError(
            f"scale_inv has shape {tuple(scale_inv.shape)} but a weight of shape {tuple(weight.shape)} "
            f"with {bo}x{bi} blocks needs {want}"
        )
    *_, out, inn = weight.shape
    # copy=True: never scale the caller's tensor in place when it is already float32.
    blocks = _to_blocks(weight.to(torch.float32, copy=True), bo, bi)
    blocks.mul_(scale_inv.to(torch.float32)[..., :, None, :, None])
    return _from_blocks(blocks, out, inn).to(dtype).contiguous()


def quantize_fp8_blockwise(weight: torch.Tensor, block: Block = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``weight`` [..., out, in] to float8_e4m3fn with one float32 scale per block.

    scale = amax(|block|) / 448, stored as ``scale_inv`` (the factor dequantisation multiplies by, as
    in DeepSeek-V3 checkpoints). Returns ``(fp8_weight, scale_inv)``; used to make FP8 test checkpoints.
    """
    if weight.ndim < 2:
        raise ValueError(f"block-wise FP8 needs a weight with >= 2 dims, got shape {tuple(weight.shape)}")
    bo, bi = _block_dims(block)
    *_, out, inn = weight.shape
    blocks = _to_blocks(weight.to(torch.float32, copy=True), bo, bi)  # [..., ob, bo, ib, bi]
    amax = blocks.abs().amax(dim=(-3, -1))  # [..., ob, ib]; zero padding never raises the max
    # An all-zero block gets any positive scale (0 / scale = 0); tiny keeps the division finite.
    scale = (amax / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    blocks.div_(scale[..., :, None, :, None]).clamp_(-FP8_MAX, FP8_MAX)
    q = _from_blocks(blocks, out, inn).to(FP8_DTYPE).contiguous()
    return q, scale.contiguous()
