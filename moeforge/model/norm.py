"""RMSNorm computed in fp32 whatever the model dtype (fp16 overflows in the mean of squares), with or without weight."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """y = weight * x / sqrt(mean(x^2) + eps), the normalisation done in float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # F.rms_norm exports to ONNX RMSNormalization at opset >= 23.
        normed = F.rms_norm(x.to(torch.float32), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dim, computed in float32, no weight (DeepSeek-V4's q norm, mHC)."""
    return F.rms_norm(x.to(torch.float32), (x.shape[-1],), eps=eps).to(x.dtype)
