"""SwiGLU feed-forward: down(silu(gate(x)) * up(x)), optionally clamped (DeepSeek-V4's swiglu_limit)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """silu(gate) * up; with ``limit``, gate clamped to <= limit and up to [-limit, limit] first (DeepSeek-V4)."""
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


class SwiGLU(nn.Module):
    """A dense SwiGLU MLP (also a DeepSeek shared expert)."""

    def __init__(self, hidden_size: int, intermediate_size: int, limit: float | None = None) -> None:
        super().__init__()
        self.limit = limit
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x), self.limit))
        return out
