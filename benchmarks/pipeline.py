"""The pipeline bubble, measured, and each stage's bytes for DeepSeek-V3 at pp x tp from the config alone.

`python benchmarks/pipeline.py` (issue 35):

1. **Per-stage bytes from the config** (no weights: ``model/pipeline_stages.plan_stages`` + ``stage_costs``, which
   split each tensor by ``model/sharding.py``'s rules on the meta device): deepseek-v3 (61 layers, 256 experts) at
   pp 2 x tp 8 and pp 4 x tp 8 (ep 8: whole experts per rank), balanced by FP8 weight bytes plus the bf16 KV of one
   4096-token sequence. Per stage: layers, weight GiB per rank in FP8 and bf16, KV bytes per token per rank.
2. **The bubble**: models compiled with ``--pp 2`` (the tiny presets, and a DeepSeek-V3-shaped synthetic checkpoint of
   4 layers, hidden 1024, 8 experts top-2) run 8 concurrent requests through the engine with 1, 2 and 4 micro-batches
   per step, rounds alternating, on two workloads: "prefill" (192-token prompts, one new token: 512-token chunked
   prefill steps, whose micro-batches are token ranges, so each piece's compute shrinks with M) and "decode" (16-token
   prompts, 32 new tokens: 8 rows a step, pieces of 8 / M rows, each of which still reads all of its stage's weights).
   Each rank records when its stage computes (``execute_stage`` intervals, wall clock); rank 0 records each step's
   start and end. A stage's bubble is the fraction of the step time it is idle. Beside it: GPipe's formula for P equal
   stages and M equal micro-batches, (P - 1) / (M + P - 1) (Huang et al. 2019), and the bubble expected from the
   stages' measured time per micro-batch t_s when nothing else cost time (a step lasts sum(t) + (M - 1) max(t):
   unequal stages idle more than the formula says).

On this 2-core VM the two stages are two processes of one ONNX Runtime thread each, so both can compute at once;
absolute speed is not the claim, the bubble fraction and its trend with micro-batches are. Results:
benchmarks/results/pipeline.json with the machine described.

    python benchmarks/pipeline.py [--rounds 3] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from moeforge.cli.bench import write_result
from moeforge.compile.driver import CompileOptions, compile_model
from moeforge.compile.sharded_compile import rank_dir
from moeforge.model.loader import load_config
from moeforge.model.pipeline_stages import plan_stages, stage_costs
from moeforge.parallel.net import free_port

RESULTS = Path(__file__).resolve().parent / "results" / "pipeline.json"
GIB = 2**30
SPLITS = [("deepseek-v3", 2, 8, 8), ("deepseek-v3", 4, 8, 8)]  # (model, pp, tp, ep)
MICRO_BATCHES = (1, 2, 4)
REQUESTS = 8


def stage_table(model: str, pp: int, tp: int, ep: int, kv_tokens: int = 4096) -> list[dict[str, Any]]:
    """Per stage of ``model`` at pp x tp (ep): layers and each rank's bytes, from the config alone."""
    config = load_config(model)
    specs = plan_stages(config, pp, bytes_per_weight=1.0, kv_bytes_per_value=2, kv_tokens=kv_tokens)
    fp8 = stage_costs(config, specs, 1.0, 2, tp, ep)
    bf16 = stage_costs(config, specs, 2.0, 2, tp, ep)
    return [{"model": model, "pp": pp, "tp": tp, "ep": ep, "stage": spec.stage,
             "layers": [spec.first_layer, spec.last_layer - 1], "num_layers": spec.num_layers,
             "holds": "+".join(p for p, held in (("embedding", spec.has_embedding), ("head", spec.has_head)) if held),
             "weight_gib_per_rank_fp8": round(a.weight_bytes / GIB, 2),
             "weight_gib_per_rank_bf16": round(b.weight_bytes / GIB, 2),
             "kv_bytes_per_token_per_rank_bf16": a.kv_bytes_per_token}
            for spec, a, b in zip(specs, fp8, bf16, strict=True)]


# ---------------------------------------------------------------------------------------------- one rank
class _Recording:
    """A stage's backend that records when it computes (wall-clock intervals)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.intervals: list[tuple[float, float]] = []

    def execute_stage(self, step: Any, hidden: Any) -> Any:
        start = time.time()
        out = self.inner.execute_stage(step, hidden)
        self.intervals.append((start, time.time()))
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


# workload -> (prompt tokens, new tokens, prompt sets timed): "prefill" is 512-token chunked-prefill steps (8 x 192
# tokens: micro-batches cut tokens, so each piece's compute shrinks with M); "decode" is 8 rows a step (pieces of
# 8 / M rows, each of which still reads all of the stage's weights).
WORKLOADS = {"prefill": (192, 1, 2), "decode": (16, 32, 1)}


def _prompts(prompt_len: int, salt: int) -> list[list[int]]:
    """``REQUESTS`` distinct prompts (``salt`` changes them all: no prefix-cache hit between sets)."""
    return [[1 + (13 * i + 7 * j + 101 * salt + j * j * salt) % 250 for j in range(prompt_len)]
            for i in range(REQUESTS)]


def _rank_main(artifact: str, out: str, micro_batches: int, workload: str) -> int:
    """One rank of a measured run (started by ``measure`` with torchrun's variables)."""
    from moeforge.parallel.launch import open_rank_backend, run_worker, sharded_backend, start_world
    from moeforge.runtime.engine import BackendOptions, EngineConfig, LLMEngine, SchedulingOptions
    from moeforge.runtime.sampler import SamplingParams

    config = EngineConfig(scheduling=SchedulingOptions(max_num_seqs=REQUESTS),
                          backend=BackendOptions(threads=1, micro_batches=micro_batches))
    world = start_world(artifact)
    if world.rank != 0:
        local = _Recording(open_rank_backend(artifact, world, config)[0])
        code = run_worker(local, world)
        Path(f"{out}.rank{world.rank}").write_text(json.dumps({"intervals": local.intervals}))
        return code
    backend, _ = sharded_backend(artifact, world, config)
    backend.min_micro_batch_tokens = 1  # type: ignore[union-attr]  (split decode steps too: raw GPipe)
    recording = _Recording(backend.local)
    backend.local = recording  # type: ignore[union-attr]
    steps: list[tuple[float, float]] = []
    execute = backend.execute

    def timed_execute(step: Any) -> Any:
        start = time.time()
        logits = execute(step)
        steps.append((start, time.time()))
        return logits

    backend.execute = timed_execute  # type: ignore[method-assign]
    prompt_len, new_tokens, sets = WORKLOADS[workload]
    try:
        engine = LLMEngine.from_artifact(Path(artifact) / rank_dir(0), config, backend=backend)
        params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
        engine.generate(_prompts(prompt_len, 0), params)  # warm-up
        recording.intervals.clear()
        steps.clear()
        began = time.time()
        for salt in range(1, sets + 1):
            engine.generate(_prompts(prompt_len, salt), params)
        window = (began, time.time())
        Path(f"{out}.rank0").write_text(json.dumps({"intervals": recording.intervals, "steps": steps,
                                                    "window": window,
                                                    "tokens": REQUESTS * (prompt_len + new_tokens) * sets}))
    finally:
        backend.close()
    return world.finish(0)


def _busy_within(intervals: list[list[float]], windows: list[list[float]]) -> float:
    """Seconds of ``intervals`` that fall inside ``windows``."""
    total = 0.0
    for start, end in intervals:
        for lo, hi in windows:
            total += max(0.0, min(end, hi) - max(start, lo))
    return total


def expected_bubble(piece_seconds: list[float], micro_batches: int) -> list[float]:
    """Each stage's idle share of a step when stage s takes ``piece_seconds[s]`` per micro-batch and nothing else
    costs time: the step lasts sum(t) + (M - 1) max(t) (fill, steady state at the slowest stage, drain); GPipe's
    (P - 1) / (M + P - 1) when the stages are equal."""
    step = sum(piece_seconds) + (micro_batches - 1) * max(piece_seconds)
    return [1 - micro_batches * t / step for t in piece_seconds]


def measure(artifact: Path, world: int, micro_batches: int, workload: str) -> dict[str, Any]:
    """One timed run of ``artifact`` on ``world`` rank processes with ``micro_batches``: per stage its idle share."""
    port = free_port()
    out = artifact.parent / f"{artifact.name}.{workload}.m{micro_batches}"
    for stale in artifact.parent.glob(f"{out.name}.rank*"):
        stale.unlink()
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(artifact), str(out), str(micro_batches),
                               workload],
                              env={**os.environ, "RANK": str(r), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": str(port)}) for r in range(world)]
    if any(p.wait(timeout=1200) for p in procs):
        raise RuntimeError(f"a rank of {artifact} failed")
    ranks = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(world)]
    steps, window = ranks[0]["steps"], ranks[0]["window"]
    if not steps:
        raise RuntimeError(f"{artifact}: the {workload} run took no step (prompts longer than the artifact's "
                           "max_seq_len?)")
    step_time = sum(hi - lo for lo, hi in steps)
    run_time = window[1] - window[0]
    pieces = [len(data["intervals"]) / max(len(steps), 1) for data in ranks]  # micro-batches per step
    per_piece = [_busy_within(data["intervals"], steps) / max(len(data["intervals"]), 1) for data in ranks]
    expected = expected_bubble(per_piece, round(pieces[0]))
    stages = []
    for rank, data in enumerate(ranks):
        busy_steps = _busy_within(data["intervals"], steps)
        busy_run = _busy_within(data["intervals"], [window])
        stages.append({"stage": rank, "bubble_in_steps": round(1 - busy_steps / step_time, 4),
                       "expected_from_stage_times": round(expected[rank], 4),
                       "idle_over_run": round(1 - busy_run / run_time, 4), "compute_s": round(busy_run, 4),
                       "ms_per_micro_batch": round(1e3 * per_piece[rank], 3)})
    return {"workload": workload, "micro_batches": micro_batches, "micro_batches_per_step": round(pieces[0], 2),
            "steps": len(steps), "step_s": round(step_time, 4), "run_s": round(run_time, 4),
            "tokens_per_s": round(ranks[0]["tokens"] / run_time, 1), "stages": stages,
            "bubble_in_steps_mean": round(sum(s["bubble_in_steps"] for s in stages) / len(stages), 4)}


def _models(root: Path, quick: bool) -> list[tuple[str, Path]]:
    """(name, pp 2 artifact) for the tiny presets and, unless ``quick``, a small DeepSeek-V3-shaped checkpoint
    (4 layers, hidden 1024, 8 experts top-2) whose stages compute long enough that dispatch is not all there is."""
    sources = [("tiny-llama", "tiny-llama"), ("tiny-deepseek-v3", "tiny-deepseek-v3")]
    if not quick:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from synthetic_deepseek import deepseek_v3_shape, reuse_or_write

        folder = root / "ds3-h1024"
        reuse_or_write(folder, deepseek_v3_shape(layers=4, hidden=1024, experts=8, top_k=2, vocab=4096), seed=0,
                       shard_bytes=512 * 2**20)
        sources.append(("deepseek-v3-shaped 4L h1024 8x top-2", str(folder)))
    out = []
    for name, source in sources:
        artifact = root / f"{name.split()[0]}-pp2"
        if not (artifact / "sharded.json").is_file():
            compile_model(CompileOptions.from_flags(model=source, output_dir=artifact, pp=2, kv_cache="paged",
                                                    max_seq_len=256, progress=False))
        out.append((name, artifact))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="the tiny presets only, one round")
    parser.add_argument("--keep", type=Path, default=None, help="compile into (and reuse) this folder")
    args = parser.parse_args()

    tables = [row for split in SPLITS for row in stage_table(*split)]
    print("| model | pp x tp (ep) | stage | layers | holds | weights/rank FP8 GiB | bf16 GiB | "
          "KV B/token/rank (bf16) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in tables:
        print(f"| {r['model']} | {r['pp']} x {r['tp']} ({r['ep']}) | {r['stage']} | {r['layers'][0]}-{r['layers'][1]} "
              f"| {r['holds'] or '-'} | {r['weight_gib_per_rank_fp8']} | {r['weight_gib_per_rank_bf16']} | "
              f"{r['kv_bytes_per_token_per_rank_bf16']:,} |")

    rounds = 1 if args.quick else args.rounds
    bubbles: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        for name, artifact in _models(root, args.quick):
            for workload in WORKLOADS:
                runs: dict[int, list[dict[str, Any]]] = {m: [] for m in MICRO_BATCHES}
                for _ in range(rounds):  # alternating: every micro-batch count once per round
                    for m in MICRO_BATCHES:
                        runs[m].append(measure(artifact, 2, m, workload))
                for m in MICRO_BATCHES:
                    ordered = sorted(runs[m], key=lambda r: r["bubble_in_steps_mean"])
                    median = ordered[len(ordered) // 2]
                    bubbles.append({"model": name, "pp": 2, "gpipe_bubble": round((2 - 1) / (m + 2 - 1), 4),
                                    **median, "rounds": [r["bubble_in_steps_mean"] for r in runs[m]]})
    print()
    print("| model | workload | micro-batches | GPipe (P-1)/(M+P-1) | expected from the stages' times, 0 / 1 | "
          "measured bubble in steps, 0 / 1 | ms per micro-batch, 0 / 1 | tokens/s (prompt + new) |")
    print("|---|---|---|---|---|---|---|---|")
    for b in bubbles:
        s0, s1 = b["stages"]
        print(f"| {b['model']} | {b['workload']} | {b['micro_batches']} | {b['gpipe_bubble']:.3f} | "
              f"{s0['expected_from_stage_times']:.3f} / {s1['expected_from_stage_times']:.3f} | "
              f"{s0['bubble_in_steps']:.3f} / {s1['bubble_in_steps']:.3f} | {s0['ms_per_micro_batch']:.2f} / "
              f"{s1['ms_per_micro_batch']:.2f} | {b['tokens_per_s']} |")
    workloads = {name: {"requests": REQUESTS, "prompt_len": w[0], "new_tokens": w[1], "prompt_sets": w[2]}
                 for name, w in WORKLOADS.items()}
    write_result(RESULTS, "pipeline", {"stage_bytes": tables, "bubble": bubbles, "workloads": workloads,
                                       "threads_per_rank": 1, "rounds": rounds})


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        sys.exit(_rank_main(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]))
    main()
