"""The first steps of a fresh engine: cache buffers mapped up front (``kv_bindings.resident_zeros``) vs lazily.

`python benchmarks/cold_start.py ARTIFACT [--batch 8] [--rounds 3]` starts a fresh process per measurement,
alternating the two variants, and in each: loads the engine (``max_num_seqs=batch``), runs the first step (the
prefill of ``batch`` 8-token prompts) and 32 decode steps. "lazy" is the old allocation, ``np.zeros`` (pages mapped
on first touch, so the faults land inside ONNX Runtime's kernels: GroupQueryAttention's prompt path touches a
row's whole cache region); "resident" is the current one. Writes benchmarks/results/cold_start.json (medians,
machine described).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from timer import Rounds, Stopwatch

RESULTS = Path(__file__).resolve().parent / "results" / "cold_start.json"


def child(artifact: str, batch: int, lazy: bool) -> dict[str, float]:
    """One fresh engine's load, first step and decode timings (run in its own process)."""
    import numpy as np

    import moeforge.runtime.backends.onnxruntime as ort_backend
    import moeforge.runtime.backends.onnxruntime_paged as paged_backend
    from moeforge.runtime.engine import EngineConfig, LLMEngine, SchedulingOptions
    from moeforge.runtime.sampler import SamplingParams

    if lazy:  # the allocation before resident_zeros
        ort_backend.resident_zeros = paged_backend.resident_zeros = lambda shape, dtype: np.zeros(shape, dtype)
    watch = Stopwatch()
    engine = LLMEngine.from_artifact(artifact, EngineConfig(scheduling=SchedulingOptions(max_num_seqs=batch)))
    loaded = watch.elapsed()
    vocab = engine.backend.vocab_size
    for b in range(batch):
        engine.add_request([(31 * b + 7 * i) % vocab for i in range(8)],
                           SamplingParams(max_tokens=33, ignore_eos=True))
    engine.step()
    first = watch.elapsed()
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    end = watch.elapsed()
    return {"load_s": loaded, "first_step_ms": 1e3 * (first - loaded),
            "decode_tokens_per_s": batch * steps / (end - first)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--child", choices=["lazy", "resident"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.artifact, args.batch, args.child == "lazy")))
        return
    runs: dict[str, list[dict[str, float]]] = {"lazy": [], "resident": []}
    for _, order in Rounds(args.rounds, reverse=True).orders(runs):
        for variant in order:
            out = subprocess.run([sys.executable, __file__, args.artifact, "--batch", str(args.batch),
                                  "--child", variant], capture_output=True, text=True, check=True).stdout
            runs[variant].append(json.loads(out.strip().splitlines()[-1]))
            print(variant, runs[variant][-1])
    summary: dict[str, Any] = {
        variant: {key: round(statistics.median(run[key] for run in rows), 2) for key in rows[0]}
        for variant, rows in runs.items()}
    print("| caches | load s | first step ms | decode tok/s |\n|---|---|---|---|")
    for variant, row in summary.items():
        print(f"| {variant} | {row['load_s']} | {row['first_step_ms']} | {row['decode_tokens_per_s']} |")
    from moeforge.cli.bench import write_result

    write_result(args.results, "cold_start", {"artifact": args.artifact, "batch": args.batch, "rounds": args.rounds,
                                               "medians": summary, "runs": runs})


if __name__ == "__main__":
    main()
