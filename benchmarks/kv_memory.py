"""KV-cache memory of a paged artifact: what the engine's pool holds vs what its tokens need, 8 concurrent requests.

`python benchmarks/kv_memory.py PAGED_ARTIFACT [--seed 0]` runs 8 requests (prompts of 24..200 tokens, 24
generated each) twice:

1. with the engine's default pool (``CacheOptions(kv_blocks=None)``: ``max_num_seqs x ceil(max_seq_len / Bs)``
   blocks, the same bytes as the contiguous layout). While each step runs (inside ``backend.execute``) it
   records the blocks in use and the allocated tokens; at the peak it reports
   ``peak_held_bytes = peak blocks x bytes_per_block`` over the bytes of the tokens held then
   (``peak_held_over_tokens``: block rounding and nothing else), and the same tokens' ratio for the
   contiguous layout (one ``max_seq_len`` buffer per slot: ``contiguous_over_tokens_at_peak``).
2. with the pool sized to that peak (``kv_blocks = peak blocks``): the smallest pool serving this load; it
   must not preempt (``preemptions == 0``) and must give the same greedy tokens (``same_tokens``), else the
   script fails.

Writes benchmarks/results/kv_memory_<model>.json (machine described).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import numpy as np

from moeforge.cli.bench import write_result
from moeforge.core.artifact import load_artifact
from moeforge.runtime.backends.base import StepInput
from moeforge.runtime.engine import CacheOptions, EngineConfig, LLMEngine, SchedulingOptions
from moeforge.runtime.sampler import SamplingParams

RESULTS = Path(__file__).parent / "results"
NEW_TOKENS = 24
REQUESTS = 8


def _serve(artifact: Path, prompts: list[list[int]], kv_blocks: int | None) -> tuple[LLMEngine, list[list[int]],
                                                                                     int, int]:
    """Run ``prompts`` together; (engine, tokens per prompt, peak blocks in use, allocated tokens then)."""
    engine = LLMEngine.from_artifact(artifact, EngineConfig(
        scheduling=SchedulingOptions(max_num_seqs=REQUESTS, max_num_batched_tokens=256),
        cache=CacheOptions(kv_blocks=kv_blocks)))
    peak = {"blocks": 0, "tokens": 0}
    execute = engine.backend.execute

    def measured(step: StepInput) -> np.ndarray:  # blocks are held while the step runs
        in_use = engine.kv.stats().blocks_in_use
        if in_use >= peak["blocks"]:
            peak["blocks"] = in_use
            peak["tokens"] = sum(engine.kv.num_allocated_tokens(r) for r in range(len(prompts)) if r in engine.kv)
        return execute(step)

    engine.backend.execute = measured
    outputs = engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    return engine, [o.token_ids for o in outputs], peak["blocks"], peak["tokens"]


def run(artifact: Path, seed: int) -> dict[str, object]:
    manifest = load_artifact(artifact).manifest
    kv = manifest.kv_cache
    if not kv.paged:
        raise SystemExit(f"{artifact} is not a paged artifact (compile with --kv-cache paged)")
    vocab = int(manifest.model_config["vocab_size"])
    rng = np.random.default_rng(seed)
    lengths = [int(n) for n in rng.integers(24, 201, REQUESTS)]
    if max(lengths) + NEW_TOKENS > kv.max_seq_len:
        raise SystemExit(f"compile with --max-seq-len >= {max(lengths) + NEW_TOKENS}")
    prompts = [rng.integers(0, vocab, n).tolist() for n in lengths]

    default, tokens, peak_blocks, peak_tokens = _serve(artifact, prompts, None)
    sized, sized_tokens, _, _ = _serve(artifact, prompts, peak_blocks)
    same_tokens = sized_tokens == tokens
    if sized.metrics.preemptions or default.metrics.preemptions or not same_tokens:
        raise SystemExit(f"a pool of the peak's {peak_blocks} blocks preempted ({sized.metrics.preemptions}) or "
                         f"changed tokens ({not same_tokens}): the measurement is wrong")

    peak_token_bytes = peak_tokens * kv.bytes_per_token
    peak_held_bytes = peak_blocks * kv.bytes_per_block
    contiguous_bytes = REQUESTS * kv.max_seq_len * kv.bytes_per_token
    pool_bytes = default.backend.pool_bytes
    return {
        "model": manifest.model_config.get("name") or manifest.source,
        "layout": kv.layout, "block_size": kv.block_size, "bytes_per_token": kv.bytes_per_token,
        "bytes_per_block": kv.bytes_per_block, "max_seq_len": kv.max_seq_len, "requests": REQUESTS,
        "prompt_lengths": lengths, "new_tokens": NEW_TOKENS,
        "default_pool_blocks": default.kv.config.num_blocks, "default_pool_bytes": pool_bytes,
        "peak_blocks_in_use": peak_blocks, "tokens_held_at_peak": peak_tokens,
        "peak_held_bytes": peak_held_bytes, "peak_token_bytes": peak_token_bytes,
        "peak_held_over_tokens": round(peak_held_bytes / peak_token_bytes, 4),
        "peak_held_over_default_pool": round(peak_held_bytes / pool_bytes, 4),
        "contiguous_bytes": contiguous_bytes,
        "contiguous_over_tokens_at_peak": round(contiguous_bytes / peak_token_bytes, 4),
        "sized_pool_blocks": peak_blocks, "sized_pool_bytes": sized.backend.pool_bytes,
        "preemptions": sized.metrics.preemptions, "same_tokens": same_tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    results = run(args.artifact, args.seed)
    name = re.sub(r"[^a-z0-9]+", "-", str(results["model"]).lower()).strip("-")
    path = write_result(RESULTS / f"kv_memory_{name}.json", "kv_memory", results)
    print(f"peak held {results['peak_held_bytes']} B for {results['peak_token_bytes']} B of tokens "
          f"({results['peak_held_over_tokens']}x; contiguous {results['contiguous_over_tokens_at_peak']}x); "
          f"default pool {results['default_pool_bytes']} B; wrote {path}")


if __name__ == "__main__":
    main()
