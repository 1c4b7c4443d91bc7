"""KV tiers of a sharded artifact: every rank tiers its own shard of each block, rank 0 decides.

Rank 0's ``KVCacheManager`` holds a ``ShardedTiers``: each operation (demote, find, promote, prefetch, flush, close)
is broadcast to the other ranks as a KV_TIERS message (``ShardedBackend.call_ranks``), runs on every rank's own
``KVTiers`` over its own pools, host memory and disk namespace (the rank's manifest digest), and the answers that
decide something are all-reduced: ``find`` and ``promote`` take the minimum over the ranks, because a block is
usable only when every rank has its shard (a rank that promoted more wrote blocks the step then recomputes:
harmless). Messages keep the order rank 0 sent them in, so every rank demotes a block before the step that reuses
its id. Rank 0's counters (``stats``) stand for all: the ranks see the same lookups.

Payloads are int64 vectors: [operation, ...], a 16-byte block hash as two int64s.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist

from moeforge.runtime.backends.base import BlockIO
from moeforge.runtime.kv_tiers.tiers import KVTiers, TierSettings

log = logging.getLogger(__name__)

DEMOTE, FIND, PROMOTE, PREFETCH, FLUSH, CLOSE = 1, 2, 3, 4, 5, 6


class RankCaller(Protocol):
    """What ``ShardedTiers`` needs of the ``ShardedBackend``."""

    def call_ranks(self, payload: np.ndarray, local: Callable[[], int], reduce: str | None) -> int: ...


def _best_effort(what: str, run: Callable[[], int]) -> int:
    """Run one rank's part of a tier operation; a failure there answers 0 (nothing found, promoted or written) so
    the ranks' all-reduce still meets and the block is recomputed. Only the transport may stop the world."""
    try:
        return run()
    except Exception:
        log.exception("KV tiers: %s failed on this rank; the blocks concerned will be recomputed", what)
        return 0


def _keys(keys: Sequence[bytes]) -> np.ndarray:
    return np.frombuffer(b"".join(keys), np.int64) if keys else np.zeros(0, np.int64)


def _unkeys(values: np.ndarray) -> list[bytes]:
    return [values[i:i + 2].astype(np.int64).tobytes() for i in range(0, len(values), 2)]


def _message(operation: int, *parts: Sequence[int] | np.ndarray) -> np.ndarray:
    return np.concatenate([np.array([operation], np.int64), *(np.asarray(p, np.int64) for p in parts)])


class ShardedTiers(KVTiers):
    """Rank 0's tiers: its own shard's, with every operation mirrored on the other ranks (module docstring)."""

    def __init__(self, settings: TierSettings, io: BlockIO, namespace: str | None, ranks: RankCaller) -> None:
        super().__init__(settings, io, namespace)
        self._ranks = ranks

    def demote(self, block_id: int, key: bytes) -> None:
        def local() -> int:
            KVTiers.demote(self, block_id, key)
            return 0

        self._ranks.call_ranks(_message(DEMOTE, [block_id], _keys([key])), lambda: _best_effort("demote", local), None)

    def find(self, keys: Sequence[bytes]) -> int:
        if not keys:
            return 0
        return self._ranks.call_ranks(_message(FIND, _keys(keys)),
                                      lambda: _best_effort("find", lambda: KVTiers.find(self, keys)), "min")

    def promote(self, keys: Sequence[bytes], block_ids: Sequence[int], looked_up: int | None = None) -> int:
        looked_up = len(keys) if looked_up is None else looked_up
        payload = _message(PROMOTE, [looked_up, len(keys)], _keys(keys), block_ids[:len(keys)])
        return self._ranks.call_ranks(
            payload, lambda: _best_effort("promote", lambda: KVTiers.promote(self, keys, block_ids, looked_up)), "min")

    def prefetch(self, keys: Sequence[bytes]) -> None:
        def local() -> int:
            KVTiers.prefetch(self, keys)
            return 0

        if keys:
            self._ranks.call_ranks(_message(PREFETCH, _keys(keys)), lambda: _best_effort("prefetch", local), None)

    def flush(self, cached: Iterable[tuple[int, bytes]]) -> int:
        pairs = list(cached)
        payload = _message(FLUSH, [len(pairs)], [b for b, _ in pairs], _keys([k for _, k in pairs]))
        return self._ranks.call_ranks(payload, lambda: _best_effort("flush", lambda: KVTiers.flush(self, pairs)), "sum")

    def close(self) -> None:
        try:
            self._ranks.call_ranks(_message(CLOSE), lambda: 0, None)
        finally:
            KVTiers.close(self)


def rank_handler(tiers: KVTiers) -> Callable[[np.ndarray], None]:
    """A rank other than 0: run each KV_TIERS payload on this rank's ``tiers``, answering where rank 0 all-reduces."""

    def answer(value: int, reduce: str) -> None:  # the other half of ShardedBackend.call_ranks's all-reduce
        dist.all_reduce(torch.tensor([value], dtype=torch.int64),
                        op=dist.ReduceOp.MIN if reduce == "min" else dist.ReduceOp.SUM)

    def run(what: str, call: Callable[[], int | None]) -> int:
        return _best_effort(what, lambda: call() or 0)

    def handle(payload: np.ndarray) -> None:
        operation, body = int(payload[0]), payload[1:]
        if operation == DEMOTE:
            run("demote", lambda: tiers.demote(int(body[0]), _unkeys(body[1:3])[0]))
        elif operation == FIND:
            answer(run("find", lambda: tiers.find(_unkeys(body))), "min")
        elif operation == PROMOTE:
            looked_up, count = int(body[0]), int(body[1])
            keys = _unkeys(body[2:2 + 2 * count])
            block_ids = [int(b) for b in body[2 + 2 * count:2 + 3 * count]]
            answer(run("promote", lambda: tiers.promote(keys, block_ids, looked_up)), "min")
        elif operation == PREFETCH:
            run("prefetch", lambda: tiers.prefetch(_unkeys(body)))
        elif operation == FLUSH:
            count = int(body[0])
            pairs = list(zip([int(b) for b in body[1:1 + count]], _unkeys(body[1 + count:1 + 3 * count]), strict=True))
            answer(run("flush", lambda: tiers.flush(pairs)), "sum")
        elif operation == CLOSE:
            run("close", tiers.close)
        else:
            raise ValueError(f"unknown KV-tier operation {operation}")

    return handle
