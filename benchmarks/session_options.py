"""Which ONNX Runtime session settings help the engine's decode: measured, alternating, in one run.

`python benchmarks/session_options.py ARTIFACT [--rounds 3] [--batch 1] [--new-tokens 128]` decodes greedily with
each variant below, the variants interleaved round by round in a rotating order (so a busy machine slows all of
them alike), and writes
the median decode tokens/s per variant, with its ratio to the default, to
benchmarks/results/session_options_<artifact>.json (machine described):

- default: ONNX Runtime's defaults (intra-op threads = physical cores, spinning on, prepacking on);
- threads=1 / threads=N: ``EngineConfig(backend=BackendOptions(threads=...))``;
- no-spinning: ``session.intra_op.allow_spinning`` = 0 (idle threads sleep: less CPU burnt between steps);
- no-prepacking: ``session.disable_prepacking`` = 1 (weights used as stored, not repacked at load);
- dynamic-block: ``session.dynamic_block_base`` = 4 (ONNX Runtime's dynamic work partitioning);
- no-mem-pattern: ``options.enable_mem_pattern`` = 0 (no pre-planned activation memory: the decode step's
  shapes change every step, so the plan is rebuilt anyway);
- no-cpu-arena: ``options.enable_cpu_mem_arena`` = 0 (plain malloc/free instead of the arena);
- opt-extended: ``options.graph_optimization_level`` = extended (skips the layout transformations of "all").
"""

from __future__ import annotations

import argparse
import os
import statistics
from functools import partial
from pathlib import Path
from typing import Any

from timer import Rounds, Stopwatch

from moeforge.cli.bench import write_result
from moeforge.runtime.engine import BackendOptions, EngineConfig, LLMEngine, SchedulingOptions
from moeforge.runtime.sampler import SamplingParams

RESULTS = Path(__file__).resolve().parent / "results"


def variants() -> dict[str, dict[str, Any]]:
    """Name -> BackendOptions keyword arguments."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    found: dict[str, dict[str, Any]] = {
        "default": {},
        "threads=1": {"threads": 1},
        f"threads={cores}": {"threads": cores},
        "no-spinning": {"session_config": (("session.intra_op.allow_spinning", "0"),)},
        "no-prepacking": {"session_config": (("session.disable_prepacking", "1"),)},
        "dynamic-block": {"session_config": (("session.dynamic_block_base", "4"),)},
        "no-mem-pattern": {"session_config": (("options.enable_mem_pattern", "0"),)},
        "no-cpu-arena": {"session_config": (("options.enable_cpu_mem_arena", "0"),)},
        "opt-extended": {"session_config": (("options.graph_optimization_level", "extended"),)},
    }
    return found


def decode_rate(engine: LLMEngine, batch: int, new_tokens: int, prompt_len: int = 8) -> float:
    """Decode tokens/s of ``batch`` greedy requests of ``new_tokens`` (the prefill step excluded)."""
    vocab = engine.backend.vocab_size
    prompts = [[(31 * b + 7 * i) % vocab for i in range(prompt_len)] for b in range(batch)]
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    engine.step()  # the prefill (all prompts fit one step)
    watch, steps = Stopwatch(), 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return batch * steps / watch.elapsed()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--results", type=Path, default=None)
    args = parser.parse_args()
    engines = {name: LLMEngine.from_artifact(args.artifact, EngineConfig(
        scheduling=SchedulingOptions(max_num_seqs=args.batch), backend=BackendOptions(**kwargs)))
               for name, kwargs in variants().items()}
    for engine in engines.values():
        decode_rate(engine, args.batch, 8)  # warm-up
    # the order rotates, so no variant always follows the same one
    rates = Rounds(args.rounds).run(engines, partial(decode_rate, batch=args.batch, new_tokens=args.new_tokens))
    default = statistics.median(rates["default"])
    results = {name: {"decode_tokens_per_s": [round(r, 1) for r in values],
                      "median": round(statistics.median(values), 1),
                      "vs_default": round(statistics.median(values) / default, 3)}
               for name, values in rates.items()}
    print(f"| variant | median decode tok/s (batch {args.batch}) | vs default |\n|---|---|---|")
    for name, row in results.items():
        print(f"| {name} | {row['median']} | {row['vs_default']} |")
    path = args.results or RESULTS / f"session_options_{Path(args.artifact).name}_b{args.batch}.json"
    write_result(path, "session_options", {"artifact": args.artifact, "batch": args.batch,
                                           "new_tokens": args.new_tokens, "rounds": args.rounds,
                                           "variants": results})


if __name__ == "__main__":
    main()
