"""ONNX Runtime backend for paged artifacts (``moeforge compile --kv-cache paged``).

Per layer one preallocated block pool per buffer, [num_blocks, block_size, Hkv, D] (absorbed MLA: one
latent pool [num_blocks, block_size, 1, R+Dr]), wrapped as OrtValues without a copy and bound with
IOBinding as both the pool input and the pool output, so each step writes only its new tokens' slots.
One engine step is ONE session run: every row's new tokens are packed into T (prefill chunks and decodes
mixed), with the rows' block tables (from the engine's ``KVCacheManager``: prefix-cache blocks shared
between sequences are the same pool blocks), seq_lens and query_start_loc; ``logits_indices`` selects
each row's last token, so the vocabulary projection costs rows x V, not T x V.

The pools are the ones the artifact's ``manifest.kv_cache`` names, in its dtype (float32 or float16; the
session's inputs are cross-checked, ``kv_bindings.py``). Before a step writes the first
slot of a block, the backend zeroes that block: a freed block may hold anything (even NaN/inf from an
earlier request), and the attention core multiplies masked-out slots by probability 0, which keeps a NaN.
Block tables are padded with each row's own last block for the same reason.

The graph's ``moeforge::PagedAttention`` nodes are lowered for ONNX Runtime on load
(moeforge/ops/paged_attention/ort_lowering.py); the artifact itself also runs as is (its local function).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from moeforge.core.errors import ArtifactError
from moeforge.core.kv_layout import ARGMAX_ONLY, EXPERT_HITS, LOGITS_CERTIFIED, KVCacheSpec
from moeforge.core.ort_session import make_session
from moeforge.model.pipeline_stages import HIDDEN_INPUT, HIDDEN_OUTPUT
from moeforge.ops.paged_attention.ort_lowering import lower_for_ort
from moeforge.ops.sparse_mla.ort_lowering import lower_for_ort as lower_sparse_mla
from moeforge.runtime.backends.base import (
    DEFAULT_BACKEND_OPTIONS,
    ArgmaxHeadStats,
    BackendOptions,
    BlockLayout,
    ExpertActivity,
    PoolInfo,
    PoolShape,
    RowInput,
    StepInput,
    check_row_tokens,
)
from moeforge.runtime.backends.kv_bindings import cache_bindings, resident_zeros
from moeforge.runtime.backends.onnxruntime import (
    ExpertCounter,
    check_session,
    collectives_prepare,
    has_argmax_head,
    kernel_time_shares,
    run_certified,
)

# ONNX Runtime input type -> numpy dtype of a pool (bfloat16 has no numpy dtype to wrap zero-copy).
_POOL_DTYPES: dict[str, type[np.floating[Any]]] = {"tensor(float)": np.float32, "tensor(float16)": np.float16}


def pool_dtype(ort_type: str, name: str = "pool") -> type[np.floating]:
    """numpy dtype of a pool input whose ONNX Runtime type is ``ort_type`` (e.g. ``tensor(float16)``)."""
    dtype = _POOL_DTYPES.get(ort_type)
    if dtype is None:
        raise ValueError(f"{name}: pools of type {ort_type} are not supported by the ONNX Runtime paged backend "
                         f"(supported: {sorted(_POOL_DTYPES)})")
    return dtype


class BlockPools:
    """Zeroed block pools [num_blocks, Bs, Hkv, D] for a session's pool inputs, in the session's dtype,
    wrapped as OrtValues without a copy. ``aliases`` maps each pool input to the outputs bound to the same
    buffer (written in place)."""

    def __init__(self, session: ort.InferenceSession, aliases: dict[str, tuple[str, ...]], num_blocks: int) -> None:
        inputs = {i.name: i for i in session.get_inputs()}
        self.arrays: dict[str, np.ndarray] = {}
        self._values: list[tuple[str, tuple[str, ...], ort.OrtValue]] = []
        for name, outputs in aliases.items():
            spec = inputs[name]
            array = resident_zeros((num_blocks, *spec.shape[1:]), pool_dtype(spec.type, name))
            self.arrays[name] = array
            self._values.append((name, outputs, ort.OrtValue.ortvalue_from_numpy(array)))  # zero-copy

    def bind(self, io: ort.IOBinding) -> None:
        for name, outputs, value in self._values:
            io.bind_ortvalue_input(name, value)
            for output in outputs:
                io.bind_ortvalue_output(output, value)  # same buffer: new tokens written in place

    def zero_blocks(self, block_ids: Sequence[int]) -> None:
        """Clear whole blocks in every pool (writes into the bound buffers)."""
        if block_ids:
            index = np.asarray(block_ids, np.int64)
            for array in self.arrays.values():
                array[index] = 0

    def pointers(self) -> dict[str, int]:
        return {name: value.data_ptr() for name, _, value in self._values}

    # -- BlockIO (runtime/backends/base.py): whole blocks out of and into every pool, for the KV tiers --------

    def layout(self) -> BlockLayout:
        return BlockLayout(tuple(PoolShape(tuple(a.shape[1:]), a.dtype.name) for a in self.arrays.values()))

    def read(self, block_ids: Sequence[int]) -> list[list[np.ndarray]]:
        index = np.asarray(block_ids, np.int64)
        per_pool = [array[index] for array in self.arrays.values()]  # fancy indexing copies: [n, Bs, Hkv, D]
        return [[rows[i] for rows in per_pool] for i in range(len(block_ids))]

    def write(self, block_ids: Sequence[int], rows: Sequence[Sequence[np.ndarray]]) -> None:
        if len(rows) != len(block_ids):
            raise ValueError(f"{len(rows)} blocks of rows for {len(block_ids)} block ids")
        for position, array in enumerate(self.arrays.values()):
            for block_id, block in zip(block_ids, rows, strict=True):
                array[block_id] = block[position]  # in place: the bound OrtValue wraps this buffer


def packed_feeds(rows: Sequence[RowInput], *, all_logits: bool = False) -> dict[str, np.ndarray]:
    """The non-pool inputs of a paged graph for ``rows`` (each with its ``block_table``): their tokens packed
    into T, block tables [B, M] (a short table is padded with its own last block: masked, and never another
    sequence's data), seq_lens, query_start_loc, and ``logits_indices`` = each row's last ``num_logits`` tokens (or
    every token with ``all_logits``)."""
    counts = [len(r.token_ids) for r in rows]
    starts = np.zeros(len(rows) + 1, np.int32)
    starts[1:] = np.cumsum(counts)
    row_tables = [row.block_table or () for row in rows]
    tables = np.empty((len(rows), max(len(t) for t in row_tables)), np.int32)
    for b, table in enumerate(row_tables):
        tables[b, :len(table)] = table
        tables[b, len(table):] = table[-1]
    total = int(starts[-1])
    return {
        "input_ids": np.fromiter((t for r in rows for t in r.token_ids), np.int64, total),
        "position_ids": np.concatenate([np.arange(r.start, r.start + len(r.token_ids), dtype=np.int64) for r in rows]),
        "block_tables": tables,
        "seq_lens": np.array([r.start + len(r.token_ids) for r in rows], np.int32),
        "query_start_loc": starts,
        "logits_indices": np.arange(total, dtype=np.int64) if all_logits else last_positions(rows, starts),
    }


def last_positions(rows: Sequence[RowInput], starts: np.ndarray) -> np.ndarray:
    """[sum of num_logits] packed indices of each row's last ``num_logits`` tokens, in row then position order."""
    if all(row.num_logits == 1 for row in rows):
        return (starts[1:] - 1).astype(np.int64)
    return np.concatenate([np.arange(end - row.num_logits, end, dtype=np.int64)
                           for row, end in zip(rows, starts[1:].tolist(), strict=True)])


def _session(model_path: Path, *, threads: int | None, providers: list[str] | None, lower: bool = True,
             profile: bool = False, session_config: Sequence[tuple[str, str]] = (),
             collectives: bool = False, huge_pages: bool = False) -> ort.InferenceSession:
    """A session of a paged graph, its PagedAttention / SparseMLAPaged nodes lowered for ONNX Runtime unless ``lower``
    is False."""
    graph = None
    if lower:  # PagedAttention and SparseMLAPaged nodes -> standard ops ONNX Runtime runs (their ort_lowering.py)
        graph = lower_sparse_mla(lower_for_ort(onnx.load(str(model_path), load_external_data=False)))
    return make_session(model_path, graph=graph, threads=threads, providers=providers, profile=profile,
                        session_config=session_config, prepare=collectives_prepare(collectives),
                        huge_pages=huge_pages)


def _spec_pools(session: ort.InferenceSession, kv: KVCacheSpec, num_blocks: int, graph: str) -> BlockPools:
    """``num_blocks``-block pools for the pools ``kv`` names, after cross-checking ``kv`` with the session."""
    check_session(session, kv, graph)
    return BlockPools(session, {b.input_name: b.output_names for b in cache_bindings(kv)}, num_blocks)


def _block_size(kv: KVCacheSpec, model_path: str | Path) -> int:
    if kv.block_size is None:
        raise ArtifactError(f"{model_path} is not a paged artifact (its kv_cache has no block_size); compile with "
                            "--kv-cache paged, or run it with the contiguous ONNX Runtime backend")
    return kv.block_size


class PagedRunner:
    """Runs a paged session with its pools bound once: one IOBinding for the session's life, so a step binds only
    the few packed inputs and the logits buffer, with no Python work per layer. Logits land in a buffer the
    runner keeps (grown when a step has more rows) and are returned as a view of it."""

    def __init__(self, session: ort.InferenceSession, pools: BlockPools, experts: ExpertCounter | None = None) -> None:
        self.session = session
        self.io = session.io_binding()
        pools.bind(self.io)
        self.experts = experts  # count the routing of every packed token (all are real)
        logits = next((o for o in session.get_outputs() if o.name == "logits"), None)
        vocab = logits.shape[-1] if logits is not None else None
        # A pipeline stage (model/pipeline_stages.py): a later stage takes the hidden state instead of input_ids,
        # and a stage before the last returns every token's hidden state instead of logits.
        inputs = {i.name: i for i in session.get_inputs()}
        self.input_names = set(inputs)
        self.hidden_dtype = pool_dtype(inputs[HIDDEN_INPUT].type, HIDDEN_INPUT) if HIDDEN_INPUT in inputs else None
        self.returns_hidden = logits is None and any(o.name == HIDDEN_OUTPUT for o in session.get_outputs())
        self._vocab = vocab if isinstance(vocab, int) else None
        self._logits = np.empty((0, self._vocab or 0), np.float32)
        # The certified argmax head (moeforge/passes/argmax_head.py): see ``OrtSession.decode``. The flag is bound once
        # as an OrtValue (ONNX Runtime binds an input with a default only this way) and flipped in place.
        self.argmax_head = self._vocab is not None and has_argmax_head(session)
        self._flag = np.zeros((), bool)
        if self.argmax_head:
            self._flag_value = ort.OrtValue.ortvalue_from_numpy(self._flag)
            self.io.bind_ortvalue_input(ARGMAX_ONLY, self._flag_value)
        self._certified = np.ones((0, 1), bool)
        self.argmax_runs = 0
        self.argmax_reruns = 0

    def run(self, feeds: dict[str, np.ndarray], argmax_only: bool = False) -> np.ndarray:
        """One run on ``feeds`` (``packed_feeds``); logits [rows, V], valid until the next ``run``. ``argmax_only``
        (graphs with the argmax head): only each row's argmax is exact (``StepInput.argmax_only``)."""
        for name, array in feeds.items():
            if name in self.input_names:  # a stage before the last has no logits_indices
                self.io.bind_cpu_input(name, np.ascontiguousarray(array))
        if self.experts is not None:
            self.io.bind_output(EXPERT_HITS, "cpu")
        if self.returns_hidden:  # [T, H] of every token, for the next stage
            self.io.bind_output(HIDDEN_OUTPUT, "cpu")
            self.session.run_with_iobinding(self.io)
            outputs = self.io.get_outputs()
            self._count(outputs[-2] if self.experts is not None else None)
            hidden: np.ndarray = outputs[-1].numpy()
            return hidden
        if self._vocab is None:  # no static vocabulary to preallocate for: ONNX Runtime allocates
            self.io.bind_output("logits", "cpu")
            self.session.run_with_iobinding(self.io)
            outputs = self.io.get_outputs()  # binding order: pools, then the routing (if bound), logits last
            self._count(outputs[-2] if self.experts is not None else None)
            logits: np.ndarray = outputs[-1].numpy()
            return logits
        rows = len(feeds["logits_indices"])
        if self._logits.shape[0] < rows:
            self._logits = np.empty((max(rows, 2 * self._logits.shape[0]), self._vocab), np.float32)
        out = self._logits[:rows]
        self.io.bind_ortvalue_output("logits", ort.OrtValue.ortvalue_from_numpy(out))
        if self.argmax_head:
            if self._certified.shape[0] < rows:
                self._certified = np.ones((max(rows, 2 * self._certified.shape[0]), 1), bool)
            certified = self._certified[:rows]
            self.io.bind_ortvalue_output(LOGITS_CERTIFIED, ort.OrtValue.ortvalue_from_numpy(certified))
        if argmax_only and self.argmax_head:
            self.argmax_runs += 1
            self.argmax_reruns += run_certified(self.session, self.io, self._flag, certified)
        else:
            self._flag[()] = False
            self.session.run_with_iobinding(self.io)
        if self.experts is not None:  # the routing, bound before the logits (and the flag)
            self._count(self.io.get_outputs()[-3 if self.argmax_head else -2])
        return out

    def _count(self, hits: ort.OrtValue | None) -> None:
        if self.experts is not None and hits is not None:
            array = hits.numpy()  # [L, T, E]
            self.experts.add(array, np.ones(array.shape[1], bool))


class PagedOrtBackend:
    """The ``Backend`` of a paged artifact: block pools shared by all sequences, one run per step. The pools, their
    names, shape and dtype are the artifact's ``manifest.kv_cache`` (the session's inputs are cross-checked)."""

    def __init__(self, model_path: str | Path, *, kv_cache: KVCacheSpec, num_blocks: int, num_slots: int,
                 vocab_size: int, options: BackendOptions = DEFAULT_BACKEND_OPTIONS, lower: bool = True,
                 collectives: bool = False) -> None:
        """``options``: as ``OrtBackend``'s. ``lower``: PagedAttention / SparseMLAPaged nodes run as standard ops
        (their ort_lowering.py) rather than their local functions. ``collectives``: a sharded rank's graph."""
        self.block_size = _block_size(kv_cache, model_path)
        self.session = _session(Path(model_path), threads=options.threads, providers=list(options.providers) or None,
                                lower=lower, profile=options.profile, session_config=options.session_config,
                                collectives=collectives, huge_pages=options.huge_pages)
        self._pools = _spec_pools(self.session, kv_cache, num_blocks, str(model_path))
        self.pools = self._pools.arrays
        self._experts = ExpertCounter.for_session(self.session) if options.track_expert_load else None
        self._runner = PagedRunner(self.session, self._pools, self._experts)
        self._profiling = options.profile
        self.kv = kv_cache
        self.num_blocks = num_blocks
        self._num_slots, self._vocab = num_slots, vocab_size
        if kv_cache.layer_buffers is not None:  # DeepSeek-V4's rings hold each block's last rows: a rewind past a
            self.multi_logit_rows = False  # rejected draft would read overwritten ones

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
    def kv_pool(self) -> PoolInfo:
        return PoolInfo(num_blocks=self.num_blocks, block_size=self.block_size)

    @property
    def pool_bytes(self) -> int:
        """Bytes allocated for all pools (all layers)."""
        return sum(p.nbytes for p in self.pools.values())

    def block_io(self) -> BlockPools:
        """The pools as a ``BlockIO``: blocks copied out and in by the KV tiers (runtime/kv_tiers)."""
        return self._pools

    def pool_pointers(self) -> dict[str, int]:
        """data_ptr of each bound pool OrtValue (unchanged by runs when ORT writes in place)."""
        return self._pools.pointers()

    def release(self, slot: int) -> None:
        """Nothing to do: blocks belong to the engine's KVCacheManager."""

    def expert_load(self) -> np.ndarray | None:
        """Routed tokens per MoE layer and expert so far, [L_moe, E] (with ``track_expert_load``), else None."""
        return None if self._experts is None else self._experts.counts.copy()

    def expert_activity(self) -> ExpertActivity | None:
        """Distinct experts computed per run and MoE layer so far (with ``track_expert_load``), else None."""
        return None if self._experts is None else self._experts.activity()

    def argmax_head_stats(self) -> ArgmaxHeadStats | None:
        """The certified argmax head's runs and reruns so far; None when the graph has no such head."""
        runner = self._runner
        return ArgmaxHeadStats(runner.argmax_runs, runner.argmax_reruns) if runner.argmax_head else None

    def op_time_shares(self) -> dict[str, float] | None:
        """Share of kernel time per op type so far (needs ``profile=True``; ends profiling). The paged
        attention is lowered, so its index math, ScatterND and Gathers count under their own op types."""
        trace = self.end_profile()
        return None if trace is None else kernel_time_shares(trace)

    def end_profile(self) -> Path | None:
        """End profiling and return ONNX Runtime's JSON trace of the runs so far, for a per-node look (needs
        ``profile=True``; None otherwise or once ended)."""
        if not self._profiling:
            return None
        self._profiling = False
        return Path(self.session.end_profiling())

    multi_logit_rows = True  # rows may ask for num_logits > 1 (speculative verification); see ``Backend``

    def execute(self, step: StepInput) -> np.ndarray:
        """Run all rows in one packed step; logits [sum of num_logits, V] of each row's last ``num_logits`` tokens,
        valid until the next ``execute`` (a view of the runner's buffer: no copy per step)."""
        for row in step.rows:
            self._check(row)
        self._pools.zero_blocks(self._first_written_blocks(step.rows))
        return self._runner.run(packed_feeds(step.rows), step.argmax_only)

    def execute_stage(self, step: StepInput, hidden: np.ndarray | None) -> np.ndarray:
        """One pipeline stage's part of a step (``runtime/backends/pipeline.py``): ``hidden`` [T, H] is the previous
        stage's output for the step's packed tokens (None on stage 0, which reads the token ids). Returns this
        stage's output: every token's hidden state [T, H] on a stage before the last, else ``execute``'s logits."""
        for row in step.rows:
            self._check(row)
        feeds = packed_feeds(step.rows)
        runner = self._runner
        if (hidden is None) != (runner.hidden_dtype is None):
            raise ValueError("a pipeline stage after the first takes the previous stage's hidden state; stage 0 takes "
                             "token ids")
        if hidden is not None:
            assert runner.hidden_dtype is not None
            if hidden.shape[0] != len(feeds["input_ids"]):
                raise ValueError(f"the hidden state has {hidden.shape[0]} rows for {len(feeds['input_ids'])} tokens")
            # input_ids stay in the feeds: bound only where the stage's graph takes them (DeepSeek-V4's, for its
            # hash-routed layers), skipped by the runner elsewhere
            feeds[HIDDEN_INPUT] = hidden.astype(runner.hidden_dtype, copy=False)
        self._pools.zero_blocks(self._first_written_blocks(step.rows))
        return runner.run(feeds, step.argmax_only)

    def _first_written_blocks(self, rows: Sequence[RowInput]) -> list[int]:
        """Blocks whose slot 0 a row writes this step: new to their sequence, so their old content is stale."""
        size = self.block_size
        return [(row.block_table or ())[k] for row in rows  # _check made every table present
                for k in range(-(-row.start // size), (row.start + len(row.token_ids) - 1) // size + 1)]

    def _check(self, row: RowInput) -> None:
        if row.block_table is None:
            raise ValueError(f"slot {row.slot}: a paged backend needs the row's block table")
        check_row_tokens(row)
        total = row.start + len(row.token_ids)
        if total > self.max_seq_len:
            raise ValueError(f"slot {row.slot}: {total} tokens exceed max_seq_len {self.max_seq_len}")
        if len(row.block_table) * self.block_size < total:
            raise ValueError(f"slot {row.slot}: {len(row.block_table)} blocks of {self.block_size} cannot hold "
                             f"{total} tokens")
        if any(not 0 <= b < self.num_blocks for b in row.block_table):
            raise ValueError(f"slot {row.slot}: block ids must be in [0, {self.num_blocks})")


class PagedSequenceSession:
    """One sequence on a paged graph, with the ``OrtSession.forward`` signature (teacher-forced parity): its
    pools (as ``kv_cache`` names them) hold ``ceil(max_len / Bs)`` blocks and its block table is all of them."""

    def __init__(self, model_path: str | Path, max_len: int, *, kv_cache: KVCacheSpec,
                 threads: int | None = None, collectives: bool = False,
                 session_config: Sequence[tuple[str, str]] = ()) -> None:
        num_blocks = -(-max_len // _block_size(kv_cache, model_path))
        self.session = _session(Path(model_path), threads=threads, providers=None, collectives=collectives,
                                session_config=session_config)
        self._pools = _spec_pools(self.session, kv_cache, num_blocks, str(model_path))
        self.pools = self._pools.arrays
        self._runner = PagedRunner(self.session, self._pools)
        self.block_table = tuple(range(num_blocks))

    def forward(self, input_ids: np.ndarray, position_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        """input_ids/position_ids [1, S] (positions start .. start+S-1) -> logits [1, S, V] of every token."""
        ids = tuple(int(t) for t in np.asarray(input_ids).reshape(-1))
        row = RowInput(0, ids, int(np.asarray(position_ids).reshape(-1)[0]), self.block_table)
        return self._runner.run(packed_feeds([row], all_logits=True))[None].copy()  # callers keep each step's
