"""Compile time and peak RSS per model: `python benchmarks/compile_time.py [MODEL ...]`.

Each compile runs in its own process, so its peak RSS is its own. Results go to
benchmarks/results/compile_time.json.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from moeforge.bench import write_result

RESULTS = Path(__file__).parent / "results" / "compile_time.json"


def measure(model: str, max_seq_len: int) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "artifact"
        before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "moeforge.cli", "compile", model, "-o", str(out),
                               "--max-seq-len", str(max_seq_len), "--quiet"], capture_output=True, text=True)
        seconds = time.perf_counter() - start
        if proc.returncode != 0:
            raise SystemExit(f"compile of {model} failed:\n{proc.stderr}")
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
        return {"model": model, "seconds": round(seconds, 1), "peak_rss_mib": round(max(peak, before) / 1024, 1),
                "artifact_mib": round(size / 2**20, 1), "max_seq_len": max_seq_len}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("models", nargs="*", default=["smollm2-135m", "tiny-deepseek-v3", "tiny-llama"])
    parser.add_argument("--max-seq-len", type=int, default=2048)
    args = parser.parse_args()
    # Measure the largest first: RUSAGE_CHILDREN keeps the maximum over all finished children.
    rows = [measure(m, args.max_seq_len) for m in args.models]
    for row in rows:
        print(row)
    print("wrote", write_result(RESULTS, "compile_time", {"rows": rows,
          "note": "peak_rss_mib is the max over this and earlier children; models run largest first"}))


if __name__ == "__main__":
    main()
