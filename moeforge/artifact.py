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

import dataclasses
import errno
import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import re
import secrets
import shutil
import socket
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from moeforge.errors import MoeforgeError

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST_FILE = "manifest.json"
MODEL_FILE = "model.onnx"
GENAI_CONFIG_FILE = "genai_config.json"

KVLayout = Literal["gqa", "mla_latent"]
KV_LAYOUTS: tuple[str, ...] = ("gqa", "mla_latent")
# Named dynamic axes of the per-layer KV buffer.
BATCH_AXIS, MAX_SEQ_AXIS = "batch_size", "max_sequence_length"

DTYPE_BYTES: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1, "bool": 1,
}

_HASH_CHUNK = 8 << 20
_TMP_TAG, _OLD_TAG = "moeforge-tmp", "moeforge-old"


class ArtifactError(MoeforgeError):
    """An artifact directory that cannot be written or read: exists, unwritable, missing, corrupted."""


def dtype_size(dtype: str) -> int:
    """Bytes per element of a dtype name ("float32", "bfloat16", ...)."""
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ArtifactError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}") from None


# ---------------------------------------------------------------------------------------------- manifest
@dataclass
class TensorSpec:
    """One graph input or output. A ``str`` in ``shape`` is a named dynamic axis."""

    name: str
    dtype: str
    shape: list[int | str]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TensorSpec:
        return cls(name=str(data["name"]), dtype=str(data["dtype"]), shape=list(data["shape"]))


@dataclass
class KVCacheSpec:
    """The KV cache the graph reads and writes, per layer.

    ``gqa``: two buffers per layer (key, value), ``shape`` ``[batch_size, Hkv, max_sequence_length, D]``.
    ``mla_latent``: one buffer per layer holding ``[c_kv | k_rope]`` (absorbed MLA).
    ``past_input_names[i]`` / ``present_output_names[i]`` name layer i's graph inputs/outputs, in the order
    (key, value) or (latent,). An MLA layer may have more than one present output (e.g. GroupQueryAttention's
    present_key and present_value, which are identical): a backend binds all of them to the layer's single
    latent buffer, the one bound to its past input. ``values_per_token_per_layer`` counts the scalars one
    token adds to one layer (all buffers together); ``bytes_per_token`` covers all layers. ``max_seq_len``
    is the longest sequence the artifact supports (positions, rotary tables).
    ``block_size`` set: a paged artifact (``--kv-cache paged``); ``shape`` is then a block pool
    ``[num_blocks, block_size, Hkv, D]`` and the names are ``kv_pool.{i}.*`` -> ``kv_pool_out.{i}.*``.
    """

    layout: KVLayout
    num_layers: int
    past_input_names: list[list[str]]
    present_output_names: list[list[str]]
    shape: list[int | str]
    dtype: str
    values_per_token_per_layer: int
    bytes_per_token: int
    max_seq_len: int
    block_size: int | None = None  # paged artifacts only

    @property
    def paged(self) -> bool:
        return self.block_size is not None

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one pool block over all layers (paged artifacts)."""
        return self.bytes_per_token * (self.block_size or 0)

    def __post_init__(self) -> None:
        self.validate()

    @property
    def buffers_per_layer(self) -> int:
        return 2 if self.layout == "gqa" else 1

    def bytes_for(self, seq_len: int, batch_size: int = 1) -> int:
        """Bytes of cache for ``batch_size`` sequences of ``seq_len`` tokens (all layers)."""
        return self.bytes_per_token * seq_len * batch_size

    def validate(self) -> None:
        if self.layout not in KV_LAYOUTS:
            raise ArtifactError(f"kv_cache.layout {self.layout!r} is not one of {', '.join(KV_LAYOUTS)}")
        dtype_size(self.dtype)
        for what, names in (("past_input_names", self.past_input_names),
                            ("present_output_names", self.present_output_names)):
            if len(names) != self.num_layers:
                raise ArtifactError(f"kv_cache.{what} has {len(names)} layers, num_layers is {self.num_layers}")
            for i, per_layer in enumerate(names):
                n = len(per_layer)
                # MLA: exactly one past input; present outputs all alias that one buffer.
                ok = n == 2 if self.layout == "gqa" else (n == 1 or (what == "present_output_names" and n >= 1))
                if not ok:
                    raise ArtifactError(
                        f"kv_cache.{what}[{i}] has {n} names; layout {self.layout} has "
                        f"{self.buffers_per_layer} buffer(s) per layer"
                    )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | ({"bytes_per_block": self.bytes_per_block} if self.paged else {})

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVCacheSpec:
        return cls(
            layout=data["layout"],
            num_layers=int(data["num_layers"]),
            past_input_names=[list(n) for n in data["past_input_names"]],
            present_output_names=[list(n) for n in data["present_output_names"]],
            shape=list(data["shape"]),
            dtype=str(data["dtype"]),
            values_per_token_per_layer=int(data["values_per_token_per_layer"]),
            bytes_per_token=int(data["bytes_per_token"]),
            max_seq_len=int(data["max_seq_len"]),
            block_size=None if data.get("block_size") is None else int(data["block_size"]),
        )


def kv_cache_spec(config: Any, *, max_seq_len: int, dtype: str = "float32") -> KVCacheSpec:
    """The default KV-cache spec for a ``ModelConfig`` with the GenAI-compatible names.

    GQA: ``past_key_values.{i}.key|value`` -> ``present.{i}.key|value``, shape
    ``[batch_size, Hkv, max_sequence_length, head_dim]``.
    MLA (absorbed): ``past_key_values.{i}.latent`` -> ``present.{i}.latent`` and ``.latent_v``, shape
    ``[batch_size, 1, max_sequence_length, kv_lora_rank + qk_rope_head_dim]`` (one KV head, as bound to
    GroupQueryAttention). An exporter with another layout builds ``KVCacheSpec`` itself.
    """
    from moeforge.graph_passes.kv_cache import cache_names  # the pass that creates them owns the names

    layers = config.num_hidden_layers
    names = [cache_names(i, config.mla is not None) for i in range(layers)]
    past = [list(n.past) for n in names]
    present = [list(n.present) for n in names]
    if config.mla is not None:
        per_layer = config.mla.latent_dim
        shape: list[int | str] = [BATCH_AXIS, 1, MAX_SEQ_AXIS, per_layer]
        layout: KVLayout = "mla_latent"
    else:
        per_layer = 2 * config.num_key_value_heads * config.head_dim
        shape = [BATCH_AXIS, config.num_key_value_heads, MAX_SEQ_AXIS, config.head_dim]
        layout = "gqa"
    return KVCacheSpec(
        layout=layout, num_layers=layers, past_input_names=past, present_output_names=present, shape=shape,
        dtype=dtype, values_per_token_per_layer=per_layer,
        bytes_per_token=per_layer * layers * dtype_size(dtype), max_seq_len=max_seq_len,
    )


def _utc_now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(kw_only=True)
class Manifest:
    """Everything a backend needs to know about an artifact without opening the graph.

    ``passes``: ``[{"name": str, "matches": int, "seconds": float}, ...]`` in the order they ran.
    ``files``: ``{relpath: {"sha256": hex, "bytes": int}}`` for every file but manifest.json
    (``write_artifact`` fills it in).
    ``layer_outputs``: names of the values holding each decoder layer's output [B, S, H] inside
    model.onnx (not graph outputs), for ``moeforge parity --per-layer``.
    """

    format_version: int = FORMAT_VERSION
    model_config: dict[str, Any]
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    kv_cache: KVCacheSpec
    passes: list[dict[str, Any]] = field(default_factory=list)
    target: str
    precision: str
    tool_versions: dict[str, str | None] = field(default_factory=lambda: tool_versions())
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    source: str = ""
    created_utc: str = field(default_factory=_utc_now)
    layer_outputs: list[str] = field(default_factory=list)
    # TensorRT target: the engine plan beside the ONNX (moeforge/trt/build.py EngineInfo.to_dict()).
    engine: dict[str, Any] | None = None
    quantization: dict[str, Any] | None = None  # moeforge/quantize.py summary: scheme, block, per-weight choices

    def config(self) -> Any:
        """The model config as a ``moeforge.export.config.ModelConfig``."""
        from moeforge.export.config import ModelConfig

        return ModelConfig.from_dict(self.model_config)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format_version": self.format_version,
            "model_config": self.model_config,
            "inputs": [t.to_dict() for t in self.inputs],
            "outputs": [t.to_dict() for t in self.outputs],
            "kv_cache": self.kv_cache.to_dict(),
            "passes": [dict(p) for p in self.passes],
            "target": self.target,
            "precision": self.precision,
            "tool_versions": dict(self.tool_versions),
            "files": {k: dict(v) for k, v in sorted(self.files.items())},
            "source": self.source,
            "created_utc": self.created_utc,
            "layer_outputs": list(self.layer_outputs),
            **({"engine": self.engine} if self.engine is not None else {}),
            "quantization": self.quantization,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, ensure_ascii=False) + "\n"

    @classmethod
    def from_dict(cls, data: Any) -> Manifest:
        if not isinstance(data, dict):
            raise ArtifactError(f"manifest is a JSON {type(data).__name__}, expected an object")
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            from moeforge import __version__

            if isinstance(version, int) and version > FORMAT_VERSION:
                hint = "it was written by a newer moeforge: upgrade moeforge, or recompile with this one"
            else:
                hint = "recompile the artifact with this moeforge"
            raise ArtifactError(
                f"unsupported artifact format_version {version!r}: moeforge {__version__} reads format "
                f"version {FORMAT_VERSION}; {hint}"
            )
        try:
            return cls(
                format_version=version,
                model_config=dict(data["model_config"]),
                inputs=[TensorSpec.from_dict(t) for t in data["inputs"]],
                outputs=[TensorSpec.from_dict(t) for t in data["outputs"]],
                kv_cache=KVCacheSpec.from_dict(data["kv_cache"]),
                passes=[dict(p) for p in data.get("passes", [])],
                target=str(data["target"]),
                precision=str(data["precision"]),
                tool_versions=dict(data.get("tool_versions", {})),
                files={str(k): {"sha256": str(v["sha256"]), "bytes": int(v["bytes"])}
                       for k, v in data["files"].items()},
                source=str(data.get("source", "")),
                created_utc=str(data.get("created_utc", "")),
                layer_outputs=[str(n) for n in data.get("layer_outputs", [])],
                engine=dict(data["engine"]) if data.get("engine") is not None else None,
                quantization=data.get("quantization"),
            )
        except KeyError as exc:
            raise ArtifactError(f"manifest is missing the field {exc.args[0]!r}") from None
        except (TypeError, ValueError, AttributeError) as exc:
            raise ArtifactError(f"manifest is malformed: {exc}") from None

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ArtifactError(f"manifest is not valid JSON: {exc}") from None
        return cls.from_dict(data)


_TOOL_DISTRIBUTIONS: dict[str, tuple[str, ...]] = {
    "moeforge": ("moeforge",),
    "torch": ("torch",),
    "onnx": ("onnx",),
    "onnxruntime": ("onnxruntime", "onnxruntime-gpu", "onnxruntime-directml", "onnxruntime-openvino"),
    "onnx_ir": ("onnx-ir",),
    "onnxscript": ("onnxscript",),
}


def tool_versions() -> dict[str, str | None]:
    """Versions of the tools that shape an artifact (None for one not installed). Imports nothing."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for key, dists in _TOOL_DISTRIBUTIONS.items():
        out[key] = None
        for dist in dists:
            try:
                out[key] = importlib.metadata.version(dist)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    return out


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
