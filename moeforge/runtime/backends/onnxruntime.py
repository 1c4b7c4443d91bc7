"""ONNX Runtime backend: runs a compiled artifact's graph with its KV cache bound in place.

Cache buffers are preallocated numpy arrays [B, Hkv, L, D] wrapped as OrtValues without a copy
and bound with IOBinding as both the past input and the present output, so a decode step writes
the new token's keys/values into the buffer and copies nothing else. The buffers, their names and
dtype come from the artifact's ``manifest.kv_cache`` (``kv_bindings.py``; the session's inputs are
only cross-checked): for absorbed MLA one latent buffer is bound to the latent input and to both
present outputs. Sessions come from ``core/ort_session.py``; ``kernel_time_shares`` reads a profiled session.

Dimension letters: B batch, S new tokens, T tokens seen (past + S), L buffer length, V vocab.
"""

from __future__ import annotations

import json
import logging
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from moeforge.core.errors import ArtifactError
from moeforge.core.kv_layout import ARGMAX_ONLY, EXPERT_HITS, LOGITS_CERTIFIED, LOGITS_TO_KEEP, KVCacheSpec
from moeforge.core.ort_session import PrepareSession, make_session
from moeforge.ops.sparse_mla.ort_lowering import lower_for_ort as lower_sparse_mla
from moeforge.runtime.backends.base import (
    DEFAULT_BACKEND_OPTIONS,
    ArgmaxHeadStats,
    BackendOptions,
    ExpertActivity,
    RowInput,
)
from moeforge.runtime.backends.contiguous import ContiguousBackend, SlotBatch
from moeforge.runtime.backends.kv_bindings import (
    CacheBinding,
    GraphTensor,
    cache_bindings,
    check_graph,
    resident_zeros,
)

log = logging.getLogger(__name__)

# ONNX Runtime type names -> numpy dtype names (the manifest's), for the types a KV cache can have.
ORT_DTYPES = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(bfloat16)": "bfloat16",
              "tensor(double)": "float64", "tensor(int8)": "int8", "tensor(uint8)": "uint8"}


def check_session(session: ort.InferenceSession, kv: KVCacheSpec, graph: str) -> None:
    """Cross-check ``kv`` against the session's inputs and outputs (``kv_bindings.check_graph``)."""
    inputs = {i.name: GraphTensor(ORT_DTYPES.get(i.type, i.type), tuple(i.shape)) for i in session.get_inputs()}
    check_graph(kv, inputs, {o.name for o in session.get_outputs()}, graph)


@dataclass
class DecodeBinding:
    """A reusable IOBinding for decode runs (one new token per row; W of them for a speculative verification run)
    on cache rows lo..hi-1.

    Everything but the attention mask is bound once: the cache views (as past inputs and present outputs), the
    ids and positions arrays (refilled in place each step) and the logits buffer. A steady-state decode step
    then does no Python work per layer and allocates nothing the size of the vocabulary.
    """

    io: ort.IOBinding
    ids: np.ndarray  # [B, W] int64, bound as input_ids
    positions: np.ndarray  # [B, W] int64, bound as position_ids (when the graph has it)
    ones: np.ndarray  # [L] int64 ones: batch 1's attention mask [1, T] is a view of its first T
    logits: np.ndarray  # [B, W, V] float32, bound as the logits output (overwritten by the next run)
    values: list[ort.OrtValue]  # the cache views, kept alive with the binding
    mask: np.ndarray  # [B * L] int64: batch > 1's attention mask [B, T] is a view of its first B * T
    arange: np.ndarray  # [L] int64 0..L-1, compared with each row's total to fill ``mask``
    argmax_only: np.ndarray | None = None  # [] bool bound as ``argmax_only`` (graphs with the argmax head)
    certified: np.ndarray | None = None  # [B, W, 1] bool bound as ``logits_certified``


class OrtSession:
    """An artifact graph in an ONNX Runtime session, with in-place cache buffers bound as ``kv_cache`` names them.

    ``forward`` runs one step for a batch of right-padded rows and returns logits [B, S, V]; ``decode`` runs one
    token per row on a range of cache rows through a cached ``DecodeBinding`` (the serving hot path).
    """

    MAX_DECODE_BINDINGS = 64  # slot ranges whose bindings are kept (least recently used dropped first)

    def __init__(self, model_path: str | Path, *, kv_cache: KVCacheSpec, threads: int | None = None,
                 providers: list[str] | None = None, optimize: bool = True, graph: onnx.ModelProto | None = None,
                 profile: bool = False, session_config: Sequence[tuple[str, str]] = (),
                 collectives: bool = False, lower: bool = True, huge_pages: bool = False) -> None:
        """``kv_cache``: the artifact's ``manifest.kv_cache`` (contiguous). ``graph``: an edited in-memory copy of
        the graph at ``model_path`` (its weights are still read from the external data next to ``model_path``).
        ``collectives``: a sharded rank's graph (``collectives_prepare``). ``lower``: run SparseMLA nodes
        (DeepSeek-V3.2) through ops/sparse_mla/ort_lowering.py rather than their local function.
        ``huge_pages``: see ``make_session``."""
        if kv_cache.paged:
            raise ArtifactError(f"{model_path} has paged KV pools (kv_cache.block_size {kv_cache.block_size}); "
                                "OrtSession binds contiguous caches: use onnxruntime_paged.PagedOrtBackend")
        self.model_path = Path(model_path)
        if kv_cache.layout == "mla_dsa" and lower:  # DSA: SparseMLACache nodes -> standard ops (ort_lowering.py)
            source = graph if graph is not None else onnx.load(str(model_path), load_external_data=False)
            graph = lower_sparse_mla(source)
        self.session = make_session(model_path, graph=graph, threads=threads, providers=providers, optimize=optimize,
                                    profile=profile, session_config=session_config,
                                    prepare=collectives_prepare(collectives),
                                    huge_pages=huge_pages)
        check_session(self.session, kv_cache, str(model_path))
        self.bindings: list[CacheBinding] = cache_bindings(kv_cache)
        # Overridable initializers are inputs with a default (``logits_to_keep``): fed only when wanted.
        self.input_names = {i.name for i in (*self.session.get_inputs(), *self.session.get_overridable_initializers())}
        self.buffers: list[np.ndarray] = []
        self._ort_values: list[ort.OrtValue] = []
        self._decode_bindings: OrderedDict[tuple[int, int, int], DecodeBinding] = OrderedDict()
        # MoE graphs' routing output, fetched after each run when expert load is tracked (see ExpertCounter).
        self.expert_hits: np.ndarray | None = None
        self.track_experts = False
        logits = next((o for o in self.session.get_outputs() if o.name == "logits"), None)
        self.vocab_size = logits.shape[-1] if logits is not None and isinstance(logits.shape[-1], int) else None
        # The certified argmax head (moeforge/passes/argmax_head.py): decode runs whose rows are all plain greedy feed
        # ``argmax_only``; a run with a row it cannot certify runs again on the float head (counted in reruns).
        self.argmax_head = has_argmax_head(self.session)
        self.argmax_runs = 0
        self.argmax_reruns = 0

    def allocate(self, batch: int, max_len: int) -> None:
        """(Re)allocate zeroed cache buffers [B, H, L, D] for ``batch`` rows of up to ``max_len`` tokens."""
        self.buffers = [resident_zeros(b.contiguous_shape(batch, max_len), b.dtype) for b in self.bindings]
        self._capacity = max_len
        self._ort_values = [ort.OrtValue.ortvalue_from_numpy(buf) for buf in self.buffers]  # zero-copy on CPU
        self._decode_bindings.clear()  # they bound the old buffers

    def decode_binding(self, lo: int, hi: int, width: int = 1) -> DecodeBinding:
        """The ``DecodeBinding`` of cache rows lo..hi-1 and ``width`` new tokens per row, made on first use and kept
        (``MAX_DECODE_BINDINGS``)."""
        key = (lo, hi, width)
        found = self._decode_bindings.get(key)
        if found is not None:
            self._decode_bindings.move_to_end(key)
            return found
        if self.vocab_size is None:
            raise ArtifactError(f"{self.model_path}: the logits output has no static vocabulary size to bind")
        batch = hi - lo
        io = self.session.io_binding()
        ids, positions = np.zeros((batch, width), np.int64), np.zeros((batch, width), np.int64)
        logits = np.empty((batch, width, self.vocab_size), np.float32)
        values = self.views(lo, hi)
        io.bind_ortvalue_input("input_ids", ort.OrtValue.ortvalue_from_numpy(ids))
        if "position_ids" in self.input_names:
            io.bind_ortvalue_input("position_ids", ort.OrtValue.ortvalue_from_numpy(positions))
        for binding, value in zip(self.bindings, values, strict=True):
            io.bind_ortvalue_input(binding.input_name, value)
            for output in binding.output_names:
                io.bind_ortvalue_output(output, value)  # same buffer: updated in place
        io.bind_ortvalue_output("logits", ort.OrtValue.ortvalue_from_numpy(logits))
        argmax_only = certified = None
        if self.argmax_head:  # both bound once; the flag is flipped in place per run
            argmax_only, certified = np.zeros((), bool), np.ones((batch, width, 1), bool)
            io.bind_ortvalue_input(ARGMAX_ONLY, ort.OrtValue.ortvalue_from_numpy(argmax_only))
            io.bind_ortvalue_output(LOGITS_CERTIFIED, ort.OrtValue.ortvalue_from_numpy(certified))
        if self.track_experts:
            io.bind_output(EXPERT_HITS, "cpu")  # bound last: the last of get_outputs()
        made = DecodeBinding(io, ids, positions, np.ones(self.capacity, np.int64), logits, values,
                             np.empty(batch * self.capacity, np.int64), np.arange(self.capacity), argmax_only,
                             certified)
        self._decode_bindings[key] = made
        if len(self._decode_bindings) > self.MAX_DECODE_BINDINGS:
            self._decode_bindings.popitem(last=False)
        return made

    def decode(self, lo: int, hi: int, ids: Sequence[int] | np.ndarray, positions: Sequence[int] | np.ndarray,
               totals: Sequence[int] | np.ndarray, argmax_only: bool = False) -> np.ndarray:
        """One token per cache row lo..hi-1: ids/positions [B] (lists or int64 arrays), totals [B] tokens each row
        attends to (its past + 1). Returns logits [B, 1, V], a view the next ``decode`` on this range overwrites.
        ``argmax_only`` (graphs with the argmax head): only each row's argmax of the result is exact.

        The steady decode step runs here right after the previous step's kernels have swept the caches, when every
        distinct numpy routine costs tens of microseconds: so it makes as few calls as it can (two buffer fills,
        one mask view or comparison, one bind) and allocates nothing."""
        bound = self.decode_binding(lo, hi)
        bound.ids[:, 0] = ids
        bound.positions[:, 0] = positions
        if isinstance(totals, np.ndarray):
            totals = totals.tolist()
        width = max(totals)
        if width > self.capacity:
            raise ValueError(f"{width} tokens exceed the cache capacity {self.capacity}")
        if "attention_mask" in self.input_names:
            if len(totals) == 1:
                mask = bound.ones[:width].reshape(1, width)  # all ones: no work per step
            else:  # [B, T]: row b's first totals[b] ones, written into the binding's own buffer
                mask = bound.mask[:len(totals) * width].reshape(len(totals), width)
                np.less(bound.arange[:width], np.array(totals)[:, None], out=mask, casting="unsafe")
            bound.io.bind_cpu_input("attention_mask", mask)
        self._run_bound(bound, argmax_only)
        return bound.logits

    def verify(self, slot: int, ids: Sequence[int], start: int, argmax_only: bool = False) -> np.ndarray:
        """Every position's logits of one row of W = len(ids) tokens at positions start .. start+W-1 on cache row
        ``slot`` (a speculative verification run, through a cached ``DecodeBinding`` of width W): [W, V], a view
        the next run of this (slot, W) overwrites. ``argmax_only``: see ``decode``."""
        width = len(ids)
        total = start + width
        if total > self.capacity:
            raise ValueError(f"{total} tokens exceed the cache capacity {self.capacity}")
        bound = self.decode_binding(slot, slot + 1, width)
        bound.ids[0] = ids
        bound.positions[0] = bound.arange[start:total]
        if "attention_mask" in self.input_names:
            bound.io.bind_cpu_input("attention_mask", bound.ones[:total].reshape(1, total))
        self._run_bound(bound, argmax_only)
        logits: np.ndarray = bound.logits[0]
        return logits

    def _run_bound(self, bound: DecodeBinding, argmax_only: bool) -> None:
        """Run a filled ``DecodeBinding``: on the certified argmax head when ``argmax_only`` and the graph has one."""
        if argmax_only and bound.argmax_only is not None and bound.certified is not None:
            self.argmax_runs += 1
            self.argmax_reruns += run_certified(self.session, bound.io, bound.argmax_only, bound.certified)
        else:
            if bound.argmax_only is not None:
                bound.argmax_only[()] = False
            self.session.run_with_iobinding(bound.io)
        if self.track_experts:
            self.expert_hits = bound.io.get_outputs()[-1].numpy()

    @property
    def capacity(self) -> int:
        return self._capacity if self.buffers else 0

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
                   attention_mask: np.ndarray, *, last_only: bool = False) -> np.ndarray:
        """``forward`` with caches bound to ``values`` (e.g. ``views``); logits [B, S, V], or with ``last_only``
        [B, 1, V] of each row's last position where the graph has a ``logits_to_keep`` input (else [B, S, V])."""
        return self._run(values, input_ids, position_ids, attention_mask, (), last_only=last_only)[0]

    def _run(self, values: list[ort.OrtValue], input_ids: np.ndarray, position_ids: np.ndarray,
             attention_mask: np.ndarray, extra_outputs: tuple[str, ...], *, last_only: bool = False
             ) -> list[np.ndarray]:
        io = self.session.io_binding()
        feeds = {"input_ids": input_ids, "position_ids": position_ids, "attention_mask": attention_mask}
        if last_only:
            feeds[LOGITS_TO_KEEP] = np.ones(1, np.int64)
        for name, array in feeds.items():
            if name in self.input_names:
                # An OrtValue, not bind_cpu_input: ONNX Runtime binds an input with a default (logits_to_keep)
                # only this way.
                io.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array, np.int64)))
        for binding, value in zip(self.bindings, values, strict=True):
            io.bind_ortvalue_input(binding.input_name, value)
            for output in binding.output_names:
                io.bind_ortvalue_output(output, value)  # same buffer: updated in place
        io.bind_output("logits", "cpu")
        for name in extra_outputs:
            io.bind_output(name, "cpu")
        if self.track_experts:
            io.bind_output(EXPERT_HITS, "cpu")
        self.session.run_with_iobinding(io)
        # Outputs come back in binding order: caches first, then logits, the extras and the routing.
        outputs = io.get_outputs()
        if self.track_experts:
            self.expert_hits = outputs[-1].numpy()
            outputs = outputs[:-1]
        first = len(outputs) - 1 - len(extra_outputs)
        return [o.numpy() for o in outputs[first:]]


def collectives_prepare(collectives: bool) -> PrepareSession | None:
    """The session rewrite of a sharded rank's graph (its AllReduce / AllGather nodes run on torch.distributed on
    CPU, ``ops/collectives/ort.py``; the process group must be initialised), or None for an ordinary graph."""
    if not collectives:
        return None
    # lazy: torch.distributed and onnxruntime-extensions cost seconds of start-up, needed by sharded ranks only
    from moeforge.ops.collectives.ort import prepare_session

    return prepare_session


class OrtBackend(ContiguousBackend):
    """The ``Backend`` of an ONNX Runtime artifact with per-sequence contiguous caches (``contiguous.py``).

    Cache memory: per layer one buffer [num_slots, Hkv, L = max_seq_len, D]; a run binds its slot range as a
    zero-copy view [B, Hkv, L, D]. GroupQueryAttention's cost follows each row's real length.
    """

    def __init__(self, model_path: str | Path, *, kv_cache: KVCacheSpec, num_slots: int, max_seq_len: int,
                 vocab_size: int, options: BackendOptions = DEFAULT_BACKEND_OPTIONS, collectives: bool = False) -> None:
        """``options``: threads, providers, session settings, expert counting, profiling, huge pages.
        ``collectives``: the artifact is one rank of a sharded artifact (``collectives_prepare``)."""
        super().__init__(kv_cache, num_slots=num_slots, max_seq_len=max_seq_len, vocab_size=vocab_size)
        self._session = OrtSession(model_path, kv_cache=kv_cache, threads=options.threads,
                                   providers=list(options.providers) or None, profile=options.profile,
                                   session_config=options.session_config, collectives=collectives,
                                   huge_pages=options.huge_pages)
        self._experts = ExpertCounter.for_session(self._session.session) if options.track_expert_load else None
        self._session.track_experts = self._experts is not None
        self._profiling = options.profile
        self._session.allocate(num_slots, max_seq_len)

    def op_time_shares(self) -> dict[str, float] | None:
        """Share of kernel time per op type so far (needs ``profile=True``; ends profiling)."""
        trace = self.end_profile()
        return None if trace is None else kernel_time_shares(trace)

    def end_profile(self) -> Path | None:
        """End profiling and return ONNX Runtime's JSON trace of the runs so far, for a per-node look (needs
        ``profile=True``; None otherwise or once ended)."""
        if not self._profiling:
            return None
        self._profiling = False
        return Path(self._session.session.end_profiling())

    def expert_load(self) -> np.ndarray | None:
        return None if self._experts is None else self._experts.counts.copy()

    def expert_activity(self) -> ExpertActivity | None:
        """Distinct experts computed per run and MoE layer so far (with ``track_expert_load``), else None."""
        return None if self._experts is None else self._experts.activity()

    def argmax_head_stats(self) -> ArgmaxHeadStats | None:
        """The certified argmax head's runs and reruns so far; None when the graph has no such head."""
        session = self._session
        return ArgmaxHeadStats(session.argmax_runs, session.argmax_reruns) if session.argmax_head else None

    def _decode(self, lo: int, hi: int, tokens: list[int], argmax_only: bool = False) -> np.ndarray:
        if self._experts is not None:  # expert counting reads the run's rows: the general path
            return super()._decode(lo, hi, tokens)
        past = self.lengths[lo:hi]
        return self._session.decode(lo, hi, tokens, past, [p + 1 for p in past], argmax_only)[:, -1]

    def _verify(self, row: RowInput, argmax_only: bool = False) -> np.ndarray:
        if self._experts is not None:  # expert counting reads the run's rows: the general path
            return super()._verify(row, argmax_only)
        logits = self._session.verify(row.slot, row.token_ids, row.start, argmax_only)
        return logits[len(row.token_ids) - row.num_logits:]

    def _forward(self, batch: SlotBatch) -> np.ndarray:
        if batch.ids.shape[1] == 1:  # a decode run: the cached binding of this slot range
            logits = self._session.decode(batch.lo, batch.hi, batch.ids[:, 0], batch.positions[:, 0], batch.totals)
        else:
            mask = (np.arange(int(batch.totals.max())) < batch.totals[:, None]).astype(np.int64)  # [B, T]
            values = self._session.views(batch.lo, batch.hi)
            # A prefill run (one row) needs only its last token's logits: the graph then projects one row, not S.
            last_only = (batch.hi - batch.lo == 1 or batch.last_only) and not batch.all_logits
            logits = self._session.forward_on(values, batch.ids, batch.positions, mask, last_only=last_only)
        if self._experts is not None and self._session.expert_hits is not None:
            rows = batch.real if batch.real is not None else np.ones(len(batch.ids), bool)
            self._experts.add(self._session.expert_hits, np.repeat(rows, batch.ids.shape[1]))
        return logits


class ExpertCounter:
    """Routed tokens per MoE layer and expert, [L_moe, E] int64, summed from the graph's ``expert_hits`` output
    (moeforge/passes/expert_load.py) over the tokens that are real: a backend passes which rows of T those are."""

    def __init__(self, layers: int, experts: int) -> None:
        self.counts = np.zeros((layers, experts), np.int64)
        # Distinct experts each run computed, summed over runs, [L_moe] (the union over the run's tokens: what a
        # sparse MoE kernel reads), and the runs counted: the memory roofline's active-expert bytes.
        self.active = np.zeros(layers, np.int64)
        self.runs = 0

    @classmethod
    def for_session(cls, session: ort.InferenceSession) -> ExpertCounter | None:
        """A counter shaped by the session's ``expert_hits`` output [L, T, E]; None when the graph has none."""
        found = next((o for o in session.get_outputs() if o.name == EXPERT_HITS), None)
        if found is None:
            return None
        layers, experts = found.shape[0], found.shape[-1]
        if not isinstance(layers, int) or not isinstance(experts, int):
            raise ArtifactError(f"{EXPERT_HITS} has shape {found.shape}: its layer and expert dims must be static")
        return cls(layers, experts)

    def add(self, hits: np.ndarray, real: np.ndarray) -> None:
        """hits [L, T, E] bool; real [T] bool, the tokens to count."""
        counted = hits[:, real]  # [L, T_real, E]
        self.counts += counted.sum(axis=1, dtype=np.int64)
        self.active += counted.any(axis=1).sum(axis=-1, dtype=np.int64)
        self.runs += 1

    def activity(self) -> ExpertActivity:
        """The distinct experts computed per layer, summed over the runs so far, and how many runs."""
        return ExpertActivity(self.active.copy(), self.runs)


def has_argmax_head(session: ort.InferenceSession) -> bool:
    """Whether the session's graph has the certified argmax head (moeforge/passes/argmax_head.py): the optional
    ``argmax_only`` input and the ``logits_certified`` output."""
    inputs = {i.name for i in (*session.get_inputs(), *session.get_overridable_initializers())}
    return ARGMAX_ONLY in inputs and LOGITS_CERTIFIED in {o.name for o in session.get_outputs()}


def run_certified(session: ort.InferenceSession, io: ort.IOBinding, flag: np.ndarray, certified: np.ndarray) -> bool:
    """Run ``io`` with its bound ``argmax_only`` buffer ``flag`` ([] bool) set. Where a row of its bound
    ``logits_certified`` buffer ``certified`` is false, run it again on the float head (flag cleared): the cache
    writes repeat the first run's, at the same positions. True when it ran twice."""
    flag[()] = True
    session.run_with_iobinding(io)
    if certified.all():
        return False
    flag[()] = False
    session.run_with_iobinding(io)
    return True


def kernel_time_shares(profile_path: str | Path) -> dict[str, float]:
    """Share of kernel time per op type in an ONNX Runtime profile (JSON trace), largest first."""
    totals: Counter[str] = Counter()
    for event in json.loads(Path(profile_path).read_text()):
        if event.get("cat") == "Node" and event.get("name", "").endswith("_kernel_time"):
            totals[event["args"]["op_name"]] += event["dur"]
    grand = sum(totals.values()) or 1
    return {op: duration / grand for op, duration in totals.most_common()}
