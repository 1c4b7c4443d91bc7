"""DeepSeek-V4's KV compressor: every ``rate`` tokens become one compressed KV entry (CSA, HCA, and CSA's indexer).

Dimension letters: B batch, S new tokens, P pending tokens (0 <= P < m), T entries so far, m = rate, W width of an
entry (head_dim, or index_head_dim for the indexer), c = 2 with overlap (CSA) else 1 (HCA), Dr rotary dims (the
trailing ones).

Each token projects to kv and gate logits [c*W]. A window of m tokens closes into one entry
    entry = rope(kv_norm(sum_j softmax_j(gate_j + position_bias_j) * kv_j)),  rotated at position (index of entry) * m,
the softmax over the window's tokens per channel. With overlap (CSA) a token's 2W values are two series: Ca (the first
W, read by the *next* window) and Cb (the last W, read by its own window); entry w pools window w-1's Ca with window w's
Cb over 2m slots (width 2m, stride m). Before the first window Ca is absent (kv 0, gate -inf: weight 0).

State (explicit tensors, grown and cut by shapes only, as a layer's cache holds them):
    entries [B, T, W]           the compressed entries so far
    pending [B, P, 2cW]         kv | gate of the tokens after the last closed window (not yet compressed)
    overlap [B, m, 2W]          (overlap only) kv | gate+bias of the last closed window's Ca half; 0 | -inf at first
A call with S new tokens closes n = (P + S) // m windows; with none closed (most decode steps) the entries and overlap
pass through unchanged and the token joins ``pending``. Exactly transformers' DeepseekV4HCACompressor /
DeepseekV4CSACompressor (and the compressor half of DeepseekV4Indexer) with their cache's buffer / overlap state.
"""

from __future__ import annotations

import torch
from torch import nn

from moeforge.core.config import ModelConfig
from moeforge.model.norm import RMSNorm
from moeforge.model.rope import RotaryEmbedding, apply_rotary_tail

CompressorState = tuple[torch.Tensor, ...]  # (entries, pending) or (entries, pending, overlap)


class KVCompressor(nn.Module):
    """kv_proj, gate_proj [c*W, H], position_bias [m, c*W], kv_norm [W]; RoPE with the compressed layers' setting."""

    def __init__(self, config: ModelConfig, width: int, rate: int, overlap: bool) -> None:
        super().__init__()
        attn = config.compressed_attention
        assert attn is not None
        self.width, self.rate, self.overlap = width, rate, overlap
        series = 2 if overlap else 1
        self.kv_proj = nn.Linear(config.hidden_size, series * width, bias=False)
        self.gate_proj = nn.Linear(config.hidden_size, series * width, bias=False)
        self.position_bias = nn.Parameter(torch.empty(rate, series * width))
        self.kv_norm = RMSNorm(width, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config, attn.compress_rope)

    def empty_state(self, x: torch.Tensor) -> CompressorState:
        """The state before any token, for a batch like x [B, S, H]."""
        b, series = x.shape[0], 2 if self.overlap else 1
        entries = x.new_zeros(b, 0, self.width)
        pending = x.new_zeros(b, 0, 2 * series * self.width)
        if not self.overlap:
            return entries, pending
        absent = torch.cat((x.new_zeros(b, self.rate, self.width),
                            x.new_full((b, self.rate, self.width), float("-inf"))), dim=-1)
        return entries, pending, absent

    def forward(self, x: torch.Tensor, state: CompressorState) -> CompressorState:
        """x [B, S, H] (the layer's normed input) and the state before it -> the state after it."""
        entries, pending = state[0], state[1]
        b, t, m = x.shape[0], entries.shape[1], self.rate
        kv_gate = torch.cat((pending, torch.cat((self.kv_proj(x), self.gate_proj(x)), dim=-1)), dim=1)  # [B, P+S, 2cW]
        n = kv_gate.shape[1] // m  # windows closed now (from shapes: no data-dependent control flow)
        closed = kv_gate[:, : n * m].view(b, n, m, kv_gate.shape[-1])  # [B, n, m, 2cW]
        kv, gate = closed.chunk(2, dim=-1)  # [B, n, m, cW] each
        gate = gate + self.position_bias
        if self.overlap:
            kv, gate, overlap = self._overlapping(kv, gate, state[2])  # [B, n, 2m, W] each
        pooled = (kv * gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)).sum(dim=2)  # [B, n, W]
        positions = ((torch.arange(n, device=x.device) + t) * m).unsqueeze(0).expand(b, -1)  # [B, n]
        cos, sin = self.rotary(positions)
        new = apply_rotary_tail(self.kv_norm(pooled).unsqueeze(2), cos, sin).squeeze(2)
        out = (torch.cat((entries, new.to(entries.dtype)), dim=1), kv_gate[:, n * m:])
        return (*out, overlap) if self.overlap else out

    def _overlapping(self, kv: torch.Tensor, gate: torch.Tensor,
                     overlap: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """kv, gate [B, n, m, 2W] (Ca | Cb) and the previous window's Ca -> each window's 2m slots (previous Ca, own
        Cb) [B, n, 2m, W] twice, and the new overlap state [B, m, 2W] (the last window's Ca: unchanged when n = 0)."""
        w = self.width
        own = torch.cat((kv[..., :w], gate[..., :w]), dim=-1)  # this call's windows' Ca [B, n, m, 2W]
        ca = torch.cat((overlap.unsqueeze(1), own), dim=1)  # [B, n+1, m, 2W]
        n = kv.shape[1]
        previous = ca[:, :n]  # window w reads window w-1's Ca (the first: the state's)
        slots_kv = torch.cat((previous[..., :w], kv[..., w:]), dim=2)
        slots_gate = torch.cat((previous[..., w:], gate[..., w:]), dim=2)
        return slots_kv, slots_gate, ca[:, n]
