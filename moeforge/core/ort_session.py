"""The one place an ONNX Runtime session is made: session options from a service's settings, providers, huge pages,
profiling. Every layer that runs a graph (calibration, golden outputs, parity, the TensorRT lowering check, the
backends, benchmarks) asks ``make_session``; nothing else constructs ``ort.InferenceSession``."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import onnx
import onnxruntime as ort

from moeforge.core.huge_pages import session_memory_on_huge_pages

log = logging.getLogger(__name__)

# Rewrites a graph for a session before it is made (e.g. the sharded ranks' collectives): (model_path, graph or None,
# options, providers) -> the graph to load, or None to load model_path as it is.
PrepareSession = Callable[[str | Path, onnx.ModelProto | None, ort.SessionOptions, list[str]], onnx.ModelProto | None]


# ``session_config`` keys "options.<name>" set a SessionOptions attribute instead of a config entry: settings a
# service tunes that ONNX Runtime exposes only as attributes (measured in docs/performance.md, "The decode step").
OPTION_PREFIX = "options."
# One-shot sessions over weights larger than memory (a streamed compile's golden run and --check, parity --stream):
# prepacking copies every matrix into anonymous memory; unpacked, the weights stay in the mapped external-data file.
UNPACKED_WEIGHTS: tuple[tuple[str, str], ...] = (("session.disable_prepacking", "1"),)
_LEVEL = ort.GraphOptimizationLevel
_LEVELS = {"disable": _LEVEL.ORT_DISABLE_ALL, "basic": _LEVEL.ORT_ENABLE_BASIC, "extended": _LEVEL.ORT_ENABLE_EXTENDED,
           "all": _LEVEL.ORT_ENABLE_ALL}
_SWITCHES = {"0": False, "1": True}
SESSION_OPTIONS: dict[str, dict[str, Any]] = {
    "enable_mem_pattern": _SWITCHES, "enable_mem_reuse": _SWITCHES, "enable_cpu_mem_arena": _SWITCHES,
    "graph_optimization_level": _LEVELS,
}


def session_option(key: str, value: str) -> tuple[str, Any]:
    """(attribute, value) of an ``options.<name>`` session_config entry; ValueError naming the accepted ones."""
    name = key[len(OPTION_PREFIX):]
    accepted = SESSION_OPTIONS.get(name)
    if accepted is None:
        raise ValueError(f"session_config key {key!r}: the SessionOptions attributes that can be set are "
                         f"{', '.join(OPTION_PREFIX + n for n in SESSION_OPTIONS)}")
    if value not in accepted:
        raise ValueError(f"session_config {key}={value!r}: give one of {', '.join(map(repr, accepted))}")
    return name, accepted[value]


def make_session(model_path: str | Path | None, *, graph: onnx.ModelProto | None = None, threads: int | None = None,
                 providers: list[str] | None = None, optimize: bool = True, profile: bool = False,
                 session_config: Sequence[tuple[str, str]] = (), prepare: PrepareSession | None = None,
                 huge_pages: bool = False) -> ort.InferenceSession:
    """An ONNX Runtime session of the graph at ``model_path``, or of ``graph``: an edited in-memory copy whose
    external weights are still read next to ``model_path``. ``session_config``: ONNX Runtime session config
    entries (``session.intra_op.allow_spinning`` = "0", ``session.disable_prepacking`` = "1", ...), applied as
    given, and ``options.<attribute>`` entries for the SessionOptions attributes in ``SESSION_OPTIONS``
    (``options.enable_mem_pattern`` = "0", ``options.graph_optimization_level`` = "extended", ...);
    ``optimize=False`` disables graph optimisation whatever ``options.graph_optimization_level`` says.
    ``collectives``: the graph is one rank of a sharded artifact; on CPU its AllReduce / AllGather nodes run on
    torch.distributed (``moeforge/ops/collectives/ort.py``; the process group must be initialised). ``huge_pages``: the
    memory the session allocates (its prepacked weights) goes on transparent huge pages (``core/huge_pages.py``).
    Off here because it costs ~4 ms per MB at load and pays back only over many decode steps: one-shot sessions
    (golden logits, --check, parity) leave it off; the engine's backends turn it on (``EngineConfig.huge_pages``)."""
    options = ort.SessionOptions()
    # Errors only: ONNX Runtime warns at every load that an input with a default (``logits_to_keep``) is not
    # constant-folded, which is the point of it; its other warnings on these graphs are advice for exporters.
    options.log_severity_level = 3
    if threads:
        options.intra_op_num_threads = threads
    for key, value in session_config:
        if key.startswith(OPTION_PREFIX):
            setattr(options, *session_option(key, value))
        else:
            options.add_session_config_entry(key, value)
    if not optimize:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    folder = None
    if profile:
        options.enable_profiling = True
        folder = tempfile.mkdtemp(prefix="moeforge-profile-")
        options.profile_file_prefix = str(Path(folder) / "ort")
    if model_path is None and graph is None:
        raise ValueError("make_session needs a model path or a graph")
    if prepare is not None:
        assert model_path is not None, "prepare rewrites a graph read from model_path"
        graph = prepare(model_path, graph, options, providers or default_providers())
    source: str | bytes = str(model_path)
    if graph is not None:
        if model_path is not None:
            options.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                             str(Path(model_path).parent))
        source = graph.SerializeToString()
    try:
        with session_memory_on_huge_pages(huge_pages) as report:
            session = ort.InferenceSession(source, options, providers=providers or default_providers())
        log.debug("%s: huge pages %s", model_path, report)
    except BaseException:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
        raise
    if folder is not None:
        # The profile (megabytes per run) is read through end_profiling() while the session lives; its folder
        # goes with the session (or at interpreter exit), so profiled runs leave nothing in the temp dir.
        weakref.finalize(session, shutil.rmtree, folder, ignore_errors=True)
    return session


def default_providers() -> list[str]:
    """CPU, the embedded default. ``MOEFORGE_ORT_PROVIDERS=CUDAExecutionProvider,CPUExecutionProvider``
    selects others (the caches are host buffers, so a GPU provider copies them each step: correct,
    not fast; device-resident caches arrive with the TensorRT backend)."""
    chosen = [p for p in os.environ.get("MOEFORGE_ORT_PROVIDERS", "").split(",") if p]
    available = set(ort.get_available_providers())
    missing = [p for p in chosen if p not in available]
    if missing:
        raise ValueError(f"ONNX Runtime providers {missing} are not available here; available: {sorted(available)}")
    return chosen or ["CPUExecutionProvider"]
