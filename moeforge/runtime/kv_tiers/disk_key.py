"""The secret that authenticates the KV disk tier's block files (an HMAC-SHA256 key).

The L3 directory may be shared: by the processes of one server, by servers on several machines, by anyone the
folder's permissions let write there. A block file's header proves that the file is whole (and for which key and
namespace it was written), not who wrote it: anyone who can write the folder could compute a consistent header for a
payload of their choosing, and the server would load it as KV and answer from it. So each file carries an HMAC of its
header fields and payload under a secret the legitimate servers share and a writer of the folder lacks; a file that
fails it is dropped and its block recomputed.

Where the secret comes from (``load_disk_key``):

- ``$MOEFORGE_KV_DISK_KEY``: the path of a key file (servers sharing one directory across users or machines are
  given the same file, e.g. ``openssl rand -hex 32 > kv.key; chmod 600 kv.key``). Links are followed (secret mounts
  are links), its content is read as it is.
- otherwise ``<moeforge cache dir>/kv-disk.key`` (``core/bandwidth.cache_dir()``: ``$MOEFORGE_CACHE_DIR`` or
  ``~/.cache/moeforge``), created with 32 random bytes (hex) and mode 0600 on first use: every process of one user on
  one machine shares it with no setup.

A key file must be a regular file of at least ``MIN_KEY_BYTES`` bytes that other users cannot write (nor read,
except the file's group), and must lie outside the KV directory (whoever reads that folder would read the key).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from pathlib import Path

from moeforge.core.bandwidth import cache_dir
from moeforge.core.errors import MoeforgeError
from moeforge.core.safe_paths import expand_user

KEY_ENV = "MOEFORGE_KV_DISK_KEY"
DEFAULT_KEY_FILE = "kv-disk.key"
MIN_KEY_BYTES = 32
_MAX_KEY_FILE_BYTES = 4096
# Group or others may not write the file, others may not read it (a group of servers' users may).
_UNSAFE_MODE_BITS = stat.S_IWGRP | stat.S_IRWXO


class DiskKeyError(MoeforgeError):
    """A key file for the KV disk tier that cannot be used; the message names the file and the fix."""


def load_disk_key(disk_dir: str | Path) -> bytes:
    """The KV disk tier's secret for the directory ``disk_dir`` (module docstring). Raises ``DiskKeyError`` when the
    key file named by ``$MOEFORGE_KV_DISK_KEY``, or the default one, is unusable; ``OSError`` when the default key
    file cannot be read or created (an unreachable or read-only cache folder: the caller decides what to do)."""
    given = os.environ.get(KEY_ENV, "").strip()
    if given:
        path = expand_user(given)
        _refuse_inside(path, Path(disk_dir), f"${KEY_ENV}")
        return _read_key(path, follow=True, where=f"${KEY_ENV}")
    path = cache_dir() / DEFAULT_KEY_FILE
    _refuse_inside(path, Path(disk_dir), "the default key file")
    try:
        return _read_key(path, follow=False, where="the default key file")
    except FileNotFoundError:
        return _create_key(path)


def _refuse_inside(path: Path, disk_dir: Path, where: str) -> None:
    key_real, dir_real = path.resolve(strict=False), disk_dir.resolve(strict=False)
    if key_real == dir_real or dir_real in key_real.parents:
        raise DiskKeyError(f"KV disk key file {path} ({where}) lies inside --kv-disk-dir {disk_dir}: whoever can read "
                           f"that folder could read the key; keep the key outside it (set ${KEY_ENV} to another "
                           "file, or MOEFORGE_CACHE_DIR)")


def _read_key(path: Path, *, follow: bool, where: str) -> bytes:
    """The key in ``path``, else ``DiskKeyError``; for the default file (not ``follow``) ``OSError`` when it does
    not exist or its folder cannot be reached (then it is created, or the caller does without)."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        if follow:  # a file the user named must exist
            raise DiskKeyError(f"KV disk key file {path} ({where}) does not exist; create it (e.g. `openssl rand "
                               f"-hex 32 > {path}; chmod 600 {path}`) or unset ${KEY_ENV}") from None
        raise
    except OSError as exc:
        if not follow and exc.errno != errno.ELOOP:  # the cache folder is unreachable: the caller decides
            raise
        raise DiskKeyError(f"KV disk key file {path} ({where}) cannot be opened ({exc.strerror or exc}); it must be "
                           "a regular file, not a symbolic link, readable by this user") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise DiskKeyError(f"KV disk key file {path} ({where}) is not a regular file; name a key file")
        if info.st_mode & _UNSAFE_MODE_BITS:
            raise DiskKeyError(f"KV disk key file {path} ({where}) has mode {stat.filemode(info.st_mode)}: other "
                               f"users could read or replace the key; run `chmod 600 {path}`")
        if not follow and info.st_uid != os.geteuid():
            raise DiskKeyError(f"KV disk key file {path} ({where}) belongs to another user; remove it (moeforge "
                               "creates a new one)")
        with os.fdopen(os.dup(fd), "rb") as handle:
            key = handle.read(_MAX_KEY_FILE_BYTES + 1)
    except OSError as exc:
        raise DiskKeyError(f"KV disk key file {path} ({where}) cannot be read ({exc.strerror or exc})") from None
    finally:
        os.close(fd)
    key = key.strip()
    if not MIN_KEY_BYTES <= len(key) <= _MAX_KEY_FILE_BYTES:
        raise DiskKeyError(f"KV disk key file {path} ({where}) holds {len(key)} bytes; a key is {MIN_KEY_BYTES} to "
                           f"{_MAX_KEY_FILE_BYTES} bytes (e.g. `openssl rand -hex 32 > {path}`)")
    return key


def _create_key(path: Path) -> bytes:
    """Write a new random key to ``path`` atomically: a temporary file (0600, ``O_EXCL | O_NOFOLLOW``) hard-linked
    into place, so two processes starting together both end up with whichever key was linked first."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    key = secrets.token_hex(32).encode()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(key + b"\n")
            handle.flush()
            os.fsync(handle.fileno())
        with contextlib.suppress(FileExistsError):  # another process was first: use its key
            os.link(tmp, path, follow_symlinks=False)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return _read_key(path, follow=False, where="the default key file")
