"""What prompt-lookup speculative decoding could give moeforge's greedy decode, measured before building it.

Speculative decoding with prompt lookup (vLLM's ``ngram`` method, TensorRT-LLM's prompt-lookup decoding) drafts up
to ``k`` tokens by finding the sequence's last n tokens earlier in the sequence (prompt and output; n from ``--max-
ngram`` down to 1, the latest match) and copying what followed; one model run over the k + 1 tokens then verifies
them, and greedy output stays exactly the same. Its speed-up is the tokens a run yields (1 + accepted drafts) over
its cost in 1-token decode steps (a run that found no match is a plain decode step). This script measures both
halves, on an artifact:

* acceptance: the engine greedily generates ``--new-tokens`` tokens from each prompt set; the drafter is replayed
  over those outputs (a draft token counts while it equals the greedy token at its place);
  prompt sets: ``random`` (``moeforge.cli.bench``'s random-token prompts, as genai_compare.py uses) and ``heldout``
  (passages of the held-out text of heldout_accuracy.py, the GPL-3 preamble: natural prose);
* cost: ``OrtSession`` runs a 1-token decode step and (k + 1)-token steps on a cache holding ``--past`` tokens,
  alternating, medians.

Writes benchmarks/results/speculative_potential.json (``moeforge.cli.bench.write_result``) and prints a table. Nothing
here changes the engine: it says whether building the feature would pay on this machine.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # heldout_accuracy, beside this script

from heldout_accuracy import DEFAULT_START, DEFAULT_TEXT, prose
from timer import Rounds, Samples

from moeforge.cli.bench import _prompts, write_result
from moeforge.core.artifact import load_artifact
from moeforge.model.tokenizer import Tokenizer
from moeforge.runtime.backends.onnxruntime import OrtSession
from moeforge.runtime.engine import EngineConfig, LLMEngine, SchedulingOptions
from moeforge.runtime.sampler import SamplingParams

RESULTS = Path(__file__).resolve().parent / "results" / "speculative_potential.json"


def draft(sequence: Sequence[int], k: int, max_ngram: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the sequence's last n tokens."""
    for n in range(min(max_ngram, len(sequence) - 1), 0, -1):
        tail = list(sequence[-n:])
        for start in range(len(sequence) - n - 1, -1, -1):
            if list(sequence[start:start + n]) == tail:
                return list(sequence[start + n:start + n + k])
    return []


def replay(prompt: Sequence[int], output: Sequence[int], k: int, max_ngram: int) -> list[tuple[int, int]]:
    """Replays speculative decoding over a greedy ``output``: per model run, (tokens it yields = 1 + accepted
    draft tokens, tokens it feeds = 1 + the draft's length: 1 when nothing matched, a plain decode step)."""
    runs, done = [], 0
    while done < len(output):
        proposal = draft([*prompt, *output[:done]], k, max_ngram)
        accepted = 0
        while accepted < len(proposal) and done + accepted < len(output) - 1 \
                and proposal[accepted] == output[done + accepted]:
            accepted += 1
        runs.append((min(accepted + 1, len(output) - done), 1 + len(proposal)))
        done += runs[-1][0]
    return runs


def greedy_outputs(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    outputs = engine.generate(prompts, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    return [list(o.token_ids) for o in outputs]


def run_cost(session: OrtSession, past: int, widths: Sequence[int], rounds: int) -> dict[int, float]:
    """Median seconds of a run of each width on a cache holding ``past`` tokens (the cache writes land past it
    and are rewritten every time)."""
    session.allocate(1, past + max(widths) + 1)
    prefix = np.arange(past, dtype=np.int64)[None] % 97 + 3
    session.forward_on(session.views(0, 1), prefix, np.arange(past)[None], np.ones((1, past), np.int64))
    times = {w: Samples() for w in widths}
    warmup = Samples()  # round 0's, dropped
    # round 0 (the warm-up) runs the widths backwards, round 1 forwards, and so on
    for r, order in Rounds(rounds + 1, reverse=True).orders(list(widths)[::-1]):
        for width in order:
            ids = np.full((1, width), 5, np.int64)
            positions = np.arange(past, past + width)[None]
            mask = np.ones((1, past + width), np.int64)
            with (times[width] if r else warmup).measure():
                if width == 1:
                    session.decode(0, 1, [5], [past], [past + 1])
                else:
                    session.forward_on(session.views(0, 1), ids, positions, mask)
    return {w: v.median() for w, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--draft", type=int, nargs="+", default=[2, 4, 8], help="draft lengths k")
    parser.add_argument("--max-ngram", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per set")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--past", type=int, default=72, help="cached tokens for the cost runs")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()

    artifact = load_artifact(args.artifact)
    engine = LLMEngine.from_artifact(
        args.artifact, EngineConfig(scheduling=SchedulingOptions(max_num_seqs=args.prompts)))
    vocab = engine.backend.vocab_size
    tokenizer = Tokenizer.from_file(artifact.root)
    text_ids = tokenizer.encode(prose(DEFAULT_TEXT, DEFAULT_START))
    sets = {"random": _prompts(vocab, args.prompts, 8, seed=0),
            "heldout": [text_ids[64 * i:64 * i + 64] for i in range(args.prompts)]}
    replays: dict[str, dict[int, list[tuple[int, int]]]] = {}
    for name, prompts in sets.items():
        outputs = greedy_outputs(engine, prompts, args.new_tokens)
        replays[name] = {k: [run for p, o in zip(prompts, outputs, strict=True)
                             for run in replay(p, o, k, args.max_ngram)] for k in args.draft}
    session = OrtSession(artifact.model_path, kv_cache=artifact.manifest.kv_cache, huge_pages=True)
    cost = run_cost(session, args.past, sorted({1, *(w for k in args.draft for w in range(2, k + 2))}), args.rounds)
    relative = {w: cost[w] / cost[1] for w in cost}
    print("| prompts | k | tokens per run | runs with a draft | speed-up over plain decode |\n|---|---|---|---|---|")
    summary: dict[str, dict[str, Any]] = {}
    for name, by_k in replays.items():
        for k, runs in by_k.items():
            tokens = sum(t for t, _ in runs)
            steps = sum(relative[w] for _, w in runs)  # in 1-token decode steps
            row = {"tokens_per_run": round(tokens / len(runs), 3),
                   "drafted_share": round(sum(w > 1 for _, w in runs) / len(runs), 3),
                   "speedup": round(tokens / steps, 3)}
            summary.setdefault(name, {})[f"k{k}"] = row
            print(f"| {name} | {k} | {row['tokens_per_run']:.2f} | {row['drafted_share']:.0%} | "
                  f"{row['speedup']:.2f}x |")
    write_result(args.results, "speculative_potential", {
        "artifact": str(args.artifact), "max_ngram": args.max_ngram, "prompts": args.prompts,
        "new_tokens": args.new_tokens, "past": args.past, "decode_step_ms": round(1e3 * cost[1], 3),
        "relative_run_cost": {f"width {w}": round(v, 3) for w, v in relative.items()}, "results": summary})
    print(f"wrote {args.results}")


if __name__ == "__main__":
    main()
