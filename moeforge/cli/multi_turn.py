"""A multi-turn chat workload (``moeforge bench --multi-turn``, benchmarks/kv_tiers.py): conversations that share
system prompts and come back turn after turn with their whole history, the case KV tiers are for.

Turn t of a conversation sends: its system prompt (one of ``system_prompts``, shared), then for every earlier
turn the user message and the model's answer, then turn t's user message. Turns go in rounds (every conversation's
turn 1, then every turn 2, ...), ``concurrency`` requests in flight at once, so between a conversation's turns all
the others run: once their histories outgrow the pool, a returning conversation finds its prefix evicted from L1.
Token ids are drawn from the vocabulary, seeded; answers are the model's greedy tokens, so a run's outputs can be
compared token for token with another configuration's.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moeforge.cli.bench import write_result
from moeforge.cli.json_output import to_json
from moeforge.core.artifact import load_artifact
from moeforge.core.errors import MoeforgeError
from moeforge.runtime.engine import BackendOptions, CacheOptions, EngineConfig, LLMEngine, SchedulingOptions
from moeforge.runtime.sampler import SamplingParams


@dataclass(frozen=True)
class MultiTurnWorkload:
    """The shape of the workload; ``prefix_tokens`` is what it asks the cache to keep (its working set)."""

    conversations: int = 32
    turns: int = 4
    system_prompts: int = 4
    system_len: int = 256
    user_len: int = 32
    new_tokens: int = 16
    concurrency: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if name != "seed" and (not isinstance(value, int) or value < 1):
                raise ValueError(f"MultiTurnWorkload({name}={value!r}) must be an integer >= 1")

    @property
    def history_tokens(self) -> int:
        """Tokens of one conversation's longest turn (the last)."""
        return self.system_len + self.turns * self.user_len + (self.turns - 1) * self.new_tokens

    @property
    def prefix_tokens(self) -> int:
        """Distinct tokens worth caching once every conversation reached its last turn: the system prompts once,
        every conversation's own part once."""
        own = self.history_tokens - self.system_len
        return self.system_prompts * self.system_len + self.conversations * own


@dataclass
class TurnResult:
    conversation: int
    turn: int
    prompt_tokens: int
    token_ids: list[int]
    logprobs: list[float]
    ttft_s: float


def run_multi_turn(engine: LLMEngine, workload: MultiTurnWorkload, logprobs: bool = False) -> dict[str, Any]:
    """Run ``workload`` on ``engine`` (greedy); return its measurements and every turn's tokens (``turns``):
    prefill tokens the engine computed, TTFT p50 / p99, throughput (prompt + generated tokens per second)."""
    rng = np.random.default_rng(workload.seed)
    vocab = engine.backend.vocab_size
    systems = [rng.integers(0, vocab, workload.system_len).tolist() for _ in range(workload.system_prompts)]
    users = rng.integers(0, vocab, (workload.conversations, workload.turns, workload.user_len)).tolist()
    histories = [list(systems[c % workload.system_prompts]) for c in range(workload.conversations)]
    params = SamplingParams(max_tokens=workload.new_tokens, ignore_eos=True, logprobs=0 if logprobs else None)
    prefill_before = engine.metrics.prefill_tokens
    results: list[TurnResult] = []
    start = time.perf_counter()
    for turn in range(workload.turns):
        for first in range(0, workload.conversations, workload.concurrency):
            batch = range(first, min(first + workload.concurrency, workload.conversations))
            prompts = [histories[c] + users[c][turn] for c in batch]
            outputs = engine.generate(prompts, params)
            for c, prompt, out in zip(batch, prompts, outputs, strict=True):
                if out.error:
                    raise RuntimeError(f"conversation {c} turn {turn}: {out.error}")
                metrics = out.metrics
                ttft = metrics.ttft if metrics is not None and metrics.ttft is not None else float("nan")
                results.append(TurnResult(c, turn, len(prompt), out.token_ids, out.logprobs, ttft))
                histories[c] = prompt + out.token_ids
    seconds = time.perf_counter() - start
    ttfts = np.array([r.ttft_s for r in results])
    tokens = sum(r.prompt_tokens + len(r.token_ids) for r in results)
    return {
        "requests": len(results),
        "prompt_tokens": sum(r.prompt_tokens for r in results),
        "prefill_tokens_computed": engine.metrics.prefill_tokens - prefill_before,
        "ttft_ms_p50": round(1e3 * float(np.percentile(ttfts, 50)), 2),
        "ttft_ms_p99": round(1e3 * float(np.percentile(ttfts, 99)), 2),
        "tokens_per_s": round(tokens / seconds, 1),
        "seconds": round(seconds, 2),
        "turns": [asdict(r) for r in results],
    }


def default_pool_blocks(workload: MultiTurnWorkload, block_size: int) -> int:
    """A pool a quarter of the workload's prefixes (so L1 alone must recompute), but never too small to run
    ``concurrency`` requests of the longest turn at once."""
    running = workload.concurrency * -(-(workload.history_tokens + workload.new_tokens) // block_size)
    return max(workload.prefix_tokens // block_size // 4, running + 1)


def compare_tiers(artifact: str | Path, workload: MultiTurnWorkload, tiers: CacheOptions,
                  config: EngineConfig | None = None, logprobs: bool = False) -> dict[str, Any]:
    """Run ``workload`` with the pool alone, then with ``tiers`` (its ``kv_blocks`` is the pool of both), then --
    when ``tiers`` has a disk tier -- once more in a new engine after the first one's shutdown (a restart). Each run
    reports ``run_multi_turn``'s numbers, whether its tokens equal the pool-alone run's, and its tier counters."""
    base = config or EngineConfig()
    runs: dict[str, dict[str, Any]] = {}
    plans = [("pool only", dataclasses.replace(tiers, host_bytes=0, disk_dir=None)), ("tiers", tiers)]
    if tiers.disk_dir is not None:
        plans.append(("tiers after restart", tiers))
    reference: list[list[int]] | None = None
    for name, cache in plans:
        engine = LLMEngine.from_artifact(artifact, dataclasses.replace(base, cache=cache))
        try:
            result = run_multi_turn(engine, workload, logprobs)
            stats = engine.stats().kv_tiers
        finally:
            engine.shutdown()
        tokens = [turn["token_ids"] for turn in result["turns"]]
        reference = reference or tokens
        result["identical_to_pool_only"] = tokens == reference
        result["kv_tiers"] = None if stats is None else {k: v for k, v in asdict(stats).items() if k != "disk"}
        runs[name] = result
    return runs


def print_comparison(runs: dict[str, dict[str, Any]]) -> None:
    """The table ``moeforge bench --multi-turn`` prints."""
    print(f"{'run':<20} {'prefill computed':>17} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12} {'tok/s':>8} "
          f"{'host/disk hits':>15} {'same tokens':>12}")
    for name, run in runs.items():
        tiers = run["kv_tiers"] or {}
        hits = f"{tiers.get('host_hits', 0)}/{tiers.get('disk_hits', 0)}" if tiers else "-"
        same = "yes" if run["identical_to_pool_only"] else "NO"
        print(f"{name:<20} {run['prefill_tokens_computed']:>17,} {run['ttft_ms_p50']:>12.1f} "
              f"{run['ttft_ms_p99']:>12.1f} {run['tokens_per_s']:>8.1f} {hits:>15} {same:>12}")


def bench_multi_turn(args: argparse.Namespace) -> int:
    """``moeforge bench ARTIFACT --multi-turn [tier flags]``: ``compare_tiers`` on the artifact, printed as a table
    (``--json``: as JSON; ``--save``: also benchmarks/results/bench_multi_turn_<model>.json). Without tier flags it
    compares the pool with a host tier that holds the whole workload. A ``--kv-disk-dir`` gets a fresh subfolder,
    removed afterwards, so the first tiered run starts cold."""
    artifact = load_artifact(args.artifact)
    kv = artifact.manifest.kv_cache
    if kv.block_size is None:
        raise MoeforgeError(f"{args.artifact} is not paged: --multi-turn measures the prefix cache and its tiers, "
                            "which need --kv-cache paged at compile time")
    workload = MultiTurnWorkload(conversations=args.conversations, turns=args.turns)
    longest = workload.history_tokens + workload.new_tokens
    if longest > kv.max_seq_len:
        raise MoeforgeError(f"the workload's last turn needs {longest} tokens and {args.artifact} holds "
                            f"{kv.max_seq_len} (max_seq_len): pass fewer --turns, or compile with --max-seq-len "
                            f"{longest} or more")
    blocks = args.kv_blocks or default_pool_blocks(workload, kv.block_size)
    host = args.kv_host_bytes
    if not host and args.kv_disk_dir is None:
        host = 2 * -(-workload.prefix_tokens // kv.block_size) * kv.bytes_per_block
    scratch = None
    disk_dir = args.kv_disk_dir
    if disk_dir is not None:
        disk_dir.mkdir(parents=True, exist_ok=True)
        scratch = disk_dir = Path(tempfile.mkdtemp(prefix="bench-", dir=disk_dir))
    tiers = CacheOptions(kv_blocks=blocks, host_bytes=host, disk_dir=disk_dir, disk_bytes=args.kv_disk_bytes,
                         offload_dtype=args.kv_offload_dtype)
    config = EngineConfig(scheduling=SchedulingOptions(max_num_seqs=workload.concurrency),
                          backend=BackendOptions(threads=args.threads))
    try:
        runs = compare_tiers(args.artifact, workload, tiers, config)
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    result = {"artifact": str(args.artifact), "model": artifact.manifest.model_config.get("name") or
              Path(args.artifact).name, "workload": asdict(workload), "kv_blocks": blocks,
              "kv_host_bytes": host, "kv_disk_bytes": args.kv_disk_bytes if disk_dir is not None else 0,
              "kv_offload_dtype": args.kv_offload_dtype,
              "runs": {name: {k: v for k, v in run.items() if k != "turns"} for name, run in runs.items()}}
    if args.save:
        write_result(f"benchmarks/results/bench_multi_turn_{Path(args.artifact).name}.json", "bench --multi-turn",
                     result)
    if args.json:
        print(to_json(result, indent=2))
        return 0
    print(f"{result['model']}: {workload.conversations} conversations x {workload.turns} turns, "
          f"{workload.system_prompts} shared system prompts of {workload.system_len} tokens; pool {blocks} blocks "
          f"of {kv.block_size} tokens for {workload.prefix_tokens:,} prefix tokens")
    print_comparison(runs)
    return 0
