"""Per-rank weight and KV-cache bytes of sharded DeepSeek-V3 (and the tiny presets), from the config alone.

`python benchmarks/sharding_per_rank.py` plans (moeforge/model/sharding.py: Megatron / DeepSeek-reference column,
row, vocab and expert rules, the model built on PyTorch's meta device: no weights) deepseek-v3's real shapes at tp 1,
tp 8 / ep 8, tp 16 / ep 16 and tp 8 / ep 1, and writes per rank: weight bytes in bf16 and fp8 (DeepSeek-V3's
checkpoint format; norms and the router stay as they are in the count, a small overcount), the replicated share, and
the KV-cache bytes per token (MLA's latent is replicated on every rank, so it does not shrink with tp). Results:
benchmarks/results/sharded.json with the machine described.

Then it measures the decode step of tiny-llama and tiny-deepseek-v3 compiled unsharded and with --tp 2 (tiny-deepseek-v3
also --ep 2), run on CPU over gloo with the ranks as separate processes: a correctness path, not a speed claim (on
one CPU host two ranks share its cores and every collective is a Python call: the sharded step is slower).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from timer import Samples

from moeforge.cli.bench import write_result
from moeforge.compile.driver import CompileOptions, compile_model
from moeforge.model.loader import load_config
from moeforge.model.sharding import plan_sharding
from moeforge.parallel.net import free_port
from moeforge.runtime.backends.base import Backend, RowInput, StepInput
from moeforge.runtime.engine import BackendOptions, EngineConfig, SchedulingOptions

RESULTS = Path(__file__).resolve().parent / "results" / "sharded.json"
SPLITS = [("deepseek-v3", 1, 1), ("deepseek-v3", 8, 8), ("deepseek-v3", 16, 16), ("deepseek-v3", 8, 1),
          ("tiny-llama", 2, 1), ("tiny-deepseek-v3", 2, 2), ("tiny-deepseek-v2", 2, 1)]


MEASURED = [("tiny-llama", 2, 1), ("tiny-deepseek-v3", 2, 2)]
PROMPT_LEN, DECODE_STEPS, BATCHES = 32, 48, (1, 8)


def decode_step_ms(backend: Backend, batch: int) -> float:
    """Median wall time of a decode step of ``batch`` rows after a ``PROMPT_LEN``-token prefill of each."""
    for slot in range(batch):
        backend.execute(StepInput((RowInput(slot, tuple(range(1, PROMPT_LEN + 1)), 0),)))
    times = Samples()
    for step in range(DECODE_STEPS):
        rows = tuple(RowInput(slot, (7,), PROMPT_LEN + step) for slot in range(batch))
        with times.measure():
            backend.execute(StepInput(rows))
    for slot in range(batch):
        backend.release(slot)
    return 1e3 * times.median()


def _config() -> EngineConfig:
    return EngineConfig(scheduling=SchedulingOptions(max_num_seqs=max(BATCHES)), backend=BackendOptions(threads=1))


def _rank_main(artifact: str, out: str) -> int:
    """One rank of a measured sharded run (started by ``measure_sharded`` with torchrun's variables)."""
    from moeforge.parallel.launch import open_rank_backend, run_worker, sharded_backend, start_world

    world = start_world(artifact)
    if world.rank != 0:
        return run_worker(open_rank_backend(artifact, world, _config())[0], world)
    backend, _ = sharded_backend(artifact, world, _config())
    try:
        Path(out).write_text(json.dumps({str(b): decode_step_ms(backend, b) for b in BATCHES}))
    finally:
        backend.close()
    return world.finish(0)


def measure_sharded(artifact: Path, world: int) -> dict[str, float]:
    port = free_port()
    out = artifact.parent / f"{artifact.name}.json"
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(artifact), str(out)],
                              env={**os.environ, "RANK": str(r), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": str(port)}) for r in range(world)]
    if any(p.wait(timeout=600) for p in procs):
        raise RuntimeError(f"a rank of {artifact} failed")
    result: dict[str, float] = json.loads(out.read_text())
    return result


def measure_unsharded(artifact: Path) -> dict[str, float]:
    from moeforge.core.artifact import load_artifact
    from moeforge.runtime.backends.onnxruntime import OrtBackend

    manifest = load_artifact(artifact).manifest
    backend = OrtBackend(artifact / "model.onnx", kv_cache=manifest.kv_cache, num_slots=max(BATCHES),
                         max_seq_len=manifest.kv_cache.max_seq_len,
                         vocab_size=int(manifest.model_config["vocab_size"]), options=BackendOptions(threads=1))
    return {str(b): decode_step_ms(backend, b) for b in BATCHES}


def step_times() -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, tp, ep in MEASURED:
            single = compile_model(CompileOptions.from_flags(model=name, output_dir=Path(tmp) / f"{name}-tp1",
                                                             max_seq_len=256, progress=False)).output_dir
            sharded = compile_model(CompileOptions.from_flags(model=name, output_dir=Path(tmp) / f"{name}-tp{tp}",
                                                              tp=tp, ep=ep, max_seq_len=256, progress=False)).output_dir
            tp1, tpn = measure_unsharded(single), measure_sharded(sharded, tp)
            for batch in BATCHES:
                rows.append({"model": name, "tp": tp, "ep": ep, "batch": batch, "threads_per_rank": 1,
                             "decode_step_ms_tp1": round(tp1[str(batch)], 3),
                             f"decode_step_ms_tp{tp}": round(tpn[str(batch)], 3)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="results JSON (default: %(default)s)")
    args = parser.parse_args()
    rows = []
    for name, tp, ep in SPLITS:
        plan = plan_sharding(load_config(name), tp, ep)
        row = plan.summary(dtype_bytes=2, kv_dtype_bytes=2)
        row["weight_gib_per_rank_bf16"] = round(plan.weight_bytes_per_rank(2) / 2**30, 2)
        row["weight_gib_per_rank_fp8"] = round(plan.weight_bytes_per_rank(1) / 2**30, 2)
        rows.append(row)
    print("| model | tp | ep | weights/rank bf16 GiB | fp8 GiB | replicated/rank | KV B/token/rank (bf16) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['tp']} | {r['ep']} | {r['weight_gib_per_rank_bf16']} | "
              f"{r['weight_gib_per_rank_fp8']} | {r['replicated_bytes_per_rank']:,} B | "
              f"{r['kv_bytes_per_token_per_rank']:,} |")
    steps = step_times()
    print("| model | tp | ep | batch | decode step tp1 ms | decode step tp2 ms |")
    print("|---|---|---|---|---|---|")
    for r in steps:
        print(f"| {r['model']} | {r['tp']} | {r['ep']} | {r['batch']} | {r['decode_step_ms_tp1']} | "
              f"{r['decode_step_ms_tp2']} |")
    write_result(args.results, "sharded", {
        "plans": rows,
        "step_time_tp1_vs_tp2": steps,
        "step_time_note": "CPU, gloo, ranks as processes on one host with 1 intra-op thread each; every collective "
                          "is a Python custom op (onnxruntime-extensions) copying its tensor: a correctness path, "
                          "not a speed claim. On GPUs the same graphs' collectives are ONNX Runtime's NCCL kernels.",
    })


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--rank":
        sys.exit(_rank_main(sys.argv[2], sys.argv[3]))
    main()
