"""Golden outputs saved with every artifact, in Polygraphy's formats, for checking another backend later.

Dimension letters: P prompt tokens, V vocabulary, H cache heads, L cache length, D head size, Bs block size.

At compile time ONNX Runtime on CPU runs one prefill of a seeded prompt through the artifact's own graph from
empty caches; the inputs and the logits are saved as Polygraphy JSON:

    golden/inputs.json    a list with one feed dict (polygraphy run --load-inputs)
    golden/outputs.json   RunResults of runner "onnxrt-cpu" with the logits (--load-outputs)

The caches come from the manifest's ``kv_cache``: contiguous buffers [1, H, L, D] (L = 32 for ONNX Runtime
artifacts, the engine's static length for TensorRT ones) or pools of ceil(P / Bs) blocks, zeroed. An engine's
golden (``for_engine``: the graph the TensorRT plan was built from, half precision included) keeps only the
small inputs (ids, positions, lengths, block tables): its caches would be tens of MB of JSON, and
``check_engine`` rebuilds them from the manifest. ``polygraphy run model.onnx --trt --load-inputs
golden/inputs.json --load-outputs golden/outputs.json`` checks an engine with Polygraphy itself;
``moeforge parity DIR --backend tensorrt`` does it with moeforge's engine runner.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import onnx
from polygraphy.comparator import RunResults
from polygraphy.comparator.struct import IterationResult
from polygraphy.json import load_json, save_json

from moeforge.core.artifact import external_initializers, load_artifact
from moeforge.core.kv_layout import KVCacheSpec
from moeforge.core.ort_session import UNPACKED_WEIGHTS, make_session
from moeforge.passes.precision import retype_floats
from moeforge.runtime.backends.base import RowInput
from moeforge.runtime.backends.onnxruntime_paged import packed_feeds

GOLDEN_DIR = "golden"
INPUTS_FILE = "inputs.json"
OUTPUTS_FILE = "outputs.json"
RUNNER_NAME = "onnxrt-cpu"
GOLDEN_CACHE_LEN = 32  # ONNX Runtime artifacts: the cache buffers' length for the golden prefill
# fp16/bf16 engine vs ORT on the same half-precision graph: both round differently per op.
ENGINE_TOLERANCE = {"fp16": 5e-2, "bf16": 2.5e-1, "fp32": 1e-3}


@dataclass(frozen=True)
class GoldenCheck:
    """How far a run is from the saved golden logits."""

    max_abs_err: float
    top1_agreement: float


def _numpy_dtype(name: str) -> Any:
    """A numpy dtype for a manifest dtype name (bfloat16 through ml_dtypes, which onnx depends on)."""
    return ml_dtypes.bfloat16 if name == "bfloat16" else np.dtype(name)


def cache_feeds(kv: KVCacheSpec, prompt_len: int) -> dict[str, np.ndarray]:
    """Zeroed caches for one prefill of ``prompt_len`` tokens: pools of ceil(P / Bs) blocks, or contiguous buffers
    [1, H, L, D] (L: the static length of an engine's cache, else ``GOLDEN_CACHE_LEN``)."""
    dtype = _numpy_dtype(kv.dtype)
    if kv.layer_buffers is not None:  # DeepSeek-V4: every buffer its own rows and width
        lead = -(-prompt_len // kv.block_size) if kv.block_size is not None else 1
        return {name: np.zeros([lead, *(int(d) for d in kv.buffer_shape(j, layer)[1:])], dtype)
                for layer, names in enumerate(kv.past_input_names) for j, name in enumerate(names)}
    if kv.block_size is not None:
        shape = [-(-prompt_len // kv.block_size), *(int(d) for d in kv.shape[1:])]
    else:
        length = kv.shape[2] if isinstance(kv.shape[2], int) else GOLDEN_CACHE_LEN
        if prompt_len > length:
            raise ValueError(f"the golden prompt ({prompt_len} tokens) exceeds the golden cache ({length})")
        shape = [1, int(kv.shape[1]), length, int(kv.shape[3])]
    # Each buffer its own width (DSA: the latent and the indexer's keys).
    return {name: np.zeros([*shape[:-1], int(kv.buffer_shape(j)[-1])], dtype)
            for names in kv.past_input_names for j, name in enumerate(names)}


def token_feeds(kv: KVCacheSpec, prompt_ids: list[int], *, for_engine: bool) -> dict[str, np.ndarray]:
    """The non-cache inputs of one prefill: packed tokens + block table for a paged graph (every token projected:
    logits [P, V]); ids, positions and the attention mask (ONNX Runtime) or the cached lengths (TensorRT)."""
    if kv.block_size is not None:
        blocks = tuple(range(-(-len(prompt_ids) // kv.block_size)))
        return packed_feeds([RowInput(0, tuple(prompt_ids), 0, blocks)], all_logits=True)
    ids = np.array([prompt_ids], dtype=np.int64)
    positions = np.arange(ids.shape[1], dtype=np.int64)[None]
    if for_engine and kv.layer_buffers is None:  # DeepSeek-V4's engine graph has its ONNX Runtime graph's inputs
        return {"input_ids": ids, "position_ids": positions, "past_lengths": np.zeros(1, np.int64)}
    return {"input_ids": ids, "position_ids": positions, "attention_mask": np.ones_like(ids)}


def write_golden(folder: Path, model_path: Path, kv: KVCacheSpec, prompt_ids: list[int], *,
                 for_engine: bool = False) -> None:
    """Run ONNX Runtime once on the graph at ``model_path`` and save inputs + logits under ``folder/golden/``."""
    tokens = token_feeds(kv, prompt_ids, for_engine=for_engine)
    feeds = {**tokens, **cache_feeds(kv, len(prompt_ids))}
    if for_engine:
        logits = _run_engine_graph(model_path, feeds)
    else:
        # One run: packing every matrix for ONNX Runtime's GEMM first would only copy the weights into anonymous
        # memory (a streamed compile's peak would grow with the model); unpacked, they stay in the mapped file.
        session = make_session(model_path, session_config=UNPACKED_WEIGHTS)
        wanted = {i.name for i in session.get_inputs()}  # DeepSeek-V4's paged graph reads no seq_lens
        feeds = {name: value for name, value in feeds.items() if name in wanted}
        (logits,) = session.run(["logits"], feeds)
    out = folder / GOLDEN_DIR
    out.mkdir(exist_ok=True)
    save_json([tokens if for_engine else feeds], str(out / INPUTS_FILE))
    results = RunResults()
    results.append((RUNNER_NAME, [IterationResult({"logits": logits}, runner_name=RUNNER_NAME)]))
    save_json(results, str(out / OUTPUTS_FILE))


def load_golden(artifact_dir: Path) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """The saved feed dict and golden logits."""
    inputs = load_json(str(artifact_dir / GOLDEN_DIR / INPUTS_FILE))[0]
    results = load_json(str(artifact_dir / GOLDEN_DIR / OUTPUTS_FILE))
    _, iterations = results[0]
    return dict(inputs), np.asarray(iterations[0]["logits"])


def compare_with_golden(artifact_dir: Path, logits: np.ndarray) -> GoldenCheck:
    """Compare logits from any backend run on the golden inputs with the saved ones."""
    _, golden = load_golden(artifact_dir)
    diff = np.abs(logits.astype(np.float64) - golden.astype(np.float64))
    return GoldenCheck(float(diff.max()), float((logits.argmax(-1) == golden.argmax(-1)).mean()))


def check_engine(artifact_dir: str | Path) -> tuple[GoldenCheck, float]:
    """Run the artifact's engine (GPU) on the golden inputs; return the check and the tolerance for its dtype."""
    from moeforge.runtime.backends.tensorrt import TrtEngine  # lazy: needs TensorRT and a GPU

    artifact = load_artifact(artifact_dir)
    feeds, golden = load_golden(artifact.root)
    prompt_len = int(np.asarray(feeds["input_ids"]).size)
    engine = TrtEngine.from_artifact(artifact)
    logits = engine.run_once({**{k: np.asarray(v) for k, v in feeds.items()},
                              **cache_feeds(artifact.manifest.kv_cache, prompt_len)})
    check = compare_with_golden(artifact.root, logits)
    tolerance = ENGINE_TOLERANCE.get(artifact.manifest.precision, 5e-2) * max(1.0, float(np.abs(golden).max()))
    return check, tolerance


def _run_engine_graph(model_path: Path, feeds: dict[str, np.ndarray]) -> np.ndarray:
    """logits of an engine's graph on ONNX Runtime CPU; bf16 graphs run retyped to fp32 (ONNX Runtime's CPU
    kernels have no bf16 arithmetic; the weights keep their bf16-rounded values).

    Memory stays far below the weights' size, as for a streamed compile's artifact: the weights stay in the mapped
    data file (no prepacking; no constant folding, which would store a float32 copy of every fp16 weight that
    ONNX Runtime's CPU kernels read through a Cast: each Cast then runs per step on one weight at a time), and the
    bf16 -> fp32 copy is written to a file beside the graph one tensor at a time and mapped likewise."""
    bf16 = any(v.dtype.name == "bfloat16" for v in feeds.values())
    if bf16:
        feeds = {k: v.astype(np.float32) if v.dtype.name == "bfloat16" else v for k, v in feeds.items()}
        model_path = _bf16_as_fp32(model_path)
    try:
        session = make_session(model_path, providers=["CPUExecutionProvider"], optimize=False,
                               session_config=UNPACKED_WEIGHTS)
    finally:  # the session maps the copy; its pages stay valid once the names are gone
        if bf16:
            model_path.unlink()
            (model_path.parent / (model_path.name + ".data")).unlink(missing_ok=True)
    wanted = {i.name for i in session.get_inputs()}
    (logits,) = session.run(["logits"], {name: value for name, value in feeds.items() if name in wanted})
    return np.asarray(logits)


def _bf16_as_fp32(model_path: Path) -> Path:
    """A copy of the graph at ``model_path`` beside it (``<name>.fp32.onnx`` + its data file) with every bfloat16
    type, Cast and tensor made float32; external weights are converted and written one at a time."""
    proto = onnx.load(str(model_path), load_external_data=False)
    out = model_path.with_name(model_path.stem + ".fp32.onnx")
    data_name = out.name + ".data"
    try:
        _write_fp32_data(proto, model_path.parent, out.parent / data_name)
    except BaseException:
        (out.parent / data_name).unlink(missing_ok=True)
        raise
    retype_floats(proto, onnx.TensorProto.BFLOAT16, onnx.TensorProto.FLOAT)  # external ones: their type only
    onnx.save(proto, str(out))
    return out


def _write_fp32_data(proto: onnx.ModelProto, folder: Path, path: Path) -> None:
    """Copy every external initializer of ``proto`` (data files under ``folder``) into ``path``, bf16 ones as
    float32, one at a time, and point the initializers at the copy."""
    data_name = path.name
    with path.open("wb") as data:
        for tensor, raw in external_initializers(proto, folder):
            array = raw.view(ml_dtypes.bfloat16).astype(np.float32) if tensor.data_type == \
                onnx.TensorProto.BFLOAT16 else raw
            offset = data.tell()
            data.write(np.ascontiguousarray(array).tobytes())
            del tensor.external_data[:]
            for key, value in (("location", data_name), ("offset", str(offset)), ("length", str(array.nbytes))):
                tensor.external_data.add(key=key, value=value)
