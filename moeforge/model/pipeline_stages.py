"""Pipeline stages: a contiguous range of decoder layers per stage, and the model that runs one stage.

``moeforge compile MODEL -o DIR --pp P`` splits the decoder into P stages (GPipe, vLLM ``--pipeline-parallel-size``,
TensorRT-LLM ``pp_size``). Stage 0 also holds the embedding, the last stage the final norm and the LM head. What
crosses a stage boundary is the residual stream alone (a decoder layer returns ``x + mlp(norm(x))``): the hidden state
[B, S, H]. Each stage caches only its own layers' KV.

``plan_stages`` balances the split by bytes: each layer's weight bytes plus its KV bytes at the compile's
``max_seq_len`` (one full sequence), the embedding on stage 0, the head on the last stage; ``--pp-layers 0-13,14-27``
overrides it. ``stage_model`` builds the stage's ``StageLM`` from the whole model (or a tensor-parallel rank's model):
its layers renumbered from 0, its config (``stage_config``) with that many layers, so every pass works on a stage graph
as on a whole one.

DeepSeek-V4 (``v4_stage_model``): what crosses its stage boundary is the ``hc_mult`` streams of mHC, [T, N * H] per
packed token (``boundary_width``), and every stage also takes the token ids (a hash-routed MoE layer picks its experts
by ``tid2eid[input_ids]`` wherever it sits); stage 0 holds the embedding, the last the HyperHead, final norm and head.
``model/v4_step.py`` runs a stage (its model's ``pipeline_stage``).

Dimension letters: B batch, S tokens, T packed tokens, H hidden, N mHC streams, V vocabulary.
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
from moeforge.core.errors import MoeforgeError
from moeforge.model.deepseek_v4 import DeepseekV4ForCausalLM
from moeforge.model.model import CausalLM, KVCache, ModelOutput
from moeforge.model.rank_model import TensorSlice
from moeforge.model.rank_model_v4 import RankDeepseekV4
from moeforge.model.sharding import plan_sharding
from moeforge.ops.collectives import torch_op as collectives  # noqa: F401  (registers torch.ops.moeforge.all_gather)

HIDDEN_INPUT = "hidden_states_in"  # a later stage's graph input [B, S, H] (paged: [T, H])
HIDDEN_OUTPUT = "hidden_states"  # a stage's graph output other than the last [B, S, H] (paged: [T, H])


@dataclass(frozen=True)
class StageSpec:
    """Stage ``stage`` of ``pp``: decoder layers ``first_layer`` .. ``last_layer - 1`` of the whole model."""

    stage: int
    pp: int
    first_layer: int
    last_layer: int

    @property
    def num_layers(self) -> int:
        return self.last_layer - self.first_layer

    @property
    def has_embedding(self) -> bool:
        return self.stage == 0

    @property
    def has_head(self) -> bool:
        return self.stage == self.pp - 1

    def to_dict(self) -> dict[str, Any]:
        return {"stage": self.stage, "pp": self.pp, "layers": [self.first_layer, self.last_layer],
                "embedding": self.has_embedding, "head": self.has_head}

    @classmethod
    def from_dict(cls, data: Any) -> StageSpec:
        first, last = data["layers"]
        return cls(int(data["stage"]), int(data["pp"]), int(first), int(last))


@dataclass(frozen=True)
class StageCost:
    """What each rank of one stage holds, in bytes (from the config; the compile records the real ones)."""

    weight_bytes: int
    kv_bytes_per_token: int


def stage_costs(config: ModelConfig, specs: list[StageSpec], bytes_per_weight: float, kv_bytes_per_value: int,
                tp: int = 1, ep: int = 1) -> list[StageCost]:
    """Per stage, what each of its ``tp`` ranks holds: weight bytes (``bytes_per_weight`` per parameter; each tensor
    split by ``model/sharding.py``'s rules, replicated ones whole) and KV bytes per token (its layers' cached values x
    ``kv_bytes_per_value``; MLA's latent is not split by tp, GQA's kv heads are). From the config alone."""
    plan = plan_sharding(config, tp, ep)
    per_layer: dict[int, int] = {}
    embedding = head = norm = 0
    for tensor in plan.tensors:
        parts = tensor.name.split(".")
        if parts[:2] == ["model", "layers"]:
            per_layer[int(parts[2])] = per_layer.get(int(parts[2]), 0) + tensor.per_rank_numel
        elif tensor.name == "model.embed_tokens.weight":
            embedding = tensor.per_rank_numel
        elif tensor.name == "lm_head.weight":
            head = tensor.per_rank_numel
        elif tensor.name == "model.norm.weight":
            norm = tensor.per_rank_numel
    head = head or embedding  # tied: the last stage holds its own copy of the table
    if config.mla is not None or config.compressed_attention is not None:  # not split by tp (V4: the average)
        kv_layer = config.kv_cache_values_per_token()
    else:
        kv_layer = 2 * max(config.num_key_value_heads // tp, 1) * config.head_dim
    out = []
    for spec in specs:
        params = sum(per_layer.get(i, 0) for i in range(spec.first_layer, spec.last_layer))
        params += (embedding if spec.has_embedding else 0) + (head + norm if spec.has_head else 0)
        out.append(StageCost(int(params * bytes_per_weight), kv_layer * kv_bytes_per_value * spec.num_layers))
    return out


def plan_stages(config: ModelConfig, pp: int, *, layers: str | None = None, bytes_per_weight: float = 4.0,
                kv_bytes_per_value: int = 4, kv_tokens: int = 2048) -> list[StageSpec]:
    """The ``pp`` stages of ``config``: ``layers`` ("0-13,14-27", every layer once, in order) as given, else the
    contiguous split that minimises the largest stage's bytes (weights + KV at ``kv_tokens`` tokens). Raises
    ``MoeforgeError`` naming the problem."""
    n = config.num_hidden_layers
    if not 1 <= pp <= n:
        raise MoeforgeError(f"--pp {pp}: {config.name or 'the model'} has {n} decoder layers, so --pp must be in "
                            f"1..{n} (each stage holds at least one layer)")
    if layers is not None:
        ranges = parse_pp_layers(layers, n, pp)
        return [StageSpec(s, pp, a, b) for s, (a, b) in enumerate(ranges)]
    kv = config.kv_cache_values_per_token() * kv_bytes_per_value * kv_tokens
    layer_cost = [config.layer_parameters(i) * bytes_per_weight + kv for i in range(n)]
    embed = config.embedding_parameters() * bytes_per_weight
    head = (config.embedding_parameters() + config.hidden_size) * bytes_per_weight
    prefix = [0.0]
    for layer in layer_cost:
        prefix.append(prefix[-1] + layer)

    def cost(a: int, b: int, stage: int) -> float:
        return prefix[b] - prefix[a] + (embed if stage == 0 else 0.0) + (head if stage == pp - 1 else 0.0)

    # best[s][b]: the smallest largest-stage cost of stages 0..s covering layers 0..b-1 (s + 1 <= b).
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(pp)]
    cut = [[0] * (n + 1) for _ in range(pp)]
    for b in range(1, n + 1):
        best[0][b] = cost(0, b, 0)
    for s in range(1, pp):
        for b in range(s + 1, n + 1):
            for a in range(s, b):
                value = max(best[s - 1][a], cost(a, b, s))
                if value < best[s][b]:
                    best[s][b], cut[s][b] = value, a
    bounds, b = [n], n
    for s in range(pp - 1, 0, -1):
        b = cut[s][b]
        bounds.append(b)
    bounds.append(0)
    bounds.reverse()
    return [StageSpec(s, pp, bounds[s], bounds[s + 1]) for s in range(pp)]


def parse_pp_layers(text: str, num_layers: int, pp: int) -> list[tuple[int, int]]:
    """"0-13,14-27" -> [(0, 14), (14, 28)]: ``pp`` inclusive ranges covering layers 0..num_layers-1 in order."""
    fix = f"give {pp} comma-separated ranges like 0-{num_layers // 2 - 1},{num_layers // 2}-{num_layers - 1}"
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != pp:
        raise MoeforgeError(f"--pp-layers {text!r} has {len(parts)} ranges for --pp {pp}: {fix}")
    ranges, expected = [], 0
    for part in parts:
        first, sep, last = part.partition("-")
        try:
            a, b = int(first), int(last if sep else first)
        except ValueError:
            raise MoeforgeError(f"--pp-layers: {part!r} is not a range of layer numbers: {fix}") from None
        if a != expected or b < a:
            raise MoeforgeError(f"--pp-layers: {part!r} should start at layer {expected} and not end before it "
                                f"(stages are contiguous, in order, each at least one layer): {fix}")
        ranges.append((a, b + 1))
        expected = b + 1
    if expected != num_layers:
        raise MoeforgeError(f"--pp-layers {text!r} covers layers 0..{expected - 1}, the model has {num_layers}: {fix}")
    return ranges


def stage_config(config: ModelConfig, spec: StageSpec) -> ModelConfig:
    """The config the stage's graph is built and checked with: its layers only, renumbered from 0 (the per-layer
    fields, MoE's first dense layers and dense_layers, follow the renumbering)."""
    changes: dict[str, Any] = {"num_hidden_layers": spec.num_layers}

    def renumbered(layers: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(i - spec.first_layer for i in layers if spec.first_layer <= i < spec.last_layer)

    if config.moe is not None:
        moe = config.moe
        changes["moe"] = dataclasses.replace(
            moe, first_k_dense_replace=min(max(moe.first_k_dense_replace - spec.first_layer, 0), spec.num_layers),
            dense_layers=renumbered(moe.dense_layers), hash_layers=renumbered(moe.hash_layers))
    attention = config.compressed_attention
    if attention is not None:  # DeepSeek-V4: each layer's type (sliding, CSA, HCA) follows the renumbering
        changes["compressed_attention"] = dataclasses.replace(
            attention, layer_types=attention.layer_types[spec.first_layer: spec.last_layer])
    return config.replace(**changes)


def boundary_width(config: ModelConfig) -> int:
    """Values per token that cross a stage boundary: the residual stream, ``hidden_size`` (DeepSeek-V4: its
    ``hc_mult`` streams, ``hc_mult * hidden_size``, flattened per token)."""
    streams = config.hyper_connections.hc_mult if config.hyper_connections is not None else 1
    return streams * config.hidden_size


class StageLM(CausalLM):
    """One pipeline stage: (input_ids [B, S] on stage 0, else the hidden state [B, S, H]; position_ids [B, S]) ->
    logits [B, S, V] float32 on the last stage, else the hidden state [B, S, H]; its layers' cache as ``CausalLM``'s.
    ``group_size`` > 1: a tensor-parallel rank's stage, whose head gathers the vocabulary-parallel logits."""

    spec: StageSpec
    group_size: int = 1

    def forward(
        self,
        inputs: torch.Tensor,
        position_ids: torch.Tensor,
        past_key_values: KVCache | None = None,
        output_hidden_states: bool = False,
    ) -> ModelOutput:
        x = self.model.embed_tokens(inputs) if self.spec.has_embedding else inputs  # [B, S, H]
        x, present, hidden = self.run_layers(x, position_ids, past_key_values, output_hidden_states)
        return ModelOutput(self.lm_logits(self.model.norm(x)) if self.spec.has_head else x, present, hidden)

    def lm_logits(self, x: torch.Tensor) -> torch.Tensor:
        local = F.linear(x, self.output_embedding).to(torch.float32)  # [B, S, V / N]
        if self.group_size == 1:
            return local
        out: torch.Tensor = torch.ops.moeforge.all_gather(local, local.dim() - 1, self.group_size)  # [B, S, V]
        return out


@torch.no_grad()
def stage_model(source: CausalLM, spec: StageSpec, group_size: int = 1) -> CausalLM:
    """Stage ``spec`` of ``source`` (the whole model, or a tensor-parallel rank's ``RankCausalLM`` with ``group_size``
    its tp): a ``StageLM`` sharing ``source``'s modules for its layers (renumbered from 0), the embedding on stage 0,
    the final norm and head on the last (a tied head: the embedding table, held by the last stage as its head).
    DeepSeek-V4: ``v4_stage_model``."""
    if isinstance(source, DeepseekV4ForCausalLM):
        return v4_stage_model(source, spec, group_size)
    config = stage_config(source.config, spec)
    with torch.device("meta"):
        stage = StageLM(config, source.mla_impl)
    stage.spec = spec
    stage.group_size = group_size
    _share_modules(stage, source, spec)
    return stage


def _share_modules(stage: CausalLM, source: CausalLM, spec: StageSpec) -> None:
    """Give ``stage`` (built on the meta device) ``source``'s modules of stage ``spec``: its layers, its own copy of
    the RoPE (every stage has one: each is released with its own stage), the embedding on stage 0, the final norm and
    head on the last."""
    full = source.model
    stage.model.layers = nn.ModuleList(list(full.layers[spec.first_layer: spec.last_layer]))
    stage.model.rotary = copy.deepcopy(full.rotary)
    # A tied table is also the last stage's head: stage 0 takes its own copy, so that releasing stage 0's weights
    # once its graph is written (compile/stages.py) leaves the source's table for the last stage to copy.
    tied = source.lm_head is None and spec.pp > 1
    embedding = copy.deepcopy(full.embed_tokens) if tied else full.embed_tokens
    stage.model.embed_tokens = embedding if spec.has_embedding else None  # type: ignore[assignment]
    stage.model.norm = full.norm if spec.has_head else None  # type: ignore[assignment]
    if not spec.has_head:
        stage.lm_head = None
    elif source.lm_head is not None:
        stage.lm_head = source.lm_head
    elif not spec.has_embedding:  # tied embeddings: the last stage holds its own copy of the table as its head
        head = nn.Linear(1, 1, bias=False)
        table = full.embed_tokens.weight  # [V (/ N), H]
        head.weight = nn.Parameter(table.detach().clone(), requires_grad=False)
        stage.lm_head = head


@torch.no_grad()
def v4_stage_model(source: DeepseekV4ForCausalLM, spec: StageSpec, group_size: int = 1) -> DeepseekV4ForCausalLM:
    """DeepSeek-V4's stage ``spec`` of ``source`` (the whole model or a tensor-parallel rank's ``RankDeepseekV4``, whose
    class it keeps, ``group_size`` its tp): a model sharing ``source``'s modules for its layers, with
    ``pipeline_stage`` set to ``spec``. A tied table is copied for the stage that lacks it, as for other models."""
    config = stage_config(source.config, spec)
    with torch.device("meta"):
        stage = type(source)(config)
    stage.pipeline_stage = spec
    if isinstance(stage, RankDeepseekV4):
        stage.group_size = group_size  # its head gathers the vocabulary-parallel logits
    _share_modules(stage, source, spec)
    full = source.model
    stage.model.compress_rotary = copy.deepcopy(full.compress_rotary)
    stage.model.hc_head = full.hc_head if spec.has_head else None  # type: ignore[assignment]
    return stage


def stage_sources(spec: StageSpec, source: Callable[[str], TensorSlice | None],
                  tied: bool) -> Callable[[str], TensorSlice | None]:
    """For a streamed compile: each tensor name of ``stage_model``'s stage -> what ``source`` (the whole or rank
    model's mapping to the checkpoint) says of the name it has there."""

    def where(name: str) -> TensorSlice | None:
        if name.startswith("model.layers."):
            index, _, rest = name[len("model.layers."):].partition(".")
            return source(f"model.layers.{int(index) + spec.first_layer}.{rest}")
        if name == "lm_head.weight" and tied:
            return source("model.embed_tokens.weight")
        return source(name)

    return where
