"""``PipelineBackend``: a pipeline-parallel artifact's stages behind the ordinary ``Backend`` protocol.

World rank r runs tensor-parallel rank ``r % tp`` of stage ``r // tp`` (``sharded.json``). Rank 0 (stage 0, tp rank
0) owns the engine, scheduler, block manager, sampler and tokenizer, unchanged: its backend is a ``PipelineBackend``
around its own stage's paged backend. The engine's step is split into micro-batches (GPipe): rows, and a long
prefill row's tokens, cut into ``micro_batches`` pieces of about equal tokens (``split_micro_batches``). Rank 0 runs
stage 0 on each piece in turn and sends each piece's hidden state on as soon as it is computed, so while stage 1
runs piece A, stage 0 runs piece B. Every stage processes the pieces in order, so a row cut in two sees its first
part's KV when its second part runs (on every stage). The last stage's tp rank 0 sends each piece's logits back to
rank 0, which keeps each row's last piece and samples as ever. Only rank 0 decides anything: the other ranks run
``serve_stage`` until STOP.

Messages go stage to stage over point-to-point ``torch.distributed`` sends from tp rank t of stage s to tp rank t of
stage s + 1 (gloo on CPU): a header int64 [5] = (op, sequence, payload length, tokens, argmax_only), the step's
int64 payload (``sharded.encode_step``), then the hidden state float32 [T, H]. Stage 0's other tp ranks get rank 0's
messages by a broadcast on the stage's group; the graph's AllReduce / AllGather run on the stage's group too
(``ops/collectives/ort.set_collective_group``). Sends are asynchronous (``isend``), so a stage never waits for the next
one to take its output before it starts the next piece.

Failures end the world, never a hang: a rank that dies makes its neighbour's receive fail at once (a silent one after
the group's timeout); that rank exits with an error, and so on down the pipeline; rank 0's receive of the logits
fails and it raises ``RankFailure``. While idle, rank 0 sends a HEARTBEAT down the pipeline every timeout / 4.
"""

from __future__ import annotations

import collections
import datetime
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from moeforge.ops.collectives.ort import raise_collective_failure
from moeforge.runtime.backends.base import Backend, PoolInfo, RowInput, StepInput
from moeforge.runtime.backends.sharded import RankCoordinator, RankFailure, decode_step, encode_step

log = logging.getLogger(__name__)

EXECUTE, HEARTBEAT, STOP = 1, 3, 4
_OPS = {EXECUTE: "execute", HEARTBEAT: "heartbeat", STOP: "stop"}
HEADER, PAYLOAD, HIDDEN, LOGITS = 11, 12, 13, 14  # point-to-point tags: one ordered stream each
_MAX_PENDING = 64  # unfinished sends a rank keeps before it waits for the oldest


@dataclass(frozen=True)
class Topology:
    """Where world rank ``rank`` sits: stage ``rank // tp``, tensor-parallel rank ``rank % tp``."""

    pp: int
    tp: int
    rank: int

    @property
    def stage(self) -> int:
        return self.rank // self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.pp - 1

    def peer(self, stage: int) -> int:
        """The world rank of this rank's tp position on ``stage``."""
        return stage * self.tp + self.tp_rank

    def stage_ranks(self, stage: int) -> list[int]:
        return list(range(stage * self.tp, (stage + 1) * self.tp))


def stage_groups(topology: Topology, timeout_s: float) -> dist.ProcessGroup | None:
    """One process group per stage (created by every rank, in the same order, as ``new_group`` requires) with the
    world's timeout (``new_group``'s default is 30 minutes); this rank's own stage's group, or None with tp 1 (nothing
    to reduce within a stage)."""
    if topology.tp == 1:
        return None
    mine = None
    for stage in range(topology.pp):
        group = dist.new_group(topology.stage_ranks(stage), timeout=datetime.timedelta(seconds=timeout_s))
        if stage == topology.stage:
            mine = group
    return mine


# ---------------------------------------------------------------------------------------------- micro-batches
@dataclass(frozen=True)
class MicroBatch:
    """A piece of a step: its rows (whole rows, or a token range of one), and which of its logits rows the step
    keeps (the rows that end an original row; a row cut in pieces keeps only its last piece's logits)."""

    step: StepInput
    keep: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return sum(len(row.token_ids) for row in self.step.rows)

    @property
    def num_logits(self) -> int:
        return sum(row.num_logits for row in self.step.rows)


# Fewer tokens than this per micro-batch are not worth a piece: a decode piece of a few rows still reads all of its
# stage's weights, so on a memory-bound step it costs nearly what the whole step does (benchmarks/pipeline.py: at
# 8 decode rows, 2 pieces of 4 took 3.1 ms each where one of 8 took 4.4 ms, and tokens/s fell by 30%).
MIN_MICRO_BATCH_TOKENS = 32


def split_micro_batches(step: StepInput, count: int, min_tokens: int = 1) -> list[MicroBatch]:
    """``step`` cut into at most about ``count`` micro-batches of ~equal tokens, and none of fewer than ``min_tokens``
    unless the step is smaller, in row and token order: decode rows are spread whole, a prefill row may be cut at any
    token (its pieces keep their order on every stage). A row that asks for several logits (speculative
    verification) stays whole."""
    total = sum(len(row.token_ids) for row in step.rows)
    count = max(min(count, total // max(min_tokens, 1)), 1)
    target = max(math.ceil(total / count), 1)
    pieces: list[MicroBatch] = []
    rows: list[RowInput] = []
    keep: list[int] = []
    filled, logits = 0, 0

    def close() -> None:
        nonlocal rows, keep, filled, logits
        if rows:
            pieces.append(MicroBatch(StepInput(tuple(rows), step.argmax_only), tuple(keep)))
        rows, keep, filled, logits = [], [], 0, 0

    for row in step.rows:
        n = len(row.token_ids)
        if row.num_logits > 1 or n <= target - filled:
            rows.append(row)
            keep.extend(range(logits, logits + row.num_logits))
            logits += row.num_logits
            filled += n
        else:
            offset = 0
            while offset < n:
                if filled >= target:
                    close()
                take = min(n - offset, target - filled)
                rows.append(RowInput(row.slot, row.token_ids[offset: offset + take], row.start + offset,
                                     row.block_table, 1))
                if offset + take == n:
                    keep.append(logits)
                logits += 1
                filled += take
                offset += take
        if filled >= target:
            close()
    close()
    return pieces


# ---------------------------------------------------------------------------------------------- transport
@dataclass
class _Sends:
    """Asynchronous sends in flight (their tensors must live until they complete)."""

    pending: collections.deque[tuple[Any, torch.Tensor]] = field(default_factory=collections.deque)

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        while self.pending and self.pending[0][0].is_completed():
            work, _ = self.pending.popleft()
            work.wait()  # returns at once, or raises the send's error
        if len(self.pending) >= _MAX_PENDING:
            work, _ = self.pending.popleft()
            work.wait()
        self.pending.append((_posted(dist.isend(tensor, dst, tag=tag)), tensor))

    def drain(self) -> None:
        while self.pending:
            work, _ = self.pending.popleft()
            work.wait()


def _header(op: int, seq: int, payload: np.ndarray, tokens: int, argmax_only: bool) -> torch.Tensor:
    return torch.tensor([op, seq, payload.size, tokens, int(argmax_only)], dtype=torch.int64)


@dataclass(frozen=True)
class _Message:
    op: int
    seq: int
    step: StepInput | None
    hidden: np.ndarray | None


def _receive(src: int, hidden_size: int, expected_seq: int, rank: int) -> _Message:
    """One message from the previous stage's rank ``src``."""
    header = torch.zeros(5, dtype=torch.int64)
    dist.recv(header, src, tag=HEADER)
    op, seq, size, tokens, argmax_only = (int(v) for v in header)
    if op not in _OPS or seq != expected_seq or size < 0 or tokens < 0:
        raise RankFailure(f"rank {rank} received a malformed pipeline message from rank {src} (op {op}, sequence "
                          f"{seq} where {expected_seq} was due): the ranks are out of step")
    step, hidden = None, None
    if op == EXECUTE:
        payload = torch.zeros(size, dtype=torch.int64)
        dist.recv(payload, src, tag=PAYLOAD)
        decoded = decode_step(payload.numpy())
        step = StepInput(decoded.rows, bool(argmax_only))
        if tokens:
            buffer = torch.zeros((tokens, hidden_size), dtype=torch.float32)
            dist.recv(buffer, src, tag=HIDDEN)
            hidden = buffer.numpy()
    return _Message(op, seq, step, hidden)


def _forward(sends: _Sends, dst: int, op: int, seq: int, step: StepInput | None, hidden: np.ndarray | None) -> None:
    """Send a message to the next stage's rank ``dst``."""
    payload = encode_step(step) if step is not None else np.zeros(0, np.int64)
    tokens = 0 if hidden is None else int(hidden.shape[0])
    sends.send(_header(op, seq, payload, tokens, bool(step and step.argmax_only)), dst, HEADER)
    if op == EXECUTE:
        sends.send(torch.from_numpy(payload), dst, PAYLOAD)
        if hidden is not None and tokens:
            sends.send(torch.from_numpy(np.ascontiguousarray(hidden, dtype=np.float32)), dst, HIDDEN)


class _StageChannel:
    """Rank 0 -> stage 0's other tp ranks: a broadcast of the header and payload on the stage's group."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group

    def send(self, op: int, seq: int, step: StepInput | None) -> None:
        if self.group is None:
            return
        payload = encode_step(step) if step is not None else np.zeros(0, np.int64)
        dist.broadcast(_header(op, seq, payload, 0, bool(step and step.argmax_only)), src=0, group=self.group)
        if payload.size:
            dist.broadcast(torch.from_numpy(payload), src=0, group=self.group)

    def receive(self, expected_seq: int, rank: int) -> _Message:
        assert self.group is not None
        header = torch.zeros(5, dtype=torch.int64)
        dist.broadcast(header, src=0, group=self.group)
        op, seq, size, _tokens, argmax_only = (int(v) for v in header)
        if op not in _OPS or seq != expected_seq or size < 0:
            raise RankFailure(f"rank {rank} received a malformed control message (op {op}, sequence {seq} where "
                              f"{expected_seq} was due): the ranks are out of step")
        step = None
        if size:
            payload = torch.zeros(size, dtype=torch.int64)
            dist.broadcast(payload, src=0, group=self.group)
            decoded = decode_step(payload.numpy())
            step = StepInput(decoded.rows, bool(argmax_only))
        return _Message(op, seq, step, None)


def _posted(work: Any) -> Any:
    if work is None:  # torch returns None only for a rank outside the group, which rank 0 never is
        raise RankFailure("a receive could not be posted")
    return work


# ---------------------------------------------------------------------------------------------- rank 0
class PipelineBackend(RankCoordinator):
    """Rank 0's ``Backend`` for a pipeline artifact: each step in micro-batches through the stages (module doc)."""

    title = "pipeline backend"

    def __init__(self, local: Any, topology: Topology, *, vocab_size: int, micro_batches: int, heartbeat_s: float,
                 group: dist.ProcessGroup | None = None) -> None:
        if topology.rank != 0:
            raise ValueError("the pipeline backend runs on rank 0; the other ranks run serve_stage")
        self.local = local  # stage 0's paged backend (its execute_stage)
        self.topology = topology
        self.micro_batches = micro_batches or topology.pp
        # The default (one piece per stage) keeps pieces of at least MIN_MICRO_BATCH_TOKENS; a count the user asked
        # for is taken as it is (up to one row or token per piece), decode steps included.
        self.min_micro_batch_tokens = 1 if micro_batches else MIN_MICRO_BATCH_TOKENS
        self._vocab = vocab_size
        self._last = topology.stage_ranks(topology.pp - 1)[0]  # returns the logits
        self._channel = _StageChannel(group)
        self._sends = _Sends()
        self._seq = 0
        # Idle time of stage 0 (rank 0's own) and of the whole step, for benchmarks/pipeline.py's bubble.
        self.stage_busy_seconds = 0.0
        self.step_seconds = 0.0
        super().__init__(heartbeat_s)
        self._start_heartbeats()

    @property
    def num_slots(self) -> int:
        return int(self.local.num_slots)

    @property
    def max_seq_len(self) -> int:
        return int(self.local.max_seq_len)

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def kv_pool(self) -> PoolInfo | None:
        return getattr(self.local, "kv_pool", None)

    @property
    def world_size(self) -> int:
        return self.topology.pp * self.topology.tp

    @property
    def multi_logit_rows(self) -> bool:
        """Rows may ask for num_logits > 1 (kept whole by the split) where the stages' paged backend allows it (not
        over DeepSeek-V4's rings)."""
        return bool(getattr(self.local, "multi_logit_rows", False))

    def op_time_shares(self) -> dict[str, float] | None:
        return None

    def expert_load(self) -> np.ndarray | None:
        """None: each stage routes its own layers' tokens; a pipeline's expert counts are not gathered yet."""
        return None

    def rank_expert_load(self) -> np.ndarray | None:
        return None

    def execute(self, step: StepInput) -> np.ndarray:
        """Run ``step`` through every stage in micro-batches; logits [sum of num_logits, V] in row order."""
        if not step.rows:
            return np.zeros((0, self._vocab), np.float32)
        pieces = split_micro_batches(step, self.micro_batches, self.min_micro_batch_tokens)
        with self._lock:
            self._check_alive()
            began = time.perf_counter()
            try:
                # Receives first: the last stage sends each piece's logits as soon as it has them.
                buffers = [torch.empty((piece.num_logits, self._vocab), dtype=torch.float32) for piece in pieces]
                receives = [_posted(dist.irecv(buffer, self._last, tag=LOGITS)) for buffer in buffers]
                for piece in pieces:
                    self._seq += 1
                    self._channel.send(EXECUTE, self._seq, piece.step)
                    start = time.perf_counter()
                    hidden = self.local.execute_stage(piece.step, None)
                    raise_collective_failure()
                    self.stage_busy_seconds += time.perf_counter() - start
                    _forward(self._sends, self.topology.peer(1), EXECUTE, self._seq, piece.step, hidden)
                for work in receives:
                    work.wait()
            except BaseException as exc:  # an interrupt too: pieces may be in flight, the stages are out of step
                failure = self._fail(f"a pipeline step failed on rank 0 or a later stage ({type(exc).__name__}: "
                                     f"{exc})")
                if not isinstance(exc, Exception):
                    raise
                raise failure from exc
            self.step_seconds += time.perf_counter() - began
            self._last_sent = time.monotonic()
        kept = [buffer.numpy()[list(piece.keep)] for piece, buffer in zip(pieces, buffers, strict=True)]
        return kept[0] if len(kept) == 1 else np.concatenate(kept)

    def release(self, slot: int) -> None:
        """Nothing crosses the pipeline: paged stages keep no per-slot state (blocks belong to the engine)."""
        self.local.release(slot)

    def close(self) -> None:
        """Send STOP down the pipeline (once); every rank leaves ``serve_stage`` and exits 0."""
        with self._lock:
            if self._stopped or self._failure is not None:
                self._stopped = True
                return
            self._stopped = True
            try:
                self._send_control(STOP)
                self._sends.drain()
            except Exception as exc:
                self._failure = f"a peer did not take the stop ({type(exc).__name__}: {exc})"

    def _send_control(self, op: int) -> None:
        self._seq += 1
        self._channel.send(op, self._seq, None)
        _forward(self._sends, self.topology.peer(1), op, self._seq, None, None)

    def _send_heartbeat(self) -> None:
        self._send_control(HEARTBEAT)


# ---------------------------------------------------------------------------------------------- other ranks
def serve_stage(local: Any, topology: Topology, hidden_size: int, group: dist.ProcessGroup | None = None,
                on_step: Callable[[float], None] | None = None) -> None:
    """A rank other than 0: run every micro-batch that reaches this rank on its stage (``local.execute_stage``) and
    pass the result on (the next stage's hidden state, or from the last stage's tp rank 0 the logits to rank 0),
    until STOP. ``on_step``: called with each micro-batch's compute seconds (the bubble benchmark). Raises
    ``RankFailure`` when a neighbour dies, a step fails, or messages arrive out of order."""
    rank = topology.rank
    channel = _StageChannel(group)
    sends = _Sends()
    seq = 0
    while True:
        try:
            if topology.is_first:
                message = channel.receive(seq + 1, rank)
            else:
                message = _receive(topology.peer(topology.stage - 1), hidden_size, seq + 1, rank)
        except RankFailure:
            raise
        except Exception as exc:
            raise RankFailure(f"rank {rank} (stage {topology.stage}) lost the previous stage "
                              f"({type(exc).__name__}: {exc})") from exc
        seq = message.seq
        try:
            if message.op != EXECUTE:
                if not topology.is_last:
                    _forward(sends, topology.peer(topology.stage + 1), message.op, seq, None, None)
                if message.op == STOP:
                    sends.drain()
                    return
                continue
            assert message.step is not None
            start = time.perf_counter()
            out = local.execute_stage(message.step, message.hidden)
            raise_collective_failure()
            if on_step is not None:
                on_step(time.perf_counter() - start)
            if not topology.is_last:
                _forward(sends, topology.peer(topology.stage + 1), EXECUTE, seq, message.step, out)
            elif topology.tp_rank == 0:  # a copy: the runner's logits buffer is rewritten by the next piece
                sends.send(torch.from_numpy(np.array(out, dtype=np.float32, copy=True)), 0, LOGITS)
        except Exception as exc:
            raise RankFailure(f"rank {rank} (stage {topology.stage}): message {seq} ({_OPS[message.op]}) failed "
                              f"({type(exc).__name__}: {exc})") from exc


class PipelineSession:
    """Rank 0's whole-sequence session on a pipeline artifact (``OrtSession.forward``'s interface, for ``moeforge
    parity``): one row of every token's logits through the stages, on pools of ``ceil(max_len / Bs)`` blocks."""

    def __init__(self, backend: PipelineBackend, num_blocks: int) -> None:
        self.backend = backend
        self.block_table = tuple(range(num_blocks))

    def forward(self, input_ids: np.ndarray, position_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        """input_ids/position_ids [1, S] (positions start .. start+S-1) -> logits [1, S, V] of every token."""
        ids = tuple(int(t) for t in np.asarray(input_ids).reshape(-1))
        start = int(np.asarray(position_ids).reshape(-1)[0])
        row = RowInput(0, ids, start, self.block_table, len(ids))
        return self.backend.execute(StepInput((row,)))[None].copy()

    def close(self) -> None:
        self.backend.close()


def check_backend(backend: Backend) -> None:
    """A stage's backend must run stage graphs (the paged ONNX Runtime backend's ``execute_stage``)."""
    if not callable(getattr(backend, "execute_stage", None)):
        raise TypeError(f"{type(backend).__name__} cannot run a pipeline stage (no execute_stage): compile with "
                        "--kv-cache paged --target ort")
