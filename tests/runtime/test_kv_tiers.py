"""KV tiers below the pool on block ids and numpy pools only (no model): the codec, the host LRU, and the tiers
under a ``KVCacheManager`` -- demotion on eviction, promotion bit for bit, the disk tier behind the host one,
prefetch, flush for the next process, and every failure below L1 costing a recompute, never a wrong block."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from moeforge.runtime.backends.base import BlockLayout, PoolShape
from moeforge.runtime.block_pool import full_block_hashes
from moeforge.runtime.kv_cache_manager import KVCacheConfig, KVCacheManager
from moeforge.runtime.kv_tiers.block_codec import BlockCodec
from moeforge.runtime.kv_tiers.host_tier import HostTier
from moeforge.runtime.kv_tiers.tiers import KVTiers, TierSettings

B = 4  # tokens per block
LAYOUT = BlockLayout((PoolShape((B, 2, 3), "float32"), PoolShape((B, 1, 5), "float32")))


class FakePools:
    """A BlockIO over numpy pools; ``fill`` writes what a step would compute for a block (its key's bytes)."""

    def __init__(self, num_blocks: int) -> None:
        self.arrays = [np.zeros((num_blocks, *p.shape), np.float32) for p in LAYOUT.pools]

    def layout(self) -> BlockLayout:
        return LAYOUT

    def read(self, block_ids):
        return [[a[b].copy() for a in self.arrays] for b in block_ids]

    def write(self, block_ids, rows):
        for block_id, block in zip(block_ids, rows, strict=True):
            for array, row in zip(self.arrays, block, strict=True):
                array[block_id] = row

    def content(self, key: bytes) -> list[np.ndarray]:
        rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
        return [rng.standard_normal(p.shape).astype(np.float32) for p in LAYOUT.pools]


def run_prompt(manager: KVCacheManager, pools: FakePools, rid: int, tokens: list[int]) -> int:
    """Allocate ``tokens`` as request ``rid``, 'compute' the blocks that were not cached, commit; returns the cached
    token count. Asserts every cached block holds exactly its key's content."""
    cached = manager.allocate(rid, tokens)
    table = manager.block_table(rid)
    hashes = full_block_hashes(tokens, B)
    for index, key in enumerate(hashes):
        if index * B < cached:
            for got, want in zip(pools.read([table[index]])[0], pools.content(key), strict=True):
                np.testing.assert_array_equal(got, want)  # a promoted block is the demoted one, bit for bit
        else:
            pools.write([table[index]], [pools.content(key)])
    manager.commit_step()
    return cached


def prompt(first: int, blocks: int) -> list[int]:
    return [*range(first, first + blocks * B), first + 7777]  # + 1 token: every full block may hit


def make(tmp_path: Path | None = None, *, num_blocks: int = 4, host: int = 1 << 20, disk: int = 1 << 20,
         prefetch: bool = False, dtype: str = "native") -> tuple[KVCacheManager, FakePools, KVTiers]:
    pools = FakePools(num_blocks)
    settings = TierSettings(host_bytes=host, disk_dir=tmp_path, disk_bytes=disk, offload_dtype=dtype,
                            prefetch=prefetch)
    tiers = KVTiers(settings, pools, "artifact-a" if tmp_path is not None else None)
    return KVCacheManager(KVCacheConfig(num_blocks, B), tiers), pools, tiers


def leave_on_disk(tmp_path: Path, tokens: list[int]) -> None:
    """A process that served ``tokens`` and shut down cleanly: their blocks are in ``tmp_path``."""
    manager, pools, tiers = make(tmp_path, num_blocks=4, host=0)
    run_prompt(manager, pools, 0, tokens)
    manager.free(0)
    manager.flush_tiers()
    tiers.close()


# -- codec and host store -----------------------------------------------------------------------

def test_codec_native_is_bit_exact_and_int8_is_bounded():
    rows = FakePools(1).content(b"k" * 16)
    native = BlockCodec(LAYOUT)
    assert len(native.encode(rows)) == native.nbytes == LAYOUT.nbytes
    for got, want in zip(native.decode(native.encode(rows)), rows, strict=True):
        np.testing.assert_array_equal(got, want)
    int8 = BlockCodec(LAYOUT, "int8")
    assert int8.nbytes < LAYOUT.nbytes and int8.tag != native.tag
    for got, want in zip(int8.decode(int8.encode(rows)), rows, strict=True):
        scale = np.abs(want).max(axis=-1, keepdims=True) / 127
        assert np.all(np.abs(got - want) <= scale / 2 + 1e-7)  # half a step per (token, head)
    with pytest.raises(ValueError, match="does not match its pool"):
        native.encode([rows[1], rows[0]])
    with pytest.raises(ValueError, match="unknown"):
        BlockCodec(LAYOUT, "fp4")


def test_host_tier_is_an_lru_that_returns_what_it_pushes_out():
    host = HostTier(10)
    assert host.put(b"a", b"1234") == [] and host.put(b"b", b"1234") == []
    assert host.get(b"a") == b"1234"  # a is now the most recent
    assert host.put(b"c", b"1234") == [(b"b", b"1234")]
    assert host.put(b"big", b"x" * 11) == [(b"big", b"x" * 11)] and b"big" not in host
    assert host.pop(b"a") == b"1234" and host.nbytes == 4 and len(host) == 1


# -- under the manager --------------------------------------------------------------------------

def test_evicted_blocks_are_promoted_from_host_instead_of_recomputed():
    manager, pools, tiers = make(num_blocks=4, disk=1)
    assert run_prompt(manager, pools, 0, prompt(0, 3)) == 0
    manager.free(0)
    assert run_prompt(manager, pools, 1, prompt(100, 3)) == 0  # evicts request 0's three cached blocks
    manager.free(1)
    stats = tiers.stats()
    assert stats.demotions == 3 and stats.host_blocks == 3
    assert run_prompt(manager, pools, 2, prompt(0, 3)) == 3 * B  # all three promoted (contents checked)
    stats = tiers.stats()
    assert (stats.promotions, stats.host_hits, stats.host_misses) == (3, 3, 6)  # misses: the two cold prompts
    assert manager.pool.stats().hits == 0  # L1 missed them all: the hits came from below
    manager.free(2)
    # L2 is exclusive: the promoted blocks left it (request 1's blocks, evicted meanwhile, are there now)
    assert all(key not in tiers.host for key in full_block_hashes(prompt(0, 3), B))


def test_a_block_whose_kv_is_not_written_yet_is_never_demoted():
    manager, _, tiers = make(num_blocks=2)
    manager.allocate(0, prompt(0, 1))  # its full block is keyed, pending until the step that computes it ran
    manager.free(0)  # preempted in the same schedule, before the step
    manager.allocate(1, prompt(50, 1))  # takes both blocks: the keyed one is evicted with its KV never written
    assert tiers.stats().demotions == 0 and len(tiers.host) == 0
    manager.commit_step()
    manager.free(1)
    manager.allocate(2, prompt(0, 1))  # now a committed block is evicted: demoted
    assert tiers.stats().demotions == 1


def test_disk_tier_behind_a_small_host_tier_and_flush_for_the_next_process(tmp_path):
    block = BlockCodec(LAYOUT).nbytes
    manager, pools, tiers = make(tmp_path, num_blocks=4, host=block)  # L2 holds one block
    run_prompt(manager, pools, 0, prompt(0, 3))
    manager.free(0)
    run_prompt(manager, pools, 1, prompt(100, 3))  # demotes 3: one stays in L2, two go to disk
    manager.free(1)
    assert tiers.flush([]) >= 0 and tiers.stats().disk is not None
    assert run_prompt(manager, pools, 2, prompt(0, 3)) == 3 * B
    stats = tiers.stats()
    assert stats.host_hits + stats.disk_hits == 3 and stats.disk_hits >= 2
    manager.free(2)
    written = manager.flush_tiers()  # every committed L1 block and L2 block goes to disk
    assert written > 0
    tiers.close()
    # A new process: empty pool and host tier, the same directory and artifact.
    fresh, fresh_pools, fresh_tiers = make(tmp_path, num_blocks=4, host=0)
    assert run_prompt(fresh, fresh_pools, 0, prompt(100, 3)) == 3 * B
    assert fresh_tiers.stats().disk_hits == 3
    fresh_tiers.close()
    # Another artifact never sees these blocks.
    other = KVTiers(TierSettings(disk_dir=tmp_path, disk_bytes=1 << 20), FakePools(4), "artifact-b")
    assert other.find(full_block_hashes(prompt(100, 3), B)) == 0
    other.close()


def test_a_block_corrupted_between_find_and_promote_is_recomputed(tmp_path):
    leave_on_disk(tmp_path, prompt(0, 3))
    fresh, fresh_pools, fresh_tiers = make(tmp_path, num_blocks=4, host=0)
    second = full_block_hashes(prompt(0, 3), B)[1]
    files = [f for f in tmp_path.rglob("*.kvblock") if f.stem == second.hex()]
    assert len(files) == 1
    data = bytearray(files[0].read_bytes())
    data[-1] ^= 0xFF
    files[0].write_bytes(bytes(data))
    assert fresh.can_allocate(0, prompt(0, 3))
    cached = run_prompt(fresh, fresh_pools, 0, prompt(0, 3))  # the first block promoted, the rest computed
    assert cached == B
    assert fresh.num_allocated_tokens(0) == len(prompt(0, 3)) and len(fresh.block_table(0)) == 4
    stats = fresh_tiers.stats()
    assert stats.disk is not None and stats.disk.rejected == 1 and not files[0].exists()
    assert (stats.promotions, stats.disk_hits, stats.disk_misses) == (1, 1, 2)
    fresh_tiers.close()


def test_prefetch_reads_a_queued_prefix_into_host_memory_ahead_of_its_turn(tmp_path):
    leave_on_disk(tmp_path, prompt(0, 3))
    fresh, fresh_pools, fresh_tiers = make(tmp_path, num_blocks=4, host=0, prefetch=True)
    fresh.prefetch(prompt(0, 3))
    deadline = time.monotonic() + 10
    while fresh_tiers.stats().prefetched < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fresh_tiers.stats().prefetched == 3
    assert run_prompt(fresh, fresh_pools, 0, prompt(0, 3)) == 3 * B
    assert fresh_tiers.stats().prefetch_hits == 3
    fresh_tiers.close()


def test_an_unusable_disk_tier_leaves_serving_and_the_host_tier_working(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    manager, pools, tiers = make(blocker / "kv", num_blocks=4)
    assert tiers.disk is not None and not tiers.disk.usable
    run_prompt(manager, pools, 0, prompt(0, 3))
    manager.free(0)
    run_prompt(manager, pools, 1, prompt(100, 3))
    manager.free(1)
    assert run_prompt(manager, pools, 2, prompt(0, 3)) == 3 * B  # from host
    assert manager.flush_tiers() == 0
    tiers.close()


def test_int8_offload_round_trips_within_its_step():
    manager, pools, _ = make(num_blocks=4, dtype="int8")
    run_prompt(manager, pools, 0, prompt(0, 3))
    manager.free(0)
    run_prompt(manager, pools, 1, prompt(100, 3))
    manager.free(1)
    cached = manager.allocate(2, prompt(0, 3))
    assert cached == 3 * B
    for index, key in enumerate(full_block_hashes(prompt(0, 3), B)):
        for got, want in zip(pools.read([manager.block_table(2)[index]])[0], pools.content(key), strict=True):
            assert not np.array_equal(got, want)  # lossy...
            np.testing.assert_allclose(got, want, atol=np.abs(want).max() / 127)  # ...within a step


def test_prefetch_skips_blocks_the_pool_already_holds(tmp_path):
    # A request admitted before its prefetch ran promotes its blocks itself; the stale prefetch must not read them
    # again into host memory (they would push useful blocks out of a small host tier).
    leave_on_disk(tmp_path, prompt(0, 3))
    leave_on_disk(tmp_path, prompt(100, 2))
    fresh, fresh_pools, fresh_tiers = make(tmp_path, num_blocks=8, host=0, prefetch=True)
    assert run_prompt(fresh, fresh_pools, 0, prompt(0, 3)) == 3 * B  # read from disk synchronously, now in L1
    fresh_tiers.prefetch(full_block_hashes(prompt(0, 3), B))  # the stale queue entry
    fresh_tiers.prefetch(full_block_hashes(prompt(100, 2), B))  # then a request whose blocks are only on disk
    deadline = time.monotonic() + 10
    while fresh_tiers.stats().prefetched < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)
    assert fresh_tiers.stats().prefetched == 2  # only the second request's blocks
    fresh_tiers.close()


def test_blocks_that_appear_below_between_can_allocate_and_allocate_never_fail_the_admission():
    # Another process may store more of a chain on disk between the scheduler's can_allocate and allocate; with a
    # token budget each block found below takes a pool block, so allocate promotes fewer instead of raising.
    manager, pools, tiers = make(num_blocks=4)
    manager.allocate(9, prompt(500, 2))  # holds 3 of the 4 blocks
    tokens = prompt(0, 3)
    assert manager.can_allocate(0, tokens, token_budget=B)  # nothing below yet: one block for the chunk
    for key in full_block_hashes(tokens, B)[:2]:  # now two of its blocks appear below L1
        tiers.host.put(key, tiers.codec.encode(pools.content(key)))
    assert manager.allocate(0, tokens, token_budget=B) == 0  # no room to promote them: computed as planned
    assert manager.num_allocated_tokens(0) == B and manager.num_free_blocks == 0


def test_a_promotion_that_raises_costs_a_recompute_not_the_request(monkeypatch):
    manager, pools, tiers = make(num_blocks=4)
    run_prompt(manager, pools, 0, prompt(0, 3))
    manager.free(0)
    run_prompt(manager, pools, 1, prompt(100, 3))  # demotes request 0's blocks to host
    manager.free(1)

    def broken(payload):
        raise ValueError("a payload of another format")

    monkeypatch.setattr(tiers.codec, "decode", broken)
    assert manager.allocate(2, prompt(0, 3)) == 0  # computed, not promoted
    assert manager.num_allocated_tokens(2) == len(prompt(0, 3)) and len(manager.block_table(2)) == 4
    manager.free(2)
    assert manager.num_free_blocks == 4  # nothing leaked
