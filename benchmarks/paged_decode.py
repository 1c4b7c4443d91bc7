"""Paged against contiguous decode on the same weights: engine tokens/s at batch 1 and 8, and the nodes ONNX Runtime
runs per step.

A paged artifact (``--kv-cache paged``) runs attention as the PagedAttention ORT lowering (index math, ScatterND
into the block pools, Gathers through the block tables, one opset-23 ``Attention``; plugins/paged_attention) where a
contiguous one runs one fused ``GroupQueryAttention``: more nodes per layer, each costing microseconds on CPU. This
measures what that costs end to end, in alternating rounds (medians), and counts the nodes of each graph after ONNX
Runtime's optimisations (the per-layer index math is shared by common-subexpression elimination).

    moeforge compile smollm2-135m -o /work/perf/int4-asym --quant int4-asym
    moeforge compile smollm2-135m -o /work/perf/int4-asym-paged --quant int4-asym --kv-cache paged
    python benchmarks/paged_decode.py /work/perf/int4-asym /work/perf/int4-asym-paged

Writes benchmarks/results/paged_decode.json (``moeforge.cli.bench.write_result``) and prints a table.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

import onnx
import onnxruntime as ort
from timer import Rounds, Stopwatch

from moeforge.cli.bench import write_result
from moeforge.core.artifact import load_artifact
from moeforge.core.ort_session import make_session
from moeforge.ops.paged_attention.ort_lowering import lower_for_ort
from moeforge.runtime.engine import BackendOptions, EngineConfig, LLMEngine, SchedulingOptions
from moeforge.runtime.sampler import SamplingParams

RESULTS = Path(__file__).resolve().parent / "results" / "paged_decode.json"


def optimized_nodes(artifact: Path) -> int:
    """Nodes of the artifact's graph as ONNX Runtime runs it (paged: lowered first, as the backend does)."""
    model_path = load_artifact(artifact).model_path
    graph = lower_for_ort(onnx.load(str(model_path), load_external_data=False))
    with tempfile.TemporaryDirectory() as folder:
        optimized = Path(folder) / "optimized.onnx"

        def save_optimized(path: str | Path, lowered: onnx.ModelProto | None, options: ort.SessionOptions,
                           providers: list[str]) -> onnx.ModelProto | None:
            options.optimized_model_filepath = str(optimized)  # where ONNX Runtime writes the graph it runs
            return lowered

        make_session(model_path, graph=graph, providers=["CPUExecutionProvider"], prepare=save_optimized)
        return len(onnx.load(str(optimized), load_external_data=False).graph.node)


def decode_rate(engine: LLMEngine, batch: int, prompt_len: int, new_tokens: int) -> float:
    """Aggregate decode tokens/s of ``batch`` greedy requests, from the step where all have their first token."""
    vocab = engine.backend.vocab_size
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    for b in range(batch):
        engine.add_request([(7919 * (b * prompt_len + i) + 13) % vocab for i in range(prompt_len)], params)
    started: set[int] = set()
    first = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.token_ids:
                started.add(out.request_id)
        if first is None and len(started) == batch:
            first = Stopwatch()
    assert first is not None
    return batch * (new_tokens - 1) / first.elapsed()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("contiguous", type=Path)
    parser.add_argument("paged", type=Path)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt-len", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()

    systems = {"contiguous": args.contiguous, "paged": args.paged}
    rows: dict[str, dict[str, Any]] = {}
    for name, path in systems.items():
        rows[name] = {"artifact": str(path), "nodes_per_step": optimized_nodes(path)}
    for batch in args.batches:
        engines = {name: LLMEngine.from_artifact(path, EngineConfig(
            scheduling=SchedulingOptions(max_num_seqs=batch),
            backend=BackendOptions(huge_pages=True)))
                   for name, path in systems.items()}
        for engine in engines.values():  # warm-up
            decode_rate(engine, batch, args.prompt_len, 8)
        measured = Rounds(args.rounds, reverse=True).run(
            engines, partial(decode_rate, batch=batch, prompt_len=args.prompt_len, new_tokens=args.new_tokens))
        for name in systems:
            rates = [round(rate, 1) for rate in measured[name]]
            rows[name][f"b{batch}"] = {"decode_tokens_per_s": rates, "median": statistics.median(rates)}
        del engines
    print("| system | nodes per step | " + " | ".join(f"decode b{b} tok/s" for b in args.batches) + " |")
    print("|---|---|" + "---|" * len(args.batches))
    for name, row in rows.items():
        print(f"| {name} | {row['nodes_per_step']} | "
              + " | ".join(f"{row[f'b{b}']['median']:.1f}" for b in args.batches) + " |")
    ratios = {f"b{b}": round(rows["paged"][f"b{b}"]["median"] / rows["contiguous"][f"b{b}"]["median"], 3)
              for b in args.batches}
    print("paged / contiguous:", ratios)
    write_result(args.results, "paged_decode", {
        "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "rounds": args.rounds,
        "systems": rows, "paged_over_contiguous": ratios})
    print(f"wrote {args.results}")


if __name__ == "__main__":
    main()
