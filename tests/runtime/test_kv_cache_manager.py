"""KV-cache bookkeeping on block ids only: no model, no tensors.

Exact tests use 11 blocks of 16 tokens (as vLLM's allocator tests do) and assert block ids,
reference counts and eviction order. A state machine then runs random allocate / append / free /
preempt sequences against a shadow cache memory and checks the invariants after each step.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from moeforge.runtime.block_pool import CacheFullError, KVCacheStats, full_block_hashes, hash_block_tokens
from moeforge.runtime.kv_cache_manager import KVCacheConfig, KVCacheManager

B = 16


def make_manager(num_blocks: int = 11, *, prefix_caching: bool = True) -> KVCacheManager:
    return KVCacheManager(KVCacheConfig(num_blocks=num_blocks, block_size=B, enable_prefix_caching=prefix_caching))


def ref_counts(manager: KVCacheManager) -> list[int]:
    return [block.ref_count for block in manager.pool.blocks]


PREFIX = list(range(1000, 1064))  # 64 tokens: 4 full blocks


# -- hashing ------------------------------------------------------------------------------------

def test_block_hash_is_stable_and_chained():
    # A pinned value: Python's salted hash() would change between processes.
    assert hash_block_tokens(None, [1, 2, 3]).hex() == "20e6940ce341efc8b45db2e362c7ce61"
    first = hash_block_tokens(None, range(B))
    assert hash_block_tokens(first, range(B)) != first  # same tokens, different prefix
    assert full_block_hashes(list(range(2 * B + 5)), B) == [first, hash_block_tokens(first, range(B, 2 * B))]


# -- allocation and prefix caching --------------------------------------------------------------

def test_allocate_fresh_request():
    m = make_manager()
    assert m.can_allocate(0, list(range(50)))
    assert m.allocate(0, list(range(50))) == 0
    assert m.block_table(0) == [0, 1, 2, 3]
    assert m.num_free_blocks == 7
    assert m.num_allocated_tokens(0) == 50
    # The 3 full blocks are keyed; the partial 4th is not.
    assert [b.block_hash is not None for b in m.pool.blocks[:4]] == [True, True, True, False]
    stats = m.stats()
    assert (stats.hits, stats.misses, stats.blocks_in_use, stats.cached_blocks) == (0, 3, 4, 3)


def test_prefix_hit_shares_blocks():
    m = make_manager()
    assert m.allocate(0, [*PREFIX, 1, 2, 3, 4, 5]) == 0
    assert m.block_table(0) == [0, 1, 2, 3, 4]
    assert m.allocate(1, [*PREFIX, 7, 7, 7, 7, 7, 7, 7]) == 64
    assert m.block_table(1) == [0, 1, 2, 3, 5]
    assert ref_counts(m)[:6] == [2, 2, 2, 2, 1, 1]
    assert m.num_cached_tokens(1) == 64
    # Request 0 looked up 4 blocks (all missed); request 1 hit all 4.
    assert (m.stats().hits, m.stats().misses, m.stats().hit_rate) == (4, 4, 0.5)
    # The prefill of request 1 writes only its 7 new tokens, into block 5.
    assert m.pool_indices(1, 64, 71) == list(range(5 * B, 5 * B + 7))


def test_fully_cached_prompt_still_computes_its_last_token():
    m = make_manager()
    m.allocate(0, PREFIX)
    # Same 64 tokens: the 4th block would cover the last token, whose logits must be computed.
    assert m.allocate(1, PREFIX) == 48
    assert m.block_table(1) == [0, 1, 2, 4]
    # Block 4 ends up with the same content as block 3, which keeps the key.
    assert m.pool.blocks[4].block_hash is None
    assert m.pool.cached_blocks()[full_block_hashes(PREFIX, B)[3]] == 3


def test_lru_eviction_order_after_frees():
    m = make_manager()
    m.allocate(0, [*PREFIX, 1, 2, 3, 4, 5])  # blocks 0-4
    m.allocate(1, [*PREFIX, 7, 7, 7, 7, 7, 7, 7])  # blocks 0-3 shared, 5
    m.free(0)
    assert ref_counts(m)[:6] == [1, 1, 1, 1, 0, 1]
    m.free(1)
    # Uncached blocks first (4 then 5 in the order they were freed), then the cached ones, each
    # request's tail first, so the shared prefix's head is evicted last.
    assert m.pool.free_block_ids() == [6, 7, 8, 9, 10, 4, 5, 3, 2, 1, 0]
    assert m.stats().cached_blocks == 4

    # 9 blocks of unrelated tokens: the 7 uncached blocks, then evict 3 and 2.
    m.allocate(2, list(range(9 * B)))
    assert m.block_table(2) == [6, 7, 8, 9, 10, 4, 5, 3, 2]
    assert m.stats().evictions == 2
    assert m.pool.free_block_ids() == [1, 0]
    # The first 32 prefix tokens are still cached; blocks 2 and 3 no longer hold theirs.
    m.free(2)
    assert m.allocate(3, [*PREFIX, 9]) == 32
    assert m.block_table(3)[:2] == [0, 1]


def test_hit_on_a_freed_block_revives_it_and_moves_it_to_the_lru_tail():
    m = make_manager()
    m.allocate(0, list(range(2 * B + 1)))  # blocks 0, 1 (keyed), 2
    m.allocate(1, list(range(500, 500 + 2 * B + 1)))  # blocks 3, 4 (keyed), 5
    m.free(0)
    m.free(1)
    assert m.pool.free_block_ids() == [6, 7, 8, 9, 10, 2, 5, 1, 0, 4, 3]
    assert m.allocate(2, list(range(B + 3))) == B  # hits block 0
    assert m.pool.blocks[0].ref_count == 1
    assert m.num_free_blocks == 9  # block 0 revived, block 6 fresh
    m.free(2)
    assert m.pool.free_block_ids() == [7, 8, 9, 10, 2, 5, 6, 1, 4, 3, 0]


def test_can_allocate_counts_free_cached_hits():
    m = make_manager(num_blocks=5)
    m.allocate(0, [*PREFIX, 1])  # 5 blocks: all of them
    assert not m.can_allocate(1, [1])
    m.free(0)
    m.allocate(2, [1])  # takes block 4, the only uncached free block
    # 4 free blocks, all of them prefix hits: reviving them takes them off the free list too,
    # which leaves none for the 5th block.
    assert not m.can_allocate(1, [*PREFIX, 2])
    with pytest.raises(CacheFullError, match="need 5 free KV-cache blocks, 4 free"):
        m.allocate(1, [*PREFIX, 2])
    assert m.stats().hits == 0  # the refused allocation took nothing
    m.free(2)
    assert m.can_allocate(1, [*PREFIX, 2])
    assert m.allocate(1, [*PREFIX, 2]) == 64
    assert m.block_table(1) == [0, 1, 2, 3, 4]


def test_preempt_then_reallocate_finds_own_blocks():
    m = make_manager()
    m.allocate(0, list(range(40)))
    m.append(0, 1, [40])
    m.preempt(0)
    assert 0 not in m
    assert m.num_free_blocks == 11
    assert m.allocate(0, list(range(41))) == 32
    assert m.block_table(0) == [0, 1, 3]


def test_prefix_caching_disabled():
    m = make_manager(prefix_caching=False)
    m.allocate(0, PREFIX)
    assert m.allocate(1, PREFIX) == 0
    assert m.block_table(1) == [4, 5, 6, 7]
    m.free(0)
    assert m.pool.free_block_ids() == [8, 9, 10, 3, 2, 1, 0]
    assert m.stats() == KVCacheStats(hits=0, misses=0, evictions=0, blocks_in_use=4, free_blocks=7, cached_blocks=0)


# -- growing requests ---------------------------------------------------------------------------

def test_decode_crosses_block_boundary_and_keys_full_block():
    m = make_manager()
    m.allocate(0, list(range(15)))
    assert m.block_table(0) == [0]
    assert m.pool.blocks[0].block_hash is None
    m.append(0, 1, [15])  # the 16th token fills block 0
    assert m.block_table(0) == [0]
    assert m.pool.blocks[0].block_hash == hash_block_tokens(None, range(16))
    assert m.can_append(0)
    m.append(0, 1, [16])  # position 16 needs a new block
    assert m.block_table(0) == [0, 1]
    assert m.pool_indices(0, 14, 17) == [14, 15, B]


def test_chunked_prefill():
    m = make_manager()
    prompt = list(range(40))
    assert m.can_allocate(0, prompt, token_budget=20)
    assert m.allocate(0, prompt, token_budget=20) == 0
    assert (m.num_allocated_tokens(0), m.block_table(0)) == (20, [0, 1])
    assert m.pool.blocks[1].block_hash is None  # only 4 of its tokens have room yet
    m.append(0, 20)
    assert (m.num_allocated_tokens(0), m.block_table(0)) == (40, [0, 1, 2])
    assert m.pool.blocks[1].block_hash is not None
    with pytest.raises(ValueError, match="only 40 tokens are known"):
        m.append(0, 1)
    # A second request's budget counts from its cached prefix.
    assert m.allocate(1, prompt, token_budget=5) == 32
    assert m.num_allocated_tokens(1) == 37


def test_out_of_blocks():
    m = make_manager(num_blocks=2)
    m.allocate(0, list(range(2 * B)))
    assert not m.can_append(0)
    with pytest.raises(CacheFullError, match="need 1 free KV-cache blocks, 0 free"):
        m.append(0, 1, [7])
    assert m.token_ids(0) == list(range(2 * B))  # a refused append changes nothing
    assert not m.can_allocate(1, [1])
    with pytest.raises(CacheFullError):
        m.allocate(1, [1])
    assert 1 not in m


# -- errors -------------------------------------------------------------------------------------

def test_unknown_and_double_free_name_the_request():
    m = make_manager()
    with pytest.raises(ValueError, match="request 42 is not allocated"):
        m.free(42)
    m.allocate(7, [1, 2, 3])
    m.free(7)
    with pytest.raises(ValueError, match="request 7 is not allocated"):
        m.free(7)
    for call in (m.block_table, m.num_allocated_tokens, m.num_known_tokens, m.can_append, m.preempt):
        with pytest.raises(ValueError, match="request 7"):
            call(7)
    m.allocate(8, [1])
    with pytest.raises(ValueError, match="request 8 is already allocated"):
        m.allocate(8, [1])
    with pytest.raises(ValueError, match="outside its 1 allocated tokens"):
        m.pool_indices(8, 0, 2)
    with pytest.raises(ValueError, match="no tokens"):
        m.allocate(9, [])


# -- random operation sequences -----------------------------------------------------------------

SB = 4  # small blocks and few of them, so that hits, evictions and full caches all happen
PREFIXES = [[], [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9], [5] * 12]
tokens = st.lists(st.integers(0, 3), max_size=10)


class KVCacheMachine(RuleBasedStateMachine):
    """Every op is checked with can_* first; a refused op must raise CacheFullError and change nothing.

    ``memory`` stands for the cache contents: computing position p of a request writes its whole
    token prefix at p's pool index. Reading every request's indices back then proves that no write
    landed in a block another request still reads, and that a hit block holds what its key says.
    """

    def __init__(self) -> None:
        super().__init__()
        self.m = KVCacheManager(KVCacheConfig(num_blocks=12, block_size=SB))
        self.memory: dict[int, tuple[int, ...]] = {}
        self.computed: dict[int, int] = {}  # seq id -> positions with KV written
        self.next_id = 0

    def compute(self, request_id: int, start: int, end: int) -> None:
        token_ids = self.m.token_ids(request_id)
        for p, index in zip(range(start, end), self.m.pool_indices(request_id, start, end), strict=True):
            self.memory[index] = tuple(token_ids[:p + 1])
        self.computed[request_id] = end

    def snapshot(self) -> tuple:
        return ([(b.ref_count, b.block_hash) for b in self.m.pool.blocks], self.m.pool.free_block_ids(),
                {s: self.m.block_table(s) for s in self.computed})

    @rule(prefix=st.sampled_from(PREFIXES), suffix=tokens, budget=st.none() | st.integers(1, 8))
    def allocate(self, prefix, suffix, budget):
        token_ids = prefix + suffix or [0]
        request_id, self.next_id = self.next_id, self.next_id + 1
        if not self.m.can_allocate(request_id, token_ids, budget):
            before = self.snapshot()
            with pytest.raises(CacheFullError):
                self.m.allocate(request_id, token_ids, budget)
            assert self.snapshot() == before
            return
        cached = self.m.allocate(request_id, token_ids, budget)
        assert cached % SB == 0 and cached < len(token_ids)
        self.compute(request_id, cached, self.m.num_allocated_tokens(request_id))

    @precondition(lambda self: self.computed)
    @rule(data=st.data(), new_token=st.integers(0, 3), n=st.integers(1, 6))
    def append(self, data, new_token, n):
        """Continue a prefill chunk if the prompt has tokens without room, else decode one token."""
        request_id = data.draw(st.sampled_from(sorted(self.computed)))
        pending = len(self.m.token_ids(request_id)) - self.m.num_allocated_tokens(request_id)
        n, new_token_ids = (min(n, pending), []) if pending else (1, [new_token])
        if not self.m.can_append(request_id, n):
            before = self.snapshot()
            with pytest.raises(CacheFullError):
                self.m.append(request_id, n, new_token_ids)
            assert self.snapshot() == before
            return
        start = self.m.num_allocated_tokens(request_id)
        self.m.append(request_id, n, new_token_ids)
        self.compute(request_id, start, start + n)

    @precondition(lambda self: self.computed)
    @rule(data=st.data(), preempt=st.booleans())
    def free(self, data, preempt):
        request_id = data.draw(st.sampled_from(sorted(self.computed)))
        (self.m.preempt if preempt else self.m.free)(request_id)
        del self.computed[request_id]
        with pytest.raises(ValueError, match=f"request {request_id} "):
            self.m.free(request_id)

    @invariant()
    def blocks_are_accounted_for(self):
        pool = self.m.pool
        free = pool.free_block_ids()
        used = [b.block_id for b in pool.blocks if b.ref_count > 0]
        assert len(set(free)) == len(free) == pool.num_free_blocks
        assert sorted(free + used) == list(range(pool.num_blocks))  # no leak, nothing both free and used
        assert all(pool.blocks[b].ref_count == 0 for b in free)
        assert pool.stats().blocks_in_use == len(used)

    @invariant()
    def ref_counts_match_tables(self):
        tables = [self.m.block_table(s) for s in self.computed]
        for table in tables:
            assert len(set(table)) == len(table)
        for block in self.m.pool.blocks:
            assert block.ref_count == sum(block.block_id in table for table in tables)

    @invariant()
    def cache_keys_match_contents(self):
        pool = self.m.pool
        cached = pool.cached_blocks()
        assert {b.block_id: b.block_hash for b in pool.blocks if b.block_hash} == {v: k for k, v in cached.items()}
        for block_hash, block_id in cached.items():
            # The last pool index of a keyed block holds every token up to the block's end.
            content = self.memory[block_id * SB + SB - 1]
            assert full_block_hashes(content, SB)[-1] == block_hash

    @invariant()
    def requests_read_their_own_tokens(self):
        for request_id, computed in self.computed.items():
            token_ids = self.m.token_ids(request_id)
            assert computed == self.m.num_allocated_tokens(request_id)
            assert self.m.num_known_tokens(request_id) == len(token_ids)
            for p, index in enumerate(self.m.pool_indices(request_id, 0, computed)):
                assert self.memory[index] == tuple(token_ids[:p + 1])


TestKVCacheMachine = KVCacheMachine.TestCase
TestKVCacheMachine.settings = settings(max_examples=100, stateful_step_count=30, deadline=None, derandomize=True)


@pytest.mark.parametrize("free_first", [True, False])
def test_rollback_step_drops_only_the_keys_of_the_failed_step(free_first):
    """Keys of blocks filled since the last commit_step are pending: a rollback removes them from the prefix
    cache (the blocks become plain free blocks), keys committed earlier stay findable."""
    m = make_manager()
    prompt = list(range(2 * B + 3))
    m.allocate(0, prompt)  # 2 full blocks keyed
    m.commit_step()
    m.allocate(1, list(range(100, 100 + 3 * B)))  # 3 full blocks keyed, pending
    assert m.stats().cached_blocks == 5
    if free_first:
        m.free(1)
        m.rollback_step()
    else:
        m.rollback_step()
        m.free(1)
    assert m.stats().cached_blocks == 2 and m.num_free_blocks == 11 - 3
    assert m.pool.lookup(full_block_hashes(list(range(100, 100 + 3 * B)), B)) == []
    assert len(m.pool.lookup(full_block_hashes(prompt, B))) == 2
    m.free(0)
    m.allocate(2, list(range(100, 100 + 3 * B)))
    assert m.num_cached_tokens(2) == 0 and m.stats().evictions == 0  # nothing stale to hit or evict
