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

PAST_PREFIX = "past_key_values."


@dataclass(frozen=True)
class CacheBinding:
    """One layer-cache buffer: the graph input it feeds and the outputs that alias it."""

    input_name: str
    output_names: tuple[str, ...]
    heads: int
    head_dim: int


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
        bindings.append(CacheBinding(value.name, aliases, dims[1].dim_value, dims[3].dim_value))
    return bindings


class OrtSession:
    """An artifact graph in an ONNX Runtime session, with in-place cache buffers.

    ``forward`` runs one step for a batch of right-padded rows and returns logits [B, S, V].
    """

    def __init__(self, model_path: str | Path, *, threads: int | None = None,
                 providers: list[str] | None = None, optimize: bool = True,
                 graph: onnx.ModelProto | None = None) -> None:
        """``graph``: an edited in-memory copy of the graph at ``model_path`` (its weights are still read
        from the external data next to ``model_path``)."""
        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        if not optimize:
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        self.model_path = Path(model_path)
        source: str | bytes = str(model_path)
        if graph is not None:
            options.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                             str(self.model_path.parent))
            source = graph.SerializeToString()
        self.session = ort.InferenceSession(source, options, providers=providers or ["CPUExecutionProvider"])
        self.bindings = read_cache_bindings(model_path)
        self.input_names = {i.name for i in self.session.get_inputs()}
        self.dtype = np.float32
        self.buffers: list[np.ndarray] = []
        self._ort_values: list[ort.OrtValue] = []

    def allocate(self, batch: int, max_len: int) -> None:
        """(Re)allocate zeroed cache buffers [B, H, L, D] for ``batch`` rows of up to ``max_len`` tokens."""
        self.buffers = [np.zeros((batch, b.heads, max_len, b.head_dim), self.dtype) for b in self.bindings]
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
        io = self.session.io_binding()
        feeds = {"input_ids": input_ids, "position_ids": position_ids, "attention_mask": attention_mask}
        for name, array in feeds.items():
            if name in self.input_names:
                io.bind_cpu_input(name, np.ascontiguousarray(array, dtype=np.int64))
        for binding, value in zip(self.bindings, self._ort_values, strict=True):
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


def default_threads() -> int:
    return max(1, os.cpu_count() or 1)
