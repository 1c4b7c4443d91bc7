"""KV-cache bookkeeping: which cache slots hold each sequence's tokens. No tensors live here.

Two layouts, one per kind of artifact:

- Paged (``KVCacheManager`` over a ``BlockPool``): per layer the cache is ``num_blocks`` blocks of
  ``block_size`` token slots, [num_blocks, block_size, Hkv, D]. A sequence owns a *block table*
  (block ids in token order); its token at position p lives in slot
  ``table[p // block_size] * block_size + p % block_size`` (the *slot mapping*). Blocks are
  reference counted so sequences can share them. A full block is keyed by a hash chain of its
  tokens (prefix caching); a freed block keeps its key until it is evicted (least recently freed
  first), so a later request that starts with the same tokens reuses it instead of recomputing.
- Contiguous (``SlotAllocator``): artifacts whose cache is a per-sequence buffer
  [num_slots, Hkv, max_len, D] (today's ONNX Runtime artifacts); a sequence gets one row, its
  *slot*, for its whole life.

Block tables and slots are plain lists/ints that the scheduler hands to the backend as explicit
inputs (a paged backend derives each token's slot from its block table and position).

Lifecycle of a paged sequence (the scheduler calls ``can_*`` first; the other verbs raise
``CacheFullError`` rather than over-allocate)::

    cached = m.allocate(seq_id, prompt_ids)       # slots for the prompt; cached tokens are skipped
    m.slot_mapping(seq_id, cached, m.num_slots(seq_id))  # where the prefill writes its KV
    m.commit_step()                               # the step ran: its full blocks' keys are valid
    m.append_slots(seq_id, 1, [sampled_id])       # each decode step: one more token, one more slot
    m.free(seq_id)                                # or m.preempt(seq_id), then allocate again later

Prefix-cache keys of blocks that became full in a step are *pending* until ``commit_step()``: a
step that fails before writing its KV calls ``rollback_step()`` (after finishing its sequences),
which drops those keys, so no later request hits a block whose KV was never written.

Letters: B block size (tokens per block), p a token position.
"""

from __future__ import annotations

import hashlib
import heapq
import struct
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# Parent of a sequence's first block. A fixed 16-byte value keeps every hashed message the same
# shape (parent || tokens), so a first block can never collide with a later one by framing.
_ROOT_HASH = bytes(16)


class CacheFullError(RuntimeError):
    """An allocation needs more free blocks (or slots) than there are; check ``can_*`` first."""


class SequenceTooLongError(ValueError):
    """A sequence can never fit its contiguous slot, so waiting for free slots would not help."""


@dataclass(frozen=True)
class KVCacheConfig:
    """Paged cache geometry: ``num_blocks`` blocks of ``block_size`` tokens."""

    num_blocks: int
    block_size: int
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.num_blocks < 1 or self.block_size < 1:
            raise ValueError(f"num_blocks ({self.num_blocks}) and block_size ({self.block_size}) must be >= 1")


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

    def __init__(self, num_blocks: int) -> None:
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))  # uncached free blocks, FIFO
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # cached free blocks, LRU first
        self._cached: dict[bytes, int] = {}  # prefix-cache key -> block id
        self._in_use = 0
        self._hits = self._misses = self._evictions = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref_count 0, cached or not: all of them can be allocated."""
        return len(self._free) + len(self._cached_free)

    def free_block_ids(self) -> list[int]:
        """Free block ids in the order ``allocate`` would hand them out."""
        return [*self._free, *self._cached_free]

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
                block_id, _ = self._cached_free.popitem(last=False)
                block = self.blocks[block_id]
                del self._cached[block.block_hash]
                block.block_hash = None
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
                    self._cached_free[block_id] = None  # most recently freed: evicted last

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


@dataclass
class _SequenceState:
    token_ids: list[int]  # every token known so far (prompt, then sampled ones)
    block_ids: list[int]  # the block table: ceil(num_slots / B) blocks
    block_hashes: list[bytes]  # chain keys of the full blocks with slots, registered or not
    num_slots: int  # tokens [0, num_slots) have a slot
    num_cached_tokens: int  # tokens whose KV was already in the cache when the sequence got its blocks


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """The scheduler's view of the paged cache: blocks per sequence, prefix reuse, slot mappings.

    Sequences are identified by an int id. The manager keeps each sequence's token ids because a
    block's key is computed from them when the block becomes full. Slots are given to tokens in
    order: ``num_slots(seq_id)`` tokens have one, and the scheduler computes KV for the positions
    it has not computed yet (from ``num_cached_tokens`` on, for a new sequence).
    """

    def __init__(self, config: KVCacheConfig) -> None:
        self.config = config
        self.block_size = config.block_size
        self.pool = BlockPool(config.num_blocks)
        self._seqs: dict[int, _SequenceState] = {}
        self._pending: list[tuple[int, bytes]] = []  # (block id, key) registered since the last commit_step

    # -- new sequences ------------------------------------------------------------------------

    def can_allocate(self, seq_id: int, token_ids: Sequence[int], token_budget: int | None = None) -> bool:
        """Whether ``allocate`` with the same arguments would succeed now."""
        _, hits, num_slots = self._plan(seq_id, token_ids, token_budget)
        return self.pool.can_allocate(self._blocks_to_take(hits, num_slots))

    def allocate(self, seq_id: int, token_ids: Sequence[int], token_budget: int | None = None) -> int:
        """Start a sequence whose known tokens are ``token_ids``; return how many are already cached.

        Reuses the longest cached run of full blocks, but always leaves at least the last token to
        compute: its logits are needed to sample. Then gives slots to at most ``token_budget``
        further tokens (default: all of them; a smaller budget is a prefill chunk, continued with
        ``append_slots``). A preempted sequence comes back through here with all its tokens.
        """
        lookup_hashes, hits, num_slots = self._plan(seq_id, token_ids, token_budget)
        needed = self._blocks_to_take(hits, num_slots)
        if not self.pool.can_allocate(needed):
            raise CacheFullError(f"sequence {seq_id}: need {needed} free KV-cache blocks, "
                                 f"{self.pool.num_free_blocks} free")
        # Take the hits first: allocating fresh blocks could otherwise evict them.
        hits = self.pool.acquire_prefix(lookup_hashes) if self.config.enable_prefix_caching else []
        fresh = self.pool.allocate(_cdiv(num_slots, self.block_size) - len(hits))
        num_cached = len(hits) * self.block_size
        state = _SequenceState(list(token_ids), hits + fresh, lookup_hashes[:len(hits)], num_slots, num_cached)
        self._seqs[seq_id] = state
        self._register_full_blocks(state)
        return num_cached

    def _plan(self, seq_id: int, token_ids: Sequence[int],
              token_budget: int | None) -> tuple[list[bytes], list[int], int]:
        """(hashes to look up, cached block ids found, slots the sequence would get) for ``allocate``."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} is already allocated")
        if not token_ids:
            raise ValueError(f"sequence {seq_id} has no tokens")
        if token_budget is not None and token_budget < 1:
            raise ValueError(f"sequence {seq_id}: token_budget must be >= 1, got {token_budget}")
        lookup_hashes: list[bytes] = []
        hits: list[int] = []
        if self.config.enable_prefix_caching:
            # Only blocks that end before the last token may hit (see ``allocate``).
            lookable = token_ids[:(len(token_ids) - 1) // self.block_size * self.block_size]
            lookup_hashes = full_block_hashes(lookable, self.block_size)
            hits = self.pool.lookup(lookup_hashes)
        num_cached = len(hits) * self.block_size
        to_compute = len(token_ids) - num_cached
        num_slots = num_cached + (to_compute if token_budget is None else min(token_budget, to_compute))
        return lookup_hashes, hits, num_slots

    def _blocks_to_take(self, hits: list[int], num_slots: int) -> int:
        """Free blocks an allocation consumes: fresh ones, plus hits that are cached but free now."""
        revived = sum(1 for block_id in hits if self.pool.blocks[block_id].ref_count == 0)
        return _cdiv(num_slots, self.block_size) - len(hits) + revived

    # -- growing sequences --------------------------------------------------------------------

    def can_append(self, seq_id: int, num_new_tokens: int = 1) -> bool:
        """Whether ``append_slots(seq_id, num_new_tokens, ...)`` would find enough free blocks."""
        return self.pool.can_allocate(self._blocks_to_append(self._state(seq_id), num_new_tokens))

    def append_slots(self, seq_id: int, num_new_tokens: int = 1, new_token_ids: Sequence[int] = ()) -> None:
        """Record ``new_token_ids`` (a sampled token, for decode) and give slots to the next
        ``num_new_tokens`` tokens (a decode step: 1; a prefill chunk: the chunk length).

        A new block is taken when the slots cross a block boundary; a block that becomes full is
        keyed for prefix caching.
        """
        state = self._state(seq_id)
        if num_new_tokens < 0:
            raise ValueError(f"sequence {seq_id}: num_new_tokens must be >= 0, got {num_new_tokens}")
        known = len(state.token_ids) + len(new_token_ids)
        if state.num_slots + num_new_tokens > known:
            raise ValueError(f"sequence {seq_id}: slots for {state.num_slots + num_new_tokens} tokens "
                             f"requested but only {known} tokens are known")
        needed = self._blocks_to_append(state, num_new_tokens)
        if not self.pool.can_allocate(needed):
            raise CacheFullError(f"sequence {seq_id}: need {needed} free KV-cache blocks, "
                                 f"{self.pool.num_free_blocks} free")
        state.token_ids.extend(new_token_ids)
        state.block_ids.extend(self.pool.allocate(needed))
        state.num_slots += num_new_tokens
        self._register_full_blocks(state)

    def _blocks_to_append(self, state: _SequenceState, num_new_tokens: int) -> int:
        return _cdiv(state.num_slots + num_new_tokens, self.block_size) - len(state.block_ids)

    def _register_full_blocks(self, state: _SequenceState) -> None:
        """Key the blocks that became full, as pending (see ``commit_step``). Slots are given just
        before the step that computes them, and in one step every cache write lands before any
        attention read, so a sequence scheduled in the same step may already reuse these blocks."""
        if not self.config.enable_prefix_caching:
            return
        for index in range(len(state.block_hashes), state.num_slots // self.block_size):
            tokens = state.token_ids[index * self.block_size:(index + 1) * self.block_size]
            block_hash = hash_block_tokens(state.block_hashes[-1] if state.block_hashes else None, tokens)
            state.block_hashes.append(block_hash)
            if self.pool.register(state.block_ids[index], block_hash):
                self._pending.append((state.block_ids[index], block_hash))

    def commit_step(self) -> None:
        """The step that computed the slots given since the last call ran: keep their blocks' keys."""
        self._pending.clear()

    def rollback_step(self) -> None:
        """The step that should have computed the slots given since the last ``commit_step`` failed:
        drop the prefix-cache keys registered for it, so no later lookup finds blocks without KV.
        The caller finishes (frees) that step's sequences too: their states still name the keys."""
        for block_id, block_hash in reversed(self._pending):
            self.pool.unregister(block_id, block_hash)
        self._pending.clear()

    # -- sharing and releasing ----------------------------------------------------------------

    def can_fork(self, parent_id: int) -> bool:
        """Whether ``fork`` would find the one free block it may need."""
        return self.pool.can_allocate(self._blocks_to_fork(self._state(parent_id)))

    def fork(self, parent_id: int, child_id: int) -> int:
        """Start ``child_id`` as a copy of ``parent_id``; return how many of its tokens have KV.

        The child shares the parent's full blocks (ref_count + 1). A partial last block is not
        shared: the parent keeps writing into it, so the child gets its own fresh last block and
        the scheduler recomputes those tokens (positions [returned value, num_slots)) -- no
        copy-on-write and no block-copy kernel, as for parallel sampling through prefix caching.
        """
        parent = self._state(parent_id)
        if child_id in self._seqs:
            raise ValueError(f"sequence {child_id} is already allocated")
        needed = self._blocks_to_fork(parent)
        if not self.pool.can_allocate(needed):
            raise CacheFullError(f"fork of sequence {parent_id}: need {needed} free KV-cache blocks, "
                                 f"{self.pool.num_free_blocks} free")
        num_full = parent.num_slots // self.block_size
        shared = parent.block_ids[:num_full]
        self.pool.touch(shared)
        num_shared_tokens = num_full * self.block_size
        self._seqs[child_id] = _SequenceState(
            list(parent.token_ids), shared + self.pool.allocate(needed), parent.block_hashes[:num_full],
            parent.num_slots, num_shared_tokens)
        return num_shared_tokens

    def _blocks_to_fork(self, parent: _SequenceState) -> int:
        return 1 if parent.num_slots % self.block_size else 0

    def free(self, seq_id: int) -> None:
        """Release a finished sequence's blocks. Keyed blocks stay findable until evicted."""
        state = self._seqs.pop(seq_id, None)
        if state is None:
            raise ValueError(f"sequence {seq_id} is not allocated (unknown id, or already freed)")
        # Tail first: the LRU then evicts a sequence's last blocks before its first ones, which are
        # the likeliest to be shared (system prompts) and without which the later ones cannot hit.
        self.pool.release(reversed(state.block_ids))

    def preempt(self, seq_id: int) -> None:
        """Free a running sequence to make room; the scheduler requeues it and later calls
        ``allocate`` with all its tokens, which finds its full blocks again unless evicted."""
        self.free(seq_id)

    # -- what the backend gets ----------------------------------------------------------------

    def block_table(self, seq_id: int) -> list[int]:
        """Block ids holding the sequence's tokens, in token order."""
        return list(self._state(seq_id).block_ids)

    def slot_mapping(self, seq_id: int, start: int, end: int) -> list[int]:
        """Cache slot (block_id * B + offset) of each token position in [start, end)."""
        state = self._state(seq_id)
        if not 0 <= start <= end <= state.num_slots:
            raise ValueError(f"sequence {seq_id}: positions [{start}, {end}) outside its {state.num_slots} slots")
        size = self.block_size
        return [state.block_ids[p // size] * size + p % size for p in range(start, end)]

    def num_slots(self, seq_id: int) -> int:
        """How many leading tokens of the sequence have a slot."""
        return self._state(seq_id).num_slots

    def num_cached_tokens(self, seq_id: int) -> int:
        """What ``allocate`` (or ``fork``) returned for the sequence."""
        return self._state(seq_id).num_cached_tokens

    def token_ids(self, seq_id: int) -> list[int]:
        return list(self._state(seq_id).token_ids)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def stats(self) -> KVCacheStats:
        return self.pool.stats()

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._seqs

    def _state(self, seq_id: int) -> _SequenceState:
        state = self._seqs.get(seq_id)
        if state is None:
            raise ValueError(f"sequence {seq_id} is not allocated (unknown id, or already freed)")
        return state


class SlotAllocator:
    """Rows of a contiguous per-sequence cache [num_slots, Hkv, max_len, D], one per sequence.

    The lowest free row is handed out first, which keeps the rows in use packed at the front.
    """

    def __init__(self, num_slots: int, max_len: int) -> None:
        if num_slots < 1 or max_len < 1:
            raise ValueError(f"num_slots ({num_slots}) and max_len ({max_len}) must be >= 1")
        self.num_slots = num_slots
        self.max_len = max_len
        self._free = list(range(num_slots))  # a heap
        self._slots: dict[int, int] = {}  # seq id -> row

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether a sequence that will hold up to ``num_tokens`` tokens gets a row now.

        Raises ``SequenceTooLongError`` when it never can: returning False would make a
        scheduler wait forever.
        """
        self._check_fits(num_tokens)
        return bool(self._free)

    def allocate(self, seq_id: int, num_tokens: int) -> int:
        """Give ``seq_id`` a row for up to ``num_tokens`` tokens (prompt plus generation limit)."""
        if seq_id in self._slots:
            raise ValueError(f"sequence {seq_id} already has slot {self._slots[seq_id]}")
        if not self.can_allocate(num_tokens):
            raise CacheFullError(f"sequence {seq_id}: all {self.num_slots} KV-cache slots are in use")
        slot = heapq.heappop(self._free)
        self._slots[seq_id] = slot
        return slot

    def free(self, seq_id: int) -> None:
        slot = self._slots.pop(seq_id, None)
        if slot is None:
            raise ValueError(f"sequence {seq_id} has no slot (unknown id, or already freed)")
        heapq.heappush(self._free, slot)

    def slot(self, seq_id: int) -> int:
        if seq_id not in self._slots:
            raise ValueError(f"sequence {seq_id} has no slot (unknown id, or already freed)")
        return self._slots[seq_id]

    def _check_fits(self, num_tokens: int) -> None:
        if num_tokens > self.max_len:
            raise SequenceTooLongError(f"a sequence of {num_tokens} tokens exceeds the cache length {self.max_len}")
        if num_tokens < 1:
            raise ValueError(f"a sequence needs at least 1 token, got {num_tokens}")
