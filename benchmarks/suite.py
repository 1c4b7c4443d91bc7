"""The benchmark suite as data: every benchmark whose numbers the docs publish, by name, with what it measures and
the results files it writes; the tools beside them; and the shared modules they import.

``python -m benchmarks`` (``__main__.py``) reads this table to list, run and check them; tests/benchmarks/test_suite.py
checks that every script in benchmarks/ is in it and every file in results/ belongs to one of them. A benchmark is the
script ``benchmarks/<name>.py``; it runs from the repository root, alternates the systems it compares in rounds
(``timer.Rounds``), and writes its JSON with ``moeforge.cli.bench.write_result``, which records the machine.

Standard library only: ``python -m benchmarks list`` answers without importing moeforge.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"


@dataclass(frozen=True)
class Benchmark:
    """``benchmarks/<name>.py``: ``summary`` is what it measures, in one line; ``results`` are the glob patterns, under
    results/, of the files it writes (empty: its numbers go into another benchmark's results)."""

    name: str
    group: str
    summary: str
    results: tuple[str, ...] = ()

    @property
    def script(self) -> Path:
        return HERE / f"{self.name}.py"


PUBLISHED: tuple[Benchmark, ...] = (
    Benchmark("genai_compare", "speed against peers",
              "moeforge vs onnxruntime-genai's builder models and llama.cpp: decode, TTFT, prefill",
              ("genai_compare.json", "genai_compare_*.json")),
    Benchmark("genai_builder", "speed against peers",
              "one artifact vs GenAI's builder model of its own checkpoint (+ llama.cpp on a GGUF)",
              ("genai_builder_*.json",)),
    Benchmark("heldout_accuracy", "speed against peers",
              "teacher-forced top-1 / KL on held-out prose vs transformers fp32, moeforge and peers",
              ("heldout_accuracy.json",)),
    Benchmark("speculative_decoding", "speed against peers",
              "prompt-lookup speculative decoding vs plain decoding at batch 1: speed, acceptance",
              ("speculative_decoding.json",)),
    Benchmark("step_overhead", "the decode step",
              "host time per decode step outside ONNX Runtime, by part", ("step_overhead.json",)),
    Benchmark("decode_breakdown", "the decode step",
              "a step's parts inside ONNX Runtime (head, attention, the rest), from cut copies of the graph",
              ("decode_breakdown.json", "decode_breakdown_*.json")),
    Benchmark("matmul_scaling", "the decode step",
              "ONNX Runtime's CPU matmul kernels against the rows they multiply (the batch ceiling)",
              ("matmul_scaling.json",)),
    Benchmark("argmax_head", "the decode step",
              "the certified argmax head vs --no-argmax-head: speed, share certified, same tokens",
              ("argmax_head.json",)),
    Benchmark("cold_start", "the decode step",
              "a fresh engine's load and first steps, caches mapped up front vs lazily", ("cold_start.json",)),
    Benchmark("huge_pages", "the decode step",
              "decode with the session's memory on transparent huge pages vs without", ("huge_pages.json",)),
    Benchmark("paged_decode", "the decode step",
              "paged vs contiguous KV cache on the same weights: decode speed, nodes per step",
              ("paged_decode.json",)),
    Benchmark("moe_speed", "MoE",
              "a 1.4 B DeepSeek-V3-shaped MoE vs llama.cpp: speed, accuracy, memory roofline, ep",
              ("moe_speed.json",)),
    Benchmark("kernel_ceiling", "MoE",
              "ONNX Runtime's kernels alone on an artifact's shapes: the step's floor (in moe_speed.json)"),
    Benchmark("router_share", "MoE",
              "the MoE router's share of a profiled decode step (in moe_speed.json)"),
    Benchmark("sparse_attention", "MoE",
              "DeepSeek-V3.2 sparse attention (DSA) vs dense: decode step time against context",
              ("sparse_attention.json",)),
    Benchmark("quant_accuracy", "quantisation",
              "teacher-forced top-1 / KL of every scheme on SmolLM2 vs PyTorch fp32",
              ("quant_accuracy_*.json",)),
    Benchmark("quant_speed", "quantisation",
              "a quantised artifact's decode vs its fp32 artifact (moeforge bench, alternating)",
              ("bench_*_b1.json",)),
    Benchmark("kv_quant_accuracy", "quantisation",
              "an int8 KV cache: accuracy, bytes per token, step time", ("kv_quant_accuracy_*.json",)),
    Benchmark("compile_time", "compile",
              "compile time and peak RSS per model", ("compile_time.json",)),
    Benchmark("compile_memory", "compile",
              "the smallest memory cap a compile succeeds under, in a fresh cgroup (synthetic DeepSeek-V3)",
              ("compile_memory*.json",)),
    Benchmark("trt_build", "compile",
              "TensorRT engine build time and plan size per model", ("trt_build.json",)),
    Benchmark("kv_memory", "KV cache",
              "the paged pool's memory against the tokens it holds, 8 concurrent requests", ("kv_memory_*.json",)),
    Benchmark("kv_tiers", "KV cache",
              "KV tiers (host, disk) on a multi-turn chat workload: prefill computed, TTFT, outputs",
              ("kv_tiers*.json",)),
    Benchmark("v4_kv", "KV cache",
              "DeepSeek-V4 vs V3 of similar size: KV bytes per token / sequence and decode at 4K and 32K context",
              ("v4_kv.json",)),
    Benchmark("sharding_per_rank", "parallel",
              "per-rank weight and KV bytes of sharded DeepSeek-V3; tiny models' sharded decode",
              ("sharded.json",)),
    Benchmark("eplb", "parallel",
              "per-rank MoE load of contiguous, round-robin and EPLB expert placements", ("eplb.json",)),
    Benchmark("pipeline", "parallel",
              "the pipeline bubble against micro-batches; per-stage bytes of DeepSeek-V3", ("pipeline.json",)),
    Benchmark("serve_load", "serving",
              "64 concurrent streaming clients on `moeforge serve`, a quarter leaving mid-stream",
              ("serve_load.json",)),
    Benchmark("structured_output", "serving",
              "decode tokens/s with and without a JSON schema (constrained decoding) at batch 1 and 8",
              ("structured_output.json",)),
    Benchmark("serve_abuse", "serving",
              "slow headers, huge bodies and clients that never read, against a live server",
              ("serve_abuse.json",)),
)

# Scripts that measure nothing themselves, runnable by name too. ``tables`` is speed_table.py.
TOOLS: dict[str, tuple[str, str]] = {
    "tables": ("speed_table", "render docs/performance.md's measured tables from results/ (--print: only print)"),
    "synthetic_deepseek": ("synthetic_deepseek", "write a seeded DeepSeek-V3-shaped FP8 checkpoint of any size"),
    "synthetic_gguf": ("synthetic_gguf", "write one seeded MoE model as a llama.cpp GGUF and an HF folder"),
}

# Modules the scripts import as siblings (``from timer import Rounds``); not run by name.
SHARED: dict[str, str] = {
    "timer": "the one clock: Stopwatch, Samples, repeat, alternating Rounds",
    "decode_rate": "greedy decode tokens/s of an engine (A/B of one engine setting)",
    "peers": "onnxruntime-genai and llama.cpp runners, alternating rounds, medians, ratios, tables",
    "cgroup_memory": "a command alone in a fresh memory cgroup: peak (page cache counted), OOM kills",
    "suite": "this table",
}


def by_name() -> dict[str, Path]:
    """Every name ``python -m benchmarks NAME`` runs -> its script."""
    runnable = {b.name: b.script for b in PUBLISHED}
    runnable.update({name: HERE / f"{stem}.py" for name, (stem, _) in TOOLS.items()})
    return runnable


def owner(results_file: Path) -> Benchmark | None:
    """The published benchmark that writes ``results_file`` (a file in results/), or None."""
    for benchmark in PUBLISHED:
        if any(results_file.match(pattern) for pattern in benchmark.results):
            return benchmark
    return None
