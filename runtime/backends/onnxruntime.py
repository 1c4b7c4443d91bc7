"""ONNX Runtime backend: runs a compiled artifact's graph with its KV cache bound in place.

Cache buffers are preallocated numpy arrays [B, Hkv, L, D] wrapped as OrtValues without a copy
and bound with IOBinding as both the past input and the present output, so a decode step writes
the new token's keys/values into the buffer and copies nothing else. The buffers, their names and
dtype come from the artifact's ``manifest.kv_cache`` (``kv_bindings.py``; the session's inputs are
only cross-checked): for absorbed MLA one latent buffer is bound to the latent input and to both
present outputs. Also the session helpers both ONNX Runtime backends use (``make_session``,
``default_providers``, ``kernel_time_shares``).

Dimension letters: B batch, S new tokens, T tokens seen (past + S), L buffer length, V vocab.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import weakref
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from moeforge.errors import ArtifactError
from moeforge.kv_layout import KVCacheSpec
from moeforge.runtime.backends.contiguous import ContiguousBackend, SlotBatch
from moeforge.runtime.backends.kv_bindings import CacheBinding, GraphTensor, cache_bindings, check_graph

# ONNX Runtime type names -> numpy dtype names (the manifest's), for the types a KV cache can have.
ORT_DTYPES = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(bfloat16)": "bfloat16",
              "tensor(double)": "float64", "tensor(int8)": "int8", "tensor(uint8)": "uint8"}


def make_session(model_path: str | Path, *, graph: onnx.ModelProto | None = None, threads: int | None = None,
                 providers: list[str] | None = None, optimize: bool = True,
                 profile: bool = False) -> ort.InferenceSession:
    """An ONNX Runtime session of the graph at ``model_path``, or of ``graph``: an edited in-memory copy whose
    external weights are still read next to ``model_path``."""
    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    if not optimize:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    folder = None
    if profile:
        options.enable_profiling = True
        folder = tempfile.mkdtemp(prefix="moeforge-profile-")
        options.profile_file_prefix = str(Path(folder) / "ort")
    source: str | bytes = str(model_path)
    if graph is not None:
        options.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                         str(Path(model_path).parent))
        source = graph.SerializeToString()
    try:
        session = ort.InferenceSession(source, options, providers=providers or default_providers())
    except BaseException:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
        raise
    if folder is not None:
        # The profile (megabytes per run) is read through end_profiling() while the session lives; its folder
        # goes with the session (or at interpreter exit), so profiled runs leave nothing in the temp dir.
        weakref.finalize(session, shutil.rmtree, folder, ignore_errors=True)
    return session


def check_session(session: ort.InferenceSession, kv: KVCacheSpec, graph: str) -> None:
    """Cross-check ``kv`` against the session's inputs and outputs (``kv_bindings.check_graph``)."""
    inputs = {i.name: GraphTensor(ORT_DTYPES.get(i.type, i.type), tuple(i.shape)) for i in session.get_inputs()}
    check_graph(kv, inputs, {o.name for o in session.get_outputs()}, graph)


class OrtSession:
    """An artifact graph in an ONNX Runtime session, with in-place cache buffers bound as ``kv_cache`` names them.

    ``forward`` runs one step for a batch of right-padded rows and returns logits [B, S, V].
    """

    def __init__(self, model_path: str | Path, *, kv_cache: KVCacheSpec, threads: int | None = None,
                 providers: list[str] | None = None, optimize: bool = True, graph: onnx.ModelProto | None = None,
                 profile: bool = False) -> None:
        """``kv_cache``: the artifact's ``manifest.kv_cache`` (contiguous). ``graph``: an edited in-memory copy of
        the graph at ``model_path`` (its weights are still read from the external data next to ``model_path``)."""
        if kv_cache.paged:
            raise ArtifactError(f"{model_path} has paged KV pools (kv_cache.block_size {kv_cache.block_size}); "
                                "OrtSession binds contiguous caches: use onnxruntime_paged.PagedOrtBackend")
        self.model_path = Path(model_path)
        self.session = make_session(model_path, graph=graph, threads=threads, providers=providers, optimize=optimize,
                                    profile=profile)
        check_session(self.session, kv_cache, str(model_path))
        self.bindings: list[CacheBinding] = cache_bindings(kv_cache)
        self.input_names = {i.name for i in self.session.get_inputs()}
        self.buffers: list[np.ndarray] = []
        self._ort_values: list[ort.OrtValue] = []

    def allocate(self, batch: int, max_len: int) -> None:
        """(Re)allocate zeroed cache buffers [B, H, L, D] for ``batch`` rows of up to ``max_len`` tokens."""
        self.buffers = [np.zeros((batch, b.heads, max_len, b.head_dim), b.dtype) for b in self.bindings]
        self._ort_values = [ort.OrtValue.ortvalue_from_numpy(buf) for buf in self.buffers]  # zero-copy on CPU

    @property
    def capacity(self) -> int:
        return self.buffers[0].shape[2] if self.buffers else 0

    def forward(self, input_ids: np.ndarray, position_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        """input_ids/position_ids [B, S] int64, attention_mask [B, T] int64 -> logits [B, S, V] float32."""
        return self.forward_with_outputs(input_ids, position_ids, attention_mask)[0]

    def forward_with_outputs(
        self, input_ids: np.ndarray, position_ids: np.ndarray, attention_mask: np.ndarray,
        extra_outputs: tuple[str, ...] = (),
    ) -> list[np.ndarray]:
        """Like ``forward``, also returning the named extra graph outputs: [logits, *extras]."""
        if attention_mask.shape[1] > self.capacity:
            raise ValueError(f"{attention_mask.shape[1]} tokens exceed the cache capacity {self.capacity}")
        return self._run(self._ort_values, input_ids, position_ids, attention_mask, extra_outputs)

    def views(self, lo: int, hi: int) -> list[ort.OrtValue]:
        """OrtValues over rows lo..hi-1 of every cache buffer, without copying (C-contiguous slices)."""
        return [ort.OrtValue.ortvalue_from_numpy(buf[lo:hi]) for buf in self.buffers]

    def forward_on(self, values: list[ort.OrtValue], input_ids: np.ndarray, position_ids: np.ndarray,
                   attention_mask: np.ndarray) -> np.ndarray:
        """``forward`` with caches bound to ``values`` (e.g. ``views``); logits [B, S, V]."""
        return self._run(values, input_ids, position_ids, attention_mask, ())[0]

    def _run(self, values: list[ort.OrtValue], input_ids: np.ndarray, position_ids: np.ndarray,
             attention_mask: np.ndarray, extra_outputs: tuple[str, ...]) -> list[np.ndarray]:
        io = self.session.io_binding()
        feeds = {"input_ids": input_ids, "position_ids": position_ids, "attention_mask": attention_mask}
        for name, array in feeds.items():
            if name in self.input_names:
                io.bind_cpu_input(name, np.ascontiguousarray(array, dtype=np.int64))
        for binding, value in zip(self.bindings, values, strict=True):
            io.bind_ortvalue_input(binding.input_name, value)
            for output in binding.output_names:
                io.bind_ortvalue_output(output, value)  # same buffer: updated in place
        io.bind_output("logits", "cpu")
        for name in extra_outputs:
            io.bind_output(name, "cpu")
        self.session.run_with_iobinding(io)
        # Outputs come back in binding order: caches first, then logits and the extras.
        outputs = io.get_outputs()
        first = len(outputs) - 1 - len(extra_outputs)
        return [o.numpy() for o in outputs[first:]]


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


class OrtBackend(ContiguousBackend):
    """The ``Backend`` of an ONNX Runtime artifact with per-sequence contiguous caches (``contiguous.py``).

    Cache memory: per layer one buffer [num_slots, Hkv, L = max_seq_len, D]; a run binds its slot range as a
    zero-copy view [B, Hkv, L, D]. GroupQueryAttention's cost follows each row's real length.
    """

    def __init__(self, model_path: str | Path, *, kv_cache: KVCacheSpec, num_slots: int, max_seq_len: int,
                 vocab_size: int, threads: int | None = None, providers: list[str] | None = None,
                 profile: bool = False) -> None:
        super().__init__(kv_cache, num_slots=num_slots, max_seq_len=max_seq_len, vocab_size=vocab_size)
        self._session = OrtSession(model_path, kv_cache=kv_cache, threads=threads, providers=providers,
                                   profile=profile)
        self._profiling = profile
        self._session.allocate(num_slots, max_seq_len)

    def op_time_shares(self) -> dict[str, float] | None:
        """Share of kernel time per op type so far (needs ``profile=True``; ends profiling)."""
        if not self._profiling:
            return None
        self._profiling = False
        return kernel_time_shares(self._session.session.end_profiling())

    def _forward(self, batch: SlotBatch) -> np.ndarray:
        mask = (np.arange(int(batch.totals.max())) < batch.totals[:, None]).astype(np.int64)  # [B, T]
        values = self._session.views(batch.lo, batch.hi)
        return self._session.forward_on(values, batch.ids, batch.positions, mask)


def kernel_time_shares(profile_path: str | Path) -> dict[str, float]:
    """Share of kernel time per op type in an ONNX Runtime profile (JSON trace), largest first."""
    totals: Counter[str] = Counter()
    for event in json.loads(Path(profile_path).read_text()):
        if event.get("cat") == "Node" and event.get("name", "").endswith("_kernel_time"):
            totals[event["args"]["op_name"]] += event["dur"]
    grand = sum(totals.values()) or 1
    return {op: duration / grand for op, duration in totals.most_common()}
