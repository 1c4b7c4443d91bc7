"""Compile time and peak RSS per model: `python benchmarks/compile_time.py [MODEL ...]`.

Each compile runs in its own process, which reports its own peak RSS. Results go to
benchmarks/results/compile_time.json.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from moeforge.bench import write_result

RESULTS = Path(__file__).parent / "results" / "compile_time.json"
# The child runs the CLI, then prints its own peak RSS (KiB on Linux) as the last stderr line.
CHILD = ("import resource, sys; from moeforge.cli import main; sys.argv[0] = 'moeforge'; code = main(sys.argv[1:]); "
         "print(f'peak_rss_kib={resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}', file=sys.stderr); "
         "sys.exit(code)")


def measure(model: str, max_seq_len: int | None) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "artifact"
        start = time.perf_counter()
        limit = ["--max-seq-len", str(max_seq_len)] if max_seq_len else []
        proc = subprocess.run([sys.executable, "-c", CHILD, "compile", model, "-o", str(out), *limit, "--quiet"],
                              capture_output=True, text=True)
        seconds = time.perf_counter() - start
        if proc.returncode != 0:
            raise SystemExit(f"compile of {model} failed:\n{proc.stderr}")
        peak_kib = int(proc.stderr.strip().splitlines()[-1].removeprefix("peak_rss_kib="))
        size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
        return {"model": model, "seconds": round(seconds, 1), "peak_rss_mib": round(peak_kib / 1024, 1),
                "artifact_mib": round(size / 2**20, 1), "max_seq_len": max_seq_len or "default"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("models", nargs="*", default=["smollm2-135m", "tiny-deepseek-v3", "tiny-llama"])
    parser.add_argument("--max-seq-len", type=int, default=None, help="default: the compiler's default")
    args = parser.parse_args()
    rows = [measure(m, args.max_seq_len) for m in args.models]
    for row in rows:
        print(row)
    print("wrote", write_result(RESULTS, "compile_time", {"rows": rows}))


if __name__ == "__main__":
    main()
