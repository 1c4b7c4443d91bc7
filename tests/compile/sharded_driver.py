"""One rank of a sharded-engine test, started by torchrun (or by the tests with torchrun's variables).

    torchrun --nproc-per-node 2 tests/compile/sharded_driver.py DIR OUT.json [--die-after N]

Rank 0 runs 8 concurrent greedy requests through ``LLMEngine`` on a ``ShardedBackend`` and writes their tokens to
OUT.json; every other rank serves the steps. ``--die-after N``: rank 1 exits abruptly after N steps (a rank dying
mid-step), which must make rank 0 fail with an error, not hang. ``--speculative-tokens K``: prompt-lookup drafts for
every running request (``speculative_max_batch`` 8), the draft counts written to OUT.json.metrics.json.
``--kv-host-bytes`` / ``--kv-disk-dir`` (with ``--kv-blocks``, ``--repeat``): KV tiers on every rank, the tier counts
written to OUT.json.tiers.json. A pipeline artifact (``--pp``) runs the same way (``--micro-batches M``); a dying
rank then dies in its stage's step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from moeforge.compile.sharded_compile import rank_dir
from moeforge.core.errors import MoeforgeError
from moeforge.parallel.launch import rank_worker, run_worker, sharded_backend, start_world
from moeforge.runtime.engine import (
    BackendOptions,
    CacheOptions,
    EngineConfig,
    LLMEngine,
    SchedulingOptions,
    SpeculativeOptions,
)
from moeforge.runtime.sampler import SamplingParams

PROMPTS = [[1 + (7 * i + 3 * j) % 250 for j in range(5 + 3 * i)] for i in range(8)]


class DyingBackend:
    """Runs ``after`` steps, then ends the process without a word (a crashed rank)."""

    def __init__(self, inner: Any, after: int) -> None:
        self.inner, self.after = inner, after

    def execute(self, step: Any) -> Any:
        if self.after <= 0:
            os._exit(17)
        self.after -= 1
        return self.inner.execute(step)

    def execute_stage(self, step: Any, hidden: Any) -> Any:  # a pipeline stage's rank
        if self.after <= 0:
            os._exit(17)
        self.after -= 1
        return self.inner.execute_stage(step, hidden)

    def release(self, slot: int) -> None:
        self.inner.release(slot)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("artifact")
    parser.add_argument("out")
    parser.add_argument("--die-after", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--speculative-tokens", type=int, default=0)
    parser.add_argument("--prompts", default=None, help="a JSON list of token lists (default: PROMPTS)")
    parser.add_argument("--expert-load", default=None,
                        help="write the expert load of the run (logical, per rank, per slot) to this JSON file")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512, help="chunked prefill: the step's budget")
    parser.add_argument("--kv-blocks", type=int, default=None)
    parser.add_argument("--kv-host-bytes", type=int, default=0)
    parser.add_argument("--kv-disk-dir", default=None)
    parser.add_argument("--repeat", type=int, default=1, help="run the prompts this many times, one after the other")
    parser.add_argument("--micro-batches", type=int, default=0, help="a pipeline artifact's micro-batches per step")
    parser.add_argument("--min-micro-batch-tokens", type=int, default=None,
                        help="a pipeline artifact's smallest piece (default: the backend's)")
    args = parser.parse_args()
    config = EngineConfig(
        scheduling=SchedulingOptions(max_num_seqs=args.max_num_seqs,
                                     max_num_batched_tokens=args.max_num_batched_tokens),
        cache=CacheOptions(kv_blocks=args.kv_blocks, host_bytes=args.kv_host_bytes, disk_dir=args.kv_disk_dir),
        backend=BackendOptions(threads=1, track_expert_load=args.expert_load is not None,
                               micro_batches=args.micro_batches),
        speculative=SpeculativeOptions(tokens=args.speculative_tokens,
                                       max_batch=8 if args.speculative_tokens else None))
    prompts = json.loads(args.prompts) if args.prompts else PROMPTS
    world = start_world(args.artifact, timeout_s=30)
    if world.rank != 0:
        local, kv_tiers = rank_worker(args.artifact, world, config)
        if args.die_after is not None and world.rank == 1:
            local = DyingBackend(local, args.die_after)
        return run_worker(local, world, kv_tiers)
    backend, _ = sharded_backend(args.artifact, world, config)
    if args.min_micro_batch_tokens is not None:
        backend.min_micro_batch_tokens = args.min_micro_batch_tokens  # type: ignore[union-attr]
    try:
        engine = LLMEngine.from_artifact(Path(args.artifact) / rank_dir(0), config, backend=backend)
        for _ in range(args.repeat):
            outputs = engine.generate(prompts, SamplingParams(max_tokens=args.max_tokens, ignore_eos=True))
        engine.shutdown()  # with --kv-disk-dir: every rank writes its shard of the cached blocks
        Path(args.out).write_text(json.dumps([list(o.token_ids) for o in outputs]))
        tiers = engine.stats().kv_tiers
        if tiers is not None:
            Path(args.out + ".tiers.json").write_text(json.dumps(
                {"host_hits": tiers.host_hits, "disk_hits": tiers.disk_hits, "promotions": tiers.promotions,
                 "prefill_tokens": engine.metrics.prefill_tokens}))
        metrics = engine.metrics
        Path(args.out + ".metrics.json").write_text(json.dumps(
            {"draft_tokens": metrics.draft_tokens, "accepted_draft_tokens": metrics.accepted_draft_tokens,
             "preemptions": metrics.preemptions, "steps": metrics.steps}))
        if args.expert_load:
            load, ranks, slots = backend.expert_load(), backend.rank_expert_load(), backend.slot_expert_load()
            Path(args.expert_load).write_text(json.dumps({
                "logical": None if load is None else load.tolist(), "ranks": None if ranks is None else ranks.tolist(),
                "slots": None if slots is None else slots.tolist()}))
    except MoeforgeError as exc:
        print(f"rank 0: error: {exc}", file=sys.stderr)
        return 3
    finally:
        backend.close()
    return world.finish(0)


if __name__ == "__main__":
    sys.exit(main())
