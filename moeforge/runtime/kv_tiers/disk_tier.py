"""DiskTier: the KV cache's L3, encoded blocks in files that outlive the process.

A prefix block dropped from the pool and from host memory is still cheaper to read back (10 KB - 2 MB)
than to recompute. The directory is shared by every process serving the artifact, across restarts,
so the tier copes with strangers: other processes writing and evicting the same files, writers that
crash mid-file, a full or read-only disk, files of other artifacts or versions. Hence:

* one namespace per artifact, ``directory/namespace/<ab>/<key hex>.kvblock``; scans and evictions
  never leave their own namespace;
* self-checking files: a header binds magic, namespace, key, payload length and payload digest, so
  a truncated, corrupt, foreign or misnamed file is caught on read (or scan), removed and counted;
* atomic writes (a temporary file, then ``os.replace``): a reader sees a whole old file or a whole
  new one, never a torn one. No fsync: a file torn by a power loss fails its check and is dropped;
* LRU by mtime (a hit touches the file), shared by all processes without any coordination. Each
  process keeps a size estimate and rescans the namespace only when a write would overflow it;
* failures are misses: an unusable directory turns the tier off, a failed write (ENOSPC, EACCES...)
  is counted and logged, and no method raises ``OSError``.

Payloads are opaque bytes: the caller encodes and decodes KV blocks. Keys are the 16-byte hash chain
of ``block_pool.hash_block_tokens``, so one key always stands for one content.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

_MAGIC = b"MFKVBLK1"
# magic, blake2b-16 of the namespace, key, payload length, blake2b-32 of the payload: 80 bytes. A
# fixed size lets a read check the file size against the length before reading the payload.
_HEADER = struct.Struct("<8s16s16sQ32s")
_KEY_BYTES = 16
_SUFFIX = ".kvblock"
_TMP_SUFFIX = ".tmp"
_STALE_TMP_SECONDS = 60.0  # a writer holds its temporary file for milliseconds; older ones are a crash's
# An eviction frees 1/32 of the capacity beyond what the write needs: at steady state a put would
# otherwise rescan the whole namespace (a stat per file) every time.
_EVICT_HEADROOM = 32
_WRITE_ERROR_LOG_EVERY = 100
_NAMESPACE_RE = re.compile(r"[A-Za-z0-9._-]+")
_SUBDIR_RE = re.compile(r"[0-9a-f]{2}")
_FILE_NAME_RE = re.compile(r"[0-9a-f]{32}\.kvblock")


@dataclass(frozen=True)
class DiskTierStats:
    """A snapshot of one process's view. Byte counts are file sizes, headers included."""

    files: int  # files this process believes are in its namespace now
    bytes: int  # their total size
    hits: int  # get() returned a payload
    misses: int  # get() found no file (or could not read it)
    read_bytes: int
    read_seconds: float
    writes: int  # put() that stored a file
    write_bytes: int
    write_seconds: float
    write_errors: int  # put() that failed with OSError (disk full, unwritable, ...): nothing stored
    rejected: int  # files found corrupt / truncated / foreign / wrong key on read or scan, removed
    evictions: int  # files removed to stay under capacity


class DiskTier:
    """Encoded KV blocks under ``directory/namespace``, at most ``capacity_bytes`` of files.

    Thread safe: ``put`` may run on a writer thread while ``get``/``contains`` run on others. The
    capacity is kept per namespace and between rescans only for this process's own writes, so other
    processes' writes can overshoot it briefly; the next rescan (by any of them) brings it back.
    """

    def __init__(self, directory: str | Path, capacity_bytes: int, namespace: str) -> None:
        # "." and ".." match the pattern but would put the files beside or above other namespaces.
        if not _NAMESPACE_RE.fullmatch(namespace) or namespace in (".", ".."):
            raise ValueError(f"KV disk tier namespace {namespace!r} must match [A-Za-z0-9._-]+ (not . or ..)")
        if capacity_bytes < 1:
            raise ValueError(f"--kv-disk-bytes must be >= 1, got {capacity_bytes}")
        self.root = Path(directory) / namespace
        self.capacity_bytes = capacity_bytes
        self.namespace = namespace
        self._namespace_hash = hashlib.blake2b(namespace.encode(), digest_size=16).digest()
        self._lock = threading.Lock()  # guards every field below
        self._tmp_counter = 0
        self._files = self._bytes = 0
        self._hits = self._misses = self._read_bytes = 0
        self._writes = self._write_bytes = self._write_errors = 0
        self._read_seconds = self._write_seconds = 0.0
        self._rejected = self._evictions = 0
        self._logged_reject_reasons: set[str] = set()
        self._usable = self._probe()
        if self._usable:
            try:
                self._rescan(0)  # counts what earlier runs left, drops crashed writers' temporaries
            except OSError as exc:
                self._disable(exc)

    @property
    def usable(self) -> bool:
        """False when the directory could not be created or written at startup: the tier is off."""
        return self._usable

    def contains(self, key: bytes) -> bool:
        """Whether the block's file exists (no read: ``get`` may still find it bad or gone)."""
        path = self._path(key)
        return self._usable and os.path.isfile(path)

    def get(self, key: bytes) -> bytes | None:
        """The block's verified payload, or None (no file, unreadable, or bad: then removed)."""
        path = self._path(key)
        if not self._usable:
            return None
        start = time.perf_counter()
        try:
            payload, size, problem = self._read_verified(path, key)
        except OSError as exc:  # FileNotFoundError mostly: never stored, or evicted by another process
            if not isinstance(exc, FileNotFoundError):
                log.debug("KV disk tier: cannot read %s: %s", path, exc)
            with self._lock:
                self._misses += 1
            return None
        if problem is not None:
            self._reject(path, size, problem)
            return None
        with contextlib.suppress(OSError):  # evicted meanwhile: the payload read is still whole
            os.utime(path)  # LRU: a hit makes the block young again
        with self._lock:
            self._hits += 1
            self._read_bytes += size
            self._read_seconds += time.perf_counter() - start
        return payload

    def put(self, key: bytes, payload: bytes) -> bool:
        """Store a block; True when its file is there afterwards. Never raises ``OSError``.

        False when the tier is off, the payload alone exceeds the capacity, or the write failed
        (counted in ``write_errors``).
        """
        path = self._path(key)
        size = _HEADER.size + len(payload)
        if not self._usable or size > self.capacity_bytes:
            return False
        # Same key, same content: a file of the right size was stored by another process (or by us
        # earlier). Touch it rather than write it again; a bad one is caught and removed on read.
        with contextlib.suppress(OSError):
            if os.stat(path).st_size == size:
                os.utime(path)
                return True
        start = time.perf_counter()
        with self._lock:
            over = self._bytes + size > self.capacity_bytes
            self._tmp_counter += 1
            # Unique per process and thread, so concurrent writers never share a temporary file.
            tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.{self._tmp_counter}{_TMP_SUFFIX}")
        try:
            if over:
                self._rescan(size)  # other processes write too: count the files before evicting any
            path.parent.mkdir(exist_ok=True)
            digest = hashlib.blake2b(payload, digest_size=32).digest()
            with open(tmp, "wb") as file:
                file.write(_HEADER.pack(_MAGIC, self._namespace_hash, key, len(payload), digest))
                file.write(payload)
            os.replace(tmp, path)  # atomic: concurrent writers of one key each install a whole file
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            self._write_failed(exc)
            return False
        with self._lock:
            self._writes += 1
            self._write_bytes += size
            self._write_seconds += time.perf_counter() - start
            self._files += 1
            self._bytes += size
        return True

    def stats(self) -> DiskTierStats:
        with self._lock:
            return DiskTierStats(
                files=self._files, bytes=self._bytes, hits=self._hits, misses=self._misses,
                read_bytes=self._read_bytes, read_seconds=self._read_seconds, writes=self._writes,
                write_bytes=self._write_bytes, write_seconds=self._write_seconds,
                write_errors=self._write_errors, rejected=self._rejected, evictions=self._evictions,
            )

    # -- internals ---------------------------------------------------------------------------------

    def _path(self, key: bytes) -> Path:
        if not isinstance(key, bytes) or len(key) != _KEY_BYTES:
            raise ValueError(f"a KV block key is {_KEY_BYTES} bytes, got {key!r}")
        name = key.hex()
        return self.root / name[:2] / f"{name}{_SUFFIX}"  # 256 subfolders keep directories small

    def _probe(self) -> bool:
        """Create the namespace folder and write a file in it. Permission bits prove nothing when
        running as root (a read-only mount still refuses), so only a real write counts."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe = self.root / f".probe.{os.getpid()}.{threading.get_ident()}{_TMP_SUFFIX}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            self._disable(exc)
            return False
        return True

    def _disable(self, exc: OSError) -> None:
        self._usable = False
        log.warning("KV disk tier off: cannot write to %s (%s). Point --kv-disk-dir at a writable directory "
                    "(or fix its permissions / mount); blocks evicted from memory will be recomputed.", self.root, exc)

    def _read_verified(self, path: Path, key: bytes) -> tuple[bytes, int, str | None]:
        """(payload, file size, what is wrong with the file or None). Raises ``OSError``."""
        with open(path, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            header = file.read(_HEADER.size)
            if len(header) < _HEADER.size:
                return b"", size, "truncated"
            magic, namespace_hash, file_key, length, digest = _HEADER.unpack(header)
            if magic != _MAGIC:
                return b"", size, "bad magic"
            if namespace_hash != self._namespace_hash:
                return b"", size, "another namespace"
            if file_key != key:
                return b"", size, "wrong key"
            if size != _HEADER.size + length:  # checked before reading, so a bogus length reads nothing
                return b"", size, "wrong length"
            payload = file.read(length)
        if len(payload) != length:
            return b"", size, "wrong length"
        if hashlib.blake2b(payload, digest_size=32).digest() != digest:
            return b"", size, "payload digest mismatch"
        return payload, size, None

    def _reject(self, path: Path, size: int, reason: str) -> None:
        # If another process replaced the file since we read it, this drops a good block: a later
        # miss, never a wrong payload.
        with contextlib.suppress(OSError):  # gone already, or read-only: it fails its check again later
            os.unlink(path)
        with self._lock:
            self._rejected += 1
            self._files = max(0, self._files - 1)
            self._bytes = max(0, self._bytes - size)
            first = reason not in self._logged_reject_reasons
            self._logged_reject_reasons.add(reason)
        if first:  # once per reason: a disk of foreign files would otherwise flood the log
            log.warning("KV disk tier: removed bad block file %s (%s); later ones are only counted", path, reason)

    def _write_failed(self, exc: OSError) -> None:
        with self._lock:
            self._write_errors += 1
            count = self._write_errors
        if count % _WRITE_ERROR_LOG_EVERY == 1:  # the 1st, 101st, ...: a full disk fails every put
            log.warning("KV disk tier: cannot store a block in %s (%s); it stays uncached (%d write error(s) so "
                        "far, logged every %d)", self.root, exc, count, _WRITE_ERROR_LOG_EVERY)

    def _rescan(self, incoming: int) -> None:
        """Recount the namespace; if it plus ``incoming`` bytes exceeds the capacity, remove the
        least recently used files (oldest mtime) until it fits with some headroom."""
        entries = sorted(self._scan())
        total = sum(size for _, size, _ in entries)
        files = len(entries)
        evicted = 0
        if total + incoming > self.capacity_bytes:
            target = self.capacity_bytes - self.capacity_bytes // _EVICT_HEADROOM
            for _, size, path in entries:
                if total + incoming <= target:
                    break
                try:
                    os.unlink(path)
                    evicted += 1
                except FileNotFoundError:  # another process evicted it first
                    pass
                total -= size
                files -= 1
        with self._lock:
            self._files, self._bytes = files, total
            self._evictions += evicted

    def _scan(self) -> list[tuple[float, int, str]]:
        """(mtime, size, path) of each block file in the namespace. Removes stale temporaries and
        (counted as rejected) misnamed or header-short block files. Files may vanish meanwhile."""
        now = time.time()
        entries: list[tuple[float, int, str]] = []
        for top in _list_dir(str(self.root)):
            if top.name.endswith(_TMP_SUFFIX):  # a probe left by a crash
                _remove_if_stale(top, now)
            elif _SUBDIR_RE.fullmatch(top.name) and top.is_dir(follow_symlinks=False):
                for entry in _list_dir(top.path):
                    name = entry.name
                    try:
                        if name.endswith(_TMP_SUFFIX):
                            _remove_if_stale(entry, now)
                        elif name.endswith(_SUFFIX) and entry.is_file(follow_symlinks=False):
                            st = entry.stat(follow_symlinks=False)
                            if not _FILE_NAME_RE.fullmatch(name) or name[:2] != top.name:
                                self._reject(Path(entry.path), st.st_size, "misnamed")
                            elif st.st_size < _HEADER.size:
                                self._reject(Path(entry.path), st.st_size, "truncated")
                            else:
                                entries.append((st.st_mtime, st.st_size, entry.path))
                    except FileNotFoundError:
                        continue
        return entries


def _list_dir(path: str) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except FileNotFoundError:
        return []


def _remove_if_stale(entry: os.DirEntry[str], now: float) -> None:
    """Remove a temporary file older than ``_STALE_TMP_SECONDS``: its writer crashed."""
    with contextlib.suppress(FileNotFoundError):
        if now - entry.stat(follow_symlinks=False).st_mtime > _STALE_TMP_SECONDS:
            os.unlink(entry.path)
