"""HostTier: the L2 tier, encoded KV blocks in host memory, bounded in bytes, least recently used out first.

Keys are the prefix cache's block hashes (``block_pool.hash_block_tokens``): equal keys mean equal KV. Not
thread-safe by itself: ``KVTiers`` (tiers.py) holds its lock around every call, because the prefetch thread
and the engine's thread both use it.
"""

from __future__ import annotations

from collections import OrderedDict


class HostTier:
    """A bytes-bounded LRU map of block hash -> encoded block. ``put`` returns what it pushed out (oldest first),
    so the caller can write it back to the tier below."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"host tier capacity must be >= 0 bytes, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.nbytes = 0
        self._blocks: OrderedDict[bytes, bytes] = OrderedDict()

    def __contains__(self, key: object) -> bool:
        return key in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def put(self, key: bytes, payload: bytes) -> list[tuple[bytes, bytes]]:
        """Store ``payload`` as the most recently used block; return the blocks evicted to make room (a payload
        larger than the whole capacity is itself returned, not stored)."""
        if len(payload) > self.capacity_bytes:
            return [(key, payload)]
        old = self._blocks.pop(key, None)
        if old is not None:
            self.nbytes -= len(old)
        evicted: list[tuple[bytes, bytes]] = []
        while self.nbytes + len(payload) > self.capacity_bytes:
            evicted.append(self._pop_oldest())
        self._blocks[key] = payload
        self.nbytes += len(payload)
        return evicted

    def get(self, key: bytes) -> bytes | None:
        """The block (now the most recently used), or None."""
        payload = self._blocks.get(key)
        if payload is not None:
            self._blocks.move_to_end(key)
        return payload

    def pop(self, key: bytes) -> bytes | None:
        """Remove and return the block, or None."""
        payload = self._blocks.pop(key, None)
        if payload is not None:
            self.nbytes -= len(payload)
        return payload

    def items(self) -> list[tuple[bytes, bytes]]:
        """Every block, least recently used first (a copy)."""
        return list(self._blocks.items())

    def clear(self) -> None:
        self._blocks.clear()
        self.nbytes = 0

    def _pop_oldest(self) -> tuple[bytes, bytes]:
        key, payload = self._blocks.popitem(last=False)
        self.nbytes -= len(payload)
        return key, payload
