"""Decode speed of a quantised artifact against its fp32 artifact, batch 1, measured alternately.

`python benchmarks/quant_speed.py FP32_DIR QUANT_DIR [--repeats 3] [--label L]` runs `moeforge bench` (engine only)
on the two artifacts in alternating rounds (``timer.Rounds``: the first of each round changes), `--repeats` rounds,
and writes benchmarks/results/bench_smollm2_<label or precision>_b1.json with every run, the 1-minute load average
before each run (the machine is shared: other processes slow some runs), and the best-of and median ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

from timer import Rounds

from moeforge.cli.bench import bench_engine, write_result
from moeforge.core.artifact import load_artifact

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("fp32")
    parser.add_argument("quant")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--label", default=None,
                        help="results file label (default: the artifact's precision), e.g. int4-lm-head-int4")
    args = parser.parse_args()
    manifest = load_artifact(args.quant).manifest
    precision = args.label or manifest.precision
    folders = {"fp32": args.fp32, precision: args.quant}
    runs: dict[str, list[dict[str, float]]] = {label: [] for label in folders}
    for _, order in Rounds(args.repeats).orders(folders):  # alternating: the first of each round changes
        for label in order:
            folder = folders[label]
            load = os.getloadavg()[0]
            row = bench_engine(folder, 1, args.prompt_len, args.new_tokens, None)
            runs[label].append({"load_avg_1min_before": round(load, 2), **row})
            print(label, round(row["decode_tokens_per_s"], 1), "tok/s, load", round(load, 2), flush=True)
    best = {label: max(r["decode_tokens_per_s"] for r in rows) for label, rows in runs.items()}
    median = {label: statistics.median(r["decode_tokens_per_s"] for r in rows) for label, rows in runs.items()}
    write_result(RESULTS / f"bench_smollm2_{precision}_b1.json", "quant_speed", {
        "model": "smollm2-135m", "batch": 1, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
        "quantization": {k: (manifest.quantization or {}).get(k) for k in ("scheme", "lm_head", "accuracy_level")},
        "runs": runs, "best_decode_tokens_per_s": best,
        "best_decode_speedup_vs_fp32": best[precision] / best["fp32"],
        "median_decode_tokens_per_s": median, "median_decode_speedup_vs_fp32": median[precision] / median["fp32"],
    })


if __name__ == "__main__":
    main()
