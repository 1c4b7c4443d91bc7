"""How a model splits across tensor-parallel (and expert-parallel) ranks: the plan, from the config alone.

The rules are Megatron's and DeepSeek's own reference (``inference/model.py``: ColumnParallelLinear,
RowParallelLinear, ParallelEmbedding), applied to every parameter of ``CausalLM`` by its name. The model is built on
PyTorch's meta device, so DeepSeek-V3's 671 B parameters are planned in seconds without a byte of weights.

| parameter (suffix)                                   | rule        | split                                       |
|------------------------------------------------------|-------------|---------------------------------------------|
| embed_tokens, lm_head                                | vocab       | rows (vocabulary) / tp                      |
| q_proj, q_b_proj, kv_b_proj (+ biases)               | column      | output rows (heads) / tp                    |
| k_proj, v_proj (+ biases)                            | kv-column   | kv heads / tp; Hkv < tp: one head per rank  |
|                                                      |             | (each head replicated on tp / Hkv ranks)    |
| o_proj, down_proj (dense, shared experts)            | row         | input columns / tp, AllReduce after         |
| gate_proj, up_proj (dense, shared experts)           | column      | intermediate rows / tp                      |
| experts.gate_proj / up_proj / down_proj (routed)     | expert      | ep = tp: whole experts / ep; ep = 1: each   |
|                                                      |             | expert's intermediate / tp (column / row)   |
| norms, router (gate, correction bias), q_a_proj,     | replicated  | every rank holds all of it                  |
| kv_a_proj_with_mqa, q/k norms, o_proj bias           |             |                                             |

KV cache per rank: GQA keeps its kv heads (at least one); MLA's latent (kv_lora_rank + rope dims per token and
layer) is the same on every rank -- attention heads split, the latent they all read does not -- so MLA's per-rank
cache is the unsharded one, reported as such. Data-parallel attention (vLLM's / SGLang's DP attention for
DeepSeek) would instead give each rank whole sequences and all heads, dividing the latent cache by the number of
ranks at the price of replicated attention weights; this plan does not do that.

Dimension letters: N = tp ranks, E routed experts, H heads, Hkv kv heads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from moeforge.core.config import ModelConfig
from moeforge.core.errors import MoeforgeError
from moeforge.model.deepseek_v4 import DeepseekV4ForCausalLM
from moeforge.model.model import CausalLM

RULES = ("vocab", "column", "kv-column", "row", "expert", "replicated")


class ShardingError(MoeforgeError):
    """A tp / ep split this model cannot take; the message names the sizes that disagree."""


@dataclass(frozen=True)
class TensorShard:
    """One parameter's rule and what one rank holds of it (every rank holds the same amount)."""

    name: str
    shape: tuple[int, ...]
    rule: str
    per_rank_numel: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ShardPlan:
    """The split of one model over ``tp`` ranks with ``ep`` expert-parallel ranks (1 or tp)."""

    model: str
    tp: int
    ep: int
    tensors: tuple[TensorShard, ...]
    kv_values_per_token: int  # cache values one rank keeps per token, all layers
    kv_values_per_token_unsharded: int
    expert_ids: tuple[tuple[int, ...], ...] = field(default=())  # per rank, its routed experts (ep > 1)

    def weight_bytes_per_rank(self, dtype_bytes: float) -> int:
        return int(sum(t.per_rank_numel for t in self.tensors) * dtype_bytes)

    def total_weight_bytes(self, dtype_bytes: float) -> int:
        return int(sum(t.numel for t in self.tensors) * dtype_bytes)

    def replicated(self) -> list[str]:
        return [t.name for t in self.tensors if t.rule == "replicated"]

    def sharded_fraction_per_rank(self) -> float:
        """Per-rank elements of the sharded (not replicated) tensors over their total: 1 / tp when exact."""
        sharded = [t for t in self.tensors if t.rule != "replicated"]
        return sum(t.per_rank_numel for t in sharded) / max(sum(t.numel for t in sharded), 1)

    def summary(self, dtype_bytes: float = 2, kv_dtype_bytes: float = 2) -> dict[str, object]:
        """Numbers for a report: per-rank and total weight bytes, the replicated share, KV bytes per token."""
        replicated = sum(t.numel for t in self.tensors if t.rule == "replicated")
        return {
            "model": self.model, "tp": self.tp, "ep": self.ep,
            "weight_bytes_total": self.total_weight_bytes(dtype_bytes),
            "weight_bytes_per_rank": self.weight_bytes_per_rank(dtype_bytes),
            "sharded_fraction_per_rank": round(self.sharded_fraction_per_rank(), 6),
            "replicated_bytes_per_rank": int(replicated * dtype_bytes),
            "replicated_tensors": len(self.replicated()),
            "kv_bytes_per_token_per_rank": int(self.kv_values_per_token * kv_dtype_bytes),
            "kv_bytes_per_token_unsharded": int(self.kv_values_per_token_unsharded * kv_dtype_bytes),
            "experts_per_rank": len(self.expert_ids[0]) if self.expert_ids else None,
        }


def plan_sharding(config: ModelConfig, tp: int, ep: int = 1) -> ShardPlan:
    """The ``ShardPlan`` of ``config`` over ``tp`` ranks, experts split over ``ep`` of them (1: each expert
    tensor-parallel; tp: whole experts per rank). Raises ``ShardingError`` for a split the shapes cannot take."""
    _check(config, tp, ep)
    with torch.device("meta"):  # shapes only: no weights are allocated, whatever the model's size
        model = DeepseekV4ForCausalLM(config) if config.compressed_attention is not None else CausalLM(config)
    kv_heads = config.num_key_value_heads
    tensors = []
    for name, parameter in model.named_parameters():
        shape = tuple(parameter.shape)
        rule = _rule(name, config, ep)
        tensors.append(TensorShard(name, shape, rule, _per_rank(shape, rule, tp, ep, kv_heads, config)))
    experts = config.moe.n_routed_experts if config.moe is not None else 0
    expert_ids = tuple(tuple(range(r * experts // ep, (r + 1) * experts // ep)) for r in range(ep)) if ep > 1 else ()
    return ShardPlan(config.name, tp, ep, tuple(tensors), _kv_values(config, tp), _kv_values(config, 1), expert_ids)


def check_degrees(tp: int, ep: int) -> None:
    """Refuse a tp/ep pair no split takes (checked before any weight is loaded)."""
    if tp < 1 or ep < 1:
        raise ShardingError(f"--tp {tp} --ep {ep}: both must be >= 1")
    if ep not in (1, tp):
        fix = f"--tp {ep} --ep {ep}" if tp == 1 else f"--ep {tp} (whole experts per rank) or --ep 1 (each expert split)"
        raise ShardingError(f"--ep {ep} with --tp {tp}: expert parallelism places whole experts on the tp ranks, so "
                            f"--ep equals --tp or is 1; use {fix}")


def _check(config: ModelConfig, tp: int, ep: int) -> None:
    check_degrees(tp, ep)
    if config.num_attention_heads % tp:
        raise ShardingError(f"--tp {tp} does not divide the {config.num_attention_heads} attention heads of "
                            f"{config.name}: use a divisor of {config.num_attention_heads}")
    if tp > 1 and config.qk_norm == "projection":
        raise ShardingError(f"{config.name} normalises q and k over all heads at once (OLMoE's qk_norm), which a "
                            "rank holding some heads cannot compute without another collective: compile it "
                            "unsharded (--tp 1)")
    attn = config.compressed_attention
    if attn is not None and attn.o_groups % tp:
        raise ShardingError(f"--tp {tp} does not divide the {attn.o_groups} output groups (o_groups) of {config.name}: "
                            "a rank projects whole groups of its heads; use a divisor of o_groups")
    kv = config.num_key_value_heads
    if config.mla is None and kv % tp and tp % kv:
        raise ShardingError(f"--tp {tp} and the {kv} kv heads of {config.name}: one must divide the other (each "
                            "rank holds whole kv heads, replicated when there are fewer heads than ranks)")
    sizes = [("vocab_size", config.vocab_size)]
    if attn is None:  # DeepSeek-V4 has no dense MLP: its intermediate_size is unused
        sizes.append(("intermediate_size", config.intermediate_size))
    for name, size in sizes:
        if size % tp:
            raise ShardingError(f"--tp {tp} does not divide {name} {size} of {config.name}")
    moe = config.moe
    if moe is not None:
        if ep > 1 and moe.n_routed_experts % ep:
            raise ShardingError(f"--ep {ep} does not divide the {moe.n_routed_experts} routed experts of {config.name}")
        if ep == 1 and moe.moe_intermediate_size % tp:
            raise ShardingError(f"--tp {tp} does not divide moe_intermediate_size {moe.moe_intermediate_size} (each "
                                "expert is split across ranks with --ep 1): use --ep equal to --tp")


_V4_HEAD_SPLIT = ("self_attn.q_b_proj.weight", "self_attn.sinks", "self_attn.o_a_proj.weight")


def _rule(name: str, config: ModelConfig, ep: int) -> str:
    parts = name.split(".")
    leaf = parts[-2] if parts[-1] in ("weight", "bias") else parts[-1]
    if config.compressed_attention is not None:  # DeepSeek-V4 (rank_model_v4.py): the cache writers replicated
        if "compressor" in parts or "mtp" in parts:
            return "replicated"
        if name.endswith(_V4_HEAD_SPLIT):
            return "column"
        if name.endswith("self_attn.o_b_proj.weight"):
            return "row"
    if leaf in ("embed_tokens", "lm_head"):
        return "vocab"
    if "experts" in parts and "shared_experts" not in parts:
        return "expert"
    if leaf in ("q_proj", "q_b_proj", "kv_b_proj", "gate_proj", "up_proj"):
        return "column"
    if leaf in ("k_proj", "v_proj"):
        return "kv-column"
    if leaf in ("o_proj", "down_proj"):
        return "replicated" if parts[-1] == "bias" else "row"  # a row-parallel bias is added once, after AllReduce
    return "replicated"  # norms, router, low-rank down projections (q_a, kv_a), correction bias


def _per_rank(shape: tuple[int, ...], rule: str, tp: int, ep: int, kv_heads: int, config: ModelConfig) -> int:
    numel = math.prod(shape)
    if rule == "replicated":
        return numel
    if rule == "kv-column":
        return numel // tp if kv_heads >= tp else numel // kv_heads  # one whole head per rank when Hkv < tp
    if rule == "expert":
        return numel // ep if ep > 1 else numel // tp  # whole experts, or each expert's intermediate split
    return numel // tp  # vocab, column, row: one dimension divided


def _kv_values(config: ModelConfig, tp: int) -> int:
    """Cache values per token (all layers) one of ``tp`` ranks keeps."""
    layers = config.num_hidden_layers
    if config.compressed_attention is not None:  # V4: the whole cache on every rank (its writers are replicated)
        return layers * config.kv_cache_values_per_token()
    if config.mla is not None:
        return layers * config.mla.latent_dim  # the latent is replicated: the same on every rank
    heads = max(config.num_key_value_heads // tp, 1)
    return layers * 2 * heads * config.head_dim
