"""Running a sharded artifact: one process per rank on torch.distributed, torchrun's environment as the contract.

``moeforge run|serve|parity DIR`` on a sharded artifact calls ``start_world``. Under torchrun (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` set) this process is the rank torchrun says, on one node or
several::

    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-endpoint HOST:29500 -m moeforge.cli serve DIR

Without torchrun, the command starts the other ranks of one node itself: the same command line in child
processes with those variables set (MASTER_ADDR 127.0.0.1, a free port). Rank 0 does the command's work (engine,
sampler, tokenizer, HTTP server) through a ``ShardedBackend``; every other rank runs ``serve_rank`` until rank 0
sends STOP. Before any step the ranks check together that each holds its own rank of the same compile
(``sharded.load_rank``): a mismatch is reported by every rank, and all exit non-zero.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch.distributed as dist

from moeforge.compile.sharded_compile import load_rank, read_sharded
from moeforge.core.artifact import Artifact, artifact_digest
from moeforge.core.config import ModelConfig
from moeforge.core.errors import ArtifactError, GroupArtifactError, MoeforgeError
from moeforge.core.manifest import Manifest
from moeforge.model.pipeline_stages import boundary_width
from moeforge.ops.collectives.ort import (
    DEFAULT_TIMEOUT_S,
    CollectiveError,
    init_process_group,
    set_collective_group,
)
from moeforge.parallel.net import free_port
from moeforge.runtime.backends.base import Backend, block_io_of
from moeforge.runtime.backends.onnxruntime import OrtSession
from moeforge.runtime.backends.onnxruntime_paged import PagedSequenceSession
from moeforge.runtime.backends.pipeline import (
    PipelineBackend,
    PipelineSession,
    Topology,
    check_backend,
    serve_stage,
    stage_groups,
)
from moeforge.runtime.backends.registry import backend_for
from moeforge.runtime.backends.sharded import (
    ExpertLayout,
    ShardedBackend,
    ShardedSession,
    agree,
    gather_status,
    serve_rank,
)
from moeforge.runtime.engine import EngineConfig, open_engine_backend
from moeforge.runtime.kv_tiers.sharded_tiers import rank_handler
from moeforge.runtime.kv_tiers.tiers import KVTiers

CHILD_WAIT_S = 60.0  # how long rank 0 waits for the other ranks to exit after STOP


@dataclass
class World:
    """This process's place among the ranks, and the rank processes it started (rank 0 without torchrun)."""

    rank: int
    world_size: int
    children: list[subprocess.Popen[bytes]] = field(default_factory=list)
    # A pipeline artifact (--pp): this rank's stage and tp position, its stage's process group (tp > 1), and the
    # width of the hidden state the stages pass on. None: every rank runs the whole model (tp / ep only).
    topology: Topology | None = None
    stage_group: dist.ProcessGroup | None = None
    hidden_size: int = 0

    def dead_rank(self) -> str | None:
        """Why the world is broken, when a rank this process started has exited; None while all run. (Under torchrun
        its agent watches the ranks and, when one fails, stops the others: the default ``--max-restarts 0``.)"""
        for rank, child in enumerate(self.children, start=1):
            code = child.poll()
            if code is not None:
                return f"rank {rank} exited with status {code}"
        return None

    def finish(self, code: int) -> int:
        """Wait for the ranks this process started; non-zero if this rank or one of them failed."""
        for child in self.children:
            try:
                child_code = child.wait(timeout=CHILD_WAIT_S)
            except subprocess.TimeoutExpired:
                child.kill()
                child_code = child.wait()
            if child_code != 0 and code == 0:
                print(f"moeforge: a rank process exited with status {child_code}", file=sys.stderr)
                code = 1
        if dist.is_initialized():
            dist.destroy_process_group()
        return code


def start_world(path: str | Path, timeout_s: float = DEFAULT_TIMEOUT_S) -> World:
    """Join (under torchrun) or start (one node) the ranks of the sharded artifact at ``path``; the process group
    is initialised on return."""
    sharded = read_sharded(path)
    size = sharded.world_size
    children: list[subprocess.Popen[bytes]] = []
    if "WORLD_SIZE" in os.environ:
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ["WORLD_SIZE"])
    else:
        rank, world = 0, size
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(size),
               "LOCAL_WORLD_SIZE": str(size)}
        os.environ.update(env, RANK="0", LOCAL_RANK="0")
        # Every rank runs the moeforge this process runs: -P keeps the working directory off sys.path and
        # PYTHONPATH names the folder this package was imported from (a checkout or site-packages).
        package_root = str(Path(__file__).resolve().parents[2])
        python_path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH", "")) if p)
        for child_rank in range(1, size):
            child_env = {**os.environ, "RANK": str(child_rank), "LOCAL_RANK": str(child_rank),
                         "PYTHONPATH": python_path}
            children.append(subprocess.Popen([sys.executable, "-P", "-m", "moeforge.cli", *sys.argv[1:]], env=child_env,
                                             stdout=subprocess.DEVNULL))
    if world != size:
        raise ArtifactError(f"{path} is sharded over {size} ranks (tp {sharded.tp}, pp {sharded.pp}) but WORLD_SIZE "
                            f"is {world}: start it with --nproc-per-node {size} (or nodes x processes per node = "
                            f"{size} processes in all)")
    try:
        init_process_group(rank, world, timeout_s=timeout_s)
    except CollectiveError:
        for child in children:
            child.kill()
        raise
    if sharded.pp == 1:
        return World(rank, world, children)
    topology = Topology(sharded.pp, sharded.tp, rank)
    group = stage_groups(topology, timeout_s)  # every rank creates every stage's group, in order
    set_collective_group(group)  # the graph's tp collectives stay inside the stage
    # What crosses a stage boundary per token: the hidden state (DeepSeek-V4: its hc_mult mHC streams)
    width = boundary_width(ModelConfig.from_dict(sharded.model_config))
    return World(rank, world, children, topology, group, width)


def _open_rank(path: str | Path, world: World) -> Artifact:
    """This rank's artifact, checked by all ranks together: every rank raises if any rank's check failed."""
    problem, artifact = "", None
    try:
        _, artifact = load_rank(path, world.rank, world.world_size)
    except MoeforgeError as exc:
        problem = str(exc)
    statuses = gather_status(problem)
    bad = [f"rank {r}: {text}" for r, text in enumerate(statuses) if text]
    if bad:
        raise GroupArtifactError("the ranks do not hold one sharded artifact: " + "; ".join(bad))
    assert artifact is not None
    check_sharded_target(path, artifact.manifest)
    return artifact


def check_sharded_target(path: str | Path, manifest: Manifest) -> None:
    """Refuse a sharded artifact whose target's backend cannot run ranks (``manifest``: one rank's); the CLI asks
    first, before the ranks start."""
    spec = backend_for(manifest)
    why = spec.refusal(paged=manifest.kv_cache.paged, sharded=True)
    if why:
        raise ArtifactError(f"{path} holds {spec.title} plans (--target {spec.target}): {why}; compile with "
                            "--target ort to run it here")


def open_rank_backend(path: str | Path, world: World, config: EngineConfig) -> tuple[Backend, Artifact]:
    """This rank's backend, sized by rank 0's ``config``: every rank allocates the same slots and blocks, so the
    engine's block tables mean the same on all of them."""
    artifact = _open_rank(path, world)
    if world.topology is not None:
        check_pipeline_config(path, config)
    kv = artifact.manifest.kv_cache
    slots = config.scheduling.max_num_seqs
    blocks = config.cache.num_kv_blocks(slots, kv.max_seq_len, kv.block_size) if kv.paged and kv.block_size else 0
    slots, blocks, track = agree([slots, blocks, int(config.backend.track_expert_load)])
    # Every rank counts its own experts' load when rank 0 asks for it (``ShardedBackend.expert_load`` gathers them);
    # no rank profiles (the sharded backend reports rank 0's kernel shares only).
    rank_options = dataclasses.replace(config.backend, track_expert_load=bool(track) and world.topology is None,
                                       profile=False)
    backend = open_engine_backend(artifact, dataclasses.replace(config, backend=rank_options), collectives=True,
                                  num_slots=slots, num_blocks=blocks or None)
    return backend, artifact


def check_pipeline_config(path: str | Path, config: EngineConfig) -> None:
    """What a pipeline artifact's ranks do not do yet, refused with the reason (on every rank alike; the CLI asks
    first, before the ranks start, so that it is said once)."""
    if config.cache.tiered:
        raise MoeforgeError(f"{path} is a pipeline artifact (--pp): KV tiers (--kv-host-bytes / --kv-disk-dir) are not "
                            "supported across stages yet; drop them, or compile without --pp")
    if config.backend.micro_batches < 0:
        raise MoeforgeError(f"--micro-batches must be >= 0 (0: one per stage), got {config.backend.micro_batches}")


def rank_worker(path: str | Path, world: World,
                config: EngineConfig) -> tuple[Backend, Callable[[np.ndarray], None] | None]:
    """A rank other than 0: its backend (``open_rank_backend``) and, when ``config`` has KV tiers, the handler of
    rank 0's KV-tier messages over this rank's own tiers (its shard; files keyed by its own manifest digest)."""
    backend, artifact = open_rank_backend(path, world, config)
    if not config.cache.tiered:
        return backend, None
    io = block_io_of(backend)
    if io is None:
        raise ArtifactError(f"rank {world.rank}: its backend cannot copy KV blocks, so it cannot have KV tiers; "
                            "compile with --kv-cache paged or drop --kv-host-bytes / --kv-disk-dir")
    tiers = KVTiers(config.cache.tier_settings(), io, artifact_digest(artifact.root))
    return backend, rank_handler(tiers)


def sharded_backend(path: str | Path, world: World,
                    config: EngineConfig) -> tuple[ShardedBackend | PipelineBackend, Artifact]:
    """Rank 0's backend for the engine (``LLMEngine(backend, ...)``): a ``PipelineBackend`` for a pipeline artifact."""
    local, artifact = open_rank_backend(path, world, config)
    sharded = read_sharded(path)
    if world.topology is not None:
        check_backend(local)
        return PipelineBackend(local, world.topology, vocab_size=int(sharded.model_config["vocab_size"]),
                               micro_batches=config.backend.micro_batches, heartbeat_s=DEFAULT_TIMEOUT_S / 4,
                               group=world.stage_group), artifact
    moe = sharded.model_config.get("moe")
    experts = None if not moe else ExpertLayout(sharded.ep, int(moe["n_routed_experts"]), sharded.expert_slots())
    return ShardedBackend(local, world.world_size, heartbeat_s=DEFAULT_TIMEOUT_S / 4, experts=experts), artifact


def open_rank_session(path: str | Path, world: World, max_len: int) -> tuple[Any, Artifact]:
    """This rank's whole-sequence session (parity): rank 0 gets a ``ShardedSession``."""
    artifact = _open_rank(path, world)
    kv = artifact.manifest.kv_cache
    (max_len,) = agree([max_len])
    session: Any
    if world.topology is not None:  # the pipeline runs the sequence as one step through its stages
        assert kv.block_size is not None  # pipeline artifacts are paged
        num_blocks = -(-max_len // kv.block_size)
        backend = open_engine_backend(artifact, EngineConfig(), collectives=True, num_slots=1, num_blocks=num_blocks)
        check_backend(backend)
        if world.rank != 0:
            return backend, artifact
        pipeline = PipelineBackend(backend, world.topology, vocab_size=artifact.manifest.config().vocab_size,
                                   micro_batches=1, heartbeat_s=DEFAULT_TIMEOUT_S / 4, group=world.stage_group)
        return PipelineSession(pipeline, num_blocks), artifact
    if kv.paged:
        session = PagedSequenceSession(artifact.model_path, max_len, kv_cache=kv, collectives=True)
    else:
        session = OrtSession(artifact.model_path, kv_cache=kv, collectives=True)
        session.allocate(batch=1, max_len=max_len)
    return (ShardedSession(session) if world.rank == 0 else session), artifact


def run_worker(local: Any, world: World, kv_tiers: Callable[[np.ndarray], None] | None = None) -> int:
    """A rank other than 0: serve rank 0's steps until STOP; the process's exit status.

    SIGINT and SIGTERM are ignored here: a terminal's Ctrl-C and torchrun's or a supervisor's SIGTERM reach every
    rank, and rank 0 decides how to stop (a server drains its requests first, and needs every rank for that). A
    rank 0 that dies ends the others through their next collective, which fails at once."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        if world.topology is not None:
            serve_stage(local, world.topology, world.hidden_size, world.stage_group)
        else:
            serve_rank(local, kv_tiers)
    except MoeforgeError as exc:
        print(f"moeforge rank {world.rank}: error: {exc}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(1)  # the group is broken: tearing it down could wait on the dead peer
    return world.finish(0)
