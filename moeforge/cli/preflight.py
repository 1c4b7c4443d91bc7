"""What a command's flags ask of an artifact, checked by the process the user started before any model loads or any
rank of a sharded artifact starts: a flag every rank would refuse is one message at once, not one per rank after
each has loaded its shard. Only manifests are read (no weights, no hashes); the engine and the ranks still check
what they are given (for callers of the Python API), these checks only come first.

For a sharded artifact the checks run on rank 0: the process the user started (the ranks it starts run the same
command line, already checked) or torchrun's rank 0 (torchrun stops the other ranks when it exits).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from moeforge.cli.bench import check_bench_memory
from moeforge.compile.sharded_compile import is_sharded, rank_dir, read_sharded
from moeforge.core.artifact import load_artifact
from moeforge.core.errors import MoeforgeError
from moeforge.core.manifest import Manifest
from moeforge.model.loader import load_config
from moeforge.model.tokenizer import TOKENIZER_FILE, Tokenizer
from moeforge.parallel.launch import check_pipeline_config, check_sharded_target
from moeforge.runtime.backends.registry import backend_for
from moeforge.runtime.engine import EngineConfig, engine_sizes
from moeforge.verify.parity import check_comparable
from moeforge.verify.transformers_reference import check_transformers_loadable


@dataclass(frozen=True)
class ArtifactShape:
    """What flags are checked against: an artifact's manifest (a sharded artifact's rank 0 manifest, whose
    vocabulary, max_seq_len and cache layout every rank shares), with the ranks and pipeline stages it runs on."""

    path: str
    root: Path  # the directory of ``manifest``: the artifact, or a sharded artifact's rank 0
    manifest: Manifest
    sharded: bool = False
    world_size: int = 1
    pp: int = 1

    @property
    def checked_here(self) -> bool:
        """Whether this process checks the flags: always for an unsharded artifact, rank 0 for a sharded one."""
        return not self.sharded or os.environ.get("RANK", "0") == "0"

    def tokenizer(self) -> Tokenizer | None:
        """The artifact's tokenizer (None when it ships none), as the engine reads it."""
        return Tokenizer.from_file(self.root) if (self.root / TOKENIZER_FILE).is_file() else None


def read_shape(path: str) -> ArtifactShape:
    """The shape of the artifact at ``path`` (``ArtifactError`` when it is not one)."""
    if is_sharded(path):
        sharded = read_sharded(path)
        root = Path(path) / rank_dir(0)
        manifest = load_artifact(root, verify=False).manifest
        check_sharded_target(path, manifest)
        return ArtifactShape(path, root, manifest, sharded=True, world_size=sharded.world_size, pp=sharded.pp)
    return ArtifactShape(path, Path(path), load_artifact(path, verify=False).manifest)


# The engine's words (runtime/engine.py), which it says only once the model has loaded.
TIERS_NEED_PAGED = ("KV host/disk tiers (--kv-host-bytes, --kv-disk-dir) keep prefix-cache blocks, which only paged "
                    "artifacts have: compile with --kv-cache paged, or drop the tier options")


def check_engine_config(shape: ArtifactShape, config: EngineConfig) -> None:
    """What the engine, or every rank's backend, would refuse of ``config`` on this artifact: KV tiers without a paged
    cache or across pipeline stages, a block size that does not fit, caches that cannot fit in host memory."""
    if config.cache.tiered:
        if shape.pp > 1:
            check_pipeline_config(shape.path, config)
        if not shape.manifest.kv_cache.paged:
            raise MoeforgeError(TIERS_NEED_PAGED)
    engine_sizes(shape.manifest, config)


def check_bench(args: argparse.Namespace, shape: ArtifactShape) -> None:
    """``moeforge bench``'s work against the artifact: an unsharded artifact's batch within the memory available
    (``check_bench_memory``, as ``run_bench`` checks it), every request's prompt and new tokens within max_seq_len;
    ``--roofline`` on a sharded artifact with every rank on this machine."""
    kv = shape.manifest.kv_cache
    if not shape.sharded and backend_for(shape.manifest).host_kv:
        check_bench_memory(kv, int(shape.manifest.model_config["vocab_size"]), args.batch, args.prompt_len)
    limit = kv.max_seq_len
    if args.prompt_len + args.new_tokens > limit:
        raise MoeforgeError(f"--prompt-len {args.prompt_len} + --new-tokens {args.new_tokens} exceeds {shape.path}'s "
                            f"max_seq_len {limit}: lower them, or compile with --max-seq-len "
                            f"{args.prompt_len + args.new_tokens} or more")
    if shape.sharded and args.roofline:
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", shape.world_size))
        if local_ranks != shape.world_size:
            raise MoeforgeError(f"--roofline sums the ranks' bytes over this machine's bandwidth, but only "
                                f"{local_ranks} of the {shape.world_size} ranks run here: run the ranks on one "
                                "machine (moeforge bench starts them itself), or leave --roofline out")


def check_parity(args: argparse.Namespace, shape: ArtifactShape) -> None:
    """``moeforge parity``'s work against the artifact: the prompt and the steps within max_seq_len, and a reference
    model (``--model``, default the artifact's source) that can be compared with it (``check_comparable``)."""
    limit = shape.manifest.kv_cache.max_seq_len
    if args.prompt_len + args.steps + 1 > limit:
        raise MoeforgeError(f"--prompt-len {args.prompt_len} + --steps {args.steps} + 1 exceeds the artifact's "
                            f"max_seq_len ({limit}): lower them")
    source = shape.manifest.source
    reference = args.model or source
    if args.reference == "transformers":  # the more basic refusal first: no checkpoint at all to compare with
        check_transformers_loadable(reference)
    check_comparable(shape.path, shape.manifest.config(), reference, load_config(reference), source,
                     per_layer=args.per_layer)
