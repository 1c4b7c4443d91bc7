"""KVCacheManager: which KV-cache blocks hold each request's tokens. No tensors live here.

Per layer the cache is ``num_blocks`` blocks of ``block_size`` tokens, [num_blocks, B, Hkv, D] (the
``BlockPool`` in block_pool.py). A request owns a *block table* (block ids in token order); its token
at position p lives at *pool index* ``table[p // B] * B + p % B`` of the flattened pool. Blocks are
shared through the prefix cache: a request whose leading full blocks are cached takes them instead
of recomputing them.

For a paged artifact the blocks are the backend's pool blocks, and each row of a step carries its
block table. A contiguous artifact keeps one cache row (its *slot*) per request instead; the blocks
are then only the memory budget that drives admission and preemption, and prefix caching is off.

Life cycle of a request (the scheduler calls ``can_*`` first; the other verbs raise
``CacheFullError`` rather than over-allocate)::

    cached = m.allocate(rid, prompt_ids)     # room for the prompt; its first ``cached`` tokens are hits
    m.pool_indices(rid, cached, m.num_allocated_tokens(rid))  # where the prefill writes its KV
    m.commit_step()                          # the step ran: its full blocks' keys are valid
    m.append(rid, 1, [sampled_id])           # each decode step: one more known token, room for one more
    m.free(rid)                              # or m.preempt(rid), then allocate again later

Prefix-cache keys of blocks that became full in a step are *pending* until ``commit_step()``: a
step that fails before writing its KV calls ``rollback_step()`` (after finishing its requests),
which drops those keys, so no later request hits a block whose KV was never written.

Letters: B block size (tokens per block), p a token position.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from moeforge.runtime.block_pool import BlockPool, CacheFullError, KVCacheStats, full_block_hashes, hash_block_tokens
from moeforge.runtime.kv_tiers.tiers import KVTiers

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVCacheConfig:
    """Paged cache geometry: ``num_blocks`` blocks of ``block_size`` tokens."""

    num_blocks: int
    block_size: int
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.num_blocks < 1 or self.block_size < 1:
            raise ValueError(f"num_blocks ({self.num_blocks}) and block_size ({self.block_size}) must be >= 1")


@dataclass
class _Allocation:
    """One request's share of the cache."""

    token_ids: list[int]  # every token known so far (prompt, then sampled ones)
    block_ids: list[int]  # the block table: ceil(num_allocated / B) blocks
    block_hashes: list[bytes]  # chain keys of the full allocated blocks, registered or not
    num_allocated: int  # tokens [0, num_allocated) have a pool index
    num_cached_tokens: int  # tokens whose KV was already in the cache when the request got its blocks


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """The scheduler's view of the paged cache: blocks per request, prefix reuse, pool indices.

    Requests are identified by their int id. The manager keeps each request's token ids because a
    block's key is computed from them when the block becomes full. Room is given to tokens in
    order: ``num_allocated_tokens(rid)`` tokens have a pool index, and the scheduler computes KV for
    the positions it has not computed yet (from ``num_cached_tokens`` on, for a new request).
    """

    def __init__(self, config: KVCacheConfig, tiers: KVTiers | None = None) -> None:
        """``tiers``: host / disk levels below the pool (runtime/kv_tiers): evicted blocks are demoted there, and a
        prefix that continues there is promoted back instead of recomputed. Needs prefix caching."""
        if tiers is not None and not config.enable_prefix_caching:
            raise ValueError("KV tiers are keyed by the prefix cache: enable prefix caching to use them")
        self.config = config
        self.block_size = config.block_size
        self.tiers = tiers
        self.pool = BlockPool(config.num_blocks, on_evict=self._demote if tiers is not None else None)
        if tiers is not None:
            tiers.in_pool = self.pool.is_cached
        self._allocations: dict[int, _Allocation] = {}
        self._pending: list[tuple[int, bytes]] = []  # (block id, key) registered since the last commit_step

    # -- new requests -------------------------------------------------------------------------

    def can_allocate(self, request_id: int, token_ids: Sequence[int], token_budget: int | None = None) -> bool:
        """Whether ``allocate`` with the same arguments would succeed now."""
        _, hits, _, num_allocated = self._plan(request_id, token_ids, token_budget)
        return self.pool.can_allocate(self._blocks_to_take(hits, num_allocated))

    def allocate(self, request_id: int, token_ids: Sequence[int], token_budget: int | None = None) -> int:
        """Start a request whose known tokens are ``token_ids``; return how many are already cached.

        Reuses the longest cached run of full blocks, but always leaves at least the last token to
        compute: its logits are needed to sample. Then makes room for at most ``token_budget``
        further tokens (default: all of them; a smaller budget is a prefill chunk, continued with
        ``append``). A preempted request comes back through here with all its tokens.
        """
        lookup_hashes, hits, found_below, num_allocated = self._plan(request_id, token_ids, token_budget)
        needed = self._blocks_to_take(hits, num_allocated)
        # Another process may have stored more of this chain on disk since ``can_allocate`` looked: with a token
        # budget each block found below costs a pool block, so promote fewer rather than fail what it allowed.
        while found_below and not self.pool.can_allocate(needed):
            found_below -= 1
            num_allocated = self._room(len(token_ids), (len(hits) + found_below) * self.block_size, token_budget)
            needed = self._blocks_to_take(hits, num_allocated)
        if not self.pool.can_allocate(needed):
            raise CacheFullError(f"request {request_id}: need {needed} free KV-cache blocks, "
                                 f"{self.pool.num_free_blocks} free")
        # Take the hits first: allocating fresh blocks could otherwise evict them.
        hits = self.pool.acquire_prefix(lookup_hashes) if self.config.enable_prefix_caching else []
        fresh = self.pool.allocate(_cdiv(num_allocated, self.block_size) - len(hits))
        keys = lookup_hashes[:len(hits)]
        if self.tiers is not None:
            lower = lookup_hashes[len(hits):len(hits) + found_below]
            promoted = self._promote(lower, fresh[:len(lower)], len(lookup_hashes) - len(hits))
            for block_id, block_hash in zip(fresh[:promoted], lower[:promoted], strict=True):
                self.pool.register(block_id, block_hash)  # written already: committed, not pending
            keys = lookup_hashes[:len(hits) + promoted]
            if promoted < len(lower):  # a block vanished or failed its check since _plan: compute from there
                num_allocated = self._room(len(token_ids), len(keys) * self.block_size, token_budget)
                surplus = len(hits) + len(fresh) - _cdiv(num_allocated, self.block_size)
                if surplus > 0:
                    self.pool.release(reversed(fresh[len(fresh) - surplus:]))
                    fresh = fresh[:len(fresh) - surplus]
        num_cached = len(keys) * self.block_size
        allocation = _Allocation(list(token_ids), hits + fresh, keys, num_allocated, num_cached)
        self._allocations[request_id] = allocation
        self._register_full_blocks(allocation)
        return num_cached

    def _plan(self, request_id: int, token_ids: Sequence[int],
              token_budget: int | None) -> tuple[list[bytes], list[int], int, int]:
        """(hashes to look up, cached block ids found, blocks after them found below the pool, tokens the request
        would have room for) for ``allocate``."""
        if request_id in self._allocations:
            raise ValueError(f"request {request_id} is already allocated")
        if not token_ids:
            raise ValueError(f"request {request_id} has no tokens")
        if token_budget is not None and token_budget < 1:
            raise ValueError(f"request {request_id}: token_budget must be >= 1, got {token_budget}")
        lookup_hashes: list[bytes] = []
        hits: list[int] = []
        if self.config.enable_prefix_caching:
            lookup_hashes = self._lookup_hashes(token_ids)
            hits = self.pool.lookup(lookup_hashes)
        lower = self.tiers.find(lookup_hashes[len(hits):]) if self.tiers is not None else 0
        num_allocated = self._room(len(token_ids), (len(hits) + lower) * self.block_size, token_budget)
        return lookup_hashes, hits, lower, num_allocated

    def _lookup_hashes(self, token_ids: Sequence[int]) -> list[bytes]:
        """Keys of the full blocks a request may find cached: only blocks that end before its last token (whose
        logits must be computed to sample, see ``allocate``)."""
        lookable = token_ids[:(len(token_ids) - 1) // self.block_size * self.block_size]
        return full_block_hashes(lookable, self.block_size)

    @staticmethod
    def _room(num_tokens: int, num_cached: int, token_budget: int | None) -> int:
        """Tokens an allocation gives room to: the cached ones, then at most ``token_budget`` to compute."""
        to_compute = num_tokens - num_cached
        return num_cached + (to_compute if token_budget is None else min(token_budget, to_compute))

    def _blocks_to_take(self, hits: list[int], num_allocated: int) -> int:
        """Free blocks an allocation consumes: fresh ones, plus hits that are cached but free now."""
        revived = sum(1 for block_id in hits if self.pool.blocks[block_id].ref_count == 0)
        return _cdiv(num_allocated, self.block_size) - len(hits) + revived

    # -- growing requests ---------------------------------------------------------------------

    def can_append(self, request_id: int, num_new_tokens: int = 1, num_lookahead_tokens: int = 0) -> bool:
        """Whether ``append(request_id, num_new_tokens, ..., num_lookahead_tokens)`` would find enough free blocks."""
        return self.pool.can_allocate(self._blocks_to_append(self._allocation(request_id),
                                                             num_new_tokens + num_lookahead_tokens))

    def append(self, request_id: int, num_new_tokens: int = 1, new_token_ids: Sequence[int] = (),
               num_lookahead_tokens: int = 0) -> None:
        """Record ``new_token_ids`` (a sampled token, for decode) and make room for the next
        ``num_new_tokens`` tokens (a decode step: 1; a prefill chunk: the chunk length).

        A new block is taken when the room crosses a block boundary; a block that becomes full is
        keyed for prefix caching.

        ``num_lookahead_tokens``: blocks also for that many positions after the room, whose tokens are not known
        yet (speculative draft tokens, vLLM's lookahead slots): their KV is written, and kept where the
        verification accepts them, which the next ``append`` records by covering them with their token ids.
        They get no room and no prefix-cache key until then.
        """
        allocation = self._allocation(request_id)
        if num_new_tokens < 0:
            raise ValueError(f"request {request_id}: num_new_tokens must be >= 0, got {num_new_tokens}")
        known = len(allocation.token_ids) + len(new_token_ids)
        if allocation.num_allocated + num_new_tokens > known:
            raise ValueError(f"request {request_id}: room for {allocation.num_allocated + num_new_tokens} tokens "
                             f"requested but only {known} tokens are known")
        if num_lookahead_tokens < 0:
            raise ValueError(f"request {request_id}: num_lookahead_tokens must be >= 0, got {num_lookahead_tokens}")
        needed = self._blocks_to_append(allocation, num_new_tokens + num_lookahead_tokens)
        if not self.pool.can_allocate(needed):
            raise CacheFullError(f"request {request_id}: need {needed} free KV-cache blocks, "
                                 f"{self.pool.num_free_blocks} free")
        allocation.token_ids.extend(new_token_ids)
        allocation.block_ids.extend(self.pool.allocate(needed))
        allocation.num_allocated += num_new_tokens
        self._register_full_blocks(allocation)

    def _blocks_to_append(self, allocation: _Allocation, num_new_tokens: int) -> int:
        # Lookahead blocks of an earlier append may already cover the new room.
        return max(_cdiv(allocation.num_allocated + num_new_tokens, self.block_size) - len(allocation.block_ids), 0)

    def _register_full_blocks(self, allocation: _Allocation) -> None:
        """Key the blocks that became full, as pending (see ``commit_step``). Room is made just
        before the step that computes it, and in one step every cache write lands before any
        attention read, so a request scheduled in the same step may already reuse these blocks."""
        if not self.config.enable_prefix_caching:
            return
        for index in range(len(allocation.block_hashes), allocation.num_allocated // self.block_size):
            tokens = allocation.token_ids[index * self.block_size:(index + 1) * self.block_size]
            parent = allocation.block_hashes[-1] if allocation.block_hashes else None
            block_hash = hash_block_tokens(parent, tokens)
            allocation.block_hashes.append(block_hash)
            if self.pool.register(allocation.block_ids[index], block_hash):
                self._pending.append((allocation.block_ids[index], block_hash))

    def commit_step(self) -> None:
        """The step that computed the tokens given room since the last call ran: keep their blocks' keys."""
        self._pending.clear()

    def rollback_step(self) -> None:
        """The step that should have computed the tokens given room since the last ``commit_step`` failed:
        drop the prefix-cache keys registered for it, so no later lookup finds blocks without KV.
        The caller finishes (frees) that step's requests too: their allocations still name the keys."""
        for block_id, block_hash in reversed(self._pending):
            self.pool.unregister(block_id, block_hash)
        self._pending.clear()

    # -- tiers below the pool -----------------------------------------------------------------

    def _demote(self, block_id: int, block_hash: bytes) -> None:
        """The pool evicts a cached block: the tiers copy it out first, unless its KV is not written yet (a key
        pending until ``commit_step``). A tier failure loses the block below L1, never the step."""
        assert self.tiers is not None
        if (block_id, block_hash) in self._pending:
            return
        try:
            self.tiers.demote(block_id, block_hash)
        except Exception:  # a cache below L1 is best effort: losing a block there costs only its recompute
            log.exception("KV block %d could not be demoted; it will be recomputed if needed again", block_id)

    def _promote(self, keys: list[bytes], block_ids: list[int], looked_up: int) -> int:
        """``tiers.promote``, where a failure promotes nothing: the blocks are then computed, the request goes on."""
        assert self.tiers is not None
        try:
            return self.tiers.promote(keys, block_ids, looked_up)
        except Exception:  # a cache below L1 is best effort: a failure costs the blocks' recompute
            log.exception("KV blocks could not be promoted from the tiers below the pool; they will be recomputed")
            return 0

    def prefetch(self, token_ids: Sequence[int]) -> None:
        """A request with these tokens was queued: start reading its prefix blocks that are below L1 into host
        memory (in the background), so its admission does not wait for the disk."""
        if self.tiers is None or len(token_ids) <= self.block_size:
            return
        hashes = self._lookup_hashes(token_ids)
        self.tiers.prefetch(hashes[len(self.pool.lookup(hashes)):])

    def flush_tiers(self) -> int:
        """Write every committed cached block (L1 and below) to the disk tier, for the next process; returns the
        blocks written (0 without a disk tier). For a clean shutdown: nothing else may run meanwhile."""
        if self.tiers is None:
            return 0
        pending = set(self._pending)
        cached = [(block_id, key) for key, block_id in self.pool.cached_blocks().items()
                  if (block_id, key) not in pending]
        return self.tiers.flush(cached)

    # -- releasing ----------------------------------------------------------------------------

    def free(self, request_id: int) -> None:
        """Release a finished request's blocks. Keyed blocks stay findable until evicted."""
        allocation = self._allocations.pop(request_id, None)
        if allocation is None:
            raise ValueError(f"request {request_id} is not allocated (unknown id, or already freed)")
        # Tail first: the LRU then evicts a request's last blocks before its first ones, which are
        # the likeliest to be shared (system prompts) and without which the later ones cannot hit.
        self.pool.release(reversed(allocation.block_ids))

    def preempt(self, request_id: int) -> None:
        """Free a running request to make room; the scheduler requeues it and later calls
        ``allocate`` with all its tokens, which finds its full blocks again unless evicted."""
        self.free(request_id)

    # -- what the backend gets ----------------------------------------------------------------

    def block_table(self, request_id: int) -> list[int]:
        """Block ids holding the request's tokens, in token order (then its lookahead blocks)."""
        return list(self._allocation(request_id).block_ids)

    def pool_indices(self, request_id: int, start: int, end: int) -> list[int]:
        """Pool index (block_id * B + offset) of each token position in [start, end)."""
        allocation = self._allocation(request_id)
        if not 0 <= start <= end <= allocation.num_allocated:
            raise ValueError(f"request {request_id}: positions [{start}, {end}) outside its "
                             f"{allocation.num_allocated} allocated tokens")
        size = self.block_size
        return [allocation.block_ids[p // size] * size + p % size for p in range(start, end)]

    # -- reading ------------------------------------------------------------------------------

    def num_allocated_tokens(self, request_id: int) -> int:
        """How many leading tokens of the request have a pool index."""
        return self._allocation(request_id).num_allocated

    def num_known_tokens(self, request_id: int) -> int:
        """How many of the request's tokens the manager has been told (``allocate`` and ``append``)."""
        return len(self._allocation(request_id).token_ids)

    def num_cached_tokens(self, request_id: int) -> int:
        """What ``allocate`` returned for the request."""
        return self._allocation(request_id).num_cached_tokens

    def token_ids(self, request_id: int) -> list[int]:
        return list(self._allocation(request_id).token_ids)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def stats(self) -> KVCacheStats:
        return self.pool.stats()

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._allocations

    def _allocation(self, request_id: int) -> _Allocation:
        allocation = self._allocations.get(request_id)
        if allocation is None:
            raise ValueError(f"request {request_id} is not allocated (unknown id, or already freed)")
        return allocation
