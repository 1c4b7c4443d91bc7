"""KVTiers: the levels below the backend's pool (L1): host memory (L2) and a disk directory (L3).

The prefix cache keys every full block by its hash chain (``block_pool.hash_block_tokens``); the tiers keep
blocks under the same keys. What moves, and when:

- **Demotion, write-back.** A cached block leaves L1 only when the pool evicts it (``BlockPool.allocate`` hands
  its id to another sequence). Right then, before the step that reuses the id writes anything, its rows are
  copied out (``BlockIO.read``), encoded (``BlockCodec``) and put in L2; a block L2 pushes out goes to a
  background writer that stores it in L3. Write-back rather than write-through: a block is copied only when a
  tier runs out of room, so a working set that fits L1 costs nothing, and the only work on the step's path is a
  memory copy of the evicted blocks (SmolLM2: 0.75 MB each). Persistence does not need write-through:
  ``flush`` (a clean shutdown) writes every cached block of every tier to L3.
- **Promotion.** ``KVCacheManager.allocate`` looks a request's prefix up in L1, then continues the chain here
  (``find``); the blocks found are written into fresh L1 blocks (``promote``) and count as cached tokens, so
  the scheduler does not compute them. L2 is exclusive of L1 (a promoted block leaves L2; its next eviction
  demotes it again); L3 is inclusive (files stay for other processes and restarts).
- **Prefetch.** When a request is queued, ``prefetch`` hands its chain to a background thread that reads the
  blocks it finds in L3 into host memory (L2, or a small staging store when there is no L2), stopping at the
  first block it cannot find. The step reads the disk itself only for a block the prefetcher has not reached.

L3 files are the disk tier's (disk_tier.py: keyed by the artifact's identity and the codec's layout, authenticated
on read with a key the sharing servers hold (disk_key.py), written atomically, size-bounded LRU, shared by
processes). Anything that goes wrong below L1 (a corrupt or forged file, a full or unwritable disk) loses a cached
block, never a request: the block is recomputed.

Thread safety: ``BlockIO`` is touched only on the caller's thread (the engine's). The prefetch and writer
threads touch the disk and, under ``_lock``, the host stores and the writer's pending map.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from moeforge.runtime.backends.base import BlockIO
from moeforge.runtime.kv_tiers.block_codec import BlockCodec
from moeforge.runtime.kv_tiers.disk_tier import DiskTier, DiskTierStats
from moeforge.runtime.kv_tiers.host_tier import HostTier

log = logging.getLogger(__name__)

PREFETCH_STAGING_BYTES = 64 << 20  # where prefetched disk blocks wait when there is no L2
WRITER_PENDING_BYTES = 256 << 20  # blocks waiting for the disk writer; past it a demotion to disk is dropped


@dataclass(frozen=True)
class TierSettings:
    """Which tiers exist: ``host_bytes`` of L2 (0: none), L3 in ``disk_dir`` bounded by ``disk_bytes`` (None: no L3),
    blocks stored as ``offload_dtype`` ("native" bit for bit, "int8" lossy), and whether queued requests' blocks
    are prefetched from disk."""

    host_bytes: int = 0
    disk_dir: Path | None = None
    disk_bytes: int = 0
    offload_dtype: str = "native"
    prefetch: bool = True


@dataclass(frozen=True)
class KVTierStats:
    """Counts since the tiers were opened. A lookup reaches L2 after an L1 miss and L3 after an L2 miss;
    ``*_hits`` count blocks promoted from that tier, ``*_misses`` blocks looked up there and not found (every
    block after the first miss of a chain counts, as for L1). ``demote_seconds`` / ``promote_seconds`` are time on the
    engine's thread; the disk's read / write seconds are all file I/O, the writer's and prefetcher's included."""

    host_hits: int
    host_misses: int
    disk_hits: int
    disk_misses: int
    demotions: int  # blocks copied out of L1 when the pool evicted them
    promotions: int  # blocks written into L1 from L2 or L3
    prefetched: int  # blocks the prefetcher read from disk ahead of their request's turn
    prefetch_hits: int  # promotions served by a prefetched block (the step did not wait for the disk)
    dropped: int  # blocks not kept below L1 (writer backlog full, disk unusable or refusing)
    host_blocks: int
    host_bytes: int
    host_capacity_bytes: int
    demote_seconds: float  # engine thread: copying evicted blocks out of the pool and encoding them
    promote_seconds: float  # engine thread: fetching (a synchronous disk read included), decoding, writing to the pool
    disk_read_seconds: float
    disk_write_seconds: float
    disk_read_bytes: int
    disk_write_bytes: int
    disk_capacity_bytes: int
    disk: DiskTierStats | None


class KVTiers:
    """L2 and L3 below a paged backend's pool, keyed by the prefix cache's block hashes."""

    def __init__(self, settings: TierSettings, io: BlockIO, namespace: str | None) -> None:
        """``io``: the backend's pools. ``namespace``: the artifact's identity (needed when there is a disk tier);
        the codec's layout tag is appended, so blocks of another dtype or shape never meet."""
        self.settings = settings
        self.io = io
        self.codec = BlockCodec(io.layout(), settings.offload_dtype)
        self.host = HostTier(settings.host_bytes)
        self.disk: DiskTier | None = None
        if settings.disk_dir is not None:
            if not namespace:
                raise ValueError("a disk KV tier needs the artifact's identity to key its files by")
            self.disk = DiskTier(settings.disk_dir, settings.disk_bytes, f"{namespace}-{self.codec.tag}")
        # Disk blocks read ahead when there is no L2 to put them in.
        self.staging = HostTier(0 if settings.host_bytes else PREFETCH_STAGING_BYTES)
        self._prefetched: set[bytes] = set()  # keys in host memory because the prefetcher read them
        # Keys promoted into L1 and not demoted since: the prefetcher skips them (with ``in_pool``, which a rank other
        # than 0 of a sharded artifact lacks). Bounded by the pool's blocks.
        self._in_l1: set[bytes] = set()
        self._pending: OrderedDict[bytes, bytes] = OrderedDict()  # waiting for the disk writer, oldest first
        self._pending_bytes = 0
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._closed = False
        self._counts = dict.fromkeys(("host_hits", "host_misses", "disk_hits", "disk_misses", "demotions",
                                      "promotions", "prefetched", "prefetch_hits", "dropped"), 0)
        self._demote_seconds = self._promote_seconds = 0.0
        self._writer: threading.Thread | None = None
        self._prefetcher: threading.Thread | None = None
        self._prefetch_queue: queue.SimpleQueue[list[bytes] | None] = queue.SimpleQueue()
        # Whether L1 holds a key now (``KVCacheManager`` sets it to its pool's lookup): the prefetcher skips those,
        # since a request admitted before its prefetch ran promotes its blocks itself.
        self.in_pool: Callable[[bytes], bool] = lambda key: False
        if self.disk is not None and self.disk.usable:
            self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True)
            self._writer.start()
            if settings.prefetch:
                self._prefetcher = threading.Thread(target=self._prefetch_loop, name="kv-prefetch", daemon=True)
                self._prefetcher.start()

    # -- L1 eviction ---------------------------------------------------------------------------------

    def demote(self, block_id: int, key: bytes) -> None:
        """The pool is evicting ``block_id`` (whose content ``key`` names): copy it into L2 (or queue it for L3)."""
        with self._lock:
            self._in_l1.discard(key)
            self._prefetched.discard(key)  # a copy made now comes from the pool, not from a prefetch
        if self.host.capacity_bytes == 0 and not self._disk_usable:
            return
        start = time.perf_counter()
        payload = self.codec.encode(self.io.read([block_id])[0])
        with self._lock:
            self._counts["demotions"] += 1
            if self.host.capacity_bytes:
                for old_key, old_payload in self.host.put(key, payload):
                    self._prefetched.discard(old_key)
                    self._queue_disk(old_key, old_payload)
            else:
                self._queue_disk(key, payload)
            self._demote_seconds += time.perf_counter() - start

    # -- lookups and promotion -----------------------------------------------------------------------

    def find(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` some tier below L1 holds now (nothing is read or counted)."""
        found = 0
        for key in keys:
            with self._lock:
                here = key in self.host or key in self.staging or key in self._pending
            if not here and not (self._disk_usable and self.disk is not None and self.disk.contains(key)):
                break
            found += 1
        return found

    def promote(self, keys: Sequence[bytes], block_ids: Sequence[int], looked_up: int | None = None) -> int:
        """Write the blocks of the leading ``keys`` into L1 blocks ``block_ids`` (one each); return how many were
        written: fewer than asked when a block vanished or failed its check since ``find`` (the caller computes
        the rest). ``looked_up``: the blocks of the request L1 missed (default ``len(keys)``); those not promoted
        count as misses."""
        looked_up = len(keys) if looked_up is None else looked_up
        payloads: list[bytes] = []
        host_hits = disk_hits = prefetch_hits = 0
        start = time.perf_counter()
        for key in keys:
            with self._lock:
                payload = self.host.pop(key) or self.staging.pop(key) or self._pending.get(key)
                prefetched = key in self._prefetched
                self._prefetched.discard(key)
            if payload is not None and not prefetched:
                host_hits += 1
            elif payload is not None:
                disk_hits += 1
                prefetch_hits += 1
            elif self._disk_usable and self.disk is not None:
                payload = self.disk.get(key)  # needed now: the step waits for this read
                if payload is None:
                    break
                disk_hits += 1
            else:
                break
            payloads.append(payload)
        if payloads:
            rows = [self.codec.decode(p) for p in payloads]
            self.io.write(block_ids[:len(payloads)], rows)
        with self._lock:
            self._in_l1.update(keys[:len(payloads)])
            counts = self._counts
            counts["host_hits"] += host_hits
            counts["host_misses"] += looked_up - host_hits
            counts["disk_hits"] += disk_hits
            if self.disk is not None:
                counts["disk_misses"] += looked_up - host_hits - disk_hits
            counts["promotions"] += len(payloads)
            counts["prefetch_hits"] += prefetch_hits
            self._promote_seconds += time.perf_counter() - start
        return len(payloads)

    def prefetch(self, keys: Sequence[bytes]) -> None:
        """Read the blocks of ``keys`` (a queued request's chain after its L1 hits) from disk into host memory in
        the background, in order, stopping at the first one no tier holds."""
        if self._prefetcher is not None and keys and not self._closed:
            self._prefetch_queue.put(list(keys))

    # -- shutdown ------------------------------------------------------------------------------------

    def flush(self, cached: Iterable[tuple[int, bytes]]) -> int:
        """Write every block below L1 and every L1 block of ``cached`` ((block id, key) pairs, committed content
        only) to L3, and wait until the writer is done; returns the blocks written. Without a usable disk tier,
        nothing (host memory dies with the process)."""
        if not self._disk_usable or self.disk is None:
            return 0
        written = 0
        for block_id, key in cached:
            if not self.disk.contains(key):
                written += self.disk.put(key, self.codec.encode(self.io.read([block_id])[0]))
        with self._lock:
            below = self.host.items() + self.staging.items()
        for key, payload in below:
            if not self.disk.contains(key):
                written += self.disk.put(key, payload)
        with self._wake:
            while self._pending and self._writer is not None and self._writer.is_alive():
                self._wake.wait(0.1)
        return written

    def close(self) -> None:
        """Stop the background threads (after ``flush`` when the blocks should survive)."""
        with self._wake:
            self._closed = True
            self._wake.notify_all()
        self._prefetch_queue.put(None)
        for thread in (self._writer, self._prefetcher):
            if thread is not None:
                thread.join(timeout=10)

    def stats(self) -> KVTierStats:
        disk = self.disk.stats() if self.disk is not None else None
        with self._lock:
            return KVTierStats(
                **self._counts, host_blocks=len(self.host), host_bytes=self.host.nbytes,
                host_capacity_bytes=self.host.capacity_bytes, demote_seconds=self._demote_seconds,
                promote_seconds=self._promote_seconds,
                disk_read_seconds=disk.read_seconds if disk else 0.0,
                disk_write_seconds=disk.write_seconds if disk else 0.0,
                disk_read_bytes=disk.read_bytes if disk else 0, disk_write_bytes=disk.write_bytes if disk else 0,
                disk_capacity_bytes=self.settings.disk_bytes if disk else 0, disk=disk)

    # -- background work -----------------------------------------------------------------------------

    @property
    def _disk_usable(self) -> bool:
        return self.disk is not None and self.disk.usable

    def _queue_disk(self, key: bytes, payload: bytes) -> None:
        """Hand a block to the disk writer (caller holds the lock); dropped when there is no room to wait or the writer
        has stopped (``close``)."""
        if key in self._pending:
            return
        if not self._disk_usable or self._closed or self._pending_bytes + len(payload) > WRITER_PENDING_BYTES:
            self._counts["dropped"] += 1
            return
        self._pending[key] = payload
        self._pending_bytes += len(payload)
        self._wake.notify_all()

    def _write_loop(self) -> None:
        assert self.disk is not None
        while True:
            with self._wake:
                while not self._pending and not self._closed:
                    self._wake.wait()
                if not self._pending:
                    return
                key, payload = next(iter(self._pending.items()))  # stays findable until it is on disk
            stored = self.disk.contains(key) or self.disk.put(key, payload)
            with self._wake:
                if self._pending.get(key) is payload:
                    del self._pending[key]
                    self._pending_bytes -= len(payload)
                if not stored:
                    self._counts["dropped"] += 1
                self._wake.notify_all()

    def _prefetch_loop(self) -> None:
        assert self.disk is not None
        while True:
            keys = self._prefetch_queue.get()
            if keys is None:
                return
            for key in keys:
                if self.in_pool(key):  # a dict lookup: safe beside the engine thread's writes
                    continue
                with self._lock:
                    if key in self._in_l1 or key in self.host or key in self.staging or key in self._pending:
                        continue
                payload = self.disk.get(key)
                if payload is None:
                    break  # the chain stops here: nothing after it can be a prefix hit
                with self._lock:
                    store = self.host if self.host.capacity_bytes else self.staging
                    for old_key, old_payload in store.put(key, payload):
                        self._prefetched.discard(old_key)
                        if store is self.host:
                            self._queue_disk(old_key, old_payload)  # usually on disk already: the writer skips it
                    if key in store:
                        self._prefetched.add(key)
                        self._counts["prefetched"] += 1
