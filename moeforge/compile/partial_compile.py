"""A sharded compile that survives being killed: its ranks are written into a partial directory a rerun continues.

``moeforge compile MODEL -o DIR --tp N`` writes every rank into ``.DIR.moeforge-partial`` beside ``DIR`` (a fixed
name, so the next run finds it) and renames it to ``DIR`` when all ranks and ``sharded.json`` are written. A rank is
done once its directory exists there: ``write_artifact`` renames it into place complete, with the sha256 of each of
its files in its manifest. A compile killed half-way (SIGKILL, an OOM kill, SIGTERM, Ctrl-C) leaves the partial
directory; the same command run again verifies the ranks already written and builds only the others. "The same
command" is checked: ``resume.json`` holds a fingerprint of the options that shape the artifact and of the source
checkpoint's files (names, sizes, modification times) and of moeforge's version; a partial directory with another
fingerprint is cleared and the compile starts over, saying so. A compile that fails with an error (bad input, a
corrupt weight) removes it: an error is not resumed, it is fixed.

The granularity is one rank: an unsharded artifact is one graph and one external-data file written in a single
pass, so an unsharded compile killed half-way starts again from the beginning.

Only one compile may write a partial directory at a time: it is locked (``flock``) while a compile holds it.

The partial directory is moeforge's own (``core/safe_paths.py``): it is created with a marker file
(``create_owned_dir``), and only a real directory with that marker is ever resumed, emptied or removed. Whatever
else sits at its name -- a symbolic link (to a user's folder, say), a file, a folder moeforge did not create -- is
refused before anything is touched, with the advice to move it away. Inside it, links are removed as links, never
followed, and ``resume.json`` is read by the strict JSON reader: one that does not read as moeforge's is a
different compile, and the compile starts over.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from moeforge import __version__
from moeforge.compile.options import CompileOptions
from moeforge.core.artifact import load_artifact
from moeforge.core.errors import ArtifactError, MoeforgeError
from moeforge.core.safe_paths import (
    OWNED_MARKER,
    create_owned_dir,
    expand_user,
    is_owned_dir,
    remove_owned_dir,
    remove_tree,
)
from moeforge.core.strict_json import (
    JsonFileError,
    json_int,
    json_object,
    json_str,
    read_json_file,
    read_regular_file,
)

log = logging.getLogger(__name__)

PARTIAL_SUFFIX = ".moeforge-partial"
RESUME_FILE = "resume.json"


def partial_dir(out: Path) -> Path:
    """Where the sharded compile of ``out`` writes its ranks until all are done."""
    return out.parent / f".{out.name}{PARTIAL_SUFFIX}"


def compile_fingerprint(options: CompileOptions) -> str:
    """sha256 over what decides the artifact's bytes: the options (not where it goes, --force, progress, workers
    or the memory limit), the source's files (names, sizes, modification times), the placement plan's content and
    moeforge's version."""
    settings = dataclasses.asdict(dataclasses.replace(options, output_dir=Path("."), force=False, progress=False,
                                                      workers=1, max_memory=None))
    source = expand_user(options.model)
    if source.is_dir():
        files = [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in sorted(source.iterdir()) if p.is_file()]
    elif source.is_file():
        files = [[source.name, source.stat().st_size, source.stat().st_mtime_ns]]
    else:  # a preset or built-in model: its name (and moeforge's version) decide it
        files = [[options.model]]
    plan = None
    if options.placement is not None:  # its content, not only its path; read as the plan is (regular, bounded)
        try:
            plan = hashlib.sha256(read_regular_file(expand_user(options.placement), what="placement plan")).hexdigest()
        except JsonFileError as exc:
            raise MoeforgeError(str(exc)) from None
    text = json.dumps({"moeforge": __version__, "options": settings, "source": files, "placement": plan},
                      sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


@dataclasses.dataclass
class PartialCompile:
    """The locked partial directory of one sharded compile and the ranks already written in it (verified)."""

    root: Path
    done: set[int]
    fd: int | None = None  # the locked directory, open: what ``root`` must still name (None: not checked)

    def seal(self) -> None:
        """Drop resume.json and the ownership marker: the directory is complete and becomes the artifact next. Refused
        if ``root`` no longer names the locked directory (replaced by a link to a user's folder meanwhile): nothing
        there is removed, and the compile fails instead of installing it."""
        if self.fd is not None:
            _check_still(self.root, self.fd)
        for name in (RESUME_FILE, OWNED_MARKER):
            with contextlib.suppress(FileNotFoundError):
                if self.fd is None:
                    os.unlink(self.root / name)
                else:
                    os.unlink(name, dir_fd=self.fd)


def _check_still(root: Path, fd: int) -> None:
    """Refuse a ``root`` that is no longer the directory ``fd`` holds open (renamed away, a link put in its place)."""
    try:
        now = os.lstat(root)
    except OSError:
        now = None
    held = os.fstat(fd)
    if now is None or not stat.S_ISDIR(now.st_mode) or (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino):
        raise MoeforgeError(f"{root} was replaced while the compile wrote it (by a link or another folder); moeforge "
                            "leaves it as it is and installs nothing: move it away and compile again")


@contextlib.contextmanager
def open_partial(out: Path, options: CompileOptions, tp: int) -> Iterator[PartialCompile]:
    """Lock ``out``'s partial directory (creating it), keep the ranks a killed compile with the same fingerprint
    wrote (each verified against its manifest's hashes; one that fails is rebuilt), clear anything else. On an
    error the directory is removed; on an interruption (Ctrl-C, SIGTERM turned into SystemExit) it is kept, and a
    kill leaves it as it is, for the next run to continue."""
    root = _claim(partial_dir(out), out)
    try:  # O_NOFOLLOW: a link put in its place since _claim is not opened (nor locked, nor written through)
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        raise MoeforgeError(f"{root} changed while moeforge opened it ({exc.strerror}); move it away and compile "
                            "again") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise MoeforgeError(f"another compile is writing {out} (it holds {root}); wait for it to finish, or "
                                "write to another directory") from None
        fingerprint = compile_fingerprint(options)
        done = _resumable(root, fingerprint, tp, fd)  # by descriptor: a link put at root's name is not followed
        _write_resume(fd, json.dumps({"fingerprint": fingerprint, "tp": tp}) + "\n")
        partial = PartialCompile(root, done, fd)
        try:
            yield partial
        except Exception:
            if not remove_owned_dir(root) and os.path.lexists(root):  # sealed: no longer provably ours
                log.warning("the compile failed after %s was complete; it is left as it is: remove it yourself",
                            root)
            raise
        except BaseException:
            if is_owned_dir(root):
                kept = sorted(int(p.name[4:]) for p in root.glob("rank*") if p.name[4:].isdigit() and p.is_dir())
                log.warning("compile interrupted: %d of %d ranks are kept in %s; run the same command again to "
                            "continue from them", len(kept), tp, root)
            raise
    finally:
        os.close(fd)


def check_partial(out: Path) -> bool:
    """Refuse (before any work) a compile of ``out`` whose partial directory's name holds something moeforge did not
    create there: a symbolic link, a file, a foreign folder; it is left untouched. True if a killed compile's
    partial directory is there (to resume), False if nothing is."""
    root = partial_dir(out)
    if is_owned_dir(root):
        return True
    try:
        info = os.lstat(root)
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise MoeforgeError(f"{root} cannot be checked ({exc.strerror}); compile to another directory") from None
    what = ("a symbolic link" if stat.S_ISLNK(info.st_mode) else
            "a folder moeforge did not create" if stat.S_ISDIR(info.st_mode) else "a file")
    raise MoeforgeError(f"{root} is where moeforge writes the ranks of {out.name}, but it is {what}; moeforge leaves "
                        "it as it is: move it away (or remove it) and compile again, or compile to another directory")


def _claim(root: Path, out: Path) -> Path:
    """``root`` as this compile's partial directory: kept if moeforge made it (a killed compile's, to resume), else
    created with moeforge's marker (the output's parent too, if missing); anything else is refused."""
    return root if check_partial(out) else create_owned_dir(root)


def _previous(root: Path) -> dict[str, object] | None:
    """The fingerprint and tp a killed compile recorded in ``root``; None without a record; ``{}`` for a record
    that does not read as one (a link, bad JSON, wrong fields: another compile's, or not moeforge's)."""
    path = root / RESUME_FILE
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return {}
    except FileNotFoundError:
        return None
    except OSError:
        return {}
    try:
        data = json_object(read_json_file(path, what="resume record", max_bytes=4096), source=str(path))
        return {"fingerprint": json_str(data.get("fingerprint"), source=str(path), field="fingerprint", max_len=64),
                "tp": json_int(data.get("tp"), source=str(path), field="tp", lo=1, hi=2**20)}
    except JsonFileError as exc:
        log.warning("%s", exc)
        return {}


def _write_resume(fd: int, text: str) -> None:
    """Write resume.json in the locked directory ``fd``, by descriptor (atomically: a temporary file, renamed)."""
    tmp = f".{RESUME_FILE}.{os.getpid()}.tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp, dir_fd=fd)
    handle = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=fd)
    with os.fdopen(handle, "w") as file:
        file.write(text)
    os.replace(tmp, RESUME_FILE, src_dir_fd=fd, dst_dir_fd=fd)


def _resumable(root: Path, fingerprint: str, tp: int, fd: int | None = None) -> set[int]:
    """The ranks of ``root`` a rerun may keep; everything else in ``root`` (but moeforge's marker) is removed, links
    as links. With ``fd`` (``root`` open), the directory is listed and cleared through it."""
    previous = _previous(root)
    same = previous == {"fingerprint": fingerprint, "tp": tp}
    if previous is not None and not same:
        log.warning("%s holds ranks of a compile with other options or another source: starting over", root)
    done: set[int] = set()
    for name in os.listdir(root if fd is None else fd):
        if name == OWNED_MARKER:
            continue
        entry = root / name
        try:  # a link to a folder is a link, not a folder
            mode = os.stat(entry if fd is None else name, dir_fd=fd, follow_symlinks=False).st_mode
            real_dir = stat.S_ISDIR(mode)
        except FileNotFoundError:
            continue
        rank = int(name[4:]) if name.startswith("rank") and name[4:].isdigit() else None
        if same and real_dir and rank is not None and rank < tp and _verified(entry, rank, tp):
            done.add(rank)
        else:  # a folder of any depth, by descriptor: links inside are removed, never followed
            try:
                if fd is None:
                    remove_tree(entry)
                else:
                    remove_tree(name, dir_fd=fd)
            except OSError as exc:
                raise MoeforgeError(f"cannot clear {entry} ({exc.strerror or exc}) in the partial directory of a "
                                    f"killed compile; remove {root} yourself and compile again") from None
    return done


def _verified(rank_root: Path, rank: int, tp: int) -> bool:
    try:
        sharding = load_artifact(rank_root, verify=True).manifest.sharding or {}
    except (ArtifactError, OSError) as exc:
        log.warning("%s is damaged (%s): rebuilding it", rank_root, exc)
        return False
    return sharding.get("rank") == rank and sharding.get("world_size", sharding.get("tp")) == tp
