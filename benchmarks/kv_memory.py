"""KV-cache memory of a paged artifact vs the bytes its tokens need, for 8 concurrent requests of mixed lengths.

`python benchmarks/kv_memory.py PAGED_ARTIFACT [--seed 0]` runs 8 requests (prompts of 24..200 tokens,
24 generated each) on the engine with the block pool sized to exactly the blocks the requests need at their
longest (no preemption must happen), and reports:
  - token_bytes: sum over requests of (prompt + generated) tokens x bytes_per_token (all layers);
  - pool_bytes: the preallocated pools (what the process holds for KV), and pool_bytes / token_bytes;
  - peak_blocks_in_use x bytes_per_block vs the tokens held at that step;
  - the contiguous layout's bytes for the same requests (one max_seq_len buffer per slot) for comparison.
Writes benchmarks/results/kv_memory_<model>.json (machine described). The engine's greedy tokens are also
compared with a run that has a generous pool (same tokens expected).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import numpy as np

from moeforge.artifact import load_artifact
from moeforge.bench import write_result
from moeforge.runtime.engine import EngineConfig, LLMEngine
from moeforge.runtime.sampler import SamplingParams

RESULTS = Path(__file__).parent / "results"
NEW_TOKENS = 24


def run(artifact: Path, seed: int) -> dict[str, object]:
    manifest = load_artifact(artifact).manifest
    kv = manifest.kv_cache
    if not kv.paged:
        raise SystemExit(f"{artifact} is not a paged artifact (compile with --kv-cache paged)")
    vocab = int(manifest.model_config["vocab_size"])
    rng = np.random.default_rng(seed)
    lengths = [int(n) for n in rng.integers(24, 201, 8)]
    prompts = [rng.integers(0, vocab, n).tolist() for n in lengths]
    totals = [n + NEW_TOKENS for n in lengths]
    blocks = sum(-(-t // kv.block_size) for t in totals)
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    engine = LLMEngine.from_artifact(artifact, EngineConfig(max_num_seqs=8, max_num_batched_tokens=256,
                                                             kv_blocks=blocks))
    for prompt in prompts:
        engine.add_request(prompt, params)
    peak_blocks, tokens_at_peak, outputs = 0, 0, {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.token_ids
        in_use = engine.kv.stats().blocks_in_use
        if in_use >= peak_blocks:
            held = sum(engine.kv.num_slots(r) for r in range(len(prompts)) if r in engine.kv)
            peak_blocks, tokens_at_peak = in_use, held
    generous = LLMEngine.from_artifact(artifact, EngineConfig(max_num_seqs=8, max_num_batched_tokens=256))
    same_tokens = [o.token_ids for o in generous.generate(prompts, params)] == [outputs[i] for i in range(8)]
    token_bytes = sum(totals) * kv.bytes_per_token
    pool_bytes = engine.backend.pool_bytes
    return {
        "model": manifest.model_config.get("name") or manifest.source,
        "layout": kv.layout, "block_size": kv.block_size, "bytes_per_token": kv.bytes_per_token,
        "bytes_per_block": kv.bytes_per_block, "requests": len(prompts), "prompt_lengths": lengths,
        "new_tokens": NEW_TOKENS, "tokens": sum(totals), "token_bytes": token_bytes,
        "pool_blocks": blocks, "pool_bytes": pool_bytes, "pool_over_tokens": round(pool_bytes / token_bytes, 4),
        "peak_blocks_in_use": peak_blocks, "tokens_held_at_peak": tokens_at_peak,
        "peak_held_over_tokens": round(peak_blocks * kv.bytes_per_block
                                       / max(tokens_at_peak * kv.bytes_per_token, 1), 4),
        "preemptions": engine.metrics.preemptions,
        "contiguous_bytes_same_requests": 8 * kv.max_seq_len * kv.bytes_per_token,
        "contiguous_over_tokens": round(8 * kv.max_seq_len * kv.bytes_per_token / token_bytes, 4),
        "greedy_tokens_equal_generous_pool": same_tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    results = run(args.artifact, args.seed)
    name = re.sub(r"[^a-z0-9]+", "-", str(results["model"]).lower()).strip("-")
    path = write_result(RESULTS / f"kv_memory_{name}.json", "kv_memory", results)
    print(f"pool {results['pool_bytes']} B for {results['token_bytes']} B of tokens "
          f"({results['pool_over_tokens']}x); wrote {path}")


if __name__ == "__main__":
    main()
