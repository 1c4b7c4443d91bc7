"""The artifact directory: the contract between ``moeforge compile`` and every backend.

Layout (all paths relative to the artifact root)::

    model.onnx            the graph (weights as external data beside it)
    *.data / ...          external data, tokenizer.json, tokenizer_config.json, genai_config.json ...
    manifest.json         written last: format version, model config, graph I/O, KV-cache layout,
                          passes, target/precision, tool versions, and sha256 + size of every other file

``write_artifact`` builds the directory under a hidden temporary sibling and renames it into place,
so ``out_dir`` is either absent, the previous artifact, or the complete new one -- never half-written.
Replacing an artifact moves the old one aside (``.NAME.moeforge-old.*``) for the instant between two renames;
a writer killed there leaves NAME missing, and the next ``check_output_dir``/``write_artifact``/``load_artifact``
renames the old copy back (never deleting it). ``load_artifact`` checks the manifest (types, bounds, internal
consistency), refuses symlinks and external data outside the artifact, and (by default) every file's sha256.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import itertools
import logging
import os
import re
import secrets
import socket
import stat
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import onnx

from moeforge.core.errors import ArtifactError
from moeforge.core.kv_layout import KVCacheSpec
from moeforge.core.manifest import FORMAT_VERSION, MANIFEST_FILE, MAX_MANIFEST_BYTES, MODEL_FILE, Manifest
from moeforge.core.safe_paths import expand_user, remove_tree
from moeforge.core.strict_json import JsonFileError, read_json_file

# The artifact API is one import: the manifest types a loader needs come with load_artifact.
__all__ = ["FORMAT_VERSION", "MANIFEST_FILE", "MODEL_FILE", "Artifact", "ArtifactError", "KVCacheSpec", "Manifest",
           "check_output_dir", "install_directory", "load_artifact", "restore_interrupted", "write_artifact"]

log = logging.getLogger(__name__)

_HASH_CHUNK = 8 << 20
_TMP_TAG, _OLD_TAG = "moeforge-tmp", "moeforge-old"


# ---------------------------------------------------------------------------------------------- writing
def _host_tag() -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname())[:40] or "host"


def _scratch_name(out: Path, tag: str) -> Path:
    return out.parent / f".{out.name}.{tag}.{_host_tag()}.{os.getpid()}.{secrets.token_hex(4)}"


def make_scratch_dir(out: str | Path) -> Path:
    """A new scratch folder beside the artifact path ``out`` (created), named as the artifact writer's own: if this
    process is killed, the next write of ``out`` removes it (``_remove_stale_scratch``)."""
    path = _scratch_name(expand_user(out).absolute(), _TMP_TAG)
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkdir(path)
    return path


def external_initializers(graph: onnx.ModelProto, folder: Path, mode: Literal["r", "c"] = "r"
                          ) -> Iterator[tuple[onnx.TensorProto, np.ndarray]]:
    """Each initializer of ``graph`` (loaded without its external data) stored in a data file under ``folder``,
    with its bytes: a uint8 view into a memory map of that file (``mode`` "r", or "c": copy-on-write, for a reader
    that writes into its buffers). Nothing is read until the bytes are used; a view keeps its map alive."""
    maps: dict[str, np.memmap] = {}
    for tensor in graph.graph.initializer:
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = {entry.key: entry.value for entry in tensor.external_data}
        location, offset, length = info["location"], int(info.get("offset", 0)), int(info["length"])
        if location not in maps:
            maps[location] = np.memmap(folder / location, dtype=np.uint8, mode=mode)
        data = maps[location]
        if offset + length > len(data):
            raise ArtifactError(f"{location} is shorter than initializer {tensor.name} needs ({offset + length} "
                                f"bytes, the file has {len(data)}): the artifact is truncated; recompile it")
        yield tensor, data[offset:offset + length]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stale_scratch(out: Path) -> list[tuple[str, Path]]:
    """(tag, path) of the scratch dirs of ``out`` whose writer (on this host) is gone. Another host's are
    never touched: its process ids mean nothing here."""
    pattern = re.compile(rf"^\.{re.escape(out.name)}\.({_TMP_TAG}|{_OLD_TAG})\.{re.escape(_host_tag())}\.(\d+)\.")
    try:
        entries = sorted(out.parent.iterdir())
    except OSError:
        return []
    stale = []
    for entry in entries:
        match = pattern.match(entry.name)
        if match and int(match.group(2)) != os.getpid() and not _pid_alive(int(match.group(2))):
            stale.append((match.group(1), entry))
    return stale


def restore_interrupted(out_dir: str | Path) -> None:
    """Undo a replace killed between its two renames: ``out_dir`` is missing and the previous artifact sits in
    a dead writer's ``.NAME.moeforge-old.*``. Exactly one complete copy is renamed back; otherwise (none
    complete, or several) ``ArtifactError`` says where they are. Nothing is ever deleted here."""
    out = expand_user(out_dir).absolute()
    if os.path.lexists(out):
        return
    olds = [path for tag, path in _stale_scratch(out) if tag == _OLD_TAG]
    if not olds:
        return
    complete = [path for path in olds if _artifact_problem(path) is None]
    if len(complete) == 1:
        try:
            os.rename(complete[0], out)
        except OSError as exc:
            if os.path.lexists(out) and not os.path.lexists(complete[0]):
                return  # another process restored it first
            raise ArtifactError(
                f"{out} is missing: a killed moeforge compile left it at {complete[0]}, and moving it back failed "
                f"({exc.strerror or exc}); move it yourself: mv {complete[0]} {out}"
            ) from None
        _fsync_dir(out.parent)
        log.warning("restored %s from %s, where a killed moeforge compile had moved it aside", out, complete[0])
        return
    where = ", ".join(str(path) for path in olds)
    raise ArtifactError(
        f"{out} is missing: killed moeforge compiles left earlier copies of it ({len(complete)} of {len(olds)} "
        f"complete) at {where}; nothing was deleted: move the one to keep back (mv COPY {out}) and delete the rest"
    )


def _remove_stale_scratch(out: Path) -> None:
    """Remove scratch dirs of ``out`` left by a killed writer (same host, process gone). A moved-aside old
    artifact is removed only once ``out`` is a complete artifact (the replace it belonged to finished)."""
    stale = _stale_scratch(out)
    out_complete = any(tag == _OLD_TAG for tag, _ in stale) and _artifact_problem(out) is None
    for tag, entry in stale:
        if tag == _OLD_TAG and not out_complete:
            log.warning("keeping %s, left by an interrupted moeforge compile: %s is not a complete artifact",
                        entry, out)
            continue
        log.warning("removing %s left behind by an interrupted moeforge run", entry)
        with contextlib.suppress(OSError):  # best effort: what cannot be removed stays
            remove_tree(entry)


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


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


def _walk(root: Path) -> Iterator[tuple[int, str, list[str], list[tuple[str, int]]]]:
    """Every folder under ``root`` (itself first), depth first: (its descriptor, open while yielded; its POSIX path
    relative to ``root``, "" for root; its real subfolders; every other entry with its ``lstat`` mode: files, links
    of any kind, FIFOs ...).
    Iterative and by descriptor with one folder open at a time (it climbs back by ``..``, checked against the
    folder it left), never following a link below ``root``: a tree of any depth is walked, one deeper than the
    recursion limit (``os.walk`` raises ``RecursionError``) or than PATH_MAX included. A folder that cannot be read,
    or that moves while it is walked, raises ``OSError``."""
    fd = os.open(root, _DIR_FLAGS)
    parts: list[str] = []
    levels: list[tuple[int, int, list[str]]] = []  # per open level: (st_dev, st_ino, subfolders still to visit)
    try:
        while True:
            dirs: list[str] = []
            others: list[tuple[str, int]] = []
            for name in sorted(os.listdir(fd)):
                mode = os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode
                if stat.S_ISDIR(mode):
                    dirs.append(name)
                else:
                    others.append((name, mode))
            yield fd, "/".join(parts), dirs, others
            info = os.fstat(fd)
            levels.append((info.st_dev, info.st_ino, dirs[::-1]))
            while not levels[-1][2]:  # this folder is done: back up to the nearest one with subfolders left
                levels.pop()
                if not levels:
                    return
                up = os.open("..", _DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = up
                parts.pop()
                info = os.fstat(fd)
                if (info.st_dev, info.st_ino) != levels[-1][:2]:
                    raise OSError(errno.ESTALE, "a folder moved while it was read", str(root / "/".join(parts)))
            name = levels[-1][2].pop()
            child = os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = child
            parts.append(name)
    finally:
        os.close(fd)


def _shown(rel: str) -> str:
    """``rel`` short enough for a message (a path thousands of folders deep would fill the screen)."""
    return rel if len(rel) <= 160 else f"{rel[:60]}/.../{rel[-80:]}"


def _list_files(root: Path) -> list[str]:
    """Relative POSIX paths of every file under root (sorted); symlinks are refused."""
    out: list[str] = []
    try:
        for _, rel, _, others in _walk(root):
            for name, mode in others:
                path = f"{rel}/{name}" if rel else name
                if stat.S_ISLNK(mode):
                    raise ArtifactError(f"{root / _shown(path)} is a symlink; an artifact holds regular files only "
                                        "(a link could point anywhere): replace it with the file itself, or recompile "
                                        "the artifact")
                out.append(path)
    except OSError as exc:
        raise ArtifactError(f"cannot read {_shown(str(exc.filename or root))}: {exc.strerror or exc}") from None
    return sorted(out)


def _hash_tree(root: Path) -> dict[str, dict[str, Any]]:
    rels = _list_files(root)
    results = _map_files(lambda p: _hash_file(p, sync=True), [root / r for r in rels])
    for fd, _, _, _ in _walk(root):
        with contextlib.suppress(OSError):  # some filesystems do not fsync directories
            os.fsync(fd)
    return {rel: {"sha256": sha, "bytes": size} for rel, (sha, size) in zip(rels, results, strict=True)}


SHARDED_FILE = "sharded.json"  # the sharded record, beside the rank directories (compile/sharded_compile.py)
SHARDED_FORMAT_NAME = "moeforge-sharded"  # its "format" field
_RANK_DIR = re.compile(r"rank\d+")


def _check_sharded_replaceable(out: Path, refuse: str) -> None:
    """A sharded artifact (compile/sharded_compile.py) is ours to delete when its sharded.json reads as one and every
    other entry is a rank directory holding a replaceable artifact (with its manifest)."""
    try:  # strict: a nesting bomb or a FIFO planted as sharded.json is refused, never a traceback or a hang
        data = read_json_file(out / SHARDED_FILE, what="sharded manifest")
    except JsonFileError:
        data = None
    if not isinstance(data, dict) or data.get("format") != SHARDED_FORMAT_NAME:
        raise ArtifactError(f"{out} holds a {SHARDED_FILE} that is not a moeforge sharded manifest; {refuse}")
    extra = [p.name for p in out.iterdir() if p.name != SHARDED_FILE and not _RANK_DIR.fullmatch(p.name)]
    if extra:
        raise ArtifactError(f"{out} is a sharded moeforge artifact but also holds {', '.join(extra[:5])}; {refuse}")
    for rank in out.iterdir():
        if rank.name == SHARDED_FILE:
            continue
        if not (rank / MANIFEST_FILE).is_file():
            raise ArtifactError(f"{out} is a sharded moeforge artifact but {rank.name} has no {MANIFEST_FILE}; "
                                f"{refuse}")
        _check_replaceable(rank)


def _check_replaceable(out: Path) -> None:
    """With --force we only delete an earlier artifact (or an empty directory), never arbitrary data: ``out``
    must hold a manifest that reads as a moeforge one (``Manifest.from_json``), and nothing it does not list."""
    if out.is_symlink():
        raise ArtifactError(f"{out} is a symbolic link (to {os.readlink(out)}); --force replaces only a directory, "
                            "never what a link points to: remove the link yourself or give the real path")
    if not out.is_dir():
        raise ArtifactError(f"{out} exists and is not a directory; remove it yourself or choose another output path")
    if not any(out.iterdir()):
        return
    refuse = "refusing to delete it even with --force: remove it yourself or choose another output path"
    if (out / SHARDED_FILE).is_file():
        _check_sharded_replaceable(out, refuse)
        return
    try:
        manifest = _read_manifest(out)
    except ArtifactError:
        has = (out / MANIFEST_FILE).is_file()
        reason = f"its {MANIFEST_FILE} is not a moeforge manifest of format {FORMAT_VERSION}" if has else \
            f"no {MANIFEST_FILE}"
        raise ArtifactError(f"{out} exists and is not a moeforge artifact ({reason}); {refuse}") from None
    unlisted = _unlisted_entries(out, manifest)
    if unlisted:
        raise ArtifactError(f"{out} is a moeforge artifact but also holds {', '.join(unlisted)}, which it does not "
                            f"list; {refuse}")


def _unlisted_entries(root: Path, manifest: Manifest, limit: int = 5) -> list[str]:
    """Up to ``limit`` files (or links, sockets ...) under ``root`` that are neither manifest.json nor listed."""
    out: list[str] = []
    try:
        for _, folder, _, others in _walk(root):
            for name, _ in others:
                rel = f"{folder}/{name}" if folder else name
                if rel != MANIFEST_FILE and rel not in manifest.files:
                    out.append(_shown(rel))
                    if len(out) >= limit:
                        return out
    except OSError as exc:  # what it holds is unknown: never deleted unseen
        out.append(f"{_shown(str(exc.filename or root))}, which cannot be read ({exc.strerror or exc})")
    return out


def _check_destination(out: Path, force: bool) -> None:
    if os.path.lexists(out):
        _check_replaceable(out)  # first: advise --force only where --force would replace it
        if not force:
            raise ArtifactError(f"{out} already exists; pass --force to replace it")


def _check_parent_writable(out: Path) -> None:
    """The nearest existing ancestor of ``out`` must be a directory this user may create entries in.
    ``os.access`` honours a read-only mount for everyone, but root passes any permission bits: as root only
    the mkdir in ``write_artifact`` finds a directory root may not write (it is refused there too)."""
    for ancestor in out.parents:
        if ancestor.exists():
            if not ancestor.is_dir():
                raise ArtifactError(f"cannot create the directory {out.parent}: {ancestor} is a file")
            if not os.access(ancestor, os.W_OK | os.X_OK):
                raise ArtifactError(f"cannot write the artifact {out}: the directory {ancestor} is not writable "
                                    "(read-only filesystem or no permission); choose an output path you can write to")
            try:  # what the permission bits cannot tell (root, /proc, a full or special filesystem): try it
                os.rmdir(tempfile.mkdtemp(prefix=".moeforge-probe-", dir=ancestor))
            except OSError as exc:
                raise ArtifactError(f"cannot write the artifact {out}: creating a directory in {ancestor} fails "
                                    f"({exc.strerror}); choose an output path you can write to") from None
            return


def check_output_dir(out_dir: str | Path, force: bool = False) -> Path:
    """Fail early (before a long compile) if ``write_artifact(out_dir, force=force)`` would refuse the
    destination (it exists without ``force``, it is not an earlier artifact, a path component above it is a file,
    or the directory to create it in is not writable) or if it lies inside a sharded artifact. Changes nothing,
    except that an artifact a killed compile left moved aside is renamed back first (see ``restore_interrupted``).
    Returns the absolute path."""
    out = expand_user(out_dir).absolute()
    restore_interrupted(out)
    _check_not_inside_sharded(out)
    _check_destination(out, force)
    _check_parent_writable(out)
    return out


def _check_not_inside_sharded(out: Path) -> None:
    """Refuse a destination inside a sharded artifact (e.g. ``SHARDED/rank0``): replacing one rank would leave the
    others and ``sharded.json`` describing a model that is no longer there."""
    for ancestor in out.parents:
        if (ancestor / SHARDED_FILE).is_file():
            raise ArtifactError(f"{out} is inside the sharded artifact {ancestor} ({SHARDED_FILE} there): writing "
                                "one rank would break it; compile the whole sharded artifact again (-o "
                                f"{ancestor} --tp N --force) or choose an output outside it")


def _install(tmp: Path, out: Path, force: bool) -> None:
    """Rename the finished ``tmp`` to ``out``; an existing artifact is moved aside first, then deleted."""
    _check_destination(out, force)
    install_directory(tmp, out)


def install_directory(tmp: Path, out: Path) -> None:
    """Rename the finished directory ``tmp`` to ``out`` (the caller checked that ``out`` may be replaced); what is
    at ``out`` is moved aside first and deleted once the new one is in place, so ``out`` is never half written."""
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
        remove_tree(aside)  # iterative and by descriptor: any depth, links removed as links
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
    out = expand_user(out_dir).absolute()
    parent = out.parent
    restore_interrupted(out)
    _check_destination(out, force)  # fail before the (possibly long) payload
    _check_parent_writable(out)
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
        with contextlib.suppress(OSError):
            remove_tree(tmp)
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


def _read_manifest(root: Path) -> Manifest:
    """Parse ``root/manifest.json``: a regular file (no symlink, FIFO ...) of at most ``MAX_MANIFEST_BYTES``."""
    path = root / MANIFEST_FILE
    try:
        # O_NONBLOCK: opening a FIFO planted as manifest.json must not hang.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise ArtifactError(
            f"{root} has no {MANIFEST_FILE}: it is not a moeforge artifact, or its compile did not finish; recompile"
        ) from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ArtifactError(f"{path} is a symlink; an artifact holds regular files only: recompile it") from None
        raise ArtifactError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ArtifactError(f"{path} is not a regular file; recompile the artifact")
        if info.st_size > MAX_MANIFEST_BYTES:
            raise ArtifactError(f"{path} has {info.st_size} bytes, more than any manifest ({MAX_MANIFEST_BYTES}); "
                                "recompile the artifact")
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
    except OSError as exc:
        raise ArtifactError(f"cannot read {path}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    try:
        return Manifest.from_json(b"".join(chunks).decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ArtifactError(f"cannot read {path}: {exc}") from None
    except ArtifactError as exc:
        raise ArtifactError(f"{path}: {exc}") from None


def _artifact_problem(root: Path) -> str | None:
    """Why ``root`` is not a complete artifact (its manifest, and every listed file with its size), or None.
    Cheap: nothing is hashed."""
    try:
        manifest = _read_manifest(root)
    except ArtifactError as exc:
        return str(exc)
    for rel, entry in manifest.files.items():
        if not _safe_relpath(rel):
            return f"{MANIFEST_FILE} lists {rel!r}, outside the artifact"
        try:
            info = os.lstat(root / rel)
        except OSError:
            return f"{rel} is missing"
        if not stat.S_ISREG(info.st_mode) or info.st_size != entry["bytes"]:
            return f"{rel} is not the file the manifest lists"
    return None


def load_artifact(path: str | Path, verify: bool = True) -> Artifact:
    """Open an artifact directory and check it against its manifest.

    Always: the manifest parses, has this format version, passes ``Manifest.check`` (bounded sizes, a
    KV cache consistent with the model and the graph I/O), no symlink lies anywhere in the directory, every
    listed file is a regular file of the listed size, and every external-data ``location`` in model.onnx is
    a listed file. With ``verify`` (default) every file's sha256 is recomputed (streamed). Files not listed in
    the manifest are logged as a warning and ignored. An artifact a killed compile left moved aside is renamed
    back first. Any problem raises ``ArtifactError``.
    """
    root = expand_user(path).absolute()
    restore_interrupted(root)
    if not root.exists():
        raise ArtifactError(f"no artifact at {root}: the directory does not exist (compile one with moeforge compile)")
    if not root.is_dir():
        raise ArtifactError(f"{root} is not a directory; an artifact is a directory holding {MANIFEST_FILE}")
    manifest_path = root / MANIFEST_FILE
    manifest = _read_manifest(root)

    for rel in manifest.files:
        if not _safe_relpath(rel):
            raise ArtifactError(f"{manifest_path} lists the file {rel!r}, which lies outside the artifact")
    if MODEL_FILE not in manifest.files:
        raise ArtifactError(f"{manifest_path} does not list {MODEL_FILE}; recompile the artifact")
    present = set(_list_files(root))  # refuses a symlink anywhere, as the writer does

    problems: list[str] = []
    to_hash: list[str] = []
    for rel, entry in sorted(manifest.files.items()):
        if rel not in present:
            problems.append(f"{rel} is missing")
            continue
        info = os.lstat(root / rel)
        if not stat.S_ISREG(info.st_mode):  # a FIFO would hang the hashing
            problems.append(f"{rel} is not a regular file")
        elif info.st_size != entry["bytes"]:
            problems.append(f"{rel} has {info.st_size} bytes, the manifest says {entry['bytes']} "
                            "(modified or truncated)")
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
    _check_external_data(root, manifest)

    extra = [rel for rel in sorted(present) if rel != MANIFEST_FILE and rel not in manifest.files]
    if extra:
        log.warning("%s: files not listed in %s are ignored: %s", root, MANIFEST_FILE, ", ".join(extra))
    return Artifact(root=root, manifest=manifest, model_path=root / MODEL_FILE, extra_files=extra)


def _graph_tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield from (sparse.values, sparse.indices)
    for node in graph.node:
        yield from _node_tensors(node)


def _node_tensors(node: onnx.NodeProto) -> Iterator[onnx.TensorProto]:
    for attr in node.attribute:
        if attr.HasField("t"):
            yield attr.t
        yield from attr.tensors
        sparse = [*attr.sparse_tensors, *([attr.sparse_tensor] if attr.HasField("sparse_tensor") else [])]
        for tensor in sparse:
            yield from (tensor.values, tensor.indices)
        if attr.HasField("g"):
            yield from _graph_tensors(attr.g)
        for sub in attr.graphs:
            yield from _graph_tensors(sub)


def _check_external_data(root: Path, manifest: Manifest) -> None:
    """Every tensor model.onnx stores outside itself must point into a file of this artifact (one the manifest
    lists, so sized and hashed), within its bytes. An edited ``location`` (``../../secret``, an absolute path)
    is refused here with our message, before ONNX Runtime or ``inspect`` reads anything through it."""
    model_path = root / MODEL_FILE
    try:
        model = onnx.load(str(model_path), load_external_data=False)
    except Exception as exc:  # protobuf's DecodeError and whatever else a damaged file raises
        raise ArtifactError(f"{model_path} is not a readable ONNX model ({exc}); recompile the artifact") from None
    tensors = itertools.chain(_graph_tensors(model.graph),
                              (t for function in model.functions for node in function.node
                               for t in _node_tensors(node)))
    for tensor in tensors:
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = {entry.key: entry.value for entry in tensor.external_data}
        location = info.get("location", "")
        rel = Path(location).as_posix()
        if not _safe_relpath(location) or rel == MODEL_FILE or rel not in manifest.files:
            raise ArtifactError(
                f"{model_path}: the weight {tensor.name!r} is stored in {location!r}, which is not a file of this "
                f"artifact (external data must be a file inside it, listed in {MANIFEST_FILE}); recompile the artifact"
            )
        try:
            offset = int(info.get("offset", "0"))
            end = offset + int(info["length"]) if "length" in info else offset
        except ValueError:
            end = offset = -1
        if offset < 0 or end < offset or end > manifest.files[rel]["bytes"]:
            raise ArtifactError(f"{model_path}: the weight {tensor.name!r} lies outside {rel} (offset "
                                f"{info.get('offset')!r}, length {info.get('length')!r}); recompile the artifact")


# ---------------------------------------------------------------------------------------------- inspection


def _record_file(path: str | Path) -> Path:
    """The file that describes an artifact as a whole: ``sharded.json`` when sharded, else ``manifest.json``."""
    root = expand_user(path).absolute()
    return root / SHARDED_FILE if (root / SHARDED_FILE).is_file() else root / MANIFEST_FILE


def artifact_model_config(path: str | Path) -> dict[str, Any]:
    """The model config an artifact records (``sharded.json``'s when sharded, else ``manifest.json``'s)."""
    record = _record_file(path)
    try:
        data = read_json_file(record, what="artifact record", max_bytes=MAX_MANIFEST_BYTES)
    except JsonFileError as exc:
        raise ArtifactError(f"cannot read the model config: {exc}") from None
    config = data.get("model_config") if isinstance(data, dict) else None
    return config if isinstance(config, dict) else {}


def artifact_digest(path: str | Path) -> str:
    """The sha256 that names an artifact: of its ``sharded.json`` (which records every rank's manifest hash) when
    sharded, else of its ``manifest.json`` (which records the hash of every other file)."""
    record = _record_file(path)
    try:
        return hashlib.sha256(record.read_bytes()).hexdigest()
    except OSError as exc:
        raise ArtifactError(f"cannot read {record}: {exc.strerror or exc}") from None
