"""Optimisation profile of a TensorRT engine: the (min, opt, max) ranges one profile gives the inputs.

Shared by ``build`` (contiguous profiles, and building) and ``paged_profiles`` (ranges by dimension name).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ProfileSpec:
    """One optimisation profile: (min, opt, max) batch and tokens; the cache length is fixed."""

    name: str
    batch: tuple[int, int, int]
    tokens: tuple[int, int, int]
    # Paged graphs (moeforge/compile/trt/paged_profiles.py): (min, opt, max) per symbolic ONNX dimension name
    # (num_tokens, num_seqs, max_blocks, num_blocks, ...); empty: axis 0 batch, axis 1 tokens.
    dims: dict[str, tuple[int, int, int]] = field(default_factory=dict)
