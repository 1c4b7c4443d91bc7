"""DiskTier: the KV cache's L3, encoded blocks in files that outlive the process.

A prefix block dropped from the pool and from host memory is still cheaper to read back (10 KB - 2 MB)
than to recompute. The directory is shared by every process serving the artifact, across restarts,
so the tier copes with strangers: other processes writing and evicting the same files, writers that
crash mid-file, a full or read-only disk, files of other artifacts or versions, and anyone else who can
write the folder. Hence:

* one namespace per artifact, ``directory/namespace/<ab>/<key hex>.kvblock``. The tier reads, writes,
  counts, evicts and removes only regular files at its own names inside its namespace, through folders
  opened with ``O_NOFOLLOW``: it never follows a link. A link at one of its names (a ``<ab>`` folder, a
  ``.kvblock`` or ``.tmp`` file) is removed -- the link, never its target -- and anything else it did
  not make (another folder, a FIFO, a stray ``x.tmp`` folder) is skipped and not counted; each is
  logged once;
* authenticated files: a header binds magic, namespace, key and payload length, and an HMAC-SHA256 of
  those and the payload under a secret the servers sharing the folder share (disk_key.py). A
  truncated, corrupt, foreign, misnamed or forged file (one written without the secret) is caught on
  read (or scan), removed and counted; a file of the older unauthenticated format is a miss;
* atomic writes (a temporary file, then ``os.replace``): a reader sees a whole old file or a whole
  new one, never a torn one. No fsync: a file torn by a power loss fails its check and is dropped;
* LRU by mtime (a hit touches the file it read, by descriptor), shared by all processes without any
  coordination. Each process keeps a size estimate and rescans the namespace only when a write would
  overflow it;
* failures are misses: an unusable directory or key turns the tier off (with a message saying which and
  why), a failed write (ENOSPC, EACCES...) is counted and logged, and no method raises ``OSError``.

Payloads are opaque bytes: the caller encodes and decodes KV blocks. Keys are the 16-byte hash chain
of ``block_pool.hash_block_tokens``, so one key always stands for one content.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import re
import secrets
import stat
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from moeforge.core.safe_paths import UnsafePathError, refuse_symlinked
from moeforge.runtime.kv_tiers.disk_key import DiskKeyError, load_disk_key

log = logging.getLogger(__name__)

_MAGIC = b"MFKVBLK2"
_OLD_MAGIC = b"MFKVBLK1"  # blake2b digest, no secret: its files are misses (and removed)
# magic, blake2b-16 of the namespace, key, payload length, then HMAC-SHA256 of those 48 bytes and the
# payload: 80 bytes. A fixed size lets a read check the file size against the length before reading the
# payload.
_FIELDS = struct.Struct("<8s16s16sQ")
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
# Folders are opened relative to a verified parent and never through a link; O_NONBLOCK so that a FIFO
# planted at a block's name cannot block a read.
_OLDER_FORMAT = "an older, unauthenticated format"  # a miss, not a rejection
_FORGED = "failed authentication: corrupt, or written without this server's key"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


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
    rejected: int  # files found corrupt / truncated / foreign / wrong key / forged on read or scan, removed
    evictions: int  # files removed to stay under capacity
    unauthenticated: int = 0  # of ``rejected``: payloads failing the HMAC (corrupt, or written without the key)


class DiskTier:
    """Encoded KV blocks under ``directory/namespace``, at most ``capacity_bytes`` of files.

    ``secret``: the HMAC key of the block files; None reads it as disk_key.py says (``$MOEFORGE_KV_DISK_KEY``,
    else a per-user key file in the moeforge cache folder, created on first use).

    Thread safe: ``put`` may run on a writer thread while ``get``/``contains`` run on others. The
    capacity is kept per namespace and between rescans only for this process's own writes, so other
    processes' writes can overshoot it briefly; the next rescan (by any of them) brings it back.
    """

    def __init__(self, directory: str | Path, capacity_bytes: int, namespace: str,
                 secret: bytes | None = None) -> None:
        # "." and ".." match the pattern but would put the files beside or above other namespaces.
        if not _NAMESPACE_RE.fullmatch(namespace) or namespace in (".", ".."):
            raise ValueError(f"KV disk tier namespace {namespace!r} must match [A-Za-z0-9._-]+ (not . or ..)")
        if capacity_bytes < 1:
            raise ValueError(f"--kv-disk-bytes must be >= 1, got {capacity_bytes}")
        if secret is not None and not secret:
            raise ValueError("a KV disk tier secret must not be empty")
        self.directory = Path(directory)
        self.root = self.directory / namespace
        self.capacity_bytes = capacity_bytes
        self.namespace = namespace
        self._namespace_hash = hashlib.blake2b(namespace.encode(), digest_size=16).digest()
        self._lock = threading.Lock()  # guards every field below
        self._tmp_counter = 0
        self._files = self._bytes = 0
        self._hits = self._misses = self._read_bytes = 0
        self._writes = self._write_bytes = self._write_errors = 0
        self._read_seconds = self._write_seconds = 0.0
        self._rejected = self._evictions = self._unauthenticated = 0
        self._logged: set[str] = set()  # reasons already logged (once each: a hostile folder would flood the log)
        self._secret = secret if secret is not None else self._load_secret()
        self._usable = self._secret is not None and self._probe()
        if self._usable:
            try:
                self._rescan(0)  # counts what earlier runs left, drops crashed writers' temporaries
            except OSError as exc:  # the folder takes files but cannot be listed: eviction is impossible
                self._turn_off(f"cannot list {self.root} ({exc.strerror or exc}); give this user read access to it "
                               "or point --kv-disk-dir elsewhere")

    @property
    def usable(self) -> bool:
        """False when the directory could not be created or written at startup, or no key could be had: the tier
        is off."""
        return self._usable

    def contains(self, key: bytes) -> bool:
        """Whether the block's file exists as a regular file (no read: ``get`` may still find it bad or gone)."""
        sub, name = self._names(key)
        if not self._usable:
            return False
        try:
            with self._folder(sub, create=False) as sub_fd:
                return stat.S_ISREG(os.stat(name, dir_fd=sub_fd, follow_symlinks=False).st_mode)
        except OSError:
            return False

    def get(self, key: bytes) -> bytes | None:
        """The block's authenticated payload, or None (no file, unreadable, or bad: then removed)."""
        sub, name = self._names(key)
        if not self._usable:
            return None
        start = time.perf_counter()
        try:
            with self._folder(sub, create=False) as sub_fd:
                payload, size, problem = self._read_verified(sub_fd, sub, name, key)
                if problem is not None:
                    self._reject(sub_fd, sub, name, size, problem)
                    return None
        except OSError as exc:  # FileNotFoundError mostly: never stored, or evicted by another process
            if not isinstance(exc, FileNotFoundError):
                log.debug("KV disk tier: cannot read %s/%s: %s", sub, name, exc)
            with self._lock:
                self._misses += 1
            return None
        with self._lock:
            self._hits += 1
            self._read_bytes += size
            self._read_seconds += time.perf_counter() - start
        return payload

    def put(self, key: bytes, payload: bytes) -> bool:
        """Store a block; True when its file is there afterwards. Never raises ``OSError``.

        False when the tier is off, the payload alone exceeds the capacity, the block's folder or file name is
        taken by something moeforge did not make, or the write failed (counted in ``write_errors``).
        """
        sub, name = self._names(key)
        size = _HEADER.size + len(payload)
        if not self._usable or size > self.capacity_bytes:
            return False
        header = self._header(key, payload)
        start = time.perf_counter()
        with self._lock:
            over = self._bytes + size > self.capacity_bytes
            self._tmp_counter += 1
            # Unique per process and thread, and unguessable, so concurrent writers never share a temporary file.
            tmp = (f"{name}.{os.getpid()}.{threading.get_ident()}.{self._tmp_counter}.{secrets.token_hex(4)}"
                   f"{_TMP_SUFFIX}")
        try:
            if over:
                self._rescan(size)  # other processes write too: count the files before evicting any
            with self._folder(sub, create=True) as sub_fd:
                if self._same_file(sub_fd, sub, name, header, size):
                    return True
                try:
                    # Created in the verified folder (O_EXCL | O_NOFOLLOW); renamed by path, which never follows a
                    # link at the final name and finds the unguessable temporary name only in that folder.
                    with open(tmp, "wb", opener=_opener(sub_fd)) as file:
                        file.write(header)
                        file.write(payload)
                    os.replace(self.root / sub / tmp, self.root / sub / name)  # atomic: each writer installs a whole
                except OSError:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp, dir_fd=sub_fd)
                    raise
        except _Foreign:
            return False
        except OSError as exc:
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
                unauthenticated=self._unauthenticated,
            )

    # -- internals ---------------------------------------------------------------------------------

    def _names(self, key: bytes) -> tuple[str, str]:
        """(subfolder, file name) of a key's block: 256 subfolders keep directories small."""
        if not isinstance(key, bytes) or len(key) != _KEY_BYTES:
            raise ValueError(f"a KV block key is {_KEY_BYTES} bytes, got {key!r}")
        name = key.hex()
        return name[:2], f"{name}{_SUFFIX}"

    def _header(self, key: bytes, payload: bytes) -> bytes:
        fields = _FIELDS.pack(_MAGIC, self._namespace_hash, key, len(payload))
        assert self._secret is not None
        mac = hmac.new(self._secret, fields, hashlib.sha256)
        mac.update(payload)
        return fields + mac.digest()

    def _load_secret(self) -> bytes | None:
        try:
            return load_disk_key(self.directory)
        except DiskKeyError as exc:
            self._turn_off(str(exc))
            return None
        except RuntimeError as exc:  # pathlib: a symbolic link loop on the key's or the folder's way, or a "~user"
            self._turn_off(f"the key file or {self.directory} cannot be resolved ({exc}); point --kv-disk-dir and "
                           "$MOEFORGE_KV_DISK_KEY at real paths")
            return None
        except OSError as exc:  # the default key file cannot be created (read-only home, ...)
            log.warning("KV disk tier: cannot create a key file in the moeforge cache folder (%s); using a key for "
                        "this process only, so its blocks in %s will not be read after a restart or by other "
                        "servers. Set MOEFORGE_CACHE_DIR to a writable folder or MOEFORGE_KV_DISK_KEY to a key file.",
                        exc.strerror or exc, self.directory)
            return secrets.token_bytes(32)

    def _probe(self) -> bool:
        """Create the namespace folder and write a file in it. Permission bits prove nothing when
        running as root (a read-only mount still refuses), so only a real write counts."""
        try:
            refuse_symlinked(self.root, root=self.directory, what="KV disk tier namespace")
            self.root.mkdir(parents=True, exist_ok=True)
        except UnsafePathError as exc:
            self._turn_off(str(exc))
            return False
        except OSError as exc:
            self._disable(exc)
            return False
        probe = f".probe.{secrets.token_hex(8)}{_TMP_SUFFIX}"
        try:
            root_fd = os.open(self.root, _DIR_FLAGS)
            try:
                os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=root_fd))
                os.unlink(probe, dir_fd=root_fd)
            finally:
                os.close(root_fd)
        except OSError as exc:
            self._disable(exc)
            return False
        return True

    def _disable(self, exc: OSError) -> None:
        self._turn_off(f"cannot write to {self.root} ({exc.strerror or exc}). Point --kv-disk-dir at a writable "
                       "directory (or fix its permissions / mount)")

    def _turn_off(self, why: str) -> None:
        self._usable = False
        log.warning("KV disk tier off: %s; blocks evicted from memory will be recomputed.", why)

    @contextlib.contextmanager
    def _folder(self, sub: str, *, create: bool) -> Iterator[int]:
        """A descriptor of the namespace's folder ``sub`` (a real folder, never reached through a link). ``create``:
        make it when missing, and replace a link at its name by a folder; else a missing folder or a link raises
        ``FileNotFoundError`` (a miss). Something else at its name raises ``_Foreign`` when creating."""
        root_fd = os.open(self.root, _DIR_FLAGS)
        try:
            sub_fd = self._open_sub(root_fd, sub, create)
        finally:
            os.close(root_fd)
        try:
            yield sub_fd
        finally:
            os.close(sub_fd)

    def _open_sub(self, root_fd: int, sub: str, create: bool) -> int:
        for _ in range(3):  # another process may create, remove or replace it meanwhile
            try:
                return os.open(sub, _DIR_FLAGS, dir_fd=root_fd)
            except FileNotFoundError:
                if not create:
                    raise
            except OSError:  # ELOOP / ENOTDIR: a link or a non-folder at the name
                mode = _lstat_mode(root_fd, sub)
                if mode is not None and stat.S_ISLNK(mode):
                    if not create:
                        self._note("link", f"KV disk tier: {self.root / sub} is a symbolic link; moeforge never reads "
                                           "through it (the next write or scan removes the link, not its target)")
                        raise FileNotFoundError(sub) from None
                    self._remove_link(root_fd, sub, sub)
                elif mode is not None and not stat.S_ISDIR(mode):
                    self._skip_foreign(sub, mode)
                    raise (_Foreign(sub) if create else FileNotFoundError(sub)) from None
                elif mode is not None or not create:
                    raise  # a real folder this user cannot open (EACCES), or gone
            with contextlib.suppress(FileExistsError):
                os.mkdir(sub, 0o777, dir_fd=root_fd)
        raise FileNotFoundError(sub)

    def _same_file(self, sub_fd: int, sub: str, name: str, header: bytes, size: int) -> bool:
        """Whether ``name`` already is this block's file (same size and header, so same key, namespace, secret and
        payload MAC): then it is touched (LRU) by descriptor, never through a link. A link there is replaced by the
        write (``os.replace`` replaces the link itself); a folder or device there raises ``_Foreign``."""
        try:
            fd = os.open(name, _READ_FLAGS, dir_fd=sub_fd)
        except FileNotFoundError:
            return False
        except OSError:
            mode = _lstat_mode(sub_fd, name)
            if mode is not None and stat.S_ISLNK(mode):  # os.replace below replaces the link itself
                self._note("link", f"KV disk tier: {self.root / sub / name} is a symbolic link; moeforge never "
                                   "follows it and replaces the link (not its target) with its own file")
            return False
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                self._skip_foreign(f"{sub}/{name}", info.st_mode)
                raise _Foreign(name)
            if info.st_size != size or os.read(fd, len(header)) != header:
                return False  # another block's, a forged or a corrupt file: written over
            with contextlib.suppress(OSError):  # not ours to touch (another user's file): it ages, no harm
                os.utime(fd)
            return True
        finally:
            os.close(fd)

    def _read_verified(self, sub_fd: int, sub: str, name: str, key: bytes) -> tuple[bytes, int, str | None]:
        """(payload, file size, what is wrong with the file or None). Raises ``OSError`` (``FileNotFoundError``
        for a link or anything but a regular file: never read)."""
        try:
            fd = os.open(name, _READ_FLAGS, dir_fd=sub_fd)
        except FileNotFoundError:
            raise
        except OSError:  # ELOOP: a link at the block's name
            mode = _lstat_mode(sub_fd, name)
            if mode is not None and stat.S_ISLNK(mode):
                self._note("link", f"KV disk tier: {self.root / sub / name} is a symbolic link; it is never read "
                                   "through (the next write or scan replaces the link)")
                raise FileNotFoundError(name) from None
            raise
        with os.fdopen(fd, "rb") as file:
            info = os.fstat(file.fileno())
            if not stat.S_ISREG(info.st_mode):
                self._skip_foreign(f"{sub}/{name}", info.st_mode)
                raise FileNotFoundError(name)
            size = info.st_size
            if size > self.capacity_bytes:  # never read a huge file into memory
                return b"", size, "larger than --kv-disk-bytes"
            header = file.read(_HEADER.size)
            if len(header) < _HEADER.size:
                return b"", size, "truncated"
            magic, namespace_hash, file_key, length, mac = _HEADER.unpack(header)
            if magic == _OLD_MAGIC:
                return b"", size, _OLDER_FORMAT
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
            if not hmac.compare_digest(self._header(key, payload)[_FIELDS.size:], mac):
                return b"", size, _FORGED
            with contextlib.suppress(OSError):  # LRU: a hit makes the block young again (the file read, by fd)
                os.utime(file.fileno())
        return payload, size, None

    def _reject(self, sub_fd: int, sub: str, name: str, size: int, reason: str) -> None:
        # If another process replaced the file since we read it, this drops a good block: a later
        # miss, never a wrong payload.
        self._remove(sub_fd, name)
        with self._lock:
            if reason == _OLDER_FORMAT:
                self._misses += 1
            else:
                self._rejected += 1
            self._unauthenticated += reason == _FORGED
            self._files = max(0, self._files - 1)
            self._bytes = max(0, self._bytes - size)
        self._note(reason, f"KV disk tier: removed block file {self.root / sub / name} ({reason}); its block will "
                           "be recomputed, later such files are only counted")

    def _remove(self, dir_fd: int, name: str) -> bool:
        """Unlink ``name`` in the folder ``dir_fd`` (a file or a link, never a link's target)."""
        try:
            os.unlink(name, dir_fd=dir_fd)
            return True
        except FileNotFoundError:  # another process removed it first
            return False
        except OSError as exc:  # read-only, or not ours: it fails its check again later
            log.debug("KV disk tier: cannot remove %s: %s", name, exc)
            return False

    def _remove_link(self, dir_fd: int, name: str, shown: str) -> None:
        self._remove(dir_fd, name)
        self._note("link", f"KV disk tier: removed the symbolic link {self.root / shown} from its namespace (not "
                           "what it points to): moeforge never follows a link out of a folder it owns")

    def _skip_foreign(self, shown: str, mode: int) -> None:
        self._note("foreign", f"KV disk tier: skipping {self.root / shown} ({_kind(mode)}), which moeforge did not "
                              "make; entries it did not make are neither read, written, counted nor removed "
                              "(later ones are not logged)")

    def _note(self, reason: str, message: str) -> None:
        with self._lock:
            first = reason not in self._logged
            self._logged.add(reason)
        if first:
            log.warning("%s", message)

    def _write_failed(self, exc: OSError) -> None:
        with self._lock:
            self._write_errors += 1
            count = self._write_errors
        if count % _WRITE_ERROR_LOG_EVERY == 1:  # the 1st, 101st, ...: a full disk fails every put
            log.warning("KV disk tier: cannot store a block in %s (%s); it stays uncached (%d write error(s) so "
                        "far, logged every %d)", self.root, exc, count, _WRITE_ERROR_LOG_EVERY)

    def _rescan(self, incoming: int) -> None:
        """Recount the namespace; if it plus ``incoming`` bytes exceeds the capacity, remove the
        least recently used files (oldest mtime) until it fits with some headroom. Raises ``OSError``
        only when the namespace folder itself cannot be opened or listed."""
        root_fd = os.open(self.root, _DIR_FLAGS)
        sub_fds: dict[str, int] = {}
        try:
            entries = sorted(self._scan(root_fd, sub_fds))
            total = sum(size for _, size, _, _ in entries)
            files = len(entries)
            evicted = 0
            if total + incoming > self.capacity_bytes:
                target = self.capacity_bytes - self.capacity_bytes // _EVICT_HEADROOM
                for _, size, sub, name in entries:
                    if total + incoming <= target:
                        break
                    evicted += self._remove(sub_fds[sub], name)  # False: another process evicted it first
                    total -= size
                    files -= 1
        finally:
            for fd in sub_fds.values():
                os.close(fd)
            os.close(root_fd)
        with self._lock:
            self._files, self._bytes = files, total
            self._evictions += evicted

    def _scan(self, root_fd: int, sub_fds: dict[str, int]) -> list[tuple[float, int, str, str]]:
        """(mtime, size, subfolder, name) of each block file in the namespace; ``sub_fds`` receives the
        subfolders' descriptors (the caller closes them). Removes stale temporaries, links at moeforge's names
        and (counted as rejected) misnamed or header-short block files; skips anything else. Files may vanish
        meanwhile."""
        now = time.time()
        entries: list[tuple[float, int, str, str]] = []
        for top in os.listdir(root_fd):
            mode = _lstat_mode(root_fd, top)
            ours = _SUBDIR_RE.fullmatch(top) is not None
            if mode is None:
                continue
            if stat.S_ISLNK(mode) and (ours or top.endswith(_TMP_SUFFIX)):
                self._remove_link(root_fd, top, top)
            elif top.endswith(_TMP_SUFFIX) and stat.S_ISREG(mode):  # a probe left by a crash
                self._remove_if_stale(root_fd, top, now)
            elif ours and stat.S_ISDIR(mode):
                try:
                    sub_fd = os.open(top, _DIR_FLAGS, dir_fd=root_fd)
                except OSError:  # replaced meanwhile (by a link: the next scan removes it)
                    continue
                sub_fds[top] = sub_fd
                entries += self._scan_sub(sub_fd, top, now)
            else:
                self._skip_foreign(top, mode)
        return entries

    def _scan_sub(self, sub_fd: int, sub: str, now: float) -> list[tuple[float, int, str, str]]:
        entries: list[tuple[float, int, str, str]] = []
        try:
            names = os.listdir(sub_fd)
        except OSError:
            return entries
        for name in names:
            try:
                info = os.stat(name, dir_fd=sub_fd, follow_symlinks=False)
            except OSError:  # vanished meanwhile
                continue
            ours = name.endswith((_SUFFIX, _TMP_SUFFIX))
            if stat.S_ISLNK(info.st_mode) and ours:
                self._remove_link(sub_fd, name, f"{sub}/{name}")
            elif not (ours and stat.S_ISREG(info.st_mode)):
                self._skip_foreign(f"{sub}/{name}", info.st_mode)
            elif name.endswith(_TMP_SUFFIX):
                self._remove_if_stale(sub_fd, name, now)
            elif not _FILE_NAME_RE.fullmatch(name) or name[:2] != sub:
                self._reject(sub_fd, sub, name, info.st_size, "misnamed")
            elif info.st_size < _HEADER.size:
                self._reject(sub_fd, sub, name, info.st_size, "truncated")
            else:
                entries.append((info.st_mtime, info.st_size, sub, name))
        return entries

    def _remove_if_stale(self, dir_fd: int, name: str, now: float) -> None:
        """Remove a temporary file older than ``_STALE_TMP_SECONDS``: its writer crashed."""
        with contextlib.suppress(OSError):
            if now - os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mtime > _STALE_TMP_SECONDS:
                self._remove(dir_fd, name)


class _Foreign(Exception):
    """Something moeforge did not make sits at a name it needs (a folder at a block's name, a file at a
    subfolder's): the block is not stored."""


def _opener(dir_fd: int) -> Callable[[str, int], int]:
    """An ``open(..., opener=)`` that creates a new file in the folder ``dir_fd``: never an existing one, never
    through a link."""
    return lambda name, flags: os.open(name, flags | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666, dir_fd=dir_fd)


def _lstat_mode(dir_fd: int, name: str) -> int | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
    except OSError:
        return None


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISREG(mode):
        return "a file"
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    return "a device, FIFO or socket"
