"""Prompt-lookup speculative decoding in the engine (``SpeculativeOptions``), measured at batch 1.

For each artifact and each setting (plain decoding, then k draft tokens with a minimum matched tail of n tokens),
one engine generates ``--new-tokens`` greedy tokens from every prompt of two sets, the settings alternating per
prompt: ``random`` (``moeforge.cli.bench``'s random-token prompts, 8 tokens, what ``genai_builder.py``
uses) and ``heldout`` (64-token passages of the held-out text of heldout_accuracy.py, the GPL-3 preamble: prose).
Reported per set: the median decode tokens/s (first token to last), its ratio to plain decoding, the share of
draft tokens accepted, and how many outputs equal plain decoding's token for token (with the mean length of the
common prefix). fp32 artifacts agree exactly; on int4 MatMulNBits artifacts a multi-token verification run
quantises its activations in other blocks than a one-token step, so at a near-tie the greedy token can differ, as
it does between batch sizes.

Writes benchmarks/results/speculative_decoding.json (``moeforge.cli.bench.write_result``) and prints a table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # heldout_accuracy, beside this script

from heldout_accuracy import DEFAULT_START, DEFAULT_TEXT, prose
from timer import Rounds

from moeforge.cli.bench import _prompts, write_result
from moeforge.core.artifact import load_artifact
from moeforge.model.tokenizer import Tokenizer
from moeforge.runtime.engine import BackendOptions, EngineConfig, LLMEngine, SchedulingOptions, SpeculativeOptions
from moeforge.runtime.sampler import SamplingParams

RESULTS = Path(__file__).resolve().parent / "results" / "speculative_decoding.json"


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def measure(artifact: Path, settings: dict[str, dict[str, int]], sets: dict[str, list[list[int]]],
            new_tokens: int, threads: int | None) -> dict[str, Any]:
    """Per setting and prompt set: median decode tok/s, acceptance, agreement with the first setting (plain)."""
    engines = {name: LLMEngine.from_artifact(artifact, EngineConfig(
        scheduling=SchedulingOptions(max_num_seqs=1), backend=BackendOptions(threads=threads),
        speculative=SpeculativeOptions(**knobs)))
               for name, knobs in settings.items()}
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    for engine in engines.values():  # warm-up
        engine.generate([_prompts(engine.backend.vocab_size, 1, 8, seed=10_000)[0]], params)
    out: dict[str, Any] = {}
    for set_name, prompts in sets.items():
        speeds: dict[str, list[float]] = {name: [] for name in engines}
        tokens: dict[str, list[list[int]]] = {name: [] for name in engines}
        drafted = {name: (e.metrics.draft_tokens, e.metrics.accepted_draft_tokens) for name, e in engines.items()}
        for prompt, (_, order) in zip(prompts, Rounds(len(prompts)).orders(engines), strict=True):
            for name in order:  # the order rotates per prompt
                result = engines[name].generate([prompt], params)[0]
                metrics = result.metrics
                assert metrics is not None and metrics.finished is not None and metrics.first_token is not None
                speeds[name].append((new_tokens - 1) / (metrics.finished - metrics.first_token))
                tokens[name].append(list(result.token_ids))
        plain = next(iter(engines))
        rows = {}
        for name, engine in engines.items():
            fed = engine.metrics.draft_tokens - drafted[name][0]
            accepted = engine.metrics.accepted_draft_tokens - drafted[name][1]
            prefixes = [_common_prefix(a, b) for a, b in zip(tokens[name], tokens[plain], strict=True)]
            rows[name] = {"decode_tokens_per_s": round(statistics.median(speeds[name]), 1),
                          "vs_plain": round(statistics.median(speeds[name]) / statistics.median(speeds[plain]), 3),
                          "draft_tokens": fed, "accepted_share": round(accepted / fed, 3) if fed else None,
                          "outputs_equal_to_plain": sum(p == new_tokens for p in prefixes),
                          "mean_common_prefix": round(statistics.mean(prefixes), 1)}
        out[set_name] = rows
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifacts", type=Path, nargs="+")
    parser.add_argument("--settings", nargs="+", default=["k4n2", "k6n2", "k6n1", "k8n2"],
                        help="kKnN: K draft tokens, minimum matched tail N (plain decoding is always measured first)")
    parser.add_argument("--prompts", type=int, default=6, help="prompts per set")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()

    settings: dict[str, dict[str, int]] = {"plain": {}}
    for spec in args.settings:
        k, n = spec.removeprefix("k").split("n")
        settings[spec] = {"tokens": int(k), "min_ngram": int(n), "max_ngram": max(3, int(n))}
    results: dict[str, Any] = {}
    print("| artifact | prompts | setting | decode tok/s | vs plain | drafts accepted | outputs = plain |")
    print("|---|---|---|---|---|---|---|")
    for artifact in args.artifacts:
        loaded = load_artifact(artifact)
        text_ids = Tokenizer.from_file(loaded.root).encode(prose(DEFAULT_TEXT, DEFAULT_START))
        vocab = int(loaded.manifest.model_config["vocab_size"])
        sets = {"random": _prompts(vocab, args.prompts, 8, seed=0),
                "heldout": [text_ids[64 * i:64 * i + 64] for i in range(args.prompts)]}
        rows = measure(artifact, settings, sets, args.new_tokens, args.threads)
        results[artifact.name] = rows
        for set_name, by_setting in rows.items():
            for name, row in by_setting.items():
                accepted = "-" if row["accepted_share"] is None else f"{row['accepted_share']:.0%}"
                print(f"| {artifact.name} | {set_name} | {name} | {row['decode_tokens_per_s']:.1f} | "
                      f"{row['vs_plain']:.2f}x | {accepted} | {row['outputs_equal_to_plain']}/{args.prompts} |",
                      flush=True)
    write_result(args.results, "speculative_decoding", {
        "settings": settings, "prompts_per_set": args.prompts, "new_tokens": args.new_tokens, "batch": 1,
        "results": results})
    print(f"wrote {args.results}")


if __name__ == "__main__":
    main()
