"""Decode step time at different positions: cost must not grow with position beyond attention.

`python benchmarks/decode_position.py ARTIFACT [--positions 64 1024]` times single-token decode
steps (batch 1, IOBinding, cache bound in place) after filling the cache to each position, and
writes benchmarks/results/decode_position.json.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from timer import Samples

from moeforge.cli.bench import write_result
from moeforge.core.artifact import load_artifact
from moeforge.runtime.backends.onnxruntime import OrtSession

RESULTS = Path(__file__).parent / "results" / "decode_position.json"


def step_times(session: OrtSession, position: int, repeats: int, vocab: int) -> Samples:
    rng = np.random.default_rng(0)
    # Fill the cache up to `position` in one prefill; then time decode steps at that position.
    session.forward(rng.integers(0, vocab, (1, position)), np.arange(position)[None], np.ones((1, position), np.int64))
    times = Samples()
    for _ in range(repeats):
        token = rng.integers(0, vocab, (1, 1))
        with times.measure():
            # Re-writing slot `position` each time keeps the position fixed.
            session.forward(token, np.array([[position]]), np.ones((1, position + 1), np.int64))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("artifact")
    parser.add_argument("--positions", type=int, nargs="+", default=[64, 1024])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    artifact = load_artifact(args.artifact)
    vocab = artifact.manifest.model_config["vocab_size"]
    # huge_pages as the engine runs it (the timings stay comparable with the engine's and earlier runs')
    session = OrtSession(artifact.model_path, kv_cache=artifact.manifest.kv_cache, huge_pages=True)
    session.allocate(1, artifact.manifest.kv_cache.max_seq_len)
    step_times(session, 16, 5, vocab)  # warm-up
    rows = []
    for position in args.positions:
        times = step_times(session, position, args.repeats, vocab)
        rows.append({"position": position, "median_ms": round(1e3 * times.median(), 3),
                     "p90_ms": round(1e3 * times.percentile(90), 3)})
        print(rows[-1])
    ratio = rows[-1]["median_ms"] / rows[0]["median_ms"]
    write_result(RESULTS, "decode_position", {
        "artifact": artifact.manifest.model_config.get("name"), "batch": 1,
        "kv_buffer_len": artifact.manifest.kv_cache.max_seq_len, "rows": rows,
        "ratio_last_to_first": round(ratio, 2),
    })
    print(f"step time at {args.positions[-1]} / at {args.positions[0]}: {ratio:.2f}x")


if __name__ == "__main__":
    main()
