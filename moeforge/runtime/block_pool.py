"""BlockPool: the paged KV cache's blocks, reference counted, with the prefix cache that keys them.

No tensors live here: a block is an id into the backend's pools ([num_blocks, B, Hkv, D] per layer).
A full block is keyed by a hash chain of its tokens (``hash_block_tokens``); a freed block keeps its
key until it is evicted (least recently freed first), so a later request that starts with the same
tokens takes the block back instead of recomputing it. ``KVCacheManager`` (kv_cache.py) decides which
blocks each request holds; this file only knows blocks.

Letters: B block size (tokens per block).
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

# Parent of a request's first block. A fixed 16-byte value keeps every hashed message the same
# shape (parent || tokens), so a first block can never collide with a later one by framing.
_ROOT_HASH = bytes(16)


class CacheFullError(RuntimeError):
    """An allocation needs more free blocks than there are; check ``can_*`` first."""


@dataclass(frozen=True)
class KVCacheStats:
    """A snapshot of the pool. ``hits``/``misses`` count full prompt blocks looked up at ``allocate``."""

    hits: int
    misses: int
    evictions: int
    blocks_in_use: int
    free_blocks: int
    cached_blocks: int  # blocks holding a prefix-cache key, in use or free

    @property
    def hit_rate(self) -> float:
        lookups = self.hits + self.misses
        return self.hits / lookups if lookups else 0.0


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Key of a full block: blake2b of its parent block's key and its token ids.

    Chaining through the parent makes a key stand for every token up to the block's end, and the
    KV of a token depends on all of those, so equal keys mean equal cache content. Python's
    ``hash`` is salted per process; this encoding (little-endian int64 tokens) is stable.
    """
    digest = hashlib.blake2b(parent_hash or _ROOT_HASH, digest_size=16)
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return digest.digest()


def full_block_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """Hash chain of every full block of ``token_ids`` (a trailing partial block has no key)."""
    hashes: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        hashes.append(hash_block_tokens(hashes[-1] if hashes else None, token_ids[start:start + block_size]))
    return hashes


@dataclass
class Block:
    """One block of the paged cache. ``block_hash`` is set only while the prefix cache holds it."""

    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None


class BlockPool:
    """A fixed set of reference-counted blocks with a prefix cache of full blocks.

    A block with ref_count 0 is free. Free blocks are handed out in this order: never-cached
    blocks first (so cached content survives as long as possible), then cached ones, least
    recently freed first, dropping their key (an eviction). ``blocks`` is for reading only.
    """

    def __init__(self, num_blocks: int, on_evict: Callable[[int, bytes], None] | None = None) -> None:
        """``on_evict(block_id, block_hash)``: called when a cached free block is handed out again, before its
        content is overwritten (the KV tiers copy it out then)."""
        self.num_blocks = num_blocks  # fixed for the pool's life
        self._on_evict = on_evict
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))  # uncached free blocks, FIFO
        self._cached_free: OrderedDict[int, bytes] = OrderedDict()  # cached free block -> its key, LRU first
        self._cached: dict[bytes, int] = {}  # prefix-cache key -> block id
        self._in_use = 0
        self._hits = self._misses = self._evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref_count 0, cached or not: all of them can be allocated."""
        return len(self._free) + len(self._cached_free)

    def free_block_ids(self) -> list[int]:
        """Free block ids in the order ``allocate`` would hand them out."""
        return [*self._free, *self._cached_free]

    def is_cached(self, block_hash: bytes) -> bool:
        """Whether a block with this key is in the pool (in use or free)."""
        return block_hash in self._cached

    def cached_blocks(self) -> dict[bytes, int]:
        """A copy of the prefix cache: key -> block id."""
        return dict(self._cached)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` free blocks (ref_count 1), evicting cached ones only when needed."""
        if not self.can_allocate(num_blocks):
            raise CacheFullError(f"need {num_blocks} free KV-cache blocks, {self.num_free_blocks} free")
        block_ids = []
        for _ in range(num_blocks):
            if self._free:
                block_id = self._free.popleft()
            else:
                block_id, block_hash = self._cached_free.popitem(last=False)
                if self._on_evict is not None:
                    self._on_evict(block_id, block_hash)
                del self._cached[block_hash]
                self.blocks[block_id].block_hash = None
                self._evictions += 1
            self.blocks[block_id].ref_count = 1
            block_ids.append(block_id)
        self._in_use += num_blocks
        return block_ids

    def lookup(self, block_hashes: Sequence[bytes]) -> list[int]:
        """Block ids of the longest cached run at the start of a hash chain. Changes nothing."""
        block_ids = []
        for block_hash in block_hashes:
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break  # a later block's key depends on this one: nothing after a miss can be valid
            block_ids.append(block_id)
        return block_ids

    def acquire_prefix(self, block_hashes: Sequence[bytes]) -> list[int]:
        """Like ``lookup``, but take a reference on the blocks found and count hits and misses."""
        block_ids = self.lookup(block_hashes)
        self._hits += len(block_ids)
        self._misses += len(block_hashes) - len(block_ids)
        self.touch(block_ids)
        return block_ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add a reference to each block; a cached free block leaves the free list (it is revived)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                if block_id not in self._cached_free:
                    raise ValueError(f"block {block_id} is free and uncached: its content is gone")
                del self._cached_free[block_id]
                self._in_use += 1
            block.ref_count += 1

    def release(self, block_ids: Iterable[int]) -> None:
        """Drop a reference from each block, in order; a block reaching 0 joins the end of its free list."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                raise ValueError(f"block {block_id} released while already free")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._in_use -= 1
                if block.block_hash is None:
                    self._free.append(block_id)
                else:
                    self._cached_free[block_id] = block.block_hash  # most recently freed: evicted last

    def register(self, block_id: int, block_hash: bytes) -> bool:
        """Key an in-use full block for prefix lookup. False when another block already holds the
        key (same content computed twice); this block then stays unkeyed and is freed plainly."""
        block = self.blocks[block_id]
        if block.ref_count == 0 or block.block_hash is not None:
            raise ValueError(f"block {block_id} must be in use and unkeyed to register it")
        if block_hash in self._cached:
            return False
        block.block_hash = block_hash
        self._cached[block_hash] = block_id
        return True

    def unregister(self, block_id: int, block_hash: bytes) -> None:
        """Drop ``block_hash`` from the prefix cache if ``block_id`` holds it; a free block becomes a plain
        free block (its content is no longer findable)."""
        block = self.blocks[block_id]
        if block.block_hash != block_hash or self._cached.get(block_hash) != block_id:
            return
        del self._cached[block_hash]
        block.block_hash = None
        if block.ref_count == 0:
            del self._cached_free[block_id]
            self._free.append(block_id)

    def stats(self) -> KVCacheStats:
        return KVCacheStats(hits=self._hits, misses=self._misses, evictions=self._evictions,
                            blocks_in_use=self._in_use, free_blocks=self.num_free_blocks,
                            cached_blocks=len(self._cached))
