"""TensorRT engine build time and plan size per model: `python benchmarks/trt_build.py [MODEL ...]`.

Each model is compiled with `moeforge compile MODEL --target trt` (TensorRT-RTX, ahead of time for
SM89, fp16) in its own process, which reports its peak RSS. Recorded per model: the engine build time
(parse + build, from the manifest), the whole compile time, the plan size and layer counts. Results
go to benchmarks/results/trt_build.json with the machine described (a CPU-only build machine: no GPU
is needed to build).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from timer import Stopwatch

from moeforge.cli.bench import write_result

RESULTS = Path(__file__).parent / "results" / "trt_build.json"
CHILD = ("import resource, sys; from moeforge.cli import main; sys.argv[0] = 'moeforge'; code = main(sys.argv[1:]); "
         "print(f'peak_rss_kib={resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}', file=sys.stderr); "
         "sys.exit(code)")


def measure(model: str, max_seq_len: int | None, sm: int, dtype: str) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "artifact"
        limit = ["--max-seq-len", str(max_seq_len)] if max_seq_len else []
        with Stopwatch() as compiling:
            proc = subprocess.run([sys.executable, "-c", CHILD, "compile", model, "-o", str(out), "--target", "trt",
                                   "--trt-impl", "tensorrt-rtx", "--sm", str(sm), "--dtype", dtype, *limit, "--quiet"],
                                  capture_output=True, text=True)
        seconds = compiling.seconds
        if proc.returncode != 0:
            raise SystemExit(f"compile of {model} failed:\n{proc.stderr}")
        peak_kib = int(proc.stderr.strip().splitlines()[-1].removeprefix("peak_rss_kib="))
        manifest = json.loads((out / "manifest.json").read_text())
        engine = manifest["engine"]
        return {"model": model, "dtype": dtype, "compute_capability": engine["compute_capability"],
                "tensorrt": f"{engine['impl']} {engine['tensorrt_version']}",
                "max_seq_len": manifest["kv_cache"]["max_seq_len"],
                "engine_build_seconds": engine["build_seconds"], "compile_seconds": round(seconds, 1),
                "plan_mib": round(engine["plan_bytes"] / 2**20, 1),
                "onnx_weights_mib": round((out / "model.onnx.data").stat().st_size / 2**20, 1),
                "peak_rss_mib": round(peak_kib / 1024, 1), "profiles": [p["name"] for p in engine["profiles"]],
                "layer_types": engine["layer_types"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("models", nargs="*", default=["tiny-llama", "tiny-deepseek-v3", "smollm2-135m"])
    parser.add_argument("--max-seq-len", type=int, default=None, help="default: the compiler's default (2048)")
    parser.add_argument("--sm", type=int, default=89)
    parser.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"])
    args = parser.parse_args()
    rows = []
    for model in args.models:
        rows.append(measure(model, args.max_seq_len, args.sm, args.dtype))
        print({k: v for k, v in rows[-1].items() if k != "layer_types"}, flush=True)
    print("wrote", write_result(RESULTS, "trt_build", {"rows": rows}))


if __name__ == "__main__":
    main()
