"""Calibration data: a text file of prompts, one per line, run through the compiled fp32 graph.

``read_prompts`` checks the file; ``GraphRunner`` runs an onnx-ir graph in ONNX Runtime (prefill from an empty
cache) and can return internal values (MatMul inputs for AWQ) and take replacement weights as feeds (one weight
swapped at a time for the sensitivity sweep).

Memory: by default the graph is serialised in memory (a protobuf holding every weight, then ONNX Runtime's own
copy). A streamed compile (``PassContext.artifact_dir``) cannot afford that: its weights are lazy reads of the
checkpoint. There the runner writes the graph to a temporary folder first, one tensor at a time (``ir.save``: each
lazy weight read, transformed, written and freed), and ONNX Runtime maps the external data file with prepacking
off, so the weights stay clean file pages the kernel reclaims under a memory cap -- the same way the streamed
``--check`` runs the artifact. The folder sits beside the artifact (not /tmp, which may be a tmpfs counted as
memory) and is deleted as soon as the session holds its mapping; it is named as the artifact writer's scratch, so
if the compile is killed while writing it, the next compile to that path removes it. Results are the same
numbers: the same graph, the same kernels.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
from tqdm import tqdm

from moeforge.core.artifact import make_scratch_dir
from moeforge.core.errors import MoeforgeError
from moeforge.core.ort_session import UNPACKED_WEIGHTS, make_session
from moeforge.model.tokenizer import Tokenizer
from moeforge.passes.base import PassContext

PAST_PREFIX = "past_key_values."


class CalibrationError(MoeforgeError):
    """The calibration file is missing, empty or unusable."""


def read_prompts(path: str | Path) -> list[str]:
    """Non-blank lines of ``path`` (UTF-8), one prompt each."""
    path = Path(path)
    if not path.is_file():
        raise CalibrationError(f"calibration file {path} does not exist; pass --calib FILE with one prompt per line")
    try:
        lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    except UnicodeDecodeError as exc:
        raise CalibrationError(f"calibration file {path} is not UTF-8 text ({exc.reason})") from None
    prompts = [line for line in lines if line]
    if not prompts:
        raise CalibrationError(f"calibration file {path} is empty; write one prompt per line")
    return prompts


def tokenize_prompts(prompts: list[str], tokenizer: Tokenizer | None, max_len: int) -> list[list[int]]:
    """Token ids per prompt (truncated to ``max_len``); prompts that encode to nothing are dropped."""
    if tokenizer is None:
        raise CalibrationError("the model ships no tokenizer, so text calibration prompts cannot be encoded")
    ids = [tokenizer.encode(p)[:max_len] for p in prompts]
    ids = [row for row in ids if row]
    if not ids:
        raise CalibrationError("no calibration prompt encodes to any token")
    return ids


class GraphRunner:
    """A graph in an ONNX Runtime session; ``overridable`` weights can be fed per run. ``artifact_dir``: write the
    graph to a scratch folder beside that artifact path and map its weights instead of serialising it in memory
    (see the module docstring)."""

    def __init__(self, model: ir.Model, extra_outputs: tuple[str, ...] = (),
                 overridable: tuple[str, ...] = (), threads: int | None = None,
                 artifact_dir: Path | None = None, progress: bool = False) -> None:
        self.extra_outputs = extra_outputs
        if artifact_dir is None:
            proto = self._edit(ir.serde.serialize_model(model), extra_outputs, overridable)
            # errors only (make_session): overridable initializers are intended, no warning per weight. Prepacking
            # off in both cases: packed and unpacked MatMuls round differently, and a streamed compile must
            # calibrate to the in-memory one's numbers (one-shot runs gain little from prepacking anyway).
            self.session = make_session(None, graph=proto, threads=threads, session_config=UNPACKED_WEIGHTS,
                                        providers=["CPUExecutionProvider"])
        else:
            _check_disk(model, artifact_dir.parent)
            folder = make_scratch_dir(artifact_dir)
            try:
                path = folder / "model.onnx"
                _save_with_bar(model, path, progress)
                proto = self._edit(onnx.load(str(path), load_external_data=False), extra_outputs, overridable)
                self.session = make_session(path, graph=proto, threads=threads, session_config=UNPACKED_WEIGHTS,
                                            providers=["CPUExecutionProvider"])
            finally:  # the session maps the data file; its pages stay valid once the name is gone
                shutil.rmtree(folder, ignore_errors=True)
        self.inputs = {i.name: i for i in self.session.get_inputs()}

    @staticmethod
    def _edit(proto: onnx.ModelProto, extra_outputs: tuple[str, ...],
              overridable: tuple[str, ...]) -> onnx.ModelProto:
        """``proto`` returning ``extra_outputs`` too, with the ``overridable`` initializers also graph inputs."""
        existing = {o.name for o in proto.graph.output}
        for name in extra_outputs:
            if name not in existing:
                proto.graph.output.append(_value_info(name))
        if overridable:
            # An initializer that is also a graph input takes a fed value over its stored one.
            by_name = {init.name: init for init in proto.graph.initializer}
            for name in overridable:
                init = by_name[name]
                proto.graph.input.append(_tensor_info(name, init.data_type, list(init.dims)))
        return proto

    def run(self, ids: list[int], weights: dict[str, np.ndarray] | None = None,
            extras: tuple[str, ...] | None = None) -> list[np.ndarray]:
        """Prefill ``ids`` from an empty cache: [logits [S, V], *extras] (``extras``: a subset of the runner's
        extra outputs, in that order; default all of them)."""
        s = len(ids)
        feeds: dict[str, np.ndarray] = {
            "input_ids": np.array([ids], np.int64), "position_ids": np.arange(s, dtype=np.int64)[None],
            "attention_mask": np.ones((1, s), np.int64),
        }
        feeds = {k: v for k, v in feeds.items() if k in self.inputs}
        for name, arg in self.inputs.items():
            if name.startswith(PAST_PREFIX) and len(arg.shape) == 3:  # DeepSeek-V4 (v4_hybrid): [B, rows, w]
                _, rows, width = arg.shape
                feeds[name] = np.zeros((1, rows, width), np.float32)  # an empty cache: zero rows
            elif name.startswith(PAST_PREFIX):
                _, heads, _, dim = arg.shape
                feeds[name] = np.zeros((1, heads, s, dim), np.int8 if arg.type == "tensor(int8)" else np.float32)
        feeds.update(weights or {})
        outputs = self.session.run(["logits", *(self.extra_outputs if extras is None else extras)], feeds)
        return [outputs[0][0], *outputs[1:]]


def runner_options(ctx: PassContext | None) -> dict[str, Any]:
    """``GraphRunner`` keywords from a pass's context: where a streamed compile maps the graph from, and the bar."""
    if ctx is None:
        return {}
    return {"artifact_dir": ctx.artifact_dir, "progress": ctx.progress}


def _check_disk(model: ir.Model, folder: Path) -> None:
    """Refuse, before writing, a calibration graph that the disk beside the artifact cannot hold."""
    need = sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None)
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return  # the artifact writer reports an unusable folder
    if free < need:
        raise CalibrationError(f"calibration writes the graph's {need / 2**30:.1f} GiB of weights beside the artifact "
                               f"(the streamed compile maps them from disk), but {folder} has {free / 2**30:.1f} GiB "
                               "free; free space there or write the artifact to a larger disk")


def _save_with_bar(model: ir.Model, path: Path, progress: bool) -> None:
    """``ir.save`` with external data; a bar over the tensors written (each lazy weight is read and transformed
    now, which takes as long as writing the artifact)."""
    with tqdm(desc="calibration graph", unit="tensor", disable=not progress, leave=False, position=1) as bar:
        def advance(_tensor: ir.TensorProtocol, info: ir.external_data.CallbackInfo) -> None:
            bar.total = info.total
            bar.update()

        ir.save(model, path, external_data=path.name + ".data", callback=advance)


def _value_info(name: str) -> onnx.ValueInfoProto:
    return onnx.helper.make_empty_tensor_value_info(name)


def _tensor_info(name: str, elem_type: int, dims: list[int]) -> onnx.ValueInfoProto:
    return onnx.helper.make_tensor_value_info(name, elem_type, dims)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    out: np.ndarray = x - np.log(np.exp(x).sum(-1, keepdims=True))
    return out


def mean_kl(ref_logits: np.ndarray, logits: np.ndarray) -> float:
    """Mean over positions of KL(softmax(ref) || softmax(ours)); inputs [P, V]."""
    ref, ours = log_softmax(ref_logits), log_softmax(logits)
    return float((np.exp(ref) * (ref - ours)).sum(-1).mean())
