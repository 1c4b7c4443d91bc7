"""Manifold-constrained hyper-connections (mHC, DeepSeek-V4): the residual stream is N = hc_mult streams.

Dimension letters: B batch, S tokens, N streams (hc_mult), H hidden.

Each block (attention, then MoE) has a ``HyperConnection``. From the streams h [B, S, N, H] (flattened and
RMS-normalised without weight) one linear map gives three sets of weights:
    pre  = sigmoid(a_pre * s_pre + b_pre) + eps            [B, S, N]     the block reads x = sum_n pre_n * h_n
    post = 2 * sigmoid(a_post * s_post + b_post)           [B, S, N]     the block's output y goes to stream n * post_n
    comb = sinkhorn(softmax(a_comb * s_comb + b_comb) + eps) [B, S, N, N] doubly stochastic: mixes the residual streams
and the new streams are h'_k = post_k * y + sum_j comb[j, k] * h_j (comb transposed: it is not symmetric).
Sinkhorn-Knopp normalises the columns, then rows and columns ``sinkhorn_iters - 1`` more times (a static count:
unrolled on export).
The ``HyperHead`` collapses the streams once more (its own pre weights) before the final norm. All in float32.
Exactly transformers' DeepseekV4HyperConnection / DeepseekV4HyperHead (parameter names fn, base, scale / hc_fn, hc_base,
hc_scale).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moeforge.core.config import ModelConfig
from moeforge.model.norm import rms_normalize


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """comb [..., N, N] (positive) -> nearly doubly stochastic: columns, then ``iters - 1`` x (rows, columns)."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


class HyperConnection(nn.Module):
    """One block's mHC weights: fn [(2+N)N, N*H], base [(2+N)N], scale [3] (pre, post, comb)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hc = config.hyper_connections
        assert hc is not None
        self.n, self.iters, self.eps, self.norm_eps = hc.hc_mult, hc.sinkhorn_iters, hc.eps, config.rms_norm_eps
        mixes = (2 + self.n) * self.n
        self.fn = nn.Parameter(torch.empty(mixes, self.n * config.hidden_size))
        self.base = nn.Parameter(torch.empty(mixes))
        self.scale = nn.Parameter(torch.empty(3))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [B, S, N, H] -> (the block's input [B, S, H], post [B, S, N], comb [B, S, N, N]) in float32."""
        n = self.n
        mixes = F.linear(rms_normalize(streams.flatten(2).to(torch.float32), self.norm_eps), self.fn.float())
        pre_w, post_w, comb_w = torch.split(mixes, [n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = torch.split(self.base.float(), [n, n, n * n])
        pre_s, post_s, comb_s = self.scale.float().unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(comb_w.view(*comb_w.shape[:-1], n, n) * comb_s + comb_b.view(n, n), dim=-1) + self.eps
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)
        return collapsed, post, sinkhorn(comb, self.iters, self.eps)

    @staticmethod
    def expand(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """The new streams [B, S, N, H]: the block's output out [B, S, H] written to each stream by post, plus the
        residual streams mixed by comb (h'_k = sum_j comb[j, k] h_j)."""
        dtype = streams.dtype
        mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
        return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + mixed


class HyperHead(nn.Module):
    """The final collapse of the N streams: hc_fn [N, N*H], hc_base [N], hc_scale [1]."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hc = config.hyper_connections
        assert hc is not None
        self.eps, self.norm_eps = hc.eps, config.rms_norm_eps
        self.hc_fn = nn.Parameter(torch.empty(hc.hc_mult, hc.hc_mult * config.hidden_size))
        self.hc_base = nn.Parameter(torch.empty(hc.hc_mult))
        self.hc_scale = nn.Parameter(torch.empty(1))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        """streams [B, S, N, H] -> [B, S, H]."""
        mixes = F.linear(rms_normalize(streams.flatten(2).to(torch.float32), self.norm_eps), self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.eps
        return (pre.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)
