"""Golden outputs for TensorRT artifacts, and the one-command engine check against them.

Dimension letters: P prompt tokens, V vocabulary, Hkv/L/D cache heads, length, head size.

At compile time ONNX Runtime (CPU) runs one prefill of a seeded prompt through the artifact's own
lowered graph (the exact ONNX the engine was built from, half precision included) from empty caches;
``golden/inputs.json`` keeps the small inputs (input_ids [1, P], position_ids [1, P], past_lengths [1])
and ``golden/outputs.json`` the logits [1, P, V], in Polygraphy's JSON formats. The KV caches are not
stored (zeros of the engine's static shape [1, Hkv, L, D], rebuilt from the manifest): at L = 2048 they
would be tens of MB of JSON. ``moeforge parity DIR --backend tensorrt`` runs the engine on a GPU host on
the same feeds and compares.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from moeforge.golden import GOLDEN_DIR, INPUTS_FILE, OUTPUTS_FILE, RUNNER_NAME, GoldenCheck, load_golden

PAST_PREFIX = "past_key_values."
# fp16/bf16 engine vs ORT on the same half-precision graph: both round differently per op.
TOLERANCE = {"fp16": 5e-2, "bf16": 2.5e-1, "fp32": 1e-3}

_NUMPY = {"float16": np.float16, "float32": np.float32, "bfloat16": "bfloat16"}


def _np_dtype(name: str) -> Any:
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return _NUMPY.get(name, np.float32)


def cache_feeds(model_path: Path) -> dict[str, np.ndarray]:
    """Zero caches [1, Hkv, L, D] for every ``past_key_values.*`` input of the lowered graph."""
    import onnx

    proto = onnx.load(str(model_path), load_external_data=False)
    feeds = {}
    for value in proto.graph.input:
        if value.name.startswith(PAST_PREFIX):
            tensor_type = value.type.tensor_type
            dims = [d.dim_value for d in tensor_type.shape.dim]
            dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type)
            feeds[value.name] = np.zeros([1, *dims[1:]], dtype)
    return feeds


def golden_inputs(prompt_ids: list[int]) -> dict[str, np.ndarray]:
    ids = np.array([prompt_ids], dtype=np.int64)
    return {"input_ids": ids, "position_ids": np.arange(ids.shape[1], dtype=np.int64)[None],
            "past_lengths": np.zeros(1, np.int64)}


def write_trt_golden(artifact_dir: Path, model_path: Path, prompt_ids: list[int]) -> None:
    """ONNX Runtime (CPU) on the lowered graph: save inputs and logits as Polygraphy JSON under ``golden/``."""
    import onnxruntime as ort
    from polygraphy.comparator import RunResults
    from polygraphy.comparator.struct import IterationResult
    from polygraphy.json import save_json

    small = golden_inputs(prompt_ids)
    options = ort.SessionOptions()
    options.log_severity_level = 3  # TensorScatter warns that it copies (no shared buffer here)
    caches = cache_feeds(model_path)
    if any(c.dtype.name == "bfloat16" for c in caches.values()):
        # ONNX Runtime's CPU kernels have no bf16 arithmetic: run the same graph retyped to fp32
        # (weights keep their bf16-rounded values).
        source: str | bytes = _bf16_as_fp32(model_path).SerializeToString()
        caches = {k: v.astype(np.float32) for k, v in caches.items()}
    else:
        source = str(model_path)
    session = ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
    (logits,) = session.run(["logits"], {**small, **caches})
    out = artifact_dir / GOLDEN_DIR
    out.mkdir(exist_ok=True)
    save_json([small], str(out / INPUTS_FILE))
    results = RunResults()
    results.append((RUNNER_NAME, [IterationResult({"logits": logits}, runner_name=RUNNER_NAME)]))
    save_json(results, str(out / OUTPUTS_FILE))


def check_engine(artifact_dir: str | Path) -> tuple[GoldenCheck, float]:
    """Run the artifact's engine (GPU) on the golden inputs; return the check and the tolerance for its dtype."""
    from moeforge.artifact import load_artifact
    from moeforge.runtime.backends.tensorrt import TrtEngine

    artifact = load_artifact(artifact_dir)
    feeds, golden = load_golden(artifact.root)
    engine = TrtEngine.from_artifact(artifact)
    logits = engine.run_once({**{k: np.asarray(v) for k, v in feeds.items()}, **cache_feeds(artifact.model_path)})
    diff = np.abs(logits.astype(np.float64) - golden.astype(np.float64))
    check = GoldenCheck(float(diff.max()), float((logits.argmax(-1) == golden.argmax(-1)).mean()))
    tolerance = TOLERANCE.get(artifact.manifest.precision, 5e-2) * max(1.0, float(np.abs(golden).max()))
    return check, tolerance


def _bf16_as_fp32(model_path: Path) -> Any:
    """The graph at ``model_path`` with weights loaded and every bfloat16 type, Cast and tensor made float32."""
    import onnx

    proto = onnx.load(str(model_path))
    bf16, f32 = onnx.TensorProto.BFLOAT16, onnx.TensorProto.FLOAT

    def convert(tensor: Any) -> None:
        if tensor.data_type == bf16:
            array = onnx.numpy_helper.to_array(tensor).astype(np.float32)
            tensor.CopyFrom(onnx.numpy_helper.from_array(array, tensor.name))

    graph = proto.graph
    for info in [*graph.input, *graph.output, *graph.value_info]:
        if info.type.tensor_type.elem_type == bf16:
            info.type.tensor_type.elem_type = f32
    for tensor in graph.initializer:
        convert(tensor)
    for node in graph.node:
        for attr in node.attribute:
            if attr.name == "to" and attr.i == bf16:
                attr.i = f32
            if attr.type == onnx.AttributeProto.TENSOR:
                convert(attr.t)
    return proto
