"""Golden outputs saved with an artifact, in Polygraphy's formats, for comparing another backend later.

At compile time ONNX Runtime on CPU runs one prefill of a seeded prompt through the finished graph
(empty caches of a small fixed length); the inputs and the logits are saved as Polygraphy JSON:

    golden/inputs.json    a list with one feed dict (polygraphy run --load-inputs)
    golden/outputs.json   RunResults of runner "onnxrt-cpu" with the logits (--load-outputs)

so a GPU host can check a TensorRT engine of the same graph with one command, e.g.
``polygraphy run model.onnx --trt --load-inputs golden/inputs.json --load-outputs golden/outputs.json
--onnx-outputs logits --trt-outputs logits`` (issue: TensorRT target), or ``moeforge`` itself can
compare any backend against them with ``compare_with_golden``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moeforge.runtime.backends.onnxruntime import OrtSession

GOLDEN_DIR = "golden"
INPUTS_FILE = "inputs.json"
OUTPUTS_FILE = "outputs.json"
RUNNER_NAME = "onnxrt-cpu"
GOLDEN_CACHE_LEN = 32


@dataclass(frozen=True)
class GoldenCheck:
    """How far a run is from the saved golden logits."""

    max_abs_err: float
    top1_agreement: float


def golden_feeds(
    session: OrtSession, prompt_ids: list[int], cache_len: int = GOLDEN_CACHE_LEN
) -> dict[str, np.ndarray]:
    """Every graph input for one prefill from empty caches (zeros) of length ``cache_len``."""
    if len(prompt_ids) > cache_len:
        raise ValueError(f"the golden prompt ({len(prompt_ids)} tokens) exceeds the golden cache ({cache_len})")
    ids = np.array([prompt_ids], dtype=np.int64)
    feeds = {
        "input_ids": ids,
        "position_ids": np.arange(ids.shape[1], dtype=np.int64)[None],
        "attention_mask": np.ones_like(ids),
    }
    for binding in session.bindings:
        feeds[binding.input_name] = np.zeros((1, binding.heads, cache_len, binding.head_dim), binding.dtype)
    return feeds


def write_golden(artifact_dir: Path, model_path: Path, prompt_ids: list[int]) -> None:
    """Run ONNX Runtime once and save inputs + logits as Polygraphy JSON under ``golden/``."""
    from polygraphy.comparator import RunResults
    from polygraphy.comparator.struct import IterationResult
    from polygraphy.json import save_json

    from moeforge.runtime.backends.onnxruntime_paged import is_paged_graph, paged_golden_feeds

    session = OrtSession(model_path)
    # Paged artifacts (--kv-cache paged): packed-token feeds over zeroed pools; their logits are [P, V].
    feeds = paged_golden_feeds(model_path, prompt_ids) if is_paged_graph(model_path) else golden_feeds(
        session, prompt_ids)
    (logits,) = session.session.run(["logits"], feeds)
    out = artifact_dir / GOLDEN_DIR
    out.mkdir(exist_ok=True)
    save_json([feeds], str(out / INPUTS_FILE))
    results = RunResults()
    results.append((RUNNER_NAME, [IterationResult({"logits": logits}, runner_name=RUNNER_NAME)]))
    save_json(results, str(out / OUTPUTS_FILE))


def load_golden(artifact_dir: Path) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """The saved feed dict and golden logits."""
    from polygraphy.json import load_json

    inputs = load_json(str(artifact_dir / GOLDEN_DIR / INPUTS_FILE))[0]
    results = load_json(str(artifact_dir / GOLDEN_DIR / OUTPUTS_FILE))
    _, iterations = results[0]
    return dict(inputs), np.asarray(iterations[0]["logits"])


def compare_with_golden(artifact_dir: Path, logits: np.ndarray) -> GoldenCheck:
    """Compare logits [1, P, V] from any backend run on the golden inputs with the saved ones."""
    _, golden = load_golden(artifact_dir)
    diff = np.abs(logits.astype(np.float64) - golden.astype(np.float64))
    return GoldenCheck(float(diff.max()), float((logits.argmax(-1) == golden.argmax(-1)).mean()))
