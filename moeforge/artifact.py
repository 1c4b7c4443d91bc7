"""The artifact directory: the contract between ``moeforge compile`` and every backend.

Layout (all paths relative to the artifact root)::

    model.onnx            the graph (weights as external data beside it)
    *.data / ...          external data, tokenizer.json, tokenizer_config.json, genai_config.json ...
    manifest.json         written last: format version, model config, graph I/O, KV-cache layout,
                          passes, target/precision, tool versions, and sha256 + size of every other file

``write_artifact`` builds the directory under a hidden temporary sibling and renames it into place,
so ``out_dir`` is either absent, the previous artifact, or the complete new one -- never half-written.
``load_artifact`` checks the manifest and (by default) every file's size and sha256.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import re
import secrets
import shutil
import socket
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moeforge.errors import ArtifactError
from moeforge.kv_layout import KVCacheSpec
from moeforge.manifest import FORMAT_VERSION, MANIFEST_FILE, MODEL_FILE, Manifest

# The artifact API is one import: the manifest types a loader needs come with load_artifact.
__all__ = ["FORMAT_VERSION", "MANIFEST_FILE", "MODEL_FILE", "Artifact", "ArtifactError", "KVCacheSpec", "Manifest",
           "check_output_dir", "load_artifact", "write_artifact"]

log = logging.getLogger(__name__)

_HASH_CHUNK = 8 << 20
_TMP_TAG, _OLD_TAG = "moeforge-tmp", "moeforge-old"


# ---------------------------------------------------------------------------------------------- writing
def _host_tag() -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname())[:40] or "host"


def _scratch_name(out: Path, tag: str) -> Path:
    return out.parent / f".{out.name}.{tag}.{_host_tag()}.{os.getpid()}.{secrets.token_hex(4)}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_scratch(out: Path) -> None:
    """Remove scratch dirs of ``out`` left by a killed writer (same host, process gone)."""
    pattern = re.compile(rf"^\.{re.escape(out.name)}\.(?:{_TMP_TAG}|{_OLD_TAG})\.{re.escape(_host_tag())}\.(\d+)\.")
    try:
        entries = list(out.parent.iterdir())
    except OSError:
        return
    for entry in entries:
        match = pattern.match(entry.name)
        if match and int(match.group(1)) != os.getpid() and not _pid_alive(int(match.group(1))):
            log.warning("removing %s left behind by an interrupted moeforge run", entry)
            shutil.rmtree(entry, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems do not fsync directories
        pass
    finally:
        os.close(fd)


def _hash_file(path: Path, sync: bool = False) -> tuple[str, int]:
    """Streamed sha256 and byte count (optionally fsync the file while it is open)."""
    digest = hashlib.sha256()
    size = 0
    buf = bytearray(_HASH_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(buf):
            digest.update(view[:n])
            size += n
        if sync:
            os.fsync(fh.fileno())
    return digest.hexdigest(), size


def _map_files(fn: Callable[[Path], Any], paths: list[Path]) -> list[Any]:
    """Apply ``fn`` to every path, a few at a time (sha256 releases the GIL on large buffers)."""
    if len(paths) <= 1:
        return [fn(p) for p in paths]
    pool = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1, len(paths)))
    try:
        return list(pool.map(fn, paths))
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _list_files(root: Path) -> list[str]:
    """Relative POSIX paths of every file under root (sorted); symlinks are refused."""
    out: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            full = Path(dirpath, name)
            if full.is_symlink():
                raise ArtifactError(f"{full} is a symlink; an artifact holds regular files only")
        out.extend(Path(dirpath, name).relative_to(root).as_posix() for name in filenames)
    return sorted(out)


def _hash_tree(root: Path) -> dict[str, dict[str, Any]]:
    rels = _list_files(root)
    results = _map_files(lambda p: _hash_file(p, sync=True), [root / r for r in rels])
    for dirpath, _, _ in os.walk(root):
        _fsync_dir(Path(dirpath))
    return {rel: {"sha256": sha, "bytes": size} for rel, (sha, size) in zip(rels, results, strict=True)}


def _check_replaceable(out: Path) -> None:
    """With --force we only delete an earlier artifact (or an empty directory), never arbitrary data."""
    if out.is_symlink() or not out.is_dir():
        raise ArtifactError(f"{out} exists and is not a directory; remove it yourself or choose another output path")
    if not (out / MANIFEST_FILE).is_file() and any(out.iterdir()):
        raise ArtifactError(
            f"{out} exists and is not a moeforge artifact (no {MANIFEST_FILE}); refusing to delete it even with "
            "--force: remove it yourself or choose another output path"
        )


def _check_destination(out: Path, force: bool) -> None:
    if os.path.lexists(out):
        if not force:
            raise ArtifactError(f"{out} already exists; pass --force to replace it")
        _check_replaceable(out)


def check_output_dir(out_dir: str | Path, force: bool = False) -> Path:
    """Fail early (before a long compile) if ``write_artifact(out_dir, force=force)`` would refuse the
    destination: it exists without ``force``, it is not an earlier artifact, or a path component above
    it is a file. Changes nothing; returns the absolute path."""
    out = Path(out_dir).expanduser().absolute()
    _check_destination(out, force)
    for ancestor in out.parents:
        if ancestor.exists():
            if not ancestor.is_dir():
                raise ArtifactError(f"cannot create the directory {out.parent}: {ancestor} is a file")
            break
    return out


def _install(tmp: Path, out: Path, force: bool) -> None:
    """Rename the finished ``tmp`` to ``out``; an existing artifact is moved aside first, then deleted."""
    _check_destination(out, force)
    if not os.path.lexists(out):
        os.rename(tmp, out)
        _fsync_dir(out.parent)
        return
    aside = _scratch_name(out, _OLD_TAG)
    os.rename(out, aside)
    try:
        os.rename(tmp, out)
    except BaseException:
        os.rename(aside, out)
        raise
    _fsync_dir(out.parent)
    try:
        shutil.rmtree(aside)
    except OSError as exc:
        log.warning("the new artifact is in place, but the old one at %s could not be deleted: %s", aside, exc)


def write_artifact(
    out_dir: str | Path,
    *,
    write_payload: Callable[[Path], None],
    manifest: Manifest,
    force: bool = False,
) -> Path:
    """Write an artifact atomically and return its path.

    ``write_payload(tmp)`` writes every file but manifest.json (model.onnx is required) into a hidden
    temporary sibling of ``out_dir``. Then every file is hashed and fsynced, ``manifest.files`` is set (on
    the object passed in), ``manifest.json`` is written last, and the directory is renamed into place.
    An existing ``out_dir`` is an ``ArtifactError`` unless ``force``; with ``force`` an earlier artifact
    is moved aside, the new one renamed in, and the old one deleted. Any exception (KeyboardInterrupt
    included) removes the temporary directory and is re-raised; ``out_dir`` is left as it was.
    A full disk during the payload becomes an ``ArtifactError``.
    """
    out = Path(out_dir).expanduser().absolute()
    parent = out.parent
    _check_destination(out, force)  # fail before the (possibly long) payload
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ArtifactError(f"cannot create the directory {parent}: {exc.strerror or exc}") from None
    _remove_stale_scratch(out)
    tmp = _scratch_name(out, _TMP_TAG)
    try:
        os.mkdir(tmp)
    except OSError as exc:
        raise ArtifactError(
            f"cannot write into the directory {parent}: {exc.strerror or exc}; choose an output path you can write to"
        ) from None
    try:
        try:
            write_payload(tmp)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise ArtifactError(f"no space left in {parent} while writing the artifact: {exc}") from exc
            raise
        try:
            files = _hash_tree(tmp)
            if MANIFEST_FILE in files:
                raise ArtifactError(f"the payload wrote {MANIFEST_FILE}; only write_artifact writes it")
            if MODEL_FILE not in files:
                raise ArtifactError(f"the payload wrote no {MODEL_FILE}")
            manifest.files = files  # filled in on the caller's object too (CompileResult reports it)
            with open(tmp / MANIFEST_FILE, "w", encoding="utf-8") as fh:
                fh.write(manifest.to_json())
                fh.flush()
                os.fsync(fh.fileno())
            _fsync_dir(tmp)
            _install(tmp, out, force)
        except OSError as exc:
            raise ArtifactError(f"writing the artifact {out} failed: {exc}") from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


# ---------------------------------------------------------------------------------------------- reading
@dataclass
class Artifact:
    """A loaded artifact directory. ``extra_files`` lists files present but not in the manifest (ignored)."""

    root: Path
    manifest: Manifest
    model_path: Path
    extra_files: list[str] = field(default_factory=list)

    def path(self, relpath: str) -> Path:
        return self.root / relpath

    def config(self) -> Any:
        return self.manifest.config()


def _safe_relpath(rel: str) -> bool:
    p = Path(rel)
    return not p.is_absolute() and ".." not in p.parts and rel not in ("", ".")


def load_artifact(path: str | Path, verify: bool = True) -> Artifact:
    """Open an artifact directory and check it against its manifest.

    Always: the manifest parses, has this format version, and every listed file exists with the listed
    size. With ``verify`` (default) every file's sha256 is recomputed (streamed). Files not listed in
    the manifest are logged as a warning and ignored. Any problem raises ``ArtifactError``.
    """
    root = Path(path).expanduser().absolute()
    if not root.exists():
        raise ArtifactError(f"no artifact at {root}: the directory does not exist (compile one with moeforge compile)")
    if not root.is_dir():
        raise ArtifactError(f"{root} is not a directory; an artifact is a directory holding {MANIFEST_FILE}")
    manifest_path = root / MANIFEST_FILE
    try:
        text = manifest_path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ArtifactError(
            f"{root} has no {MANIFEST_FILE}: it is not a moeforge artifact, or its compile did not finish; recompile"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"cannot read {manifest_path}: {exc}") from None
    try:
        manifest = Manifest.from_json(text)
    except ArtifactError as exc:
        raise ArtifactError(f"{manifest_path}: {exc}") from None

    for rel in manifest.files:
        if not _safe_relpath(rel):
            raise ArtifactError(f"{manifest_path} lists the file {rel!r}, which lies outside the artifact")
    if MODEL_FILE not in manifest.files:
        raise ArtifactError(f"{manifest_path} does not list {MODEL_FILE}; recompile the artifact")

    problems: list[str] = []
    to_hash: list[str] = []
    for rel, entry in sorted(manifest.files.items()):
        file = root / rel
        if not file.is_file():
            problems.append(f"{rel} is missing")
            continue
        size = file.stat().st_size
        if size != entry["bytes"]:
            problems.append(f"{rel} has {size} bytes, the manifest says {entry['bytes']} (modified or truncated)")
        elif verify:
            to_hash.append(rel)
    if to_hash:
        digests = _map_files(lambda p: _hash_file(p)[0], [root / r for r in to_hash])
        problems.extend(f"{rel} does not match its sha256 in the manifest (modified or corrupted)"
                        for rel, digest in zip(to_hash, digests, strict=True)
                        if digest != manifest.files[rel]["sha256"])
    if problems:
        raise ArtifactError(
            f"artifact {root} is damaged: " + "; ".join(problems) + ". Recompile it (moeforge compile ... --force)"
        )

    extra = [rel for rel in _list_files_lenient(root) if rel != MANIFEST_FILE and rel not in manifest.files]
    if extra:
        log.warning("%s: files not listed in %s are ignored: %s", root, MANIFEST_FILE, ", ".join(extra))
    return Artifact(root=root, manifest=manifest, model_path=root / MODEL_FILE, extra_files=extra)


def _list_files_lenient(root: Path) -> list[str]:
    out: list[str] = []
    for dirpath, _, filenames in os.walk(root):
        out.extend(Path(dirpath, name).relative_to(root).as_posix() for name in filenames)
    return sorted(out)


# ---------------------------------------------------------------------------------------------- inspection
