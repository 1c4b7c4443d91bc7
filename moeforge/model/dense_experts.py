"""Routed experts dense over experts: the form a graph takes where NonZero cannot go (TensorRT-RTX).

Dimension letters: T tokens, H hidden, I expert intermediate, E experts (of this block), K experts per token.

``apply_experts`` (``moe.py``) runs each expert on the tokens routed to it: ``torch.where(expert_ids == e)`` exports to
NonZero, whose output length depends on the data. TensorRT-RTX 1.7's ONNX parser imports NonZero only through a
plugin it does not ship ("NonZero plugin creator version 1 was not found"), so a DeepSeek-V4 step graph (exported
whole, its MoE in torch) does not parse. ``apply_experts_dense`` is the same math with static shapes, the form the
other families' ``moeforge.MoEExperts`` local function has: every expert runs on every token ([E, T, H]), then each
token takes its K chosen rows and mixes them with the router's weights. Only the chosen rows are multiplied by a
weight, as in ``apply_experts`` (an unchosen expert's output never meets a zero weight, so an overflow there cannot
turn into NaN); the K products are summed in slot order instead of expert order. An id equal to E (an expert-parallel
rank's "another rank's expert", ``moe.hold_local_experts``) contributes nothing. Cost: E experts per token instead
of K; what TensorRT needs until a grouped-GEMM MoE plugin exists.

``dense_routed_experts(model)`` swaps every ``RoutedExperts`` of a model for a ``DenseRoutedExperts`` holding the same
parameters (same names and tensors, so an export's initializers are unchanged) while an export runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from moeforge.model.mlp import swiglu
from moeforge.model.moe import RoutedExperts


def apply_experts_dense(x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor,
                        gate_proj: torch.Tensor, up_proj: torch.Tensor, down_proj: torch.Tensor,
                        swiglu_limit: float | None = None) -> torch.Tensor:
    """x [T, H], ids/weights [T, K], stacked SwiGLU weights (gate/up [E, I, H], down [E, H, I]) -> [T, H]: every
    expert on every token, then each token's K chosen rows weighted and summed (ids >= E contribute nothing)."""
    experts = gate_proj.shape[0]
    gate = torch.matmul(x, gate_proj.transpose(1, 2))  # [E, T, I]
    up = torch.matmul(x, up_proj.transpose(1, 2))  # [E, T, I]
    every = torch.matmul(swiglu(gate, up, swiglu_limit), down_proj.transpose(1, 2))  # [E, T, H]
    ids = expert_ids.to(torch.int64)
    held = ids < experts
    tokens = torch.arange(x.shape[0], dtype=torch.int64, device=x.device)[:, None].expand_as(ids)  # [T, K]
    chosen = every[torch.where(held, ids, 0), tokens]  # [T, K, H]
    weights = torch.where(held, expert_weights, 0.0).to(x.dtype)  # [T, K]
    return (chosen * weights[..., None]).sum(dim=1)


class DenseRoutedExperts(RoutedExperts):
    """``RoutedExperts`` computed by ``apply_experts_dense``; built from an existing block, sharing its parameters."""

    @classmethod
    def sharing(cls, experts: RoutedExperts) -> DenseRoutedExperts:
        _, intermediate, hidden = experts.gate_proj.shape
        with torch.device("meta"):  # placeholders, replaced at once by the block's own parameters
            dense = cls(experts.num_experts, hidden, intermediate, experts.swiglu_limit)
        dense.gate_proj, dense.up_proj, dense.down_proj = experts.gate_proj, experts.up_proj, experts.down_proj
        return dense

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return apply_experts_dense(x, expert_ids, weights, self.gate_proj, self.up_proj, self.down_proj,
                                   self.swiglu_limit)


@contextlib.contextmanager
def dense_routed_experts(model: nn.Module) -> Iterator[int]:
    """While the block runs, every ``RoutedExperts`` in ``model`` computes dense over experts (same parameters);
    yields how many were swapped. The original modules are put back on exit."""
    swapped: list[tuple[nn.Module, str, nn.Module]] = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, RoutedExperts) and not isinstance(child, DenseRoutedExperts):
                swapped.append((parent, name, child))
    try:
        for parent, name, child in swapped:
            assert isinstance(child, RoutedExperts)
            setattr(parent, name, DenseRoutedExperts.sharing(child))
        yield len(swapped)
    finally:
        for parent, name, child in swapped:
            setattr(parent, name, child)

