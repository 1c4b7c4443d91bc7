"""ONNX Runtime backend: runs a compiled artifact's graph with its KV cache bound in place.

Cache buffers are preallocated numpy arrays [B, Hkv, L, D] wrapped as OrtValues without a copy
and bound with IOBinding as both the past input and the present output, so a decode step writes
the new token's keys/values into the buffer and copies nothing else. For absorbed MLA one latent
buffer is bound to the latent input and to both present outputs.

Dimension letters: B batch, S new tokens, T tokens seen (past + S), L buffer length, V vocab.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from moeforge.runtime.backends.base import PoolInfo, RowInput, StepInput

PAST_PREFIX = "past_key_values."


@dataclass(frozen=True)
class CacheBinding:
    """One layer-cache buffer: the graph input it feeds and the outputs that alias it."""

    input_name: str
    output_names: tuple[str, ...]
    heads: int
    head_dim: int
    dtype: str = "float32"  # numpy name; "int8" for a quantised cache (--kv-quant int8)


def read_cache_bindings(model_path: str | Path) -> list[CacheBinding]:
    """Derive buffer bindings from the graph's inputs/outputs (past_key_values.{i}.{kind})."""
    proto = onnx.load(str(model_path), load_external_data=False)
    outputs = [o.name for o in proto.graph.output]
    bindings = []
    for value in proto.graph.input:
        if not value.name.startswith(PAST_PREFIX):
            continue
        _, layer, kind = value.name.split(".")
        dims = value.type.tensor_type.shape.dim
        stem = f"present.{layer}.{kind}"
        aliases = tuple(o for o in outputs if o == stem or o.startswith(stem + "_"))
        dtype = onnx.helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type)
        bindings.append(CacheBinding(value.name, aliases, dims[1].dim_value, dims[3].dim_value, np.dtype(dtype).name))
    return bindings


class OrtSession:
    """An artifact graph in an ONNX Runtime session, with in-place cache buffers.

    ``forward`` runs one step for a batch of right-padded rows and returns logits [B, S, V].
    """

    def __init__(self, model_path: str | Path, *, threads: int | None = None,
                 providers: list[str] | None = None, optimize: bool = True,
                 graph: onnx.ModelProto | None = None, profile: bool = False) -> None:
        """``graph``: an edited in-memory copy of the graph at ``model_path`` (its weights are still read
        from the external data next to ``model_path``)."""
        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        if not optimize:
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        if profile:
            import tempfile

            options.enable_profiling = True
            options.profile_file_prefix = str(Path(tempfile.mkdtemp(prefix="moeforge-profile-")) / "ort")
        self.model_path = Path(model_path)
        source: str | bytes = str(model_path)
        if graph is not None:
            options.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                             str(self.model_path.parent))
            source = graph.SerializeToString()
        self.session = ort.InferenceSession(source, options, providers=providers or default_providers())
        self.bindings = read_cache_bindings(model_path)
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



class OrtBackend:
    """The ``Backend`` of an ONNX Runtime artifact with per-sequence contiguous caches.

    Cache memory: per layer one buffer [num_slots, Hkv, L, D]; slot s is row s. A prefill chunk runs
    alone on its row (a zero-copy [1, Hkv, L, D] view); decode rows run together on the smallest
    contiguous range of rows that holds them. Rows in that range that have no work this step get a
    dummy token whose cache write lands at their next free position, which their own next real token
    overwrites, so they are unharmed. GroupQueryAttention's cost follows each row's real length.
    """

    def __init__(self, model_path: str | Path, num_slots: int, max_seq_len: int, vocab_size: int,
                 threads: int | None = None, providers: list[str] | None = None, profile: bool = False) -> None:
        self._session = OrtSession(model_path, threads=threads, providers=providers, profile=profile)
        self._profiling = profile
        self._num_slots, self._max_seq_len, self._vocab = num_slots, max_seq_len, vocab_size
        self._session.allocate(num_slots, max_seq_len)
        self.lengths = [0] * num_slots  # tokens held per slot: the cache's own bookkeeping

    @property
    def num_slots(self) -> int:
        return self._num_slots

    @property
    def max_seq_len(self) -> int:
        return self._max_seq_len

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def kv_pool(self) -> PoolInfo | None:
        """None: per-slot contiguous caches, no block pools."""
        return None

    def release(self, slot: int) -> None:
        self.lengths[slot] = 0

    def op_time_shares(self) -> dict[str, float] | None:
        """Share of kernel time per op type so far (needs ``profile=True``; ends profiling)."""
        if not self._profiling:
            return None
        path = self._session.session.end_profiling()
        self._profiling = False
        return kernel_time_shares(path)

    def execute(self, step: StepInput) -> np.ndarray:
        """Run prefill chunks one by one and all decodes together; logits [rows, V] of each last token."""
        out = np.empty((len(step.rows), self._vocab), np.float32)
        decodes = []
        for index, row in enumerate(step.rows):
            self._check(row)
            if len(row.token_ids) == 1:
                decodes.append((index, row))
                continue
            out[index] = self._run_rows(row.slot, row.slot + 1, {row.slot: row})[0, -1]
            self.lengths[row.slot] += len(row.token_ids)
        if decodes:
            lo = min(r.slot for _, r in decodes)
            hi = max(r.slot for _, r in decodes) + 1
            logits = self._run_rows(lo, hi, {r.slot: r for _, r in decodes})
            for index, row in decodes:
                out[index] = logits[row.slot - lo, -1]
                self.lengths[row.slot] += 1
        return out

    def _check(self, row: RowInput) -> None:
        if not 0 <= row.slot < self._num_slots:
            raise ValueError(f"slot {row.slot} is outside 0..{self._num_slots - 1}")
        if row.start != self.lengths[row.slot]:
            raise ValueError(f"slot {row.slot} holds {self.lengths[row.slot]} tokens, the row starts at {row.start}")
        if not row.token_ids:
            raise ValueError(f"slot {row.slot}: a row needs at least one token")
        if row.start + len(row.token_ids) > self._max_seq_len:
            raise ValueError(f"slot {row.slot}: {row.start + len(row.token_ids)} tokens exceed max_seq_len "
                             f"{self._max_seq_len}")

    def _run_rows(self, lo: int, hi: int, work: dict[int, RowInput]) -> np.ndarray:
        # Rows lo..hi-1 of every buffer, right-padded: ids/positions [B, S], mask [B, T].
        width = max(len(r.token_ids) for r in work.values())
        batch = hi - lo
        ids = np.zeros((batch, width), np.int64)
        positions = np.zeros((batch, width), np.int64)
        totals = []
        for b, slot in enumerate(range(lo, hi)):
            row = work.get(slot)
            start = self.lengths[slot]
            tokens = row.token_ids if row is not None else (0,)  # dummy: written at `start`, overwritten later
            ids[b, : len(tokens)] = tokens
            positions[b] = np.arange(start, start + width)
            totals.append(start + len(tokens))
        mask = np.zeros((batch, max(totals)), np.int64)
        for b, total in enumerate(totals):
            mask[b, :total] = 1
        values = self._session.views(lo, hi)
        return self._session.forward_on(values, ids, positions, mask)


def kernel_time_shares(profile_path: str | Path) -> dict[str, float]:
    """Share of kernel time per op type in an ONNX Runtime profile (JSON trace), largest first."""
    import json
    from collections import Counter

    totals: Counter[str] = Counter()
    for event in json.loads(Path(profile_path).read_text()):
        if event.get("cat") == "Node" and event.get("name", "").endswith("_kernel_time"):
            totals[event["args"]["op_name"]] += event["dur"]
    grand = sum(totals.values()) or 1
    return {op: duration / grand for op, duration in totals.most_common()}
