"""Does putting the session's weights on transparent huge pages speed up decode? Measured, alternating, in one run.

`python benchmarks/huge_pages.py ARTIFACT [ARTIFACT ...] [--rounds 6] [--batch 1] [--new-tokens 128]` runs greedy
decode on each artifact with ``BackendOptions(huge_pages=True)`` (the default, ``moeforge/core/huge_pages.py``) and with
``huge_pages=False``, each run in a fresh process (huge pages are a property of the process's memory, and a fresh
process is what a deployment starts), the two alternating and the first of each round swapped every round, so
a machine that drifts slows both alike. Per variant it reports the median decode tokens/s, the engine's load
seconds (collapsing pages costs time there) and the bytes of the process's anonymous memory on huge pages; paired
per round, the ratio on/off. Results go to benchmarks/results/huge_pages.json with the machine described, and a
table is printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # timer and decode_rate, beside this script (-P child)

from timer import Rounds, Stopwatch

RESULTS = Path(__file__).resolve().parent / "results" / "huge_pages.json"
VARIANTS = {"on": True, "off": False}


def run_once(artifact: str, batch: int, new_tokens: int, huge_pages: bool) -> dict[str, float]:
    """One fresh process: load the engine, warm up, decode; its load seconds, tokens/s and huge-page bytes."""
    from decode_rate import decode_rate

    from moeforge.core.huge_pages import huge_bytes
    from moeforge.runtime.engine import BackendOptions, EngineConfig, LLMEngine, SchedulingOptions

    loading = Stopwatch()
    engine = LLMEngine.from_artifact(artifact, EngineConfig(
        scheduling=SchedulingOptions(max_num_seqs=batch),
        backend=BackendOptions(huge_pages=huge_pages)))
    load_s = loading.elapsed()
    decode_rate(engine, batch, 8)  # warm-up
    rate = decode_rate(engine, batch, new_tokens)
    return {"decode_tokens_per_s": rate, "load_s": load_s, "huge_bytes": huge_bytes()}


def measure(artifact: str, batch: int, new_tokens: int, rounds: int) -> dict[str, Any]:
    """Alternating fresh-process runs of both variants; medians and per-round paired ratios."""
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in VARIANTS}
    for _, order in Rounds(rounds, reverse=True).orders(VARIANTS):
        for name in order:
            out = subprocess.run([sys.executable, "-P", __file__, "--child", artifact, str(batch), str(new_tokens),
                                  str(int(VARIANTS[name]))], capture_output=True, text=True, check=True)
            runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    ratios = [on["decode_tokens_per_s"] / off["decode_tokens_per_s"] for on, off in zip(runs["on"], runs["off"],
                                                                                          strict=True)]
    result: dict[str, Any] = {"artifact": artifact, "batch": batch, "new_tokens": new_tokens, "rounds": rounds}
    for name, values in runs.items():
        result[name] = {
            "decode_tokens_per_s": [round(v["decode_tokens_per_s"], 1) for v in values],
            "median_tokens_per_s": round(statistics.median(v["decode_tokens_per_s"] for v in values), 1),
            "median_load_s": round(statistics.median(v["load_s"] for v in values), 2),
            "huge_mib": round(statistics.median(v["huge_bytes"] for v in values) / 2**20, 1),
        }
    result["paired_ratio_on_off"] = [round(r, 3) for r in ratios]
    result["median_ratio_on_off"] = round(statistics.median(ratios), 3)
    result["rounds_on_faster"] = sum(r > 1 for r in ratios)
    return result


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        artifact, batch, new_tokens, huge = sys.argv[2:6]
        print(json.dumps(run_once(artifact, int(batch), int(new_tokens), huge == "1")))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifacts", nargs="+")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--batch", type=int, nargs="+", default=[1])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    from moeforge.cli.bench import write_result

    results = [measure(a, b, args.new_tokens, args.rounds) for a in args.artifacts for b in args.batch]
    print("| artifact | batch | tok/s on | tok/s off | paired on/off (median) | rounds on faster | load s on / off "
          "| huge MiB on / off |\n|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {Path(r['artifact']).name} | {r['batch']} | {r['on']['median_tokens_per_s']} | "
              f"{r['off']['median_tokens_per_s']} | {r['median_ratio_on_off']} | {r['rounds_on_faster']}/{r['rounds']} "
              f"| {r['on']['median_load_s']} / {r['off']['median_load_s']} | {r['on']['huge_mib']} / "
              f"{r['off']['huge_mib']} |")
    write_result(args.results, "huge_pages", {"runs": results})


if __name__ == "__main__":
    main()
