"""ONNX Runtime backend for paged artifacts (``moeforge compile --kv-cache paged``).

Per layer one preallocated block pool per buffer, [num_blocks, block_size, Hkv, D] (absorbed MLA: one
latent pool [num_blocks, block_size, 1, R+Dr]), wrapped as OrtValues without a copy and bound with
IOBinding as both the pool input and the pool output, so each step writes only its new tokens' slots.
One engine step is ONE session run: every row's new tokens are packed into T (prefill chunks and decodes
mixed), with the rows' block tables (from the engine's ``KVCacheManager``: prefix-cache blocks shared
between sequences are the same pool blocks), seq_lens and query_start_loc; ``logits_indices`` selects
each row's last token, so the vocabulary projection costs rows x V, not T x V.

The graph's ``moeforge::PagedAttention`` nodes are lowered for ONNX Runtime on load
(plugins/paged_attention/ort_lowering.py); the artifact itself also runs as is (its local function).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from moeforge.artifact import KVCacheSpec
from moeforge.plugins.paged_attention.ort_lowering import lower_for_ort
from moeforge.runtime.backends.base import RowInput, StepInput
from moeforge.runtime.backends.onnxruntime import default_providers


class PagedOrtBackend:
    """The ``Backend`` of a paged artifact: block pools shared by all sequences, one run per step."""

    def __init__(self, model_path: str | Path, kv: KVCacheSpec, num_blocks: int, num_slots: int, vocab_size: int,
                 *, threads: int | None = None, providers: list[str] | None = None, lower: bool = True,
                 profile: bool = False) -> None:
        if kv.block_size is None:
            raise ValueError("PagedOrtBackend needs a paged artifact (compile with --kv-cache paged)")
        model_path = Path(model_path)
        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        if profile:
            import tempfile

            options.enable_profiling = True
            options.profile_file_prefix = str(Path(tempfile.mkdtemp(prefix="moeforge-profile-")) / "ort")
        self._profiling = profile
        source: str | bytes = str(model_path)
        if lower:
            proto = lower_for_ort(onnx.load(str(model_path), load_external_data=False))
            options.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                             str(model_path.parent))
            source = proto.SerializeToString()
        self.session = ort.InferenceSession(source, options, providers=providers or default_providers())
        self.kv = kv
        self.block_size = kv.block_size
        self.num_blocks = num_blocks
        self._num_slots, self._vocab = num_slots, vocab_size
        shapes = {i.name: i.shape for i in self.session.get_inputs()}
        self.pools: dict[str, np.ndarray] = {}
        self._bindings: list[tuple[str, tuple[str, ...], ort.OrtValue]] = []
        for inputs, outputs in zip(kv.past_input_names, kv.present_output_names, strict=True):
            for name in inputs:
                pool = np.zeros((num_blocks, *shapes[name][1:]), np.float32)
                self.pools[name] = pool
                aliases = tuple(o for o in outputs if o.split(".")[-1] == name.split(".")[-1])
                self._bindings.append((name, aliases, ort.OrtValue.ortvalue_from_numpy(pool)))  # zero-copy

    @property
    def num_slots(self) -> int:
        return self._num_slots

    @property
    def max_seq_len(self) -> int:
        return self.kv.max_seq_len

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def pool_bytes(self) -> int:
        """Bytes allocated for all pools (all layers)."""
        return sum(p.nbytes for p in self.pools.values())

    def pool_pointers(self) -> dict[str, int]:
        """data_ptr of each bound pool OrtValue (unchanged by runs when ORT writes in place)."""
        return {name: value.data_ptr() for name, _, value in self._bindings}

    def release(self, slot: int) -> None:
        """Nothing to do: blocks belong to the engine's KVCacheManager."""

    def op_time_shares(self) -> dict[str, float] | None:
        """Share of kernel time per op type so far (needs ``profile=True``; ends profiling). The paged
        attention is lowered, so its index math, ScatterND and Gathers count under their own op types."""
        if not self._profiling:
            return None
        import json
        from collections import Counter

        path = self.session.end_profiling()
        self._profiling = False
        totals: Counter[str] = Counter()
        for event in json.loads(Path(path).read_text()):
            if event.get("cat") == "Node" and event.get("name", "").endswith("_kernel_time"):
                totals[event["args"]["op_name"]] += event["dur"]
        grand = sum(totals.values()) or 1
        return {op: duration / grand for op, duration in totals.most_common()}

    def execute(self, step: StepInput) -> np.ndarray:
        """Run all rows in one packed step; logits [rows, V] of each row's last token."""
        rows = step.rows
        for row in rows:
            self._check(row)
        counts = [len(r.token_ids) for r in rows]
        starts = np.zeros(len(rows) + 1, np.int32)
        starts[1:] = np.cumsum(counts)
        width = max(len(r.block_table) for r in rows)  # type: ignore[arg-type]
        tables = np.zeros((len(rows), width), np.int32)  # padding: block 0, never read (masked)
        for b, row in enumerate(rows):
            tables[b, :len(row.block_table)] = row.block_table  # type: ignore[arg-type]
        feeds = {
            "input_ids": np.fromiter((t for r in rows for t in r.token_ids), np.int64, int(starts[-1])),
            "position_ids": np.concatenate([np.arange(r.start, r.start + len(r.token_ids)) for r in rows]),
            "block_tables": tables,
            "seq_lens": np.array([r.start + len(r.token_ids) for r in rows], np.int32),
            "query_start_loc": starts,
            "logits_indices": (starts[1:] - 1).astype(np.int64),
        }
        io = self.session.io_binding()
        for name, array in feeds.items():
            io.bind_cpu_input(name, np.ascontiguousarray(array))
        for name, outputs, value in self._bindings:
            io.bind_ortvalue_input(name, value)
            for output in outputs:
                io.bind_ortvalue_output(output, value)  # same buffer: new tokens written in place
        io.bind_output("logits", "cpu")
        self.session.run_with_iobinding(io)
        return io.get_outputs()[-1].numpy()  # binding order: pools first, logits last

    def _check(self, row: RowInput) -> None:
        if row.block_table is None:
            raise ValueError(f"slot {row.slot}: a paged backend needs the row's block table")
        if not row.token_ids:
            raise ValueError(f"slot {row.slot}: a row needs at least one token")
        total = row.start + len(row.token_ids)
        if total > self.max_seq_len:
            raise ValueError(f"slot {row.slot}: {total} tokens exceed max_seq_len {self.max_seq_len}")
        if len(row.block_table) * self.block_size < total:
            raise ValueError(f"slot {row.slot}: {len(row.block_table)} blocks of {self.block_size} cannot hold "
                             f"{total} tokens")
        if any(not 0 <= b < self.num_blocks for b in row.block_table):
            raise ValueError(f"slot {row.slot}: block ids must be in [0, {self.num_blocks})")


def is_paged_graph(model_path: str | Path) -> bool:
    """Whether the graph at ``model_path`` is a paged artifact's (it takes block tables)."""
    graph = onnx.load(str(model_path), load_external_data=False).graph
    return any(i.name == "block_tables" for i in graph.input)


class PagedSequenceSession:
    """One sequence on a paged graph, with the ``OrtSession.forward`` signature (teacher-forced parity):
    its pools hold ``ceil(max_len / Bs)`` blocks and its block table is all of them, in order."""

    def __init__(self, model_path: str | Path, max_len: int, threads: int | None = None) -> None:
        model_path = Path(model_path)
        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        options.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                         str(model_path.parent))
        proto = lower_for_ort(onnx.load(str(model_path), load_external_data=False))
        self.session = ort.InferenceSession(proto.SerializeToString(), options, providers=default_providers())
        pools = [i for i in self.session.get_inputs() if i.name.startswith("kv_pool.")]
        block_size = int(pools[0].shape[1])
        num_blocks = -(-max_len // block_size)
        self.pools = {i.name: np.zeros((num_blocks, *i.shape[1:]), np.float32) for i in pools}
        self.block_table = np.arange(num_blocks, dtype=np.int32)[None]

    def forward(self, input_ids: np.ndarray, position_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        """input_ids/position_ids [1, S] (positions start .. start+S-1) -> logits [1, S, V] of every token."""
        ids = np.asarray(input_ids, np.int64).reshape(-1)
        start, count = int(np.asarray(position_ids).reshape(-1)[0]), ids.shape[0]
        feeds = {"input_ids": ids, "position_ids": np.arange(start, start + count, dtype=np.int64),
                 "block_tables": self.block_table, "seq_lens": np.array([start + count], np.int32),
                 "query_start_loc": np.array([0, count], np.int32), "logits_indices": np.arange(count, dtype=np.int64)}
        io = self.session.io_binding()
        for name, array in feeds.items():
            io.bind_cpu_input(name, array)
        values = {name: ort.OrtValue.ortvalue_from_numpy(pool) for name, pool in self.pools.items()}
        for name, value in values.items():
            io.bind_ortvalue_input(name, value)
            io.bind_ortvalue_output(name.replace("kv_pool.", "kv_pool_out."), value)
        io.bind_output("logits", "cpu")
        self.session.run_with_iobinding(io)
        return io.get_outputs()[-1].numpy()[None]


def paged_golden_feeds(model_path: str | Path, prompt_ids: list[int]) -> dict[str, np.ndarray]:
    """Every input of a paged graph for one prefill of ``prompt_ids`` from zeroed pools (blocks 0..n-1 in
    order), projecting every token: logits [P, V]. The golden-output feeds of paged artifacts."""
    graph = onnx.load(str(model_path), load_external_data=False).graph
    pools = [i for i in graph.input if i.name.startswith("kv_pool.")]
    dims = [[d.dim_value for d in p.type.tensor_type.shape.dim] for p in pools]
    num_blocks = -(-len(prompt_ids) // dims[0][1])
    count = len(prompt_ids)
    feeds = {"input_ids": np.array(prompt_ids, np.int64), "position_ids": np.arange(count, dtype=np.int64),
             "block_tables": np.arange(num_blocks, dtype=np.int32)[None], "seq_lens": np.array([count], np.int32),
             "query_start_loc": np.array([0, count], np.int32), "logits_indices": np.arange(count, dtype=np.int64)}
    for pool, shape in zip(pools, dims, strict=True):
        feeds[pool.name] = np.zeros((num_blocks, *shape[1:]), np.float32)
    return feeds
