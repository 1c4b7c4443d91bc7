"""Sharded artifacts: ``moeforge compile MODEL -o DIR --tp N [--ep M]`` writes one complete artifact per rank.

    DIR/sharded.json     the mapping: world size, tp/ep, per rank its heads / kv heads / vocabulary rows /
                         experts, weight and KV bytes, the sha256 of its manifest.json; the collective points;
                         the replicated tensors
    DIR/rank0 .. rank{N-1}/   each a complete artifact of its shard (graph, weights, manifest with hashes)

Each rank's graph is its ``moeforge/model/rank_model.py`` model exported and run through the ordinary ONNX Runtime pass
list: the same KV-cache, fusion and quantisation passes, on its heads and experts. Its collectives are
``com.microsoft.AllReduce`` / ``AllGather`` nodes (ONNX Runtime's CUDA execution provider runs them over NCCL; on
CPU ``moeforge/ops/collectives/ort.py`` maps them to gloo). The whole directory is written under a temporary name and
renamed at the end, as a single artifact is; a killed compile's ranks are kept there, and the same command run again
continues from them (``partial_compile.py``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import multiprocessing
import os
import uuid
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from queue import Empty
from typing import Any

from moeforge.compile.options import MAX_RANKS, CompileOptions
from moeforge.compile.partial_compile import check_partial, open_partial
from moeforge.compile.plan import (
    bytes_per_parameter,
    check_compile,
    compile_stages,
    kv_bytes_per_value,
    placement_slots,
)
from moeforge.compile.stages import ARTIFACT_STAGES, build_artifact, make_job, open_source, stage_bar
from moeforge.compile.targets import TARGETS, Target
from moeforge.compile.targets.ort import OrtTarget
from moeforge.core.artifact import (
    MANIFEST_FILE,
    SHARDED_FILE,
    SHARDED_FORMAT_NAME,
    Artifact,
    check_output_dir,
    install_directory,
    load_artifact,
    restore_interrupted,
)
from moeforge.core.config import ModelConfig
from moeforge.core.errors import ArtifactError, MoeforgeError
from moeforge.core.manifest import Manifest
from moeforge.core.progress import QUIET, Stages
from moeforge.core.safe_paths import expand_user, write_output_file
from moeforge.core.strict_json import JsonFileError, json_int, json_list, json_object, read_json_file
from moeforge.model.expert_slots import ExpertSlots
from moeforge.model.lazy_weights import LazyWeights
from moeforge.model.loader import LoadedModel, release_weights, source_argument
from moeforge.model.model import CausalLM
from moeforge.model.pipeline_stages import StageSpec, stage_costs, stage_model, stage_sources
from moeforge.model.rank_model import rank_sources, shard_model
from moeforge.model.sharding import plan_sharding

log = logging.getLogger(__name__)

SHARDED_FORMAT = 1
# Where the ranks meet, in graph order (what sharded.json records for a reader; the graphs hold the nodes).
COLLECTIVE_POINTS = (
    "embed_tokens: AllReduce of the vocab-parallel lookup [B, S, H]",
    "each layer's attention: AllReduce after o_proj (row-parallel) [B, S, H], then its bias",
    "each layer's MLP or MoE: one AllReduce of the routed + shared experts' partial sums [B, S, H]",
    "lm_head: AllGather of the vocab-parallel logits along the vocabulary axis -> [B, S, V] on every rank",
)
PIPELINE_POINT = ("between stages (--pp): the hidden state [T, H] sent point to point from tp rank t of stage s to tp "
                  "rank t of stage s + 1, per micro-batch; the last stage's tp rank 0 sends the logits to rank 0; the "
                  "collectives above run within each stage's group of tp ranks")


def rank_dir(rank: int) -> str:
    return f"rank{rank}"


@dataclass
class ShardedManifest:
    """``sharded.json``: how the ranks' artifacts fit together."""

    tp: int
    ep: int
    model_config: dict[str, Any]
    ranks: list[dict[str, Any]]
    compile_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    collectives: list[str] = field(default_factory=lambda: list(COLLECTIVE_POINTS))
    replicated: list[str] = field(default_factory=list)
    kv_cache_note: str = ""
    source: str = ""
    created_utc: str = field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))
    format_version: int = SHARDED_FORMAT
    # ``ExpertSlots.to_dict()`` of a ``--placement`` compile (slot -> logical expert per MoE layer), else None.
    placement: dict[str, Any] | None = None
    # Pipeline stages (``--pp``): world rank r is stage r // tp, tensor-parallel rank r % tp; per stage its layers
    # and, per rank of it, weight and KV bytes (``stages[s]``: StageSpec.to_dict() + "ranks", "weight_bytes", ...).
    pp: int = 1
    stages: list[dict[str, Any]] = field(default_factory=list)

    def stage_specs(self) -> list[StageSpec]:
        """The pipeline stages (one spanning every layer without --pp)."""
        if not self.stages:
            layers = int(self.model_config["num_hidden_layers"])
            return [StageSpec(0, 1, 0, layers)]
        return [StageSpec.from_dict(stage) for stage in self.stages]

    def stage_of(self, rank: int) -> int:
        return rank // self.tp

    def expert_slots(self) -> ExpertSlots | None:
        """The placement the ranks were compiled with (None: contiguous experts, or no expert parallelism)."""
        if self.placement is None:
            return None
        return ExpertSlots.from_array(self.placement["physical_to_logical"], self.ep)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    def to_dict(self) -> dict[str, Any]:
        return {"format": SHARDED_FORMAT_NAME, "format_version": self.format_version, "world_size": self.world_size,
                "tp": self.tp, "ep": self.ep, "compile_id": self.compile_id, "source": self.source,
                "created_utc": self.created_utc, "model_config": self.model_config, "ranks": self.ranks,
                "collectives": self.collectives, "replicated": self.replicated, "kv_cache_note": self.kv_cache_note,
                "placement": self.placement, "pp": self.pp, "stages": self.stages}

    @classmethod
    def from_dict(cls, data: Any, where: Path) -> ShardedManifest:
        fix = "recompile it with moeforge compile ... --tp N"
        if not isinstance(data, dict) or data.get("format") != SHARDED_FORMAT_NAME:
            raise ArtifactError(f"{where} is not a moeforge sharded manifest; {fix}")
        if data.get("format_version") != SHARDED_FORMAT:
            raise ArtifactError(f"{where}: sharded format_version {data.get('format_version')!r}, this moeforge reads "
                                f"{SHARDED_FORMAT}; {fix}")
        source = SHARDED_FILE
        try:
            tp = json_int(data.get("tp"), source=source, field="tp", lo=1, hi=MAX_RANKS)
            ep = json_int(data.get("ep"), source=source, field="ep", lo=1, hi=MAX_RANKS)
            pp = json_int(data.get("pp", 1), source=source, field="pp", lo=1, hi=MAX_RANKS)
            ranks = [dict(json_object(entry, source=source, field="ranks[]"))
                     for entry in json_list(data.get("ranks"), source=source, field="ranks", max_len=MAX_RANKS)]
            stages = [dict(json_object(stage, source=source, field="stages[]"))
                      for stage in json_list(data.get("stages", []), source=source, field="stages", max_len=MAX_RANKS)]
            world = tp * pp
            world_size = data.get("world_size")  # 2.0 == 2 in Python: an integer, as written, is required
            if (ep not in (1, tp) or len(ranks) != world or isinstance(world_size, bool)
                    or not isinstance(world_size, int) or world_size != world or (pp > 1 and len(stages) != pp)):
                raise ValueError(f"tp {tp}, ep {ep}, pp {pp}, world_size {data.get('world_size')!r}, {len(ranks)} "
                                 f"ranks, {len(stages)} stages")
            for index, stage in enumerate(stages):
                spec = StageSpec.from_dict(stage)
                if spec.stage != index or spec.pp != pp or spec.num_layers < 1:
                    raise ValueError(f"stages[{index}] is {stage!r:.200}")
            for index, entry in enumerate(ranks):
                if json_int(entry.get("rank"), source=source, field=f"ranks[{index}].rank", lo=0, hi=world - 1) \
                        != index or entry.get("dir") != rank_dir(index):
                    raise ValueError(f"ranks[{index}] is {entry.get('rank')!r} in {entry.get('dir')!r:.80}")
                if not isinstance(entry.get("manifest_sha256"), str):
                    raise ValueError(f"ranks[{index}] has no manifest_sha256")
            placement = data.get("placement")
            if placement is not None:
                placement = dict(json_object(placement, source=source, field="placement"))
                slots = ExpertSlots.from_array(placement.get("physical_to_logical"), ep)
                if len(slots.physical_to_logical[0]) % ep:
                    raise ValueError(f"placement of {len(slots.physical_to_logical[0])} slots over ep {ep}")
            return cls(tp=tp, ep=ep, model_config=dict(json_object(data.get("model_config"), source=source,
                                                                   field="model_config")),
                       ranks=ranks, compile_id=str(data["compile_id"]), collectives=list(data.get("collectives", [])),
                       replicated=list(data.get("replicated", [])), kv_cache_note=str(data.get("kv_cache_note", "")),
                       source=str(data.get("source", "")), created_utc=str(data.get("created_utc", "")),
                       placement=placement, pp=pp, stages=stages)
        except (KeyError, TypeError, ValueError, ArithmeticError, AttributeError, MoeforgeError) as exc:
            # MoeforgeError: the field checks' JsonFileError, ExpertSlots' PlacementError
            raise ArtifactError(f"{where} is malformed ({exc}); {fix}") from None


def is_sharded(path: str | Path) -> bool:
    """Whether ``path`` is a sharded artifact directory (holds ``sharded.json``)."""
    return (Path(path) / SHARDED_FILE).is_file()


def read_sharded(path: str | Path) -> ShardedManifest:
    """Parse ``path/sharded.json`` (no rank is opened)."""
    root = expand_user(path).absolute()
    restore_interrupted(root)
    where = root / SHARDED_FILE
    if not os.path.lexists(where):
        raise ArtifactError(f"{root} has no {SHARDED_FILE}: it is not a sharded artifact")
    try:  # strict: a nesting bomb, NaN, a 10 GB file or a FIFO end in one message, never a traceback or a hang
        data = read_json_file(where, what="sharded manifest", fix=f"recompile {root} with moeforge compile ... --tp N")
    except JsonFileError as exc:
        raise ArtifactError(str(exc)) from None
    return ShardedManifest.from_dict(data, where)


def manifest_digest(rank_root: Path) -> str:
    """sha256 of a rank's manifest.json, which lists the sha256 of every other file of the rank."""
    return hashlib.sha256((rank_root / MANIFEST_FILE).read_bytes()).hexdigest()


def load_rank(path: str | Path, rank: int, world_size: int, verify: bool = True) -> tuple[ShardedManifest, Artifact]:
    """Open rank ``rank``'s artifact and check that it belongs to this sharded artifact and this world: the
    process count matches, its manifest is the one ``sharded.json`` recorded (not a rank of another compile)
    and names this rank. ``ArtifactError`` says which."""
    root = expand_user(path).absolute()
    sharded = read_sharded(root)
    if world_size != sharded.world_size:
        raise ArtifactError(f"{root} is sharded over {sharded.world_size} ranks (tp {sharded.tp}, pp {sharded.pp}) but "
                            f"{world_size} processes were started: launch it with --nproc-per-node "
                            f"{sharded.world_size} (or WORLD_SIZE={sharded.world_size})")
    if not 0 <= rank < world_size:
        raise ArtifactError(f"rank {rank} is outside the world of {world_size} ranks")
    rank_root = root / rank_dir(rank)
    artifact = load_artifact(rank_root, verify=verify)
    digest = manifest_digest(rank_root)
    expected = sharded.ranks[rank]["manifest_sha256"]
    if digest != expected:
        raise ArtifactError(f"{rank_root} is not the rank {rank} that {SHARDED_FILE} (compile {sharded.compile_id}) "
                            f"records: its manifest.json has sha256 {digest[:12]}, expected {expected[:12]} -- a rank "
                            f"directory from another compile; recompile {root} with --tp {sharded.tp} "
                            f"--pp {sharded.pp} --force")
    info = artifact.manifest.sharding or {}
    if info.get("rank") != rank or info.get("tp") != sharded.tp:
        raise ArtifactError(f"{rank_root}'s manifest describes rank {info.get('rank')!r} of tp {info.get('tp')!r}, "
                            f"not rank {rank} of tp {sharded.tp}; recompile {root}")
    return sharded, artifact


# ---------------------------------------------------------------------------------------------- compile
def rank_target(options: CompileOptions) -> Target:
    """One rank's target: ONNX Runtime (``RankOrtTarget``), or TensorRT, whose plan turns the collectives into
    TensorRT's distributed collective layers (``moeforge/ops/collectives/tensorrt.py``)."""
    if options.target == "ort":
        return RankOrtTarget(options)
    target = TARGETS[options.target](options)
    target.check()
    return target


class RankOrtTarget(OrtTarget):
    """The ONNX Runtime target for one rank: the same passes; no golden logits, genai config or ``--check`` in
    the rank's directory (its graph runs only beside the other ranks: ``moeforge parity DIR`` checks them)."""

    def write_payload(self, job: Any, folder: Path, manifest: Manifest) -> None:
        return None


@dataclass
class ShardedCompileResult:
    """What ``compile_sharded`` wrote: the directory, ``sharded.json``, and rank 0's manifest (for the CLI)."""

    output_dir: Path
    sharded: ShardedManifest
    manifest: Manifest
    parity: None = None


def compile_sharded(options: CompileOptions) -> ShardedCompileResult:
    """Compile ``options.model`` into ``options.tp`` rank artifacts plus ``sharded.json``. Ranks are written into a
    partial directory that a rerun of a killed compile continues (``partial_compile.py``); an error leaves nothing.
    ``options.workers`` > 1 (with ``--stream``) builds that many ranks at once in separate processes. Raises
    ``ShardingError`` (a split the model cannot take) or ``MoeforgeError``."""
    checked = check_compile(options)  # a bad split, stage or placement fails before anything is read or written
    out = expand_user(options.output_dir).absolute()
    check_output_dir(out, force=options.force)  # a sharded or unsharded artifact may be replaced
    check_partial(out)  # a link or a user's folder where the ranks go is refused before the model loads
    tp, ep, pp = options.tp, options.ep, options.pp
    world = tp * pp
    title = f"compile tp{tp}" + (f" pp{pp}" if pp > 1 else "")
    with stage_bar(1 + ARTIFACT_STAGES * world + 1, title, options.progress) as bar:  # load, ranks, sharded.json
        bar.stage("load checkpoint")
        loaded, weights = open_source(options)
        plan = plan_sharding(loaded.config, tp, ep)
        stages, slots = checked.stages, checked.slots
        bar.advance()
        with open_partial(out, options, world) as partial:
            todo = [rank for rank in range(world) if rank not in partial.done]
            bar.advance(ARTIFACT_STAGES * len(partial.done))
            if partial.done:
                log.warning("continuing a killed compile: ranks %s are already written in %s",
                            ", ".join(map(str, sorted(partial.done))), partial.root)
            if options.workers > 1 and len(todo) > 1:
                release_weights(loaded.model)
                _build_in_workers(options, todo, partial.root, bar)
            else:
                for rank in todo:
                    build_rank(options, loaded, weights, rank, partial.root, bar.scoped(f"rank {rank}/{world}"))
            release_weights(loaded.model)
            bar.stage(SHARDED_FILE)
            ranks = [_rank_entry(partial.root, rank) for rank in range(world)]
            points = list(COLLECTIVE_POINTS) + ([PIPELINE_POINT] if pp > 1 else [])
            sharded = ShardedManifest(
                tp=tp, ep=ep, model_config=loaded.config.to_dict(), ranks=ranks, replicated=plan.replicated(),
                kv_cache_note=_kv_note(loaded.config.mla is not None, tp, loaded.config.num_key_value_heads),
                source=source_argument(options.model, loaded.source),
                placement=None if slots is None else slots.to_dict(), pp=pp, collectives=points,
                stages=[] if pp == 1 else _stage_entries(options, loaded.config, stages, ranks))
            write_output_file(partial.root / SHARDED_FILE, json.dumps(sharded.to_dict(), indent=2) + "\n",
                              flag=SHARDED_FILE)
            partial.seal()
            install_directory(partial.root, out)
        bar.advance()
        first = load_artifact(out / rank_dir(0), verify=False).manifest
        return ShardedCompileResult(out, sharded, first)


def build_rank(options: CompileOptions, loaded: LoadedModel, weights: LazyWeights | None, rank: int, root: Path,
               stages: Stages) -> None:
    """Write world rank ``rank``'s artifact to ``root/rank{rank}`` (atomically) from the unsharded ``loaded`` model:
    tensor-parallel rank ``rank % tp`` of pipeline stage ``rank // tp``, its stages shown on ``stages``."""
    tp, pp = options.tp, options.pp
    tp_rank, stage = rank % tp, rank // tp
    model: CausalLM
    if tp > 1 or options.ep > 1:
        slots = placement_slots(options, loaded.config)
        model, config, layout = shard_model(loaded.model, tp, options.ep, tp_rank, slots)
        sources = None if weights is None else rank_sources(loaded.config, layout, weights.shape)
        rank_weights = None if weights is None or sources is None else weights.for_rank(model, sources)
        sharding: dict[str, Any] = {**layout.to_dict()}
    else:  # pipeline stages of the whole model
        model, config, rank_weights = loaded.model, loaded.config, weights
        sharding = {"rank": 0, "tp": 1, "ep": 1}
    if pp > 1:
        spec = compile_stages(options, loaded.config)[stage]
        stage_lm = stage_model(model, spec, group_size=tp)
        if rank_weights is not None:
            rank_weights = rank_weights.for_rank(stage_lm, stage_sources(spec, rank_weights.stored,
                                                                         model.lm_head is None))
        model, config = stage_lm, stage_lm.config
        sharding.update(rank=rank, tp_rank=tp_rank, pp=pp, world_size=tp * pp, stage=spec.to_dict())
    rank_loaded = LoadedModel(model, config, loaded.tokenizer, loaded.source)
    rank_options = _rank_options(options)
    job = make_job(rank_options, rank_loaded, rank_weights, stages)
    build_artifact(job, rank_target(rank_options), root / rank_dir(rank), sharding=sharding)


def _stage_entries(options: CompileOptions, config: ModelConfig, stages: list[StageSpec],
                   ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """sharded.json's stages: each stage's layers, its ranks, its bytes over its ranks (weight files, KV per token)
    and the planner's estimate of them (``stage_costs``: parameters at the scheme's bytes, derived tables such as the
    rotary caches and the argmax head not counted)."""
    tp = options.tp
    plan = stage_costs(config, stages, bytes_per_parameter(options.quant.weights, options.quant.block_size),
                       kv_bytes_per_value(options), tp, options.ep)
    out = []
    for spec, cost in zip(stages, plan, strict=True):
        members = ranks[spec.stage * tp: (spec.stage + 1) * tp]
        out.append({**spec.to_dict(), "ranks": [entry["rank"] for entry in members],
                    "weight_bytes": sum(entry["weight_bytes"] for entry in members),
                    "kv_bytes_per_token": sum(entry["kv_bytes_per_token"] for entry in members),
                    "planned_weight_bytes": cost.weight_bytes * tp,
                    "planned_kv_bytes_per_token": cost.kv_bytes_per_token * tp})
    return out


def _build_in_workers(options: CompileOptions, ranks: list[int], root: Path, bar: Stages) -> None:
    """Build ``ranks`` in ``options.workers`` processes (spawned: each opens the checkpoint itself and reads only
    its ranks' slices); the first failure cancels the ranks not started and is raised here. Each worker sends its
    stages back over a queue, which ``_WorkerBoard`` shows on ``bar``."""
    context = multiprocessing.get_context("spawn")
    messages = context.Queue()  # (rank, "stage", name) and (rank, "advance", n), from _QueueStages
    workers = min(options.workers, len(ranks))
    board = _WorkerBoard(bar, ranks)
    with ProcessPoolExecutor(max_workers=workers, mp_context=context, initializer=_start_worker,
                             initargs=(messages,)) as pool:
        futures = {pool.submit(_rank_worker, options, rank, root): rank for rank in ranks}
        bar.stage(f"{len(ranks)} ranks in {workers} workers: starting")
        pending: set[Future[None]] = set(futures)
        try:
            while pending:
                finished, pending = wait(pending, timeout=0.25, return_when=FIRST_COMPLETED)
                board.drain(messages)
                for future in finished:
                    future.result()
                    board.written(futures[future])
        except BaseException:
            for future in futures:
                future.cancel()
            raise
    messages.close()  # after the pool's shutdown: no worker writes to it any more


class _WorkerBoard:
    """The parent's view of its workers: every running rank's stage named on ``bar`` ("rank 0: export to ONNX, rank
    1: pass 3/13 rotary"), their stages counted as they end (ARTIFACT_STAGES a rank, whatever of its messages is still
    in flight when its future is done; a message after that is dropped)."""

    def __init__(self, bar: Stages, ranks: list[int]) -> None:
        self._bar = bar
        self._running: dict[int, str] = {}
        self._counted = dict.fromkeys(ranks, 0)

    def receive(self, rank: int, kind: str, value: Any) -> None:
        if self._counted[rank] == ARTIFACT_STAGES:  # a late message from a rank already written
            return
        if kind == "stage":
            self._running[rank] = str(value)
            self._bar.stage(", ".join(f"rank {r}: {name}" for r, name in sorted(self._running.items())))
        else:
            n = min(int(value), ARTIFACT_STAGES - self._counted[rank])
            self._counted[rank] += n
            self._bar.advance(n)

    def drain(self, messages: Any) -> None:
        """Show every message waiting in ``messages`` (a queue)."""
        while True:
            try:
                rank, kind, value = messages.get_nowait()
            except Empty:
                return
            self.receive(rank, kind, value)

    def written(self, rank: int) -> None:
        self.receive(rank, "advance", ARTIFACT_STAGES)
        self._running.pop(rank, None)


# A worker process's queue to its parent's bar, set once by the pool's initializer (a multiprocessing queue passes
# to a process only when the process is started, never as an argument of a task).
_parent_messages: Any = None


def _start_worker(messages: Any) -> None:
    global _parent_messages
    _parent_messages = messages


class _QueueStages:
    """A worker's ``Stages``: each message goes to the parent, which shows it on its bar."""

    def __init__(self, messages: Any, rank: int) -> None:
        self._messages, self._rank = messages, rank

    def stage(self, name: str) -> None:
        self._messages.put((self._rank, "stage", name))

    def advance(self, n: int = 1) -> None:
        self._messages.put((self._rank, "advance", n))


def _rank_worker(options: CompileOptions, rank: int, root: Path) -> None:
    """One worker's rank (a spawned process: nothing shared with the parent but the options and the queue)."""
    stages: Stages = QUIET if _parent_messages is None else _QueueStages(_parent_messages, rank)
    stages.stage("load checkpoint")
    loaded, weights = open_source(options)
    build_rank(dataclasses.replace(options, progress=False), loaded, weights, rank, root, stages)


def _rank_entry(root: Path, rank: int) -> dict[str, Any]:
    """sharded.json's entry for the rank written in ``root``."""
    rank_root = root / rank_dir(rank)
    manifest = load_artifact(rank_root, verify=False).manifest
    return {"rank": rank, "dir": rank_dir(rank), **(manifest.sharding or {}), "weight_bytes": _weight_bytes(manifest),
            "kv_bytes_per_token": manifest.kv_cache.bytes_per_token, "manifest_sha256": manifest_digest(rank_root)}


def _rank_options(options: CompileOptions) -> CompileOptions:
    return dataclasses.replace(options, force=False, check=False)


def _weight_bytes(manifest: Manifest) -> int:
    return sum(entry["bytes"] for rel, entry in manifest.files.items() if rel.endswith(".onnx.data"))


def _kv_note(mla: bool, tp: int, kv_heads: int) -> str:
    if mla:
        return ("MLA: attention heads are split, the latent they all read is not; every rank caches the full latent "
                "(kv_lora_rank + rope dims per token and layer). Data-parallel attention would split sequences "
                "instead, dividing the cache by the ranks at the price of replicated attention weights.")
    if kv_heads < tp:
        return (f"GQA with {kv_heads} kv heads over {tp} ranks: each rank caches the one kv head its query heads "
                f"read; each head is cached on {tp // kv_heads} ranks.")
    return f"GQA: each rank caches its {kv_heads // tp} of the {kv_heads} kv heads."
