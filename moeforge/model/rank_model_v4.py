"""One tensor-parallel rank of DeepSeek-V4 (``rank_model.shard_model`` calls ``shard_v4_model`` for V4 models).

The rules (``sharding.py`` lists them per parameter):
- attention: the rank's query heads (``q_b_proj`` rows, ``sinks``) and the output groups those heads make
  (``o_a_proj``: a group is ``num_heads / o_groups`` consecutive heads, so ``o_groups`` must divide by tp), then
  ``o_b_proj`` row-parallel with an AllReduce. Everything that writes the cache is replicated: q_a_proj / q_a_norm
  (the indexer reads the residual too), the shared key/value head (kv_proj, kv_norm), the compressors and the lightning
  indexer -- every rank keeps the whole cache, as MLA's latent is kept on every rank.
- MoE: router (and tid2eid) on every rank; routed experts whole per rank (ep == tp) or each split (ep == 1); the
  shared expert split like a dense MLP; one AllReduce sums both. With an expert placement (``--placement``) a rank
  holds its slots (copies of logical experts, replicas included) and routes every layer's choices, the hash layers'
  too, to them (``moe.local_choices``); every V4 layer is a MoE layer, so MoE layer i is decoder layer i.
- mHC (attn_hc, ffn_hc, hc_head), norms: replicated; embedding and LM head vocab-parallel as for every family.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from moeforge.core.config import ModelConfig
from moeforge.model.compressed_attention import CompressedAttention, GroupedLinear
from moeforge.model.deepseek_v4 import DeepseekV4ForCausalLM
from moeforge.model.deepseek_v4_moe import V4MoE
from moeforge.model.expert_slots import ExpertSlots
from moeforge.model.mlp import SwiGLU
from moeforge.model.moe import slot_stack


class RankDeepseekV4(DeepseekV4ForCausalLM):
    """DeepSeek-V4 whose LM head holds V/N vocabulary rows and gathers every rank's logits."""

    group_size: int = 1

    def lm_logits(self, x: torch.Tensor) -> torch.Tensor:
        local = F.linear(x, self.output_embedding).to(torch.float32)  # [..., V / N]
        out: torch.Tensor = torch.ops.moeforge.all_gather(local, local.dim() - 1, self.group_size)  # [..., V]
        return out


def v4_rank_config(config: ModelConfig, tp: int, ep: int) -> ModelConfig:
    """A rank's config: its heads and output groups (the indexer's heads stay whole: it is replicated)."""
    attn = config.compressed_attention
    moe = config.moe
    assert attn is not None and moe is not None
    changes: dict[str, object] = {
        "num_attention_heads": config.num_attention_heads // tp,
        "compressed_attention": dataclasses.replace(attn, o_groups=attn.o_groups // tp),
    }
    if ep == 1:
        changes["moe"] = dataclasses.replace(moe, moe_intermediate_size=moe.moe_intermediate_size // tp)
    return config.replace(**changes)


def _slice(t: torch.Tensor, dim: int, lo: int, hi: int) -> nn.Parameter:
    return nn.Parameter(t.narrow(dim, lo, hi - lo).clone(), requires_grad=False)


@torch.no_grad()
def shard_v4_model(model: DeepseekV4ForCausalLM, tp: int, ep: int, rank: int, heads: tuple[int, int],
                   experts: tuple[int, int], reduce: type[nn.Module],
                   slots: ExpertSlots | None = None) -> tuple[RankDeepseekV4, ModelConfig]:
    """Rank ``rank``'s model: query heads ``heads`` [first, last), routed experts ``experts`` (ep > 1; with an expert
    placement ``slots``, its slots), collectives made by ``reduce(group_size)`` (``rank_model.AllReduce``).
    Vocabulary-parallel embedding and head are the caller's (shared with every family)."""
    config = model.config
    attn_config = config.compressed_attention
    assert attn_config is not None
    local_config = v4_rank_config(config, tp, ep)
    with torch.device("meta"):
        local = RankDeepseekV4(local_config)
    local.group_size = tp
    full, dst = model.model, local.model
    for name in ("norm", "hc_head", "rotary", "compress_rotary"):
        setattr(dst, name, copy.deepcopy(getattr(full, name)))
    local.mtp = model.mtp
    d = config.head_dim
    groups_per_rank = attn_config.o_groups // tp
    g0, g1 = rank * groups_per_rank, (rank + 1) * groups_per_rank
    for index, (src_layer, dst_layer) in enumerate(zip(full.layers, dst.layers, strict=True)):
        for name in ("attn_hc", "ffn_hc", "input_layernorm", "post_attention_layernorm"):
            setattr(dst_layer, name, copy.deepcopy(getattr(src_layer, name)))
        src = cast(CompressedAttention, src_layer.self_attn)
        attn = cast(CompressedAttention, dst_layer.self_attn)
        for name in ("q_a_proj", "q_a_norm", "kv_proj", "kv_norm", "compressor"):
            setattr(attn, name, copy.deepcopy(getattr(src, name)))
        attn.q_b_proj.weight = _slice(src.q_b_proj.weight, 0, heads[0] * d, heads[1] * d)
        attn.sinks = _slice(src.sinks, 0, *heads)
        rank_rows = attn_config.o_lora_rank
        grouped = GroupedLinear(src.o_a_proj.weight.shape[1], groups_per_rank * rank_rows, groups_per_rank)
        grouped.weight = _slice(src.o_a_proj.weight, 0, g0 * rank_rows, g1 * rank_rows)
        attn.o_a_proj = grouped
        row_parallel = _RowParallel(_slice(src.o_b_proj.weight, 1, g0 * rank_rows, g1 * rank_rows), reduce(tp))
        setattr(attn, "o_b_proj", row_parallel)  # noqa: B010  (another module type than nn.Linear)
        dst_layer.mlp = shard_v4_moe(cast(V4MoE, src_layer.mlp), local_config, tp, ep, rank, experts, reduce(tp),
                                     slots, index)
    return local, local_config


class _RowParallel(nn.Module):
    """y = AllReduce(x_local @ W_local^T): o_b_proj over this rank's output groups."""

    def __init__(self, weight: nn.Parameter, reduce: nn.Module) -> None:
        super().__init__()
        self.weight = weight
        self.reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.reduce(F.linear(x, self.weight))
        return out


def shard_v4_moe(src: V4MoE, local_config: ModelConfig, tp: int, ep: int, rank: int, experts: tuple[int, int],
                 reduce: nn.Module, slots: ExpertSlots | None = None, layer: int = 0) -> V4MoE:
    """Rank ``rank``'s part of MoE layer ``layer`` (``src``): its routed experts ``experts`` (ep > 1; with an expert
    placement ``slots``, the slots ``experts`` names, each a copy of its logical expert) or a slice of each (ep == 1),
    its slice of the shared expert, ``reduce`` summing the ranks' partial outputs."""
    moe = local_config.moe
    assert moe is not None
    with torch.device("meta"):
        block = V4MoE(local_config, 0)
    block.gate = copy.deepcopy(src.gate)  # the source layer's own router (top-k or hash)
    routed = src.experts
    if ep > 1:
        first, last = experts
        held = None if slots is None else slots.rank_experts(layer, rank)
        for name in ("gate_proj", "up_proj", "down_proj"):
            stacked = getattr(routed, name)  # [E, ...]
            part = _slice(stacked, 0, first, last) if held is None else nn.Parameter(slot_stack(stacked, held),
                                                                                      requires_grad=False)
            setattr(block.experts, name, part)
        block.experts.num_experts = last - first
        block.first_expert = first
        if slots is not None:
            block.slot_table = slots.slot_table(layer, moe.n_routed_experts)
    else:
        size = moe.moe_intermediate_size
        lo, hi = rank * size, (rank + 1) * size
        block.experts.gate_proj = _slice(routed.gate_proj, 1, lo, hi)
        block.experts.up_proj = _slice(routed.up_proj, 1, lo, hi)
        block.experts.down_proj = _slice(routed.down_proj, 2, lo, hi)
    shared_size = src.shared_experts.gate_proj.weight.shape[0] // tp
    with torch.device("meta"):
        shared = SwiGLU(local_config.hidden_size, shared_size, src.shared_experts.limit)
    lo, hi = rank * shared_size, (rank + 1) * shared_size
    shared.gate_proj.weight = _slice(src.shared_experts.gate_proj.weight, 0, lo, hi)
    shared.up_proj.weight = _slice(src.shared_experts.up_proj.weight, 0, lo, hi)
    shared.down_proj.weight = _slice(src.shared_experts.down_proj.weight, 1, lo, hi)
    block.shared_experts = shared
    block.reduce = reduce
    return block
