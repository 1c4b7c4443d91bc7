"""``ShardedBackend``: a sharded artifact's ranks behind the ordinary ``Backend`` protocol.

Rank 0 owns the engine, scheduler, KV manager, sampler and tokenizer, unchanged. Its backend is a
``ShardedBackend`` around rank 0's own ONNX Runtime backend: before each step it broadcasts the ``StepInput``
(and each slot release) to the other ranks, then runs its graph. Every other rank runs ``serve_rank``: receive,
run the same step on its own graph and cache, repeat. The graphs' AllReduce / AllGather nodes meet inside the
step, so every rank computes the same logits; rank 0 returns them to the engine.

Control messages are int64 tensors broadcast from rank 0 on the same gloo group (no pickling):
    header [3] = (op, payload length, sequence number); payload [length]
    EXECUTE: n_rows, then per row: slot, start, n_tokens, n_blocks (-1: contiguous), tokens..., blocks...
    RELEASE: slot.   FORWARD: B, S, T, input_ids [B*S], position_ids [B*S], attention_mask [B*T] (a whole
    sequence session's ``forward``, for parity).   HEARTBEAT: nothing (sent while idle, so an idle rank's wait
    never times out).   EXPERT_LOAD: nothing; then every rank all-gathers its expert counts [L_moe, S] (its own
    experts' or placement slots' routed tokens), so rank 0 sees every rank's load.   KV_TIERS: an operation on every
    rank's own KV tiers (runtime/kv_tiers/sharded_tiers.py encodes it), then an all-reduce of one int64 when it
    answers.   EXPERT_ACTIVITY: nothing; then every rank all-gathers [runs, distinct experts computed per MoE layer
    summed over the runs...] (its ``ExpertActivity``: what its sparse experts read, for the memory roofline).   STOP.

Failures are fatal to the whole world, never a hang: a rank that dies or hangs makes the next collective fail
on the others (the group's timeout bounds the wait); rank 0 raises ``RankFailure`` (the engine does not swallow
it) and the other ranks exit with an error naming the cause.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from moeforge.model.expert_slots import ExpertSlots
from moeforge.ops.collectives.ort import raise_collective_failure
from moeforge.runtime.backends.base import (
    Backend,
    BlockIO,
    ExpertActivity,
    FatalBackendError,
    PoolInfo,
    RowInput,
    StepInput,
    block_io_of,
)
from moeforge.runtime.kv_tiers.sharded_tiers import ShardedTiers
from moeforge.runtime.kv_tiers.tiers import TierSettings

log = logging.getLogger(__name__)

EXECUTE, RELEASE, HEARTBEAT, STOP, FORWARD, EXPERT_LOAD, KV_TIERS, EXPERT_ACTIVITY = 1, 2, 3, 4, 5, 6, 7, 8
_OPS = {EXECUTE: "execute", RELEASE: "release", HEARTBEAT: "heartbeat", STOP: "stop", FORWARD: "forward",
        EXPERT_LOAD: "expert_load", KV_TIERS: "kv_tiers", EXPERT_ACTIVITY: "expert_activity"}


class RankFailure(FatalBackendError):
    """A rank of a sharded artifact failed (died, hung past the timeout, or its step raised): the group cannot
    run another step; every rank stops with an error."""


def encode_step(step: StepInput) -> np.ndarray:
    """``step`` as the int64 payload of an EXECUTE message."""
    out: list[int] = [len(step.rows)]
    for row in step.rows:
        blocks = row.block_table
        out += [row.slot, row.start, len(row.token_ids), -1 if blocks is None else len(blocks), row.num_logits]
        out += row.token_ids
        out += blocks or ()
    return np.asarray(out, dtype=np.int64)


def decode_step(payload: np.ndarray) -> StepInput:
    """The inverse of ``encode_step``."""
    values = payload.tolist()
    rows, at = [], 1
    for _ in range(values[0]):
        slot, start, n_tokens, n_blocks, num_logits = values[at: at + 5]
        at += 5
        tokens = tuple(values[at: at + n_tokens])
        at += n_tokens
        blocks = None if n_blocks < 0 else tuple(values[at: at + n_blocks])
        at += max(n_blocks, 0)
        rows.append(RowInput(slot=slot, token_ids=tokens, start=start, block_table=blocks, num_logits=num_logits))
    return StepInput(tuple(rows))


@dataclass(frozen=True)
class Message:
    op: int
    payload: np.ndarray
    seq: int


class Channel:
    """Rank 0 -> all ranks, on the default process group. ``send`` on rank 0, ``receive`` elsewhere."""

    def __init__(self) -> None:
        self.seq = 0

    def send(self, op: int, payload: np.ndarray | None = None) -> None:
        body = np.zeros(0, np.int64) if payload is None else payload
        self.seq += 1
        dist.broadcast(torch.tensor([op, body.size, self.seq], dtype=torch.int64), src=0)
        if body.size:
            dist.broadcast(torch.from_numpy(body), src=0)

    def receive(self) -> Message:
        header = torch.zeros(3, dtype=torch.int64)
        dist.broadcast(header, src=0)
        op, size, seq = (int(v) for v in header)
        if op not in _OPS or size < 0 or seq != self.seq + 1:
            raise RankFailure(f"rank {dist.get_rank()} received a malformed control message (op {op}, {size} values, "
                              f"sequence {seq} after {self.seq}): the ranks are out of step")
        self.seq = seq
        body = torch.zeros(size, dtype=torch.int64)
        if size:
            dist.broadcast(body, src=0)
        return Message(op, body.numpy(), seq)


@dataclass(frozen=True)
class ExpertLayout:
    """How the ranks' expert counts add up: ``ep`` 1 (every rank routes every expert: rank 0's counts are the
    load), or ``ep`` ranks of whole experts or placement slots (``slots``: slot -> logical expert; None: rank ``r``
    holds experts ``r * S .. (r + 1) * S - 1``)."""

    ep: int
    experts: int
    slots: ExpertSlots | None = None

    def logical(self, gathered: np.ndarray) -> np.ndarray:
        """[N, L, S] per-rank counts -> [L, E] routed tokens per logical expert."""
        if self.ep == 1:
            return np.asarray(gathered[0])
        per_slot = np.concatenate(list(gathered), axis=1)  # [L, N * S], slot order
        return per_slot if self.slots is None else self.slots.logical_counts(per_slot, self.experts)

    def per_slot(self, gathered: np.ndarray) -> np.ndarray | None:
        """[N, L, S] -> [L, N * S]: routed tokens per physical slot, rank 0's first (None when ``ep`` is 1)."""
        return None if self.ep == 1 else np.concatenate(list(gathered), axis=1)

    def per_rank(self, gathered: np.ndarray) -> np.ndarray:
        """[N, L, S] -> [L, N]: the expert computations (token x expert) each rank ran per MoE layer."""
        if self.ep == 1:  # each rank computes its share of every routed expert: the same load on all
            return np.repeat(gathered[0].sum(axis=1, keepdims=True), gathered.shape[0], axis=1)
        return np.asarray(gathered.sum(axis=2).T)


class RankCoordinator:
    """Rank 0's side of a world of ranks, shared by ``ShardedBackend`` and the pipeline's ``PipelineBackend``: one
    control sequence at a time (``_lock``), the first failure (fatal: every later call raises), and a heartbeat sent
    while idle so the other ranks' waits never time out. A subclass sends its heartbeat in ``_send_heartbeat`` and
    calls ``_start_heartbeats`` once it can."""

    title = "sharded backend"

    def __init__(self, heartbeat_s: float) -> None:
        self._lock = threading.Lock()  # one collective sequence at a time: steps, releases and heartbeats
        self._failure: str | None = None
        self._stopped = False
        self._last_sent = time.monotonic()
        self._heartbeat_s = heartbeat_s

    def _start_heartbeats(self) -> None:
        threading.Thread(target=self._heartbeats, name="moeforge-heartbeat", daemon=True).start()

    def _send_heartbeat(self) -> None:
        raise NotImplementedError

    @property
    def failure(self) -> str | None:
        return self._failure

    def _check_alive(self) -> None:
        if self._failure is not None:
            raise RankFailure(f"the {self.title} stopped after a failure: {self._failure}")
        if self._stopped:
            raise RankFailure(f"the {self.title} is closed")

    def _fail(self, why: str) -> RankFailure:
        self._failure = why
        log.error("%s: %s", self.title, why)
        return RankFailure(f"{why}; every rank stops (a rank died, hung past the timeout, or runs another artifact)")

    def _heartbeats(self) -> None:
        while True:
            time.sleep(self._heartbeat_s / 4)
            if self._stopped or self._failure is not None:
                return
            if time.monotonic() - self._last_sent < self._heartbeat_s or not self._lock.acquire(blocking=False):
                continue
            try:
                if not self._stopped and self._failure is None:
                    self._send_heartbeat()
                    self._last_sent = time.monotonic()
            except Exception as exc:
                self._fail(f"a peer did not take a heartbeat ({type(exc).__name__}: {exc})")
            finally:
                self._lock.release()


class ShardedBackend(RankCoordinator):
    """Rank 0's ``Backend``: broadcasts each step and release, then runs its own rank's backend (``local``)."""

    def __init__(self, local: Backend, world_size: int, heartbeat_s: float,
                 experts: ExpertLayout | None = None) -> None:
        self.local = local
        self.world_size = world_size
        self.experts = experts
        self._steps = 0  # steps executed: the expert counts gathered after step n stay valid until step n + 1
        self._gathered: tuple[int, np.ndarray] | None = None
        self._channel = Channel()
        super().__init__(heartbeat_s)
        self._start_heartbeats()

    # Backend protocol: sizes from rank 0's backend (every rank allocated the same, see open_rank_backend).
    @property
    def num_slots(self) -> int:
        return self.local.num_slots

    @property
    def max_seq_len(self) -> int:
        return self.local.max_seq_len

    @property
    def vocab_size(self) -> int:
        return self.local.vocab_size

    @property
    def kv_pool(self) -> PoolInfo | None:
        return getattr(self.local, "kv_pool", None)

    @property
    def multi_logit_rows(self) -> bool:
        """Whether rows may ask for num_logits > 1: the local backend's answer (the peers run the same kind)."""
        return bool(getattr(self.local, "multi_logit_rows", False))

    def op_time_shares(self) -> dict[str, float] | None:
        return self.local.op_time_shares()

    def expert_load(self) -> np.ndarray | None:
        """Routed tokens per MoE layer and logical expert so far, [L_moe, E], summed over the ranks' experts (or
        placement slots); None unless the artifact routes to experts and every rank tracks them."""
        gathered = self._gather_expert_counts()
        return None if gathered is None or self.experts is None else self.experts.logical(gathered)

    def rank_expert_load(self) -> np.ndarray | None:
        """Expert computations (token x expert) each rank ran so far, [L_moe, N]: the per-rank load whose max / mean
        is the expert-parallel imbalance; None as for ``expert_load``."""
        gathered = self._gather_expert_counts()
        return None if gathered is None or self.experts is None else self.experts.per_rank(gathered)

    def slot_expert_load(self) -> np.ndarray | None:
        """Routed tokens per MoE layer and physical slot, [L_moe, N * S] in rank order (replicas of one expert
        counted apart); None for ``ep`` 1 or as for ``expert_load``."""
        gathered = self._gather_expert_counts()
        return None if gathered is None or self.experts is None else self.experts.per_slot(gathered)

    def _gather_expert_counts(self) -> np.ndarray | None:
        """[N, L, S]: every rank's own counts (an EXPERT_LOAD message, then an all-gather on every rank)."""
        if self._gathered is not None and self._gathered[0] == self._steps:
            return self._gathered[1]
        counts = getattr(self.local, "expert_load", None)
        local = counts() if counts is not None else None
        if local is None:
            return None
        gathered = self._all_gather(EXPERT_LOAD, local, "expert load")
        self._gathered = (self._steps, gathered)
        return gathered

    def _all_gather(self, op: int, local: np.ndarray, what: str) -> np.ndarray:
        """Send ``op``, then all-gather every rank's int64 ``local`` array ([N, ...] in rank order)."""
        with self._lock:
            self._check_alive()
            try:
                self._channel.send(op)
                gathered = gather_counts(local)
            except Exception as exc:
                raise self._fail(f"a peer did not send its {what} ({type(exc).__name__}: {exc})") from exc
            self._last_sent = time.monotonic()
        return gathered

    def rank_expert_activity(self) -> list[ExpertActivity] | None:
        """Each rank's ``ExpertActivity`` so far, in rank order: the distinct experts of its own that its runs
        computed per MoE layer (an EXPERT_ACTIVITY message, then an all-gather); None unless every rank tracks
        expert load (``track_expert_load``) and the artifact routes to experts."""
        counter = getattr(self.local, "expert_activity", None)
        local = counter() if counter is not None else None
        if local is None:
            return None
        gathered = self._all_gather(EXPERT_ACTIVITY, pack_activity(local), "expert activity")
        return [ExpertActivity(row[0, 1:].copy(), int(row[0, 0])) for row in gathered]

    def execute(self, step: StepInput) -> np.ndarray:
        with self._lock:
            self._check_alive()
            try:
                self._channel.send(EXECUTE, encode_step(step))
                logits = self.local.execute(step)
                self._steps += 1
                raise_collective_failure()  # a collective inside the graph failed: its logits are garbage
            except Exception as exc:
                raise self._fail(f"the step failed on rank 0 or a peer ({type(exc).__name__}: {exc})") from exc
            self._last_sent = time.monotonic()
            return logits

    def block_io(self) -> BlockIO | None:
        """Rank 0's pools as a ``BlockIO`` (its own shard; the other ranks' tiers copy theirs, ``call_ranks``)."""
        return block_io_of(self.local)

    def open_kv_tiers(self, settings: TierSettings, io: BlockIO, namespace: str | None) -> ShardedTiers:
        """KV tiers for rank 0's engine over ``io`` (rank 0's own shard), each operation mirrored on the other ranks
        (whose ``serve_rank`` runs them on their own tiers, ``parallel/launch.rank_worker``)."""
        return ShardedTiers(settings, io, namespace, self)

    def call_ranks(self, payload: np.ndarray, local: Callable[[], int], reduce: str | None) -> int:
        """Send a KV_TIERS message, run ``local`` (rank 0's part), then -- with ``reduce`` "min" or "sum" -- all-reduce
        its int answer with every rank's (each rank's ``serve_rank`` handler does the same); returns the result."""
        with self._lock:
            self._check_alive()
            try:
                self._channel.send(KV_TIERS, payload)
                value = local()
                if reduce is not None:
                    tensor = torch.tensor([value], dtype=torch.int64)
                    dist.all_reduce(tensor, op=dist.ReduceOp.MIN if reduce == "min" else dist.ReduceOp.SUM)
                    value = int(tensor[0])
            except Exception as exc:
                raise self._fail(f"a KV-tier operation failed on rank 0 or a peer ({type(exc).__name__}: {exc})"
                                 ) from exc
            self._last_sent = time.monotonic()
            return value

    def release(self, slot: int) -> None:
        with self._lock:
            self._check_alive()
            try:
                self._channel.send(RELEASE, np.asarray([slot], np.int64))
            except Exception as exc:
                raise self._fail(f"a peer did not take a release ({type(exc).__name__}: {exc})") from exc
            self.local.release(slot)
            self._last_sent = time.monotonic()

    def close(self) -> None:
        """Tell the other ranks to stop (once); they leave ``serve_rank`` and exit 0."""
        with self._lock:
            if self._stopped or self._failure is not None:
                self._stopped = True
                return
            self._stopped = True
            try:
                self._channel.send(STOP)
            except Exception as exc:
                self._failure = f"a peer did not take the stop ({type(exc).__name__}: {exc})"

    def _send_heartbeat(self) -> None:
        self._channel.send(HEARTBEAT)


def encode_forward(input_ids: np.ndarray, position_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
    """A FORWARD message's payload: ids and positions [B, S], mask [B, T]."""
    (b, s), t = input_ids.shape, attention_mask.shape[1]
    return np.concatenate([np.array([b, s, t], np.int64), input_ids.reshape(-1), position_ids.reshape(-1),
                           attention_mask.reshape(-1)]).astype(np.int64)


def decode_forward(payload: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    b, s, t = (int(v) for v in payload[:3])
    ids = payload[3: 3 + b * s].reshape(b, s)
    positions = payload[3 + b * s: 3 + 2 * b * s].reshape(b, s)
    return ids, positions, payload[3 + 2 * b * s: 3 + 2 * b * s + b * t].reshape(b, t)


class ShardedSession:
    """Rank 0's whole-sequence session (``OrtSession`` / ``PagedSequenceSession`` interface: ``forward`` returns
    every position's logits), for ``moeforge parity`` on a sharded artifact: broadcast, then run its own rank."""

    def __init__(self, local: Any) -> None:
        self.local = local
        self._channel = Channel()

    def forward(self, input_ids: np.ndarray, position_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        try:
            self._channel.send(FORWARD, encode_forward(input_ids, position_ids, attention_mask))
            out: np.ndarray = self.local.forward(input_ids, position_ids, attention_mask)
            raise_collective_failure()
        except Exception as exc:
            raise RankFailure(f"the forward failed on rank 0 or a peer ({type(exc).__name__}: {exc})") from exc
        return out

    def close(self) -> None:
        self._channel.send(STOP)


def serve_rank(local: Any, kv_tiers: Callable[[np.ndarray], None] | None = None) -> None:
    """A rank other than 0: run every step rank 0 broadcasts on ``local`` (a ``Backend``, or a session for
    FORWARD) until STOP; ``kv_tiers`` handles KV_TIERS messages on this rank's own tiers. Raises ``RankFailure`` when
    a peer dies, a step fails, or messages arrive out of order."""
    channel = Channel()
    while True:
        try:
            message = channel.receive()
        except RankFailure:
            raise
        except Exception as exc:
            raise RankFailure(f"rank {dist.get_rank()} lost rank 0 ({type(exc).__name__}: {exc})") from exc
        if message.op == STOP:
            return
        if message.op == HEARTBEAT:
            continue
        try:
            if message.op == RELEASE:
                local.release(int(message.payload[0]))
            elif message.op == EXPERT_LOAD:
                gather_counts(_tracked(local, "expert_load", "expert load"))
            elif message.op == EXPERT_ACTIVITY:
                gather_counts(pack_activity(_tracked(local, "expert_activity", "expert activity")))
            elif message.op == FORWARD:
                local.forward(*decode_forward(message.payload))
            elif message.op == KV_TIERS:
                if kv_tiers is None:
                    raise RankFailure(f"rank {dist.get_rank()} has no KV tiers (rank 0 has): start every rank with "
                                      "the same --kv-host-bytes / --kv-disk-dir")
                kv_tiers(message.payload)
            else:
                local.execute(decode_step(message.payload))
            raise_collective_failure()
        except Exception as exc:
            raise RankFailure(f"rank {dist.get_rank()}: step {message.seq} ({_OPS[message.op]}) failed "
                              f"({type(exc).__name__}: {exc})") from exc


def _tracked(local: Any, method: str, what: str) -> Any:
    """``local.method()``, what a rank tracks of its experts; a ``RankFailure`` when it tracks none (rank 0 does)."""
    counter = getattr(local, method, None)
    value = counter() if counter is not None else None
    if value is None:
        raise RankFailure(f"rank {dist.get_rank()} does not count {what} (rank 0 does): start every rank with the "
                          "same options")
    return value


def agree(values: Sequence[int]) -> list[int]:
    """Rank 0's ``values`` on every rank (a broadcast of a small int64 vector)."""
    tensor = torch.tensor(list(values), dtype=torch.int64)
    dist.broadcast(tensor, src=0)
    return [int(v) for v in tensor]


def gather_status(message: str, limit: int = 480) -> list[str]:
    """Every rank's ``message`` ("" = fine), in rank order, on every rank (UTF-8 bytes, truncated to ``limit``)."""
    data = message.encode("utf-8")[:limit]
    tensor = torch.zeros(limit + 2, dtype=torch.uint8)
    tensor[0], tensor[1] = len(data) // 256, len(data) % 256
    tensor[2: 2 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else tensor[2:2]
    parts = [torch.zeros_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor)
    out = []
    for part in parts:
        size = int(part[0]) * 256 + int(part[1])
        out.append(bytes(part[2: 2 + size].tolist()).decode("utf-8", "replace"))
    return out


def pack_activity(activity: ExpertActivity) -> np.ndarray:
    """An ``ExpertActivity`` as one int64 row [1, 1 + L_moe]: runs, then the per-layer sums (``gather_counts``)."""
    return np.concatenate([[activity.runs], np.asarray(activity.active, np.int64)])[None]


def gather_counts(counts: np.ndarray) -> np.ndarray:
    """Every rank's [L, S] int64 counts, stacked in rank order [N, L, S], on every rank (one all-gather)."""
    tensor = torch.from_numpy(np.ascontiguousarray(counts, dtype=np.int64))
    parts = [torch.zeros_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor)
    return torch.stack(parts).numpy()
