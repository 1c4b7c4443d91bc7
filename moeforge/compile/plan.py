"""``moeforge compile MODEL --plan``: what a compile will write and need, from the config alone (no weights read).

What the compile refuses before it reads a weight is one function, ``check_compile``, that the sharded compile and
``--plan`` both run: a plan is printed only for a compile that would start.

The model is built on the meta device (no memory) and, for ``--tp/--ep``, each rank's model is cut from it by the
same ``shard_model`` the sharded compile runs: every number per rank is exact in parameters. Artifact bytes are
float32 for vectors, norms, routers and the embedding, and the scheme's storage for every other matrix (codes plus
one float32 scale, and an offset for the asymmetric schemes, per block): an estimate within a few percent (the
LM head's own scheme and the argmax head's int8 copy are left out).

The working set is the streamed compile's (``--stream``): weights are read one tensor (q/k/v: one group) at a time
as the artifact is written, and routed experts one expert at a time, so its peak is the process's fixed part plus a
multiple of the largest layer's float32 weights with each stacked routed-experts tensor counted as one expert (a
transform holds what it reads and what it makes: the MoE fc1 reads an expert's gate and up, writes both interleaved).
Both constants come from ``benchmarks/compile_memory.py`` on the synthetic DeepSeek-V3-shaped checkpoints
(``benchmarks/results/compile_memory.json``); so does the rate behind the time estimate.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from moeforge.compile.options import DEFAULT_MAX_SEQ_LEN, CompileOptions, check_flags, check_ranks
from moeforge.core.config import ModelConfig
from moeforge.core.errors import MoeforgeError
from moeforge.core.kv_layout import DEFAULT_BLOCK_SIZE, KV_CACHE_KINDS, contiguous_spec, paged_spec
from moeforge.core.kv_layout_v4 import check_block_size as check_v4_block_size
from moeforge.core.kv_layout_v4 import default_block_size
from moeforge.core.sizes import format_bytes
from moeforge.model.expert_slots import ExpertSlots, load_plan
from moeforge.model.lazy_weights import is_expert_stack_name
from moeforge.model.loader import load_config, new_model
from moeforge.model.model import CausalLM
from moeforge.model.pipeline_stages import StageSpec, plan_stages, stage_model
from moeforge.model.rank_model import moe_layer_index, shard_model
from moeforge.model.sharding import plan_sharding
from moeforge.quant.schemes import SCHEMES
from moeforge.quant.spec import validate
from moeforge.runtime.backends.registry import BACKENDS, refusal

GIB = 2**30
# Fit to benchmarks/results/compile_memory.json (fp32 --stream rows, 2 cores, synthetic DeepSeek-V3-shaped
# checkpoints): the smallest memory cap under which a streamed compile succeeds is RUNTIME_BYTES + LAYER_FACTOR x
# its largest layer's float32 bytes (576 MiB with 86 MiB layers, 1344 MiB with 633 MiB layers, whatever the number
# of layers); it takes FIXED_SECONDS plus the float32 weights at RATE_BYTES_PER_S (1.4 B parameters: 52 s).
RUNTIME_BYTES = 460 * 2**20
LAYER_FACTOR = 1.4
# Graph bookkeeping per decoder layer (the torch.export program, the onnx-ir graph, the rewriter's state), not
# weights: a streamed tp 2 rank's peak RSS was 878 MB at 2 layers and 952 MB at 8 (~12 MB a layer).
PER_LAYER_BYTES = 12 * 2**20
FIXED_SECONDS = 20.0
RATE_BYTES_PER_S = 190e6

@dataclass(frozen=True)
class RankPlan:
    """One rank's share: parameters, the artifact's weight bytes, the largest layer's float32 bytes (its stacked
    routed experts counted as one expert each: the streamed compile reads and writes them expert by expert)."""

    rank: int
    parameters: int
    artifact_bytes: int
    largest_layer_fp32_bytes: int


@dataclass(frozen=True)
class CompilePlan:
    """A compile's plan: per rank, the working set of a streamed compile and its time at the measured rate."""

    model: str
    scheme: str
    tp: int
    ep: int
    total_parameters: int
    ranks: list[RankPlan]
    layers: int = 0  # decoder layers of the largest rank graph (graph bookkeeping grows with them: PER_LAYER_BYTES)
    pp: int = 1
    stages: list[list[int]] | None = None  # each pipeline stage's layers [first, last) (pp > 1)

    @property
    def peak_bytes(self) -> int:
        """The streamed compile's planned peak memory, for the largest rank."""
        return (RUNTIME_BYTES + int(LAYER_FACTOR * max(r.largest_layer_fp32_bytes for r in self.ranks))
                + PER_LAYER_BYTES * self.layers)

    @property
    def seconds(self) -> float:
        """Time to read, transform and write every rank at the measured rate (ranks one after another)."""
        return FIXED_SECONDS * len(self.ranks) + sum(4 * r.parameters for r in self.ranks) / RATE_BYTES_PER_S

    def table(self) -> str:
        """The plan as a text table, one line per rank."""
        lines = [f"plan: {self.model}, {self.total_parameters / 1e9:.1f} B parameters, {self.scheme} weights, "
                 f"tp {self.tp} x ep {self.ep}" + (f", pp {self.pp}" if self.pp > 1 else ""),
                 f"{'rank':>4}  {'parameters':>12}  {'artifact':>12}  {'largest layer (fp32)':>20}"
                 + ("  stage (layers)" if self.stages else "")]
        for r in self.ranks:
            stage = ""
            if self.stages:
                first, last = self.stages[r.rank // self.tp]
                stage = f"  {r.rank // self.tp} ({first}-{last - 1})"
            lines.append(f"{r.rank:>4}  {r.parameters / 1e9:>10.2f} B  {r.artifact_bytes / GIB:>8.1f} GiB  "
                         f"{r.largest_layer_fp32_bytes / GIB:>16.2f} GiB{stage}")
        total = sum(r.artifact_bytes for r in self.ranks)
        lines.append(f"artifact: {total / GIB:.1f} GiB in all")
        lines.append(f"streamed compile (--stream) peak memory: ~{size_text(self.peak_bytes)} "
                     f"({size_text(RUNTIME_BYTES)} + {LAYER_FACTOR:g} x the largest layer's float32 weights, routed "
                     f"experts one at a time, + {PER_LAYER_BYTES / 2**20:.0f} MiB x {self.layers} layers of graph)")
        lines.append(f"time: ~{_duration(self.seconds)} at the measured {RATE_BYTES_PER_S / 1e6:.0f} MB/s of float32 "
                     "weights (2 cores; benchmarks/results/compile_memory.json)")
        return "\n".join(lines)


@dataclass(frozen=True)
class CheckedCompile:
    """What ``check_compile`` found the compile takes: the model's config, its pipeline stages (one without
    ``--pp``) and the ``--placement`` plan's slots (None without one)."""

    config: ModelConfig
    stages: list[StageSpec]
    slots: ExpertSlots | None


def check_compile(options: CompileOptions) -> CheckedCompile:
    """Everything a compile refuses before it reads a weight, in one place for the compile and ``--plan``: the flags
    (``options.check_flags``, before the config is read), the quantisation (``quant.spec.validate``), and on the
    model's config the tp/ep split (``plan_sharding``), the pipeline stages and the ``--placement`` plan."""
    check_flags(options)
    check_options(options)
    config = load_config(options.model)
    validate(options.quant, target=options.target, kv_cache=options.kv.layout, kv_layout=kv_layout_of(config))
    resolve_block_size(options, config)  # refuses a V4 block size its compress rates do not divide
    check_split(config, options.tp, options.ep, options.pp)
    return CheckedCompile(config, compile_stages(options, config), placement_slots(options, config))


def kv_layout_of(config: ModelConfig) -> str:
    """The KV-cache layout of ``config``'s artifacts (``KVCacheSpec.layout``: gqa, mla_latent, mla_dsa, v4_hybrid),
    from its config alone: what ``quant.spec.validate`` checks ``--kv-quant`` against."""
    return contiguous_spec(config, max_seq_len=min(DEFAULT_MAX_SEQ_LEN, config.max_position_embeddings)).layout


def check_options(options: CompileOptions) -> None:
    """The options every target shares (the sequence length, the KV-cache layout, --pp / --workers / --placement
    combinations, what the target's backends run); the compile and ``--plan`` both run it."""
    if options.max_seq_len is not None and options.max_seq_len < 2:
        raise MoeforgeError(f"--max-seq-len must be >= 2, got {options.max_seq_len}")
    if options.kv.layout not in KV_CACHE_KINDS:
        raise MoeforgeError(f"--kv-cache {options.kv.layout!r} is not one of {', '.join(KV_CACHE_KINDS)}")
    if options.kv.block_size is not None and options.kv.block_size < 1:
        raise MoeforgeError(f"--kv-block-size must be >= 1, got {options.kv.block_size}")
    paged, sharded = options.kv.layout == "paged", options.tp > 1 or options.ep > 1 or options.pp > 1
    if options.pp < 1:
        raise MoeforgeError(f"--pp must be >= 1, got {options.pp}")
    if options.pp_layers is not None and options.pp == 1:
        raise MoeforgeError("--pp-layers splits the layers into pipeline stages: it needs --pp P with P > 1")
    if options.workers < 1:
        raise MoeforgeError(f"--workers must be >= 1, got {options.workers}")
    if options.workers > 1 and not (sharded and options.stream):
        raise MoeforgeError("--workers builds the ranks of a streamed sharded compile in parallel processes: it "
                            "needs --tp (or --ep or --pp) and --stream (without --stream each worker would load the "
                            "whole model)")
    if options.placement is not None and not (options.ep > 1 and options.ep == options.tp):
        raise MoeforgeError(f"--placement places whole experts on expert-parallel ranks: it needs --tp N --ep N "
                            f"with N > 1 (got --tp {options.tp} --ep {options.ep}); pass the --ep the plan was made "
                            "for to both")
    why = refusal(options.target, paged=paged, sharded=sharded)
    if why and not options.build_only:
        shape = (" with --kv-cache paged" if paged else " with --tp/--ep/--pp" if sharded else "") \
            if options.target in BACKENDS else ""
        raise MoeforgeError(f"--target {options.target}{shape} builds an artifact no moeforge backend runs: {why}. "
                            "Compile for --target ort to run it here, or pass --build-only to build it for a runtime "
                            "of your own")


def resolve_block_size(options: CompileOptions, config: ModelConfig) -> CompileOptions:
    """``options`` with DeepSeek-V4's pool block size decided: a block holds whole windows of every compress rate, so
    without ``--kv-block-size`` it is the smallest multiple of the default that they all divide, and a given size they
    do not divide is refused (``kv_layout_v4.check_block_size``). Other models: unchanged."""
    if config.compressed_attention is None:
        return options
    check_v4_engine(options)
    if options.kv.block_size is None:
        size = default_block_size(config, DEFAULT_BLOCK_SIZE)
        return dataclasses.replace(options, kv=dataclasses.replace(options.kv, block_size=size))
    check_v4_block_size(config, options.kv.block_size)
    return options


def check_v4_engine(options: CompileOptions) -> None:
    """DeepSeek-V4 with ``--target trt``: the plan builds (its step graph, moeforge/passes/trt_lowering.py
    ``trt_v4_pipeline``), unquantised, and no moeforge backend runs it yet (the registry says why), so it needs
    ``--build-only``."""
    if options.target != "trt":
        return
    if options.quant.weights is not None:
        raise MoeforgeError(f"--quant {options.quant.weights} with --target trt is not available for DeepSeek-V4: its "
                            "TensorRT engine is built in fp16 / bf16 (--dtype) from its step graph, which the TensorRT "
                            "weight-quantisation pass has not been checked on; drop --quant, or compile with "
                            "--target ort to quantise it")
    why = refusal(options.target, paged=options.kv.layout == "paged", sharded=options.tp > 1 or options.ep > 1,
                  layout="v4_hybrid")
    if why and not options.build_only:
        raise MoeforgeError(f"--target trt on DeepSeek-V4 builds an engine no moeforge backend runs: {why}. Compile "
                            "for --target ort to run it here, or pass --build-only to build the plan for a runtime of "
                            "your own")


def kv_plan_lines(options: CompileOptions, config: ModelConfig) -> list[str]:
    """What the compile's KV cache costs (``--plan``): bytes per token and per sequence at the compile's max_seq_len
    and at the model's longest context, from the same ``KVCacheSpec`` the artifact's manifest will carry (DeepSeek-V4:
    its rings and compressed entries; every tp rank holds it whole where the attention's cache writers are
    replicated: MLA's latent, V4's)."""
    options = resolve_block_size(options, config)
    max_len = options.max_seq_len or min(DEFAULT_MAX_SEQ_LEN, config.max_position_embeddings)
    kv = (paged_spec(config, max_seq_len=max_len, block_size=options.kv.tokens_per_block) if options.kv.paged
          else contiguous_spec(config, max_seq_len=max_len))
    where = f"{kv.block_size}-token blocks" if kv.paged else "per-sequence buffers"
    lengths = sorted({max_len, config.max_position_embeddings})
    lines = [f"KV cache: {kv.layout} in {where}, {kv.dtype}: {format_bytes(kv.bytes_per_token)} per token (all layers)"
             + (f" + {format_bytes(kv.bytes_per_sequence)} of rings per sequence" if kv.bytes_per_sequence else ""),
             "  per sequence: " + ", ".join(f"{format_bytes(kv.bytes_for(n))} at {n:,} tokens" for n in lengths)]
    if kv.paged and kv.layer_buffers is not None:
        lines.append(_v4_block_trade_off(config, max_len, kv.block_size or 0))
    return lines


def _v4_block_trade_off(config: ModelConfig, max_len: int, block_size: int) -> str:
    """DeepSeek-V4 paged: each block keeps its own rings (window, pending) so that a cached prefix block is a pure
    function of its prefix; larger blocks spread them over more tokens (coarser prefix sharing), and contiguous
    buffers keep them once per sequence. The per-token cost of a few larger block sizes, and contiguous's."""
    sizes = [block_size * k for k in (2, 4, 8)]
    per_token = [paged_spec(config, max_seq_len=max_len, block_size=size).bytes_per_token for size in sizes]
    costs = ", ".join(f"{size}: {format_bytes(cost)}" for size, cost in zip(sizes, per_token, strict=True))
    contiguous = contiguous_spec(config, max_seq_len=max_len)
    return (f"  each block holds its own rings (its prefix's window and pending tokens): per token at --kv-block-size "
            f"{costs}; --kv-cache contiguous: {format_bytes(contiguous.bytes_per_token)} + "
            f"{format_bytes(contiguous.bytes_per_sequence)} per sequence")


def check_split(config: ModelConfig, tp: int, ep: int, pp: int = 1) -> None:
    """Refuse a split of ``config`` no compile takes: degrees out of bounds, or a tp/ep split its heads, vocabulary
    or experts do not divide into (``--pp``'s limits are ``plan_stages``')."""
    check_ranks(tp, ep, pp)
    if tp > 1 or ep > 1:
        plan_sharding(config, tp, ep)


def compile_stages(options: CompileOptions, config: ModelConfig) -> list[StageSpec]:
    """The compile's pipeline stages (``pipeline_stages``: balanced by weight and KV bytes at the compile's sequence
    length and scheme, or ``--pp-layers``); one stage without ``--pp``."""
    quant = options.quant
    return pipeline_stages(config, options.pp, options.pp_layers, quant.weights, quant.block_size,
                           options.max_seq_len, kv_bytes_per_value(options))


def kv_bytes_per_value(options: CompileOptions) -> int:
    """Bytes of one cached value: 1 with ``--kv-quant int8``, else float32's 4."""
    return 1 if options.quant.kv_cache == "int8" else 4


def placement_slots(options: CompileOptions, config: ModelConfig) -> ExpertSlots | None:
    """The ``--placement`` plan's slots, checked against the model (its MoE layers and experts) and ``--ep``."""
    if options.placement is None:
        return None
    if config.moe is None:
        raise MoeforgeError(f"--placement places routed experts; {config.name} has none: drop --placement")
    slots = load_plan(options.placement)
    slots.check(len(moe_layer_index(config)), config.moe.n_routed_experts, options.ep, config.name)
    return slots


def plan_compile(model: str, config: ModelConfig, scheme: str | None = None, tp: int = 1, ep: int = 1,
                 block_size: int | None = None, pp: int = 1, pp_layers: str | None = None) -> CompilePlan:
    """The plan of compiling ``config`` with ``scheme`` (None: float32) into ``pp`` stages of ``tp`` ranks each
    (``ep`` expert-parallel; stages as the compile splits them, ``plan_stages``). A split the compile refuses is
    refused here too (``check_split``)."""
    check_split(config, tp, ep, pp)
    with torch.device("meta"):
        full = new_model(config)
    bytes_per_param = bytes_per_parameter(scheme, block_size)
    stages = pipeline_stages(config, pp, pp_layers, scheme, block_size) if pp > 1 else []
    ranks = []
    for rank in range(tp * pp):
        part: CausalLM = shard_model(full, tp, ep, rank % tp)[0] if tp > 1 else full
        if stages:
            part = stage_model(part, stages[rank // tp], tp)
        tensors = dict(part.state_dict())
        layers: dict[str, int] = {}
        artifact = 0
        for name, tensor in tensors.items():
            count = tensor.numel()
            matrix = tensor.dim() >= 2 and "embed_tokens" not in name
            artifact += int(count * (bytes_per_param if matrix else 4))
            layer = ".".join(name.split(".")[:3]) if name.startswith("model.layers.") else name
            resident = count // tensor.shape[0] if is_expert_stack_name(name, tensor.dim()) else count
            layers[layer] = layers.get(layer, 0) + 4 * resident
        ranks.append(RankPlan(rank, sum(t.numel() for t in tensors.values()), artifact, max(layers.values())))
    total = sum(t.numel() for t in full.state_dict().values())
    graph_layers = max((s.num_layers for s in stages), default=config.num_hidden_layers)  # a rank's: its stage's
    return CompilePlan(model, scheme or "fp32", tp, ep, total, ranks, graph_layers, pp,
                       [[s.first_layer, s.last_layer] for s in stages])


def bytes_per_parameter(scheme: str | None, block_size: int | None) -> float:
    """Storage per weight of a matrix: codes + a float32 scale (and offset) per block."""
    if scheme is None or scheme == "fp32":
        return 4.0
    info = SCHEMES[scheme]
    code = {"int8": 1.0, "int4": 0.5, "fp8": 1.0}.get(info.weights, 4.0)
    block = block_size or info.default_block
    per_block = (8.0 if info.asymmetric else 4.0) / block if block else 0.0
    return code + per_block


def size_text(num_bytes: float) -> str:
    """``1.5 GiB``, or ``300 MiB`` below a tenth of a GiB."""
    return f"{num_bytes / GIB:.1f} GiB" if num_bytes >= GIB / 10 else f"{num_bytes / 2**20:.0f} MiB"


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{math.ceil(seconds)} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def pipeline_stages(config: ModelConfig, pp: int, pp_layers: str | None, scheme: str | None,
                    block_size: int | None, max_seq_len: int | None = None, kv_bytes_per_value: int = 4
                    ) -> list[StageSpec]:
    """The stages a ``--pp`` compile writes (and ``--plan`` shows): ``plan_stages`` balanced by the scheme's weight
    bytes and the KV of one sequence of ``max_seq_len`` (default: min(DEFAULT_MAX_SEQ_LEN, the model's limit)), or
    ``pp_layers``."""
    kv_tokens = max_seq_len or min(DEFAULT_MAX_SEQ_LEN, config.max_position_embeddings)
    return plan_stages(config, pp, layers=pp_layers, bytes_per_weight=bytes_per_parameter(scheme, block_size),
                       kv_bytes_per_value=kv_bytes_per_value, kv_tokens=kv_tokens)

