"""Decode speed with and without a JSON schema (constrained decoding, ``runtime/grammar.py``) at batch 1 and 8.

One engine per artifact serves four settings, alternating per round (``timer.Rounds``): free and ``json_schema``
(a schema of 24 required string fields, more than the run can write, so that every request decodes
``--new-tokens`` tokens), each greedy and sampled (temperature 0.8, seeded). Each step, the constrained requests'
token masks are computed on the engine's mask thread while the model step runs; the sampler applies them.

Why both: free greedy decoding runs on the artifact's certified argmax head when it has one
(moeforge/passes/argmax_head.py), which a constrained request cannot use (it needs the exact logits of the tokens
its grammar allows), so greedy-vs-greedy measures that head as much as the masks. Sampled-vs-sampled reads the same
logits in both settings: it measures what constrained decoding itself costs.

Reported per batch and mode: the median decode tokens/s over all requests of a round (tokens after the first, over
the time from the first request's first token to the last one's end) and the schema's ratio to free decoding.
Writes benchmarks/results/structured_output.json (``moeforge.cli.bench.write_result``) and prints a table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # timer, beside this script

from timer import Rounds

from moeforge.cli.bench import write_result
from moeforge.runtime.engine import BackendOptions, EngineConfig, LLMEngine, SchedulingOptions
from moeforge.runtime.outputs import RequestOutput
from moeforge.runtime.sampler import SamplingParams
from moeforge.runtime.structured_output import StructuredOutput

RESULTS = Path(__file__).resolve().parent / "results" / "structured_output.json"
# 24 required string fields: more than --new-tokens can write, so that every run decodes as many tokens.
FIELDS = [f"field_{i}" for i in range(24)]
SCHEMA = {"type": "object", "properties": {name: {"type": "string"} for name in FIELDS}, "required": FIELDS,
          "additionalProperties": False}
PROMPTS = ["Tell me a story about a dragon, as JSON.", "Describe Paris in JSON.", "Write a poem, in JSON.",
           "Explain rain as a JSON object.", "A JSON story about a cat.", "Summarise the news in JSON.",
           "A recipe for bread, in JSON.", "Describe the sea, as JSON."]


def decode_rate(outputs: list[RequestOutput]) -> float:
    """Decode tokens/s of a batch: tokens after each request's first, over first token to last end."""
    starts = [o.metrics.first_token for o in outputs if o.metrics is not None and o.metrics.first_token is not None]
    ends = [o.metrics.finished for o in outputs if o.metrics is not None and o.metrics.finished is not None]
    return sum(len(o.token_ids) - 1 for o in outputs) / (max(ends) - min(starts))


def measure(artifact: Path, batches: list[int], new_tokens: int, rounds: int, threads: int | None) -> dict[str, Any]:
    engine = LLMEngine.from_artifact(artifact, EngineConfig(scheduling=SchedulingOptions(max_num_seqs=max(batches)),
                                                            backend=BackendOptions(threads=threads)))
    assert engine.tokenizer is not None, "the artifact needs a tokenizer (a chat model's)"
    tokenizer = engine.tokenizer
    prompts = [tokenizer.encode_chat([{"role": "user", "content": p}]) if tokenizer.chat_template
               else tokenizer.encode(p) for p in PROMPTS]
    schema = StructuredOutput.json_schema(SCHEMA)
    modes = {"greedy": {}, "sampled": {"temperature": 0.8, "seed": 1}}
    settings = {f"{kind}_{mode}": SamplingParams(max_tokens=new_tokens, ignore_eos=True, **knobs,
                                                 structured_output=schema if kind == "json_schema" else None)
                for mode, knobs in modes.items() for kind in ("free", "json_schema")}
    engine.generate(prompts[:1], settings["json_schema_greedy"])  # warm-up: the tokenizer's masks, the schema compiled
    out: dict[str, Any] = {"argmax_head": engine.argmax_head_stats() is not None}
    for batch in batches:
        batch_prompts = [prompts[i % len(prompts)] for i in range(batch)]
        speeds: dict[str, list[float]] = {name: [] for name in settings}
        for _, order in Rounds(rounds).orders(settings):
            for name in order:
                outputs = engine.generate(batch_prompts, settings[name])
                assert all(len(o.token_ids) == new_tokens for o in outputs), [len(o.token_ids) for o in outputs]
                speeds[name].append(decode_rate(outputs))
        row: dict[str, Any] = {}
        for mode in modes:
            free, constrained = (statistics.median(speeds[f"{kind}_{mode}"]) for kind in ("free", "json_schema"))
            row[mode] = {"free_tokens_per_s": round(free, 1), "json_schema_tokens_per_s": round(constrained, 1),
                         "json_schema_vs_free": round(constrained / free, 3)}
        row["rounds"] = {k: [round(v, 1) for v in vs] for k, vs in speeds.items()}
        out[f"batch_{batch}"] = row
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact", type=Path, help="a compiled artifact with a tokenizer (e.g. SmolLM2's)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="ONNX Runtime intra-op threads")
    parser.add_argument("--save", type=Path, default=RESULTS)
    args = parser.parse_args()
    results = measure(args.artifact, args.batches, args.new_tokens, args.rounds, args.threads)
    results["artifact"] = args.artifact.name
    results["new_tokens"] = args.new_tokens
    # The machine's load while it ran: other processes on its cores compete with the masks' and the model's threads.
    results["load_average_1_5_15"] = [round(x, 2) for x in os.getloadavg()]
    print(f"{'batch':>5}  {'mode':>7}  {'free tok/s':>10}  {'schema tok/s':>12}  {'ratio':>6}")
    for batch in args.batches:
        for mode in ("greedy", "sampled"):
            row = results[f"batch_{batch}"][mode]
            print(f"{batch:>5}  {mode:>7}  {row['free_tokens_per_s']:>10}  {row['json_schema_tokens_per_s']:>12}  "
                  f"{row['json_schema_vs_free']:>6}")
    write_result(args.save, "structured_output", results)


if __name__ == "__main__":
    main()
