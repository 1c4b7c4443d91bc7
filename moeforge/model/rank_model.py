"""One tensor-parallel rank of a ``CausalLM``: its slice of every weight, and the collectives that join the ranks.

``shard_model(model, tp, ep, rank)`` builds rank ``rank``'s model from the full one, with the rules of
``moeforge.model.sharding`` (Megatron's, and DeepSeek's reference ``inference/model.py``):

- attention: the rank's query heads (q_proj / q_b_proj / kv_b_proj rows) and kv heads (k/v_proj rows; with fewer
  kv heads than ranks, the one its query heads read), ``o_proj`` row-parallel: a partial sum, AllReduce, then the
  bias. MLA's q_a / kv_a projections and the latent they write are the same on every rank.
- dense MLP: gate/up rows, down columns, AllReduce after.
- MoE: the router on every rank; routed experts whole per rank (``ep == tp``) or each expert's intermediate split
  (``ep == 1``); shared experts split like a dense MLP; one AllReduce sums the routed and shared parts.
- embedding: vocab-parallel (a rank looks up only its rows, zeros elsewhere, AllReduce); LM head: vocab-parallel
  logits, AllGather along the vocabulary, so every rank (and the sampler on rank 0) sees all logits.

Collectives are ``torch.ops.moeforge.all_reduce`` / ``all_gather`` (``moeforge/ops/collectives/torch_op.py``): eager on
``torch.distributed``, exported as ``com.microsoft.AllReduce`` / ``AllGather``.

Dimension letters: B batch, S tokens, H hidden, V vocabulary, N = tp ranks.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from moeforge.core.config import ModelConfig
from moeforge.model.deepseek_v4 import DeepseekV4ForCausalLM
from moeforge.model.expert_slots import ExpertSlots
from moeforge.model.mlp import SwiGLU
from moeforge.model.model import CausalLM
from moeforge.model.moe import MoEBlock, slot_stack
from moeforge.model.rank_model_v4 import shard_v4_model
from moeforge.ops.collectives import torch_op as collectives  # noqa: F401  (registers torch.ops.moeforge.all_reduce / all_gather)


@dataclass(frozen=True)
class RankLayout:
    """What one rank holds: index ranges are [first, last + 1) in the unsharded model's numbering."""

    rank: int
    tp: int
    ep: int
    heads: tuple[int, int]
    kv_heads: tuple[int, int]
    vocab: tuple[int, int]
    experts: tuple[int, int] | None  # routed experts held (all, each partly, when ep == 1); slots with a placement
    # With an expert placement (``--placement``): per MoE layer, the logical expert of each of this rank's slots.
    expert_slots: tuple[tuple[int, ...], ...] | None = None

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


class AllReduce(nn.Module):
    """Sum over the ``group_size`` ranks."""

    def __init__(self, group_size: int) -> None:
        super().__init__()
        self.group_size = group_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.moeforge.all_reduce(x, self.group_size)
        return out


class AllReduced(nn.Module):
    """``inner`` computes a partial sum on each rank (a dense MLP with its down projection row-split)."""

    def __init__(self, inner: nn.Module, group_size: int) -> None:
        super().__init__()
        self.inner = inner
        self.reduce = AllReduce(group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.reduce(self.inner(x))
        return out


class RowParallelLinear(nn.Module):
    """y = AllReduce(x_local @ W_local^T) + b: the input features split over ranks, the bias added once."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [out, in / N]
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.reduce = AllReduce(group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows first .. first+V/N-1 of the table; ids outside them look up zeros here and are summed in."""

    def __init__(self, weight: torch.Tensor, first: int, group_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [V / N, H]
        self.first = first
        self.reduce = AllReduce(group_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.first  # [B, S]
        held = (local >= 0) & (local < self.weight.shape[0])
        rows = F.embedding(torch.where(held, local, 0), self.weight)  # [B, S, H]
        out: torch.Tensor = self.reduce(rows * held.unsqueeze(-1).to(rows.dtype))
        return out


class RankCausalLM(CausalLM):
    """A ``CausalLM`` whose LM head holds V/N vocabulary rows and gathers the logits of all ranks."""

    group_size: int = 1

    def lm_logits(self, x: torch.Tensor) -> torch.Tensor:
        local = F.linear(x, self.output_embedding).to(torch.float32)  # [B, S, V / N]
        out: torch.Tensor = torch.ops.moeforge.all_gather(local, local.dim() - 1, self.group_size)  # [B, S, V]
        return out


def rank_config(config: ModelConfig, tp: int, ep: int) -> ModelConfig:
    """The config one rank's modules are built from: its heads and intermediate sizes (vocabulary and expert count
    stay global: the router scores every expert, the sampler sees every logit)."""
    kv_heads = max(config.num_key_value_heads // tp, 1) if config.mla is None else config.num_attention_heads // tp
    changes: dict[str, object] = {
        "num_attention_heads": config.num_attention_heads // tp,
        "num_key_value_heads": kv_heads,
        "intermediate_size": config.intermediate_size // tp,
    }
    if config.moe is not None and ep == 1:
        changes["moe"] = dataclasses.replace(config.moe, moe_intermediate_size=config.moe.moe_intermediate_size // tp)
    return config.replace(**changes)


def rank_layout(config: ModelConfig, tp: int, ep: int, rank: int, slots: ExpertSlots | None = None) -> RankLayout:
    """Index ranges rank ``rank`` holds (see ``RankLayout``); with ``slots`` (an expert placement, ep > 1) its routed
    experts are its slots ``rank * S .. (rank + 1) * S - 1``."""
    heads = config.num_attention_heads // tp
    if config.mla is not None:
        kv = (rank * heads, (rank + 1) * heads)
    elif config.num_key_value_heads >= tp:
        per = config.num_key_value_heads // tp
        kv = (rank * per, (rank + 1) * per)
    else:  # fewer kv heads than ranks: the head this rank's query heads read, replicated on tp / Hkv ranks
        head = rank * config.num_key_value_heads // tp
        kv = (head, head + 1)
    vocab = config.vocab_size // tp
    experts = None
    if config.moe is not None:
        count = config.moe.n_routed_experts
        experts = (rank * count // ep, (rank + 1) * count // ep) if ep > 1 else (0, count)
    held = None
    if slots is not None and ep > 1:
        size = slots.slots_per_rank
        experts = (rank * size, (rank + 1) * size)
        held = tuple(slots.rank_experts(layer, rank) for layer in range(slots.layers))
    return RankLayout(rank, tp, ep, (rank * heads, (rank + 1) * heads), kv, (rank * vocab, (rank + 1) * vocab),
                      experts, held)


@dataclass(frozen=True)
class TensorSlice:
    """Where a rank's tensor comes from: ``source``[start:stop] along ``dim`` (the whole tensor when dim is None)."""

    source: str
    dim: int | None = None
    start: int = 0
    stop: int = 0
    # Instead of start:stop: whole experts by index along dim 0 (an expert placement's slots; ``EMPTY``: zeros).
    indices: tuple[int, ...] | None = None


_HEAD_ROWS = ("q_proj", "q_b_proj", "kv_b_proj")


def rank_sources(config: ModelConfig, layout: RankLayout,
                 source_shape: Callable[[str], tuple[int, ...]]) -> Callable[[str], TensorSlice | None]:
    """For a streamed per-rank compile: maps each tensor name of ``shard_model``'s rank model to the slice of the
    unsharded checkpoint tensor it holds (None: a derived buffer); ``source_shape`` gives an unsharded tensor's shape.
    The same rules as ``shard_model`` (checked tensor by tensor against it in tests/model/test_rank_sources.py), so
    that a rank reads only its slices."""
    tp, rank = layout.tp, layout.rank
    moe_index = moe_layer_index(config)

    def split(name: str, dim: int) -> TensorSlice:
        part = source_shape(name)[dim] // tp
        return TensorSlice(name, dim, rank * part, (rank + 1) * part)

    def source(name: str) -> TensorSlice | None:
        if name.endswith(".inv_freq"):  # RoPE's (DeepSeek-V4: also its compressed layers' and compressors')
            return None
        name = name.replace(".mlp.inner.", ".mlp.")  # AllReduced wraps a dense MLP's partial sums
        parts = name.split(".")
        leaf = parts[-2] if parts[-1] in ("weight", "bias") else parts[-1]
        if leaf in ("embed_tokens", "lm_head"):
            return TensorSlice(name, 0, *layout.vocab)
        if "compressor" in parts:  # DeepSeek-V4's compressors and indexer write the cache every rank keeps: replicated
            return TensorSlice(name)
        if "self_attn" in parts and leaf == "sinks":  # DeepSeek-V4 (rank_model_v4): one per query head
            return TensorSlice(name, 0, *layout.heads)
        if "self_attn" in parts and leaf in ("o_a_proj", "o_b_proj"):  # V4: the rank's output groups, row-parallel
            return split(name, 0 if leaf == "o_a_proj" else 1)
        if "self_attn" in parts and leaf in ("q_proj", "q_b_proj", "kv_b_proj", "k_proj", "v_proj"):
            kv = leaf in ("k_proj", "v_proj")
            first, last = layout.kv_heads if kv else layout.heads
            per = source_shape(name)[0] // (config.num_key_value_heads if kv else config.num_attention_heads)
            return TensorSlice(name, 0, first * per, last * per)  # rows per head
        if "self_attn" in parts and leaf == "o_proj":
            return split(name, 1) if parts[-1] == "weight" else TensorSlice(name)
        if "experts" in parts and "shared_experts" not in parts:
            if layout.expert_slots is not None:  # an expert placement: the logical expert of each slot
                return TensorSlice(name, 0, indices=layout.expert_slots[moe_index[int(parts[2])]])
            if layout.ep > 1:
                assert layout.experts is not None
                return TensorSlice(name, 0, *layout.experts)  # whole experts
            return split(name, 2 if leaf == "down_proj" else 1)  # each expert's intermediate
        if leaf in ("gate_proj", "up_proj", "down_proj"):  # a dense MLP, or the shared experts
            return split(name, 1 if leaf == "down_proj" else 0)
        return TensorSlice(name)  # replicated: norms, router, low-rank down projections, correction bias

    return source


def moe_layer_index(config: ModelConfig) -> dict[int, int]:
    """Decoder layer index -> its index among the MoE layers (the numbering of ``expert_hits`` and placements)."""
    moe_layers = [i for i in range(config.num_hidden_layers) if config.is_moe_layer(i)] if config.moe else []
    return {layer: index for index, layer in enumerate(moe_layers)}


def _rows(t: torch.Tensor, lo: int, hi: int, per: int) -> torch.Tensor:
    """Rows lo*per .. hi*per-1 (head-major projections: ``per`` rows per head)."""
    return t[lo * per: hi * per].clone()


def _split(t: torch.Tensor, dim: int, rank: int, tp: int) -> torch.Tensor:
    size = t.shape[dim] // tp
    return t.narrow(dim, rank * size, size).clone()


@torch.no_grad()
def shard_model(model: CausalLM, tp: int, ep: int, rank: int,
                slots: ExpertSlots | None = None) -> tuple[CausalLM, ModelConfig, RankLayout]:
    """Rank ``rank``'s model (its own copies of its weight slices), the config it was built from, and its layout.

    The split must be valid (``moeforge.model.sharding.plan_sharding`` checks it first); OLMoE-style q/k norms over the
    whole projection need every head and are refused by the plan. ``slots`` (ep > 1): an expert placement with
    replicas (``ExpertSlots.check`` first); each MoE layer holds the logical experts of its slots.
    """
    config = model.config
    layout = rank_layout(config, tp, ep, rank, slots)
    local: CausalLM
    if isinstance(model, DeepseekV4ForCausalLM):
        assert layout.experts is not None
        local, local_config = shard_v4_model(model, tp, ep, rank, layout.heads, layout.experts, AllReduce,
                                             slots if ep > 1 else None)
    else:
        local_config = rank_config(config, tp, ep)
        with torch.device("meta"):
            rank_local = RankCausalLM(local_config, model.mla_impl)
        rank_local.group_size = tp
        local = rank_local
    full = model.model
    embedding = VocabParallelEmbedding(_rows(full.embed_tokens.weight, *layout.vocab, 1), layout.vocab[0], tp)
    setattr(local.model, "embed_tokens", embedding)  # noqa: B010  (a module of another type than nn.Embedding)
    # Replicated modules are copied: each rank's model is released on its own once its graph is written.
    local.model.norm = copy.deepcopy(full.norm)
    _vocab_head(model, local, config, layout)
    if isinstance(model, DeepseekV4ForCausalLM):  # its layers are rank_model_v4's
        return local, local_config, layout
    layers: list[Any] = list(zip(full.layers, local.model.layers, strict=True))
    for index, (src, dst) in enumerate(layers):
        dst.input_layernorm = copy.deepcopy(src.input_layernorm)
        dst.post_attention_layernorm = copy.deepcopy(src.post_attention_layernorm)
        _shard_attention(src.self_attn, dst.self_attn, config, layout)
        dst.mlp = _shard_mlp(src.mlp, config, layout, index, slots)
    local.model.rotary = copy.deepcopy(full.rotary)
    return local, local_config, layout


def _vocab_head(model: CausalLM, local: CausalLM, config: ModelConfig, layout: RankLayout) -> None:
    if model.lm_head is not None:
        local.lm_head = nn.Linear(config.hidden_size, layout.vocab[1] - layout.vocab[0], bias=False)
        local.lm_head.weight = nn.Parameter(_rows(model.lm_head.weight, *layout.vocab, 1), requires_grad=False)


def _shard_attention(src: Any, dst: Any, config: ModelConfig, layout: RankLayout) -> None:
    tp, rank = layout.tp, layout.rank
    (h0, h1), (k0, k1) = layout.heads, layout.kv_heads
    for name, module in src.named_children():
        if name in ("q_proj", "q_b_proj", "kv_b_proj", "k_proj", "v_proj"):
            heads = (k0, k1) if name in ("k_proj", "v_proj") else (h0, h1)
            count = config.num_key_value_heads if name in ("k_proj", "v_proj") else config.num_attention_heads
            per = module.weight.shape[0] // count  # rows per head
            linear = getattr(dst, name)
            linear.weight = nn.Parameter(_rows(module.weight, *heads, per), requires_grad=False)
            if module.bias is not None:
                linear.bias = nn.Parameter(_rows(module.bias, *heads, per), requires_grad=False)
        elif name == "o_proj":
            setattr(dst, name, RowParallelLinear(_split(module.weight, 1, rank, tp),
                                                 None if module.bias is None else module.bias.clone(), tp))
        else:  # q_a_proj, kv_a_proj_with_mqa, latent norms, per-head q/k norms: the same on every rank
            setattr(dst, name, copy.deepcopy(module))


def _shard_swiglu(src: Any, dst: Any, rank: int, tp: int) -> None:
    dst.gate_proj.weight = nn.Parameter(_split(src.gate_proj.weight, 0, rank, tp), requires_grad=False)
    dst.up_proj.weight = nn.Parameter(_split(src.up_proj.weight, 0, rank, tp), requires_grad=False)
    dst.down_proj.weight = nn.Parameter(_split(src.down_proj.weight, 1, rank, tp), requires_grad=False)


def _shard_mlp(src: Any, config: ModelConfig, layout: RankLayout, index: int,
               slots: ExpertSlots | None = None) -> nn.Module:
    tp, ep, rank = layout.tp, layout.ep, layout.rank
    if not isinstance(src, MoEBlock):
        with torch.device("meta"):
            dense = SwiGLU(config.hidden_size, config.intermediate_size // tp)
        _shard_swiglu(src, dense, rank, tp)
        return AllReduced(dense, tp)
    moe = config.moe
    assert moe is not None and layout.experts is not None
    moe_index = moe_layer_index(config)[index]
    with torch.device("meta"):  # every tensor is replaced below
        block = MoEBlock(config if ep > 1 else rank_config(config, tp, ep))
    block.gate = copy.deepcopy(src.gate)
    experts = block.experts
    if ep > 1 and layout.expert_slots is not None:  # an expert placement: this rank's slots, replicas included
        held = layout.expert_slots[moe_index]
        for name in ("gate_proj", "up_proj", "down_proj"):
            setattr(experts, name, nn.Parameter(slot_stack(getattr(src.experts, name), held), requires_grad=False))
        experts.num_experts = len(held)
        block.first_expert = layout.experts[0]
        assert slots is not None
        block.slot_table = slots.slot_table(moe_index, moe.n_routed_experts)
    elif ep > 1:
        first, last = layout.experts
        for name in ("gate_proj", "up_proj", "down_proj"):
            setattr(experts, name, nn.Parameter(getattr(src.experts, name)[first:last].clone(), requires_grad=False))
        experts.num_experts = last - first
        block.first_expert = first
    else:
        experts.gate_proj = nn.Parameter(_split(src.experts.gate_proj, 1, rank, tp), requires_grad=False)
        experts.up_proj = nn.Parameter(_split(src.experts.up_proj, 1, rank, tp), requires_grad=False)
        experts.down_proj = nn.Parameter(_split(src.experts.down_proj, 2, rank, tp), requires_grad=False)
    if src.shared_experts is not None:
        with torch.device("meta"):
            shared = SwiGLU(config.hidden_size, moe.moe_intermediate_size * moe.n_shared_experts // tp)
        _shard_swiglu(src.shared_experts, shared, rank, tp)
        block.shared_experts = shared
    block.reduce = AllReduce(tp)
    return block
