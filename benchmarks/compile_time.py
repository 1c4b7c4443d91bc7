"""Compile time and peak RSS per model: `python benchmarks/compile_time.py [MODEL ...] [--no-check]`.

Each compile (``moeforge compile MODEL --check`` by default: parity against PyTorch included) runs in its own
process, which reports its own peak RSS and CPU time. The peak is also given as a multiple of the model's fp32
weight bytes (issue 14's budget: under 3x). The load average at the start says how busy the machine was: wall
time on a shared machine can be well above CPU time. Results go to benchmarks/results/compile_time.json.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from timer import Stopwatch

from moeforge.cli.bench import write_result
from moeforge.model.loader import load_config
from moeforge.model.model import CausalLM

RESULTS = Path(__file__).parent / "results" / "compile_time.json"
# The child runs the CLI, then prints its own peak RSS (KiB on Linux) and CPU seconds as the last stderr line.
CHILD = ("import resource, sys; from moeforge.cli import main; sys.argv[0] = 'moeforge'; code = main(sys.argv[1:]); "
         "usage = resource.getrusage(resource.RUSAGE_SELF); "
         "print(f'peak_rss_kib={usage.ru_maxrss} cpu_s={usage.ru_utime + usage.ru_stime:.2f}', file=sys.stderr); "
         "sys.exit(code)")


def fp32_weight_bytes(model: str) -> int:
    """Bytes of the model's parameters in float32 (a tied embedding counted once); nothing is loaded."""
    with torch.device("meta"):
        module = CausalLM(load_config(model))
    return sum(p.numel() for p in module.parameters()) * 4


def measure(model: str, max_seq_len: int | None, check: bool) -> dict[str, object]:
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "artifact"
        flags = [*(["--max-seq-len", str(max_seq_len)] if max_seq_len else []), *(["--check"] if check else [])]
        with Stopwatch() as compiling:
            proc = subprocess.run([sys.executable, "-c", CHILD, "compile", model, "-o", str(out), *flags, "--quiet"],
                                  capture_output=True, text=True)
        seconds = compiling.seconds
        if proc.returncode != 0:
            raise SystemExit(f"compile of {model} failed:\n{proc.stderr}")
        fields = dict(item.split("=") for item in proc.stderr.strip().splitlines()[-1].split())
        size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    peak = int(fields["peak_rss_kib"]) * 1024
    weights = fp32_weight_bytes(model)
    return {"model": model, "check": check, "seconds": round(seconds, 1), "cpu_seconds": float(fields["cpu_s"]),
            "peak_rss_mib": round(peak / 2**20, 1), "fp32_weights_mib": round(weights / 2**20, 1),
            "peak_rss_over_fp32_weights": round(peak / weights, 2), "artifact_mib": round(size / 2**20, 1),
            "max_seq_len": max_seq_len or "default", "load_avg_1min": round(load, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("models", nargs="*", default=["smollm2-135m", "tiny-deepseek-v3", "tiny-llama"])
    parser.add_argument("--max-seq-len", type=int, default=None, help="default: the compiler's default")
    parser.add_argument("--no-check", dest="check", action="store_false", help="compile without --check")
    args = parser.parse_args()
    rows = []
    for model in args.models:
        rows.append(measure(model, args.max_seq_len, args.check))
        print(rows[-1], flush=True)
    print("wrote", write_result(RESULTS, "compile_time", {"rows": rows}))


if __name__ == "__main__":
    main()
