"""The certified argmax head (moeforge/passes/argmax_head.py) measured: speed, how often it proves the argmax, and
whether its tokens are the float head's.

`python benchmarks/argmax_head.py [--model smollm2-135m] [--work-dir DIR] [--rounds 4]` compiles the model at fp32
twice into ``--work-dir`` (cached: with the argmax head, the default, and with ``--no-argmax-head``), then:

* decode tokens/s of both artifacts, greedy, 128 new tokens from 8-token prompts, batch 1 and 8, alternating rounds
  in one process (``moeforge.cli.bench``'s rules: the order rotates each round), medians and the ratio;
* on held-out prose (the GPL-3 preamble, as ``heldout_accuracy.py``; ``--text``), teacher-forced at every position
  with ``argmax_only`` fed: the share of positions certified, and whether each certified argmax equals the float
  head's (it must: a mismatch is a bug, and the script exits 1);
* greedy generation from 8 prompts through the engine, with the argmax path and without it (``logprobs=0`` makes the
  engine read the float head): identical tokens, and how many runs were repeated on the float head;
* the artifacts' weight bytes.

Results go to benchmarks/results/argmax_head.json (machine described).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from decode_rate import decode_rate
from timer import Rounds

from moeforge.cli.bench import write_result
from moeforge.compile.driver import CompileOptions, compile_model
from moeforge.core.artifact import load_artifact
from moeforge.core.kv_layout import ARGMAX_ONLY, LOGITS_CERTIFIED
from moeforge.model.tokenizer import Tokenizer
from moeforge.runtime.backends.onnxruntime import OrtSession
from moeforge.runtime.engine import EngineConfig, LLMEngine, SchedulingOptions
from moeforge.runtime.sampler import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "argmax_head.json"
DEFAULT_TEXT = Path("/usr/share/common-licenses/GPL-3")
PROMPTS = ["The history of the Roman Empire", "def quicksort(arr):", "In 1905, Albert Einstein",
           "Recipe: chocolate cake. Ingredients:", "The GNU General Public License is", "Dear Sir or Madam,",
           "import numpy as np", "Once upon a time"]


def artifacts(model: str, work_dir: Path) -> dict[str, Path]:
    """{"argmax": DIR, "float": DIR}, compiled on first use."""
    made = {}
    for name, flags in (("argmax", {}), ("float", {"argmax_head": False})):
        out = work_dir / f"{model}-fp32-{name}"
        if not (out / "manifest.json").exists():
            compile_model(CompileOptions.from_flags(model=model, output_dir=out, progress=False, force=True, **flags))
        made[name] = out
    return made


def speed(paths: dict[str, Path], batches: list[int], rounds: int, new_tokens: int) -> dict[str, Any]:
    """Median decode tokens/s per artifact and batch, alternating rounds."""
    out: dict[str, Any] = {}
    for batch in batches:
        engines = {name: LLMEngine.from_artifact(path, EngineConfig(scheduling=SchedulingOptions(max_num_seqs=batch)))
                   for name, path in paths.items()}
        for engine in engines.values():
            decode_rate(engine, batch, 8)  # warm-up
        rates = Rounds(rounds).run(engines, partial(decode_rate, batch=batch, new_tokens=new_tokens))
        medians = {name: statistics.median(values) for name, values in rates.items()}
        session = engines["argmax"].backend._session  # type: ignore[attr-defined]
        out[f"batch_{batch}"] = {
            "decode_tokens_per_s": {name: [round(v, 1) for v in values] for name, values in rates.items()},
            "median": {name: round(v, 1) for name, v in medians.items()},
            "argmax_over_float": round(medians["argmax"] / medians["float"], 3),
            "argmax_runs": session.argmax_runs, "argmax_reruns": session.argmax_reruns,
        }
        print(f"batch {batch}: argmax head {medians['argmax']:.1f} tok/s, float head {medians['float']:.1f} tok/s "
              f"({medians['argmax'] / medians['float']:.3f}x); {session.argmax_reruns} of {session.argmax_runs} "
              "runs repeated on the float head")
    return out


def teacher_forced(path: Path, text: str, tokens: int) -> dict[str, Any]:
    """Every position of ``text`` (``tokens`` tokens) with and without ``argmax_only``: certified share, agreement."""
    artifact = load_artifact(path)
    ids = Tokenizer.from_file(artifact.root).encode(text)[:tokens]
    session = OrtSession(artifact.model_path, kv_cache=artifact.manifest.kv_cache)
    n = len(ids)
    feeds = (np.array([ids]), np.arange(n)[None], np.ones((1, n), np.int64))
    session.allocate(batch=1, max_len=n + 1)
    full = session.forward(*feeds)[0]
    session.allocate(batch=1, max_len=n + 1)
    run = session.session.run
    names = {i.name: i for i in session.session.get_inputs()}
    inputs = {"input_ids": feeds[0], "position_ids": feeds[1], "attention_mask": feeds[2], ARGMAX_ONLY: np.array(True)}
    for name, value in names.items():
        if name.startswith("past_key_values."):
            shape = [1 if i == 0 else 0 if i == 2 else d for i, d in enumerate(value.shape)]
            inputs[name] = np.zeros(shape, np.float32)
    fast, certified = run(["logits", LOGITS_CERTIFIED], {k: v for k, v in inputs.items()
                                                       if k in names or k == ARGMAX_ONLY})
    ok = certified[0, :, 0]
    agree = fast[0].argmax(-1)[ok] == full.argmax(-1)[ok]
    return {"positions": n, "certified": int(ok.sum()), "certified_share": round(float(ok.mean()), 4),
            "certified_argmax_equal_float": int(agree.sum())}


def greedy_equal(path: Path, max_tokens: int) -> dict[str, Any]:
    """Greedy tokens of ``PROMPTS`` through the engine with the argmax path and with the float head (logprobs=0)."""
    engine = LLMEngine.from_artifact(path, EngineConfig(scheduling=SchedulingOptions(max_num_seqs=len(PROMPTS))))
    assert engine.tokenizer is not None
    prompts = [engine.tokenizer.encode(t) for t in PROMPTS]
    fast = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    session = engine.backend._session  # type: ignore[attr-defined]
    runs, reruns = session.argmax_runs, session.argmax_reruns
    slow = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=0))
    same = sum(a.token_ids == b.token_ids for a, b in zip(fast, slow, strict=True))
    return {"prompts": len(prompts), "new_tokens": max_tokens, "identical": same, "argmax_runs": runs,
            "argmax_reruns": reruns}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--work-dir", type=Path, default=ROOT / "artifacts" / "argmax_head")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    parser.add_argument("--text-tokens", type=int, default=512)
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    paths = artifacts(args.model, args.work_dir)
    text = " ".join(args.text.read_text(errors="replace").split())
    forced = teacher_forced(paths["argmax"], text, args.text_tokens)
    print(f"teacher-forced on {args.text}: {forced['certified']} of {forced['positions']} positions certified, "
          f"{forced['certified_argmax_equal_float']} of them equal to the float head's argmax")
    greedy = greedy_equal(paths["argmax"], args.new_tokens)
    print(f"greedy, {greedy['prompts']} prompts x {greedy['new_tokens']} tokens: {greedy['identical']} identical to "
          f"the float head; {greedy['argmax_reruns']} of {greedy['argmax_runs']} runs repeated")
    timing = speed(paths, args.batch, args.rounds, args.new_tokens)
    weights = {name: sum(f.stat().st_size for f in path.glob("model.onnx*")) for name, path in paths.items()}
    write_result(args.results, "argmax_head", {
        "model": args.model, "text": str(args.text), "teacher_forced": forced, "greedy": greedy, "speed": timing,
        "weight_bytes": weights, "rounds": args.rounds, "new_tokens": args.new_tokens})
    wrong = forced["certified"] - forced["certified_argmax_equal_float"]
    return 1 if wrong or greedy["identical"] != greedy["prompts"] else 0


if __name__ == "__main__":
    sys.exit(main())
