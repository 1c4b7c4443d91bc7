"""MoE block (DeepSeekMoE and the GQA MoE families): router ("gate"), stacked routed SwiGLU experts, optional
shared experts.

Dimension letters: B batch, S tokens, T = B*S, H hidden, I expert intermediate, E experts, K top-k.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moeforge.core.config import ModelConfig
from moeforge.model.expert_slots import EMPTY
from moeforge.model.mlp import SwiGLU, swiglu
from moeforge.model.routing import route_tokens


def apply_experts(x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor, gate_proj: torch.Tensor,
                  up_proj: torch.Tensor, down_proj: torch.Tensor, swiglu_limit: float | None = None) -> torch.Tensor:
    """x [T, H], ids/weights [T, K], stacked SwiGLU weights -> [T, H] (only the chosen experts run; ``swiglu_limit``:
    DeepSeek-V4's clamped SwiGLU)."""
    out = torch.zeros_like(x)
    # The loop is over a static expert count; which tokens an expert gets is a tensor op
    # (exports to NonZero/Gather/ScatterND), so there is no data-dependent Python control flow.
    for e in range(gate_proj.shape[0]):
        token_idx, slot = torch.where(expert_ids == e)  # [n_e], [n_e]
        xs = x[token_idx]
        h = swiglu(F.linear(xs, gate_proj[e]), F.linear(xs, up_proj[e]), swiglu_limit)
        y = F.linear(h, down_proj[e]) * expert_weights[token_idx, slot, None].to(x.dtype)
        out = out.index_add(0, token_idx, y)
    return out


class MoERouter(nn.Module):
    """Router logits in fp32 (weight [E, H]) plus DeepSeek-V3's score correction bias [E]."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        assert config.moe is not None
        self.moe = config.moe
        self.weight = nn.Parameter(torch.empty(config.moe.n_routed_experts, config.hidden_size))
        if config.moe.has_correction_bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(config.moe.n_routed_experts))
        else:
            self.e_score_correction_bias = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x: [T, H] -> expert ids [T, K] int64, weights [T, K] float32
        logits = F.linear(x.to(torch.float32), self.weight.to(torch.float32))
        return route_tokens(logits, self.e_score_correction_bias, self.moe)


class RoutedExperts(nn.Module):
    """E SwiGLU experts held as stacked tensors: gate/up [E, I, H], down [E, H, I]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 swiglu_limit: float | None = None) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.swiglu_limit = swiglu_limit
        self.gate_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.up_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        # x: [T, H]; expert_ids, weights: [T, K] -> [T, H]
        return apply_experts(x, expert_ids, weights, self.gate_proj, self.up_proj, self.down_proj, self.swiglu_limit)


def hold_local_experts(expert_ids: torch.Tensor, weights: torch.Tensor, first: int,
                       count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An expert-parallel rank holds experts first .. first+count-1: ids [T, K] become local (0 .. count-1); a slot
    routed to another rank's expert gets id ``count`` (no expert of this rank) and weight 0, so it runs nothing
    here (its rank adds it)."""
    local = expert_ids - first
    held = (local >= 0) & (local < count)
    return torch.where(held, local, count), torch.where(held, weights, 0.0)


def route_to_replicas(expert_ids: torch.Tensor, logical_to_slot: torch.Tensor,
                      replica_count: torch.Tensor) -> torch.Tensor:
    """Logical expert ids [T, K] -> physical slot ids [T, K] under an expert placement with replicas (EPLB).

    ``logical_to_slot`` [E, R_max] lists each logical expert's slots (padded by repeating its first), ``replica_count``
    [E] how many it has. The ``j``-th choice of expert ``e`` in the step (counted in token order) goes to its replica
    ``(j + s) % replica_count[e]``, ``s`` the sum of all the step's expert ids: deterministic, so every rank maps a
    choice to the same one slot; within a step the choices of a replicated expert split evenly (counts differ by at
    most one) whatever position ``k`` the router gives it, and the offset ``s`` changes from step to step, so the odd
    choice of an uneven split (a decode step choosing the expert once) does not always land on the first replica.
    (A rule on the flat position ``t * K + k`` would not split a hot expert that is mostly the top choice when ``K``
    and the replica count share a factor.) Every replica holds the same weights, so the model's math is unchanged."""
    expert_ids = expert_ids.to(torch.int64)  # the exported router's ids are int32; ONNX indexes with int64
    flat = expert_ids.reshape(-1)  # [T * K], token-major
    experts = torch.arange(logical_to_slot.shape[0], dtype=torch.int64)
    chosen = (flat[:, None] == experts[None, :]).to(torch.int64)  # [T * K, E] one-hot
    occurrence = torch.gather(torch.cumsum(chosen, dim=0), 1, flat[:, None]).squeeze(1) - 1  # [T * K]
    replica = torch.remainder(occurrence + flat.sum(), replica_count[flat])  # [T * K]
    slots: torch.Tensor = logical_to_slot[flat, replica].reshape(expert_ids.shape)
    return slots


# An expert placement's routing table of one MoE layer (``ExpertSlots.slot_table``): (logical_to_slot [E, R_max],
# replica_count [E]) as nested tuples, turned into constants at trace time (not buffers: nothing to read from a
# checkpoint).
SlotTable = tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]


def local_choices(expert_ids: torch.Tensor, weights: torch.Tensor, *, routed: int, held: int, first: int,
                  slot_table: SlotTable | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A router's global choices [T, K] as a block's that holds ``held`` of the ``routed`` experts (or placement
    slots) from ``first``: unchanged when it holds every routed expert, else ``hold_local_experts``; with a
    placement, each logical choice first goes to one of its replicas' slots (``route_to_replicas``) and the rank
    holds slots, not experts. Whoever picked the experts (a learned router, DeepSeek-V4's token-id hash) is alike."""
    if slot_table is not None:
        table, counts = slot_table
        # The tables are constants with values (CPU): a streamed compile traces on the meta device, where a
        # tensor has none, so the lookup runs on CPU and its result moves back (both moves export as nothing).
        slots = route_to_replicas(expert_ids.cpu(), torch.tensor(table, dtype=torch.int64),
                                  torch.tensor(counts, dtype=torch.int64)).to(expert_ids.device)
        return hold_local_experts(slots, weights, first, held)
    if held == routed:
        return expert_ids, weights
    return hold_local_experts(expert_ids, weights, first, held)


def slot_stack(stacked: torch.Tensor, held: tuple[int, ...]) -> torch.Tensor:
    """Stacked expert weights [E, ...] -> a placement rank's [S, ...]: slot s a copy of expert ``held[s]``'s
    (``EMPTY``: zeros, a slot nothing routes to)."""
    return torch.stack([stacked[e] if e != EMPTY else torch.zeros_like(stacked[0]) for e in held])


class MoEBlock(nn.Module):
    """out = sum_k w_k * expert_k(x) + shared_experts(x).

    On a tensor-parallel rank (``moeforge/model/rank_model.py``) the block holds a part of the experts (``first_expert``
    onwards, or a slice of every expert's intermediate) and of the shared experts, and ``reduce`` (an AllReduce
    over the ranks) sums the parts: one collective per MoE layer.
    """


    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        moe = config.moe
        assert moe is not None
        self.first_expert = 0  # expert parallelism: the global id of this block's first routed expert (or slot)
        self.slot_table: SlotTable | None = None  # an expert placement with replicas (``compile --placement``)
        self.reduce: nn.Module | None = None  # tensor parallelism: sums the ranks' partial outputs
        self.gate = MoERouter(config)
        self.experts = RoutedExperts(moe.n_routed_experts, config.hidden_size, moe.moe_intermediate_size)
        self.shared_experts = (
            SwiGLU(config.hidden_size, moe.moe_intermediate_size * moe.n_shared_experts)
            if moe.n_shared_experts > 0
            else None
        )

    def local_routing(self, expert_ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The router's global choices [T, K] as this block's (``local_choices``: its experts, or its placement's
        slots)."""
        return local_choices(expert_ids, weights, routed=self.gate.moe.n_routed_experts,
                             held=self.experts.num_experts, first=self.first_expert, slot_table=self.slot_table)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [B, S, H]
        flat = x.reshape(-1, x.shape[-1])  # [T, H]
        expert_ids, weights = self.local_routing(*self.gate(flat))
        out: torch.Tensor = self.experts(flat, expert_ids, weights).view_as(x)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out if self.reduce is None else self.reduce(out)
