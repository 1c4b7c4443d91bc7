"""One rule for every path moeforge writes or deletes: compile outputs, partial folders, KV-tier files,
statistics, plans and caches.

The rule, for a path a user named (or that lies where a user's path points):

- **Never follow a link out.** A symlink at an output path, or a symlinked folder inside a folder moeforge owns, is
  refused; files are created with ``O_NOFOLLOW | O_EXCL``, so a link planted between the check and the write fails
  the write instead of redirecting it.
- **Never delete what moeforge did not create.** A folder moeforge makes to fill and remove later (a partial
  compile, a scratch folder) carries a marker file it wrote (``.moeforge-owned``) holding a random token; only a
  real folder (not a link) with that marker is ever emptied or removed. A name pattern proves nothing.
- **Never replace a user's file without ``--force``**, and never write over a device, FIFO, socket, directory or
  link even with it; nothing under ``/proc``, ``/sys`` or ``/dev``.
- **Check before the expensive part.** ``check_output_file`` runs before any model loads; it also proves the
  folder takes a new file (a read-only mount, a full disk or a pseudo filesystem refuses the probe), so a run is
  not lost at its end.
- **Atomic.** ``write_output_file`` writes a hidden temporary sibling and renames (``--force``) or hard-links
  (no ``--force``: fails if a file appeared meanwhile) it into place: a reader sees the old file or the new one.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from pathlib import Path

from moeforge.core.errors import MoeforgeError

OWNED_MARKER = ".moeforge-owned"
_PSEUDO_ROOTS = (Path("/proc"), Path("/sys"), Path("/dev"))


class UnsafePathError(MoeforgeError):
    """A path moeforge refuses to write or delete: a link, a special file, a user's file without --force."""


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device node"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a regular file" if stat.S_ISREG(mode) else "a special file"


def expand_user(path: str | os.PathLike[str]) -> Path:
    """``path`` with a leading ``~`` or ``~user`` expanded as a shell does: one that names no known user (or a home
    that cannot be found) stays as written, a relative path (``Path.expanduser`` raises ``RuntimeError`` instead)."""
    return Path(os.path.expanduser(os.fspath(path)))


def _in_pseudo_fs(path: Path, flag: str = "") -> bool:
    try:
        resolved = path.resolve(strict=False)
    except (OSError, RuntimeError):  # a symbolic link loop on the way (RuntimeError before Python 3.13)
        named = f"{flag} {path}" if flag else str(path)
        raise UnsafePathError(f"{named}: a symbolic link loop on its way; name a file in an ordinary folder") \
            from None
    return any(resolved == root or root in resolved.parents for root in _PSEUDO_ROOTS)


def check_output_file(path: str | Path, *, force: bool = False, flag: str = "output") -> Path:
    """Refuse, before any work, an output file path moeforge must not write: a link, directory, device, FIFO or
    socket at it; an existing file without ``force``; a path under /proc, /sys or /dev; a path ending in ``/`` (it
    names a folder); a parent folder that is missing, not a folder, or does not take a new file (read-only, full, no
    permission). A leading ``~`` is expanded as a shell does (``expand_user``). Returns the path."""
    text = os.fspath(path)
    if not text or text.endswith(os.sep):  # Path() would drop the slash and write a file where a folder was named
        raise UnsafePathError(f"{flag} {text!r} names a folder, not a file: name the file to write")
    path = expand_user(text)
    if _in_pseudo_fs(path, flag):
        raise UnsafePathError(f"{flag} {path}: moeforge does not write under /proc, /sys or /dev; name a file in an "
                              "ordinary folder")
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        info = None
    except OSError as exc:
        raise UnsafePathError(f"{flag} {path}: cannot be checked ({exc.strerror}); name another file") from None
    if info is not None:
        if not stat.S_ISREG(info.st_mode):
            raise UnsafePathError(f"{flag} {path} is {_kind(info.st_mode)}: moeforge writes only regular files and "
                                  "never over a link or a special file; name a new file")
        if not force:
            raise UnsafePathError(f"{flag} {path} exists: pass --force to replace it, or name a new file")
    parent = path.parent
    if not parent.is_dir():
        raise UnsafePathError(f"{flag} {path}: its folder {parent} does not exist (or is not a folder); create it "
                              "first")
    probe = parent / f".{path.name}.moeforge-probe.{secrets.token_hex(4)}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        raise UnsafePathError(f"{flag} {path}: its folder {parent} does not take a new file ({exc.strerror}); name "
                              "a writable folder") from None
    os.close(fd)
    os.unlink(probe)
    return path


def write_output_file(path: str | Path, data: bytes | str, *, force: bool = False, flag: str = "output") -> Path:
    """Write ``data`` to ``path`` atomically under the rule above (``check_output_file`` first, again, since time
    has passed since the early check): a temporary sibling created with ``O_EXCL | O_NOFOLLOW``, then renamed over
    the old regular file (``force``) or hard-linked into place (a file that appeared meanwhile is not replaced)."""
    path = check_output_file(path, force=force, flag=flag)
    payload = data.encode("utf-8") if isinstance(data, str) else data
    tmp = path.parent / f".{path.name}.moeforge-tmp.{os.getpid()}.{secrets.token_hex(4)}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "wb") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        if force:
            with contextlib.suppress(FileNotFoundError):  # re-checked: a link or device planted since is not replaced
                if not stat.S_ISREG(os.lstat(path).st_mode):
                    raise UnsafePathError(f"{flag} {path} changed into a link or special file while moeforge ran; "
                                          "name a new file")
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path, follow_symlinks=False)
            except FileExistsError:
                raise UnsafePathError(f"{flag} {path} appeared while moeforge ran: pass --force to replace it, or "
                                      "name a new file") from None
    except OSError as exc:
        raise UnsafePathError(f"{flag} {path} could not be written ({exc.strerror or exc}); name a writable "
                              "folder") from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return path


# ------------------------------------------------------------------------------------------- owned folders
def create_owned_dir(path: str | Path) -> Path:
    """Create the folder ``path`` (its parent must exist or is created) with a marker moeforge owns it: only such a
    folder is ever emptied or removed by ``remove_owned_dir``. Refuses anything already at ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, 0o755)
    except FileExistsError:
        raise UnsafePathError(f"{path} already exists and moeforge did not create it; move it away") from None
    fd = os.open(path / OWNED_MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w") as handle:
        handle.write(secrets.token_hex(16) + "\n")
    return path


def is_owned_dir(path: str | Path) -> bool:
    """``path`` is a real folder (not a link) holding moeforge's marker as a regular file."""
    path = Path(path)
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            return False
        return stat.S_ISREG(os.lstat(path / OWNED_MARKER).st_mode)
    except OSError:
        return False


def remove_owned_dir(path: str | Path) -> bool:
    """Remove ``path`` and everything in it if (and only if) moeforge owns it (``is_owned_dir``); links inside are
    removed as links, never followed. Returns whether it removed it (best effort: what cannot be removed stays)."""
    path = Path(path)
    if not is_owned_dir(path):
        return False
    with contextlib.suppress(OSError):
        remove_tree(path)
    return True


_DIR_NOFOLLOW = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_MAX_OPEN_LEVELS = 32  # folders held open at once while removing; deeper ones are moved up first


def remove_tree(path: str | Path, *, dir_fd: int | None = None) -> None:
    """Remove the real folder ``path`` and everything in it, by descriptor: a link inside (or at ``path``) is
    removed as a link, never followed, and a tree of any depth is removed without recursion (``shutil.rmtree``
    recurses, and raises ``RecursionError`` on a tree a few thousand folders deep) and with at most
    ``_MAX_OPEN_LEVELS`` folders open: a folder deeper than that is first moved up, into ``path`` itself. With
    ``dir_fd``, ``path`` is a name in that open folder. Raises ``OSError`` for what cannot be removed (a mount
    point, a read-only file system)."""
    path = Path(path)
    parent_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        try:
            top = os.open(path.name, _DIR_NOFOLLOW, dir_fd=parent_fd)
        except OSError:
            mode = os.stat(path.name, dir_fd=parent_fd, follow_symlinks=False).st_mode
            if stat.S_ISDIR(mode):
                raise
            os.unlink(path.name, dir_fd=parent_fd)  # a link or a file at the name: removed itself
            return
        stack = [(parent_fd, path.name, top, os.listdir(top))]
        try:
            while stack:
                dir_parent, name, fd, names = stack[-1]
                if not names:
                    stack.pop()
                    os.close(fd)
                    os.rmdir(name, dir_fd=dir_parent)
                    continue
                entry = names.pop()
                try:
                    mode = os.stat(entry, dir_fd=fd, follow_symlinks=False).st_mode
                except FileNotFoundError:
                    continue
                if not stat.S_ISDIR(mode):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry, dir_fd=fd)
                    continue
                if len(stack) >= _MAX_OPEN_LEVELS:  # move it up into the top folder, removed from there later
                    moved = f".moeforge-removing.{secrets.token_hex(8)}"
                    os.rename(entry, moved, src_dir_fd=fd, dst_dir_fd=top)
                    stack[0][3].append(moved)
                    continue
                try:
                    child = os.open(entry, _DIR_NOFOLLOW, dir_fd=fd)
                except OSError:  # replaced by a link or a file since: removed as itself
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry, dir_fd=fd)
                    continue
                stack.append((fd, entry, child, os.listdir(child)))
        finally:
            for _, _, fd, _ in stack:
                os.close(fd)
    finally:
        os.close(parent_fd)


def refuse_symlinked(path: str | Path, *, root: str | Path, what: str) -> Path:
    """Refuse ``path`` if it or any folder between ``root`` and it is a symbolic link (a link inside a folder
    moeforge owns would send its reads and writes elsewhere). ``root`` itself may be reached through links."""
    path, root = Path(path), Path(root)
    try:
        relative = path.relative_to(root)
    except ValueError:
        raise UnsafePathError(f"{what} {path} is outside {root}") from None
    current = root
    for part in relative.parts:
        current = current / part
        try:
            if stat.S_ISLNK(os.lstat(current).st_mode):
                raise UnsafePathError(f"{what} {current} is a symbolic link inside {root}: moeforge never follows a "
                                      "link out of a folder it owns; remove the link")
        except FileNotFoundError:
            break
    return path
