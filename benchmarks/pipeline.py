"""The pipeline bubble, measured, and each stage's bytes for DeepSeek-V3 at pp x tp from the config alone.

`python benchmarks/pipeline.py` (issue 35):

1. **Per-stage bytes from the config** (no weights: ``model/pipeline_stages.plan_stages`` + ``stage_costs``, which
   split each tensor by ``model/sharding.py``'s rules on the meta device): deepseek-v3 (61 layers, 256 experts) at
   pp 2 x tp 8 and pp 4 x tp 8 (ep 8: whole experts per rank), balanced by FP8 weight bytes plus the bf16 KV of one
   4096-token sequence. Per stage: layers, weight GiB per rank in FP8 and bf16, KV bytes per token per rank.
2. **The bubble**: models compiled with ``--pp 2`` run 8 concurrent requests (64-token prompts, 32 new tokens,
   greedy) through the engine with 1, 2 and 4 micro-batches per step, rounds alternating. Each rank records when its
   stage computes (``execute_stage`` intervals, wall clock); rank 0 records each step's start and end. A stage's
   bubble is the fraction of the step time it is idle; GPipe's formula for P stages and M equal micro-batches is
   (P - 1) / (M + P - 1) (Huang et al. 2019), printed beside it. "idle over the run" also counts the engine's own
   time between steps (scheduling and sampling on rank 0, when no stage computes).

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
REQUESTS, PROMPT_LEN, NEW_TOKENS = 8, 64, 32


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


def _rank_main(artifact: str, out: str, micro_batches: int) -> int:
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
    try:
        engine = LLMEngine.from_artifact(Path(artifact) / rank_dir(0), config, backend=backend)
        prompts = [[1 + (13 * i + 7 * j) % 250 for j in range(PROMPT_LEN)] for i in range(REQUESTS)]
        params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
        engine.generate(prompts, params)  # warm-up
        recording.intervals.clear()
        steps.clear()
        began = time.time()
        engine.generate(prompts, params)
        window = (began, time.time())
        Path(f"{out}.rank0").write_text(json.dumps({"intervals": recording.intervals, "steps": steps,
                                                    "window": window}))
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


def measure(artifact: Path, world: int, micro_batches: int) -> dict[str, Any]:
    """One timed run of ``artifact`` on ``world`` rank processes with ``micro_batches``: per stage its idle share."""
    port = free_port()
    out = artifact.parent / f"{artifact.name}.m{micro_batches}"
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(artifact), str(out), str(micro_batches)],
                              env={**os.environ, "RANK": str(r), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": str(port)}) for r in range(world)]
    if any(p.wait(timeout=1200) for p in procs):
        raise RuntimeError(f"a rank of {artifact} failed")
    ranks = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(world)]
    steps, window = ranks[0]["steps"], ranks[0]["window"]
    step_time = sum(hi - lo for lo, hi in steps)
    run_time = window[1] - window[0]
    stages = []
    for rank, data in enumerate(ranks):
        busy_steps = _busy_within(data["intervals"], steps)
        busy_run = _busy_within(data["intervals"], [window])
        stages.append({"stage": rank, "bubble_in_steps": round(1 - busy_steps / step_time, 4),
                       "idle_over_run": round(1 - busy_run / run_time, 4),
                       "compute_s": round(busy_run, 4), "micro_batches_run": len(data["intervals"])})
    return {"micro_batches": micro_batches, "steps": len(steps), "step_s": round(step_time, 4),
            "run_s": round(run_time, 4), "tokens_per_s": round(REQUESTS * NEW_TOKENS / run_time, 1),
            "stages": stages,
            "bubble_in_steps_mean": round(sum(s["bubble_in_steps"] for s in stages) / len(stages), 4)}


def _models(root: Path, quick: bool) -> list[tuple[str, Path]]:
    """(name, pp 2 artifact) for the tiny presets and, unless ``quick``, a small DeepSeek-V3-shaped checkpoint
    (4 layers, hidden 512, 8 experts top-2) whose stages compute long enough that dispatch is not all there is."""
    sources = [("tiny-llama", "tiny-llama"), ("tiny-deepseek-v3", "tiny-deepseek-v3")]
    if not quick:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from synthetic_deepseek import deepseek_v3_shape, reuse_or_write

        folder = root / "ds3-small"
        reuse_or_write(folder, deepseek_v3_shape(layers=4, hidden=512, experts=8, top_k=2, vocab=4096), seed=0,
                       shard_bytes=512 * 2**20)
        sources.append(("deepseek-v3-shaped 4L h512 8x top-2", str(folder)))
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
            runs: dict[int, list[dict[str, Any]]] = {m: [] for m in MICRO_BATCHES}
            for _ in range(rounds):  # alternating: every micro-batch count once per round
                for m in MICRO_BATCHES:
                    runs[m].append(measure(artifact, 2, m))
            for m in MICRO_BATCHES:
                ordered = sorted(runs[m], key=lambda r: r["bubble_in_steps_mean"])
                median = ordered[len(ordered) // 2]
                bubbles.append({"model": name, "pp": 2, "gpipe_bubble": round((2 - 1) / (m + 2 - 1), 4),
                                **median, "rounds": [r["bubble_in_steps_mean"] for r in runs[m]]})
    print()
    print("| model | micro-batches | GPipe bubble (P-1)/(M+P-1) | measured bubble in steps, stage 0 / 1 | "
          "idle over the run, stage 0 / 1 | tok/s |")
    print("|---|---|---|---|---|---|")
    for b in bubbles:
        s0, s1 = b["stages"]
        print(f"| {b['model']} | {b['micro_batches']} | {b['gpipe_bubble']:.3f} | {s0['bubble_in_steps']:.3f} / "
              f"{s1['bubble_in_steps']:.3f} | {s0['idle_over_run']:.3f} / {s1['idle_over_run']:.3f} | "
              f"{b['tokens_per_s']} |")
    write_result(RESULTS, "pipeline", {"stage_bytes": tables, "bubble": bubbles,
                           "workload": {"requests": REQUESTS, "prompt_len": PROMPT_LEN, "new_tokens": NEW_TOKENS,
                                        "threads_per_rank": 1, "rounds": rounds}})


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        sys.exit(_rank_main(sys.argv[2], sys.argv[3], int(sys.argv[4])))
    main()
