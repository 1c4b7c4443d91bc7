"""Golden logits of a paged TensorRT artifact (``--target trt --kv-cache paged``).

Dimension letters: P prompt tokens, V vocabulary, N pool blocks, Bs block size.

ONNX Runtime (CPU) runs one prefill of the seeded prompt through the artifact's own lowered graph (the
exact ONNX the engine was built from, half precision and the PagedAttention local function included,
which ORT inlines) over zeroed pools of ceil(P / Bs) blocks, projecting every token: logits [P, V].
``golden/`` holds the small feeds (ids, positions, block table, lengths, logits indices) and the logits in
Polygraphy's JSON; the pools are zeros of the pool type, rebuilt by ``paged_trt_feeds`` (as the contiguous
TensorRT golden rebuilds its caches, moeforge/trt/golden.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from moeforge.golden import GOLDEN_DIR, INPUTS_FILE, OUTPUTS_FILE, RUNNER_NAME

POOL_PREFIX = "kv_pool."


def paged_trt_feeds(model_path: Path, prompt_ids: list[int]) -> dict[str, np.ndarray]:
    """The paged golden feeds with the pools in the graph's pool type (fp16 or bf16)."""
    import onnx

    from moeforge.runtime.backends.onnxruntime_paged import paged_golden_feeds
    from moeforge.trt.golden import _np_dtype

    names = {onnx.TensorProto.FLOAT16: "float16", onnx.TensorProto.BFLOAT16: "bfloat16"}
    feeds = paged_golden_feeds(model_path, prompt_ids)
    graph = onnx.load(str(model_path), load_external_data=False).graph
    for value in graph.input:
        if value.name.startswith(POOL_PREFIX):
            dtype = _np_dtype(names.get(value.type.tensor_type.elem_type, "float32"))
            feeds[value.name] = feeds[value.name].astype(dtype)
    return feeds


def run_paged_graph(model_path: Path, feeds: dict[str, np.ndarray]) -> np.ndarray:
    """logits [K, V] of the lowered paged graph on ONNX Runtime CPU (bf16 graphs run retyped to fp32)."""
    import onnxruntime as ort

    from moeforge.trt.golden import _bf16_as_fp32

    options = ort.SessionOptions()
    options.log_severity_level = 3
    if any(v.dtype.name == "bfloat16" for v in feeds.values()):
        source: str | bytes = _bf16_as_fp32(model_path).SerializeToString()  # no bf16 arithmetic on ORT CPU
        feeds = {k: v.astype(np.float32) if v.dtype.name == "bfloat16" else v for k, v in feeds.items()}
    else:
        source = str(model_path)
    session = ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
    (logits,) = session.run(["logits"], feeds)
    return logits


def write_trt_paged_golden(artifact_dir: Path, model_path: Path, prompt_ids: list[int]) -> None:
    """Save the feeds and ORT's logits [P, V] under ``golden/``."""
    from polygraphy.comparator import RunResults
    from polygraphy.comparator.struct import IterationResult
    from polygraphy.json import save_json

    feeds = paged_trt_feeds(model_path, prompt_ids)
    logits = run_paged_graph(model_path, feeds)
    out = artifact_dir / GOLDEN_DIR
    out.mkdir(exist_ok=True)
    save_json([{k: v for k, v in feeds.items() if not k.startswith(POOL_PREFIX)}], str(out / INPUTS_FILE))
    results = RunResults()
    results.append((RUNNER_NAME, [IterationResult({"logits": logits}, runner_name=RUNNER_NAME)]))
    save_json(results, str(out / OUTPUTS_FILE))
