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
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from moeforge import __version__
from moeforge.compile.options import CompileOptions
from moeforge.core.artifact import load_artifact
from moeforge.core.errors import ArtifactError, MoeforgeError

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
    source = Path(options.model).expanduser()
    if source.is_dir():
        files = [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in sorted(source.iterdir()) if p.is_file()]
    elif source.is_file():
        files = [[source.name, source.stat().st_size, source.stat().st_mtime_ns]]
    else:  # a preset or built-in model: its name (and moeforge's version) decide it
        files = [[options.model]]
    placement = options.placement
    plan = hashlib.sha256(placement.expanduser().read_bytes()).hexdigest() \
        if placement is not None and placement.expanduser().is_file() else None  # its content, not only its path
    text = json.dumps({"moeforge": __version__, "options": settings, "source": files, "placement": plan},
                      sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


@dataclasses.dataclass
class PartialCompile:
    """The locked partial directory of one sharded compile and the ranks already written in it (verified)."""

    root: Path
    done: set[int]


@contextlib.contextmanager
def open_partial(out: Path, options: CompileOptions, tp: int) -> Iterator[PartialCompile]:
    """Lock ``out``'s partial directory (creating it), keep the ranks a killed compile with the same fingerprint
    wrote (each verified against its manifest's hashes; one that fails is rebuilt), clear anything else. On an
    error the directory is removed; on an interruption (Ctrl-C, SIGTERM turned into SystemExit) it is kept, and a
    kill leaves it as it is, for the next run to continue."""
    root = partial_dir(out)
    root.mkdir(parents=True, exist_ok=True)  # the output's parent may not exist yet
    fd = os.open(root, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise MoeforgeError(f"another compile is writing {out} (it holds {root}); wait for it to finish, or "
                                "write to another directory") from None
        fingerprint = compile_fingerprint(options)
        done = _resumable(root, fingerprint, tp)
        (root / RESUME_FILE).write_text(json.dumps({"fingerprint": fingerprint, "tp": tp}) + "\n", encoding="utf-8")
        partial = PartialCompile(root, done)
        try:
            yield partial
        except Exception:
            shutil.rmtree(root, ignore_errors=True)
            raise
        except BaseException:
            if root.is_dir():
                kept = sorted(int(p.name[4:]) for p in root.glob("rank*") if p.name[4:].isdigit() and p.is_dir())
                log.warning("compile interrupted: %d of %d ranks are kept in %s; run the same command again to "
                            "continue from them", len(kept), tp, root)
            raise
    finally:
        os.close(fd)


def _resumable(root: Path, fingerprint: str, tp: int) -> set[int]:
    """The ranks of ``root`` a rerun may keep; everything else in ``root`` is removed."""
    previous = None
    with contextlib.suppress(OSError, ValueError):
        previous = json.loads((root / RESUME_FILE).read_text(encoding="utf-8"))
    same = isinstance(previous, dict) and previous.get("fingerprint") == fingerprint and previous.get("tp") == tp
    if previous is not None and not same:
        log.warning("%s holds ranks of a compile with other options or another source: starting over", root)
    done: set[int] = set()
    for entry in list(root.iterdir()):
        rank = int(entry.name[4:]) if entry.name.startswith("rank") and entry.name[4:].isdigit() else None
        if same and rank is not None and rank < tp and entry.is_dir() and _verified(entry, rank, tp):
            done.add(rank)
        elif entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    return done


def _verified(rank_root: Path, rank: int, tp: int) -> bool:
    try:
        sharding = load_artifact(rank_root, verify=True).manifest.sharding or {}
    except (ArtifactError, OSError) as exc:
        log.warning("%s is damaged (%s): rebuilding it", rank_root, exc)
        return False
    return sharding.get("rank") == rank and sharding.get("world_size", sharding.get("tp")) == tp
