"""The artifact manifest: the typed contract every backend reads (``manifest.json``).

``TensorSpec`` (graph I/O), ``KVCacheSpec`` (cache layout: contiguous per-slot buffers or paged pools,
bytes per token / block), ``Manifest`` (format version, model config, I/O, KV layout, passes, target,
precision, quantisation choices, TensorRT engine, tool versions, file hashes). Writing and loading the
directory lives in ``moeforge/core/artifact.py``.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import platform
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, cast

from moeforge import __version__
from moeforge.core.config import ModelConfig
from moeforge.core.errors import ArtifactError, ConfigError
from moeforge.core.kv_layout import (
    BATCH_AXIS,
    MAX_SEQ_AXIS,
    PAST_PREFIX,
    POOL_AXIS,
    POOL_PREFIX,
    KVCacheSpec,
    dtype_size,
    v4_spec,
)
from moeforge.core.kv_layout_v4 import BufferKind, V4Buffer
from moeforge.core.strict_json import JsonFileError, parse_json_text

FORMAT_VERSION = 1
MANIFEST_FILE = "manifest.json"
MODEL_FILE = "model.onnx"
GENAI_CONFIG_FILE = "genai_config.json"

# Bounds on the KV-cache numbers of a manifest being read. A backend preallocates slots x max_seq_len x layers
# of cache from them before it runs anything, so a corrupted or hand-edited manifest is refused here, not by
# the allocator (max_seq_len 1e12 asked for 116 TiB). The model's own sizes (vocab, layers, heads ...) are
# bounded by ``ModelConfig.validate`` (``moeforge/core/config.py``), which ``Manifest.from_dict`` runs.
MAX_SEQ_LEN = 2**24  # tokens; the limit of max_position_embeddings
MAX_KV_LAYERS = 1024  # the limit of num_hidden_layers
MAX_BLOCK_SIZE = 2**16  # tokens per paged pool block
MAX_MANIFEST_BYTES = 64 << 20  # a real manifest is kilobytes; a larger one is not read at all
_FIX = "the artifact is corrupted or was edited by hand: recompile it (moeforge compile ... --force)"
_SHA256 = re.compile(r"[0-9a-f]{64}")


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


# ---------------------------------------------------------------------------------------------- strict reading
# JSON gives bool for int, float for int and inf for 1e400: read every field with its type checked, so nothing
# downstream loops over or allocates by a value that only looked like a size.
def _show(value: object, limit: int = 60) -> str:
    """A short repr for messages (a crafted value may be long)."""
    try:
        text = repr(value)
    except ValueError:  # an int beyond sys.get_int_max_str_digits()
        return f"a {type(value).__name__} too large to print"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _int(value: object, what: str, lo: int = 0, hi: int = 2**62) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ArtifactError(f"manifest {what} must be an integer, got {_show(value)}; {_FIX}")
    if not lo <= value <= hi:
        raise ArtifactError(f"manifest {what} is {_show(value)}, outside the supported {lo}..{hi}; {_FIX}")
    return value


def _str(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise ArtifactError(f"manifest {what} must be a string, got {_show(value)}; {_FIX}")
    return value


def _list(value: object, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise ArtifactError(f"manifest {what} must be a list, got {_show(value)}; {_FIX}")
    return value


def _dict(value: object, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ArtifactError(f"manifest {what} must be an object, got {_show(value)}; {_FIX}")
    return value


def _tensor(value: object, what: str) -> TensorSpec:
    data = _dict(value, what)
    shape = _list(data["shape"], f"{what}.shape")
    for i, dim in enumerate(shape):
        if not isinstance(dim, str):
            _int(dim, f"{what}.shape[{i}]", -1)  # -1: a dynamic dim as TensorRT reports it
    return TensorSpec(_str(data["name"], f"{what}.name"), _str(data["dtype"], f"{what}.dtype"), shape)


def _names(value: object, what: str) -> list[list[str]]:
    return [[_str(n, f"{what}[{i}][{j}]") for j, n in enumerate(_list(layer, f"{what}[{i}]"))]
            for i, layer in enumerate(_list(value, what))]


def _kv_cache(value: object) -> KVCacheSpec:
    data = _dict(value, "kv_cache")
    shape = _list(data["shape"], "kv_cache.shape")
    for i, dim in enumerate(shape):
        if not isinstance(dim, str):
            _int(dim, f"kv_cache.shape[{i}]", 1, MAX_SEQ_LEN)
    block_size = data.get("block_size")
    fields: dict[str, Any] = dict(
        layout=_str(data["layout"], "kv_cache.layout"),
        num_layers=_int(data["num_layers"], "kv_cache.num_layers", 1, MAX_KV_LAYERS),
        past_input_names=_names(data["past_input_names"], "kv_cache.past_input_names"),
        present_output_names=_names(data["present_output_names"], "kv_cache.present_output_names"),
        shape=shape,
        dtype=_str(data["dtype"], "kv_cache.dtype"),
        values_per_token_per_layer=_int(data["values_per_token_per_layer"], "kv_cache.values_per_token_per_layer", 1),
        bytes_per_token=_int(data["bytes_per_token"], "kv_cache.bytes_per_token", 1),
        max_seq_len=_int(data["max_seq_len"], "kv_cache.max_seq_len", 1, MAX_SEQ_LEN),
        block_size=None if block_size is None else _int(block_size, "kv_cache.block_size", 1, MAX_BLOCK_SIZE),
    )
    widths = data.get("buffer_widths")
    if widths is not None:  # DSA: the latent and the indexer's keys
        fields["buffer_widths"] = [_int(w, f"kv_cache.buffer_widths[{i}]", 1, MAX_SEQ_LEN)
                                   for i, w in enumerate(_list(widths, "kv_cache.buffer_widths"))]
    layers = data.get("layer_buffers")
    if layers is not None:  # DeepSeek-V4: each layer's rings and entries
        fields["layer_buffers"] = [[_v4_buffer(b, f"kv_cache.layer_buffers[{i}][{j}]")
                                    for j, b in enumerate(_list(layer, f"kv_cache.layer_buffers[{i}]"))]
                                   for i, layer in enumerate(_list(layers, "kv_cache.layer_buffers"))]
    try:
        return KVCacheSpec(**fields)
    except ArtifactError as exc:  # KVCacheSpec.validate: the layout, dtype and per-layer name counts
        raise ArtifactError(f"manifest {exc}; {_FIX}") from None


def _v4_buffer(value: object, what: str) -> V4Buffer:
    data = _dict(value, what)
    return V4Buffer(kind=cast(BufferKind, _str(data["kind"], f"{what}.kind")),
                    width=_int(data["width"], f"{what}.width", 1, MAX_SEQ_LEN),
                    ring=_int(data.get("ring", 0), f"{what}.ring", 0, MAX_SEQ_LEN),
                    tokens_per_row=_int(data.get("tokens_per_row", 0), f"{what}.tokens_per_row", 0, MAX_SEQ_LEN))


def _files(value: object) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for rel, entry in _dict(value, "files").items():
        entry = _dict(entry, f"files[{rel!r}]")
        sha = _str(entry["sha256"], f"files[{rel!r}].sha256")
        if not _SHA256.fullmatch(sha):
            raise ArtifactError(f"manifest files[{rel!r}].sha256 is not a sha256 hex digest; {_FIX}")
        out[rel] = {"sha256": sha, "bytes": _int(entry["bytes"], f"files[{rel!r}].bytes")}
    return out


def _engine(value: object) -> dict[str, Any]:
    """The TensorRT engine record: the fields ``inspect`` and the TensorRT backend read, type-checked."""
    engine = _dict(value, "engine")
    for key in ("plan_file", "impl", "tensorrt_version", "compute_capability"):
        _str(engine[key], f"engine.{key}")
    _int(engine["plan_bytes"], "engine.plan_bytes")
    seconds = engine["build_seconds"]
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not math.isfinite(seconds):
        raise ArtifactError(f"manifest engine.build_seconds must be a finite number, got {_show(seconds)}; {_FIX}")
    for key in ("inputs", "outputs"):
        for i, t in enumerate(_list(engine[key], f"engine.{key}")):
            _tensor(t, f"engine.{key}[{i}]")
    for i, profile in enumerate(_list(engine["profiles"], "engine.profiles")):
        _str(_dict(profile, f"engine.profiles[{i}]")["name"], f"engine.profiles[{i}].name")
    return dict(engine)


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
    # TensorRT target: the engine plan beside the ONNX (moeforge/compile/trt/engine_build.py EngineInfo.to_dict()).
    engine: dict[str, Any] | None = None
    quantization: dict[str, Any] | None = None  # moeforge/quant/ summary: scheme, block, per-weight choices
    # One rank of a sharded artifact (compile/sharded_compile.py): rank, tp, ep and the heads/vocab/experts it holds.
    sharding: dict[str, Any] | None = None

    def config(self) -> ModelConfig:
        """The model config as a ``moeforge.core.config.ModelConfig``."""
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
            **({"sharding": self.sharding} if self.sharding is not None else {}),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, ensure_ascii=False) + "\n"

    @classmethod
    def from_dict(cls, data: Any) -> Manifest:
        """Read a manifest, every field type-checked and bounded, then ``check()``-ed; else ``ArtifactError``."""
        if not isinstance(data, dict):
            raise ArtifactError(f"manifest is a JSON {type(data).__name__}, expected an object")
        version = data.get("format_version")
        if isinstance(version, bool) or version != FORMAT_VERSION:
            if isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION:
                hint = "it was written by a newer moeforge: upgrade moeforge, or recompile with this one"
            else:
                hint = "recompile the artifact with this moeforge"
            raise ArtifactError(
                f"unsupported artifact format_version {version!r}: moeforge {__version__} reads format "
                f"version {FORMAT_VERSION}; {hint}"
            )
        try:
            versions = _dict(data.get("tool_versions", {}), "tool_versions")
            quantization = data.get("quantization")
            manifest = cls(
                format_version=FORMAT_VERSION,
                model_config=dict(_dict(data["model_config"], "model_config")),
                inputs=[_tensor(t, f"inputs[{i}]") for i, t in enumerate(_list(data["inputs"], "inputs"))],
                outputs=[_tensor(t, f"outputs[{i}]") for i, t in enumerate(_list(data["outputs"], "outputs"))],
                kv_cache=_kv_cache(data["kv_cache"]),
                passes=[dict(_dict(p, f"passes[{i}]")) for i, p in enumerate(_list(data.get("passes", []), "passes"))],
                target=_str(data["target"], "target"),
                precision=_str(data["precision"], "precision"),
                tool_versions={k: None if v is None else _str(v, f"tool_versions[{k!r}]") for k, v in versions.items()},
                files=_files(data["files"]),
                source=_str(data.get("source", ""), "source"),
                created_utc=_str(data.get("created_utc", ""), "created_utc"),
                layer_outputs=[_str(n, "layer_outputs[]")
                               for n in _list(data.get("layer_outputs", []), "layer_outputs")],
                engine=None if data.get("engine") is None else _engine(data["engine"]),
                quantization=None if quantization is None else dict(_dict(quantization, "quantization")),
                sharding=None if data.get("sharding") is None else dict(_dict(data["sharding"], "sharding")),
            )
        except KeyError as exc:
            raise ArtifactError(f"manifest is missing the field {_show(exc.args[0])}; {_FIX}") from None
        except (TypeError, ValueError, AttributeError, OverflowError) as exc:
            raise ArtifactError(f"manifest is malformed: {_show(str(exc), 200)}; {_FIX}") from None
        manifest.check()
        return manifest

    def check(self) -> None:
        """Cross-check the parts against each other, so a backend can trust any one of them: the model config
        is valid (bounded sizes), ``kv_cache`` has its layer count, buffer shape and byte counts, and names
        exactly the graph inputs and outputs that hold the cache. ``ArtifactError`` names the first mismatch."""
        try:
            config = self.config()
        except (ConfigError, TypeError, ValueError, AttributeError, OverflowError) as exc:  # any odd value
            raise ArtifactError(f"manifest model_config: {_show(str(exc), 300)}; {_FIX}") from None
        kv = self.kv_cache
        if kv.num_layers != config.num_hidden_layers:
            raise ArtifactError(f"manifest kv_cache.num_layers is {kv.num_layers}, model_config.num_hidden_layers "
                                f"{config.num_hidden_layers}; {_FIX}")
        if kv.max_seq_len > config.max_position_embeddings:
            raise ArtifactError(f"manifest kv_cache.max_seq_len {kv.max_seq_len} exceeds model_config."
                                f"max_position_embeddings {config.max_position_embeddings}; {_FIX}")
        self._check_kv_shape(config)
        logits = [t.shape[-1] for t in self.outputs if t.name == "logits" and t.shape]
        if logits and isinstance(logits[0], int) and logits[0] != config.vocab_size:
            raise ArtifactError(f"manifest model_config.vocab_size is {config.vocab_size}, the graph's logits have "
                                f"{logits[0]}; {_FIX}")
        ins, outs = [t.name for t in self.inputs], [t.name for t in self.outputs]
        past = [n for layer in kv.past_input_names for n in layer]
        present = [n for layer in kv.present_output_names for n in layer]
        for what, names, graph, side in (("past_input_names", past, set(ins), "inputs"),
                                         ("present_output_names", present, set(outs), "outputs")):
            missing = [n for n in names if n not in graph]
            if missing:
                raise ArtifactError(f"manifest kv_cache.{what} names {missing[0]!r}, which is not among the graph "
                                    f"{side}; {_FIX}")
            if len(set(names)) != len(names):
                raise ArtifactError(f"manifest kv_cache.{what} names a tensor twice; {_FIX}")
        # Every cache input must be bound by a backend: one the kv_cache does not name would run unbound.
        unbound = [n for n in ins if n.startswith((PAST_PREFIX, POOL_PREFIX)) and n not in set(past)]
        if unbound:
            raise ArtifactError(f"manifest input {unbound[0]!r} is a KV-cache input that kv_cache does not list "
                                f"({kv.num_layers} layers); {_FIX}")
        if self.engine is not None and self.engine["plan_file"] not in self.files:
            raise ArtifactError(f"manifest engine.plan_file {self.engine['plan_file']!r} is not among the artifact's "
                                f"files; {_FIX}")

    def _check_kv_shape(self, config: ModelConfig) -> None:
        """The buffer shape is the layout's ([B, Hkv, L, D] or pool [N, Bs, Hkv, D]) with the model's heads
        and head size, and the per-token counts follow from it (they size every cache allocation)."""
        kv = self.kv_cache
        if config.compressed_attention is not None:  # DeepSeek-V4: the whole spec follows from the model
            want = v4_spec(config, max_seq_len=kv.max_seq_len, block_size=kv.block_size, dtype=kv.dtype)
            for field in ("layout", "layer_buffers", "shape", "values_per_token_per_layer", "bytes_per_token"):
                if getattr(kv, field) != getattr(want, field):
                    raise ArtifactError(f"manifest kv_cache.{field} is {_show(getattr(kv, field))}; this model's "
                                        f"v4_hybrid cache has {_show(getattr(want, field))}; {_FIX}")
            return
        layout = ("mla_dsa" if config.dsa is not None else "mla_latent") if config.mla is not None else "gqa"
        if kv.layout != layout:
            raise ArtifactError(f"manifest kv_cache.layout is {kv.layout}, the model's attention caches {layout}; "
                                f"{_FIX}")
        heads, width = (1, config.mla.latent_dim) if config.mla is not None else (config.num_key_value_heads,
                                                                                    config.head_dim)
        if kv.paged:
            expected: list[object] = [POOL_AXIS, kv.block_size, heads, width]
        else:
            # TensorRT's contiguous cache has the static length max_seq_len, ONNX Runtime's a named axis.
            length = kv.max_seq_len if len(kv.shape) == 4 and kv.shape[2] == kv.max_seq_len else MAX_SEQ_AXIS
            expected = [BATCH_AXIS, heads, length, width]
        if kv.shape != expected:
            raise ArtifactError(f"manifest kv_cache.shape is {_show(kv.shape)}; this model's {kv.layout} cache is "
                                f"{expected}; {_FIX}")
        values = kv.buffers_per_layer * heads * width
        if config.dsa is not None:  # the latent + the indexer's keys, each its own width
            if kv.buffer_widths != [width, config.dsa.index_head_dim]:
                raise ArtifactError(f"manifest kv_cache.buffer_widths is {_show(kv.buffer_widths)}; this model's "
                                    f"{kv.layout} buffers are {[width, config.dsa.index_head_dim]} wide; {_FIX}")
            values = width + config.dsa.index_head_dim
        if kv.values_per_token_per_layer != values:
            raise ArtifactError(f"manifest kv_cache.values_per_token_per_layer is {kv.values_per_token_per_layer}, "
                                f"the shape gives {values}; {_FIX}")
        expected_bytes = values * kv.num_layers * dtype_size(kv.dtype)
        if kv.bytes_per_token != expected_bytes:
            raise ArtifactError(f"manifest kv_cache.bytes_per_token is {kv.bytes_per_token}, the shape and dtype "
                                f"give {expected_bytes}; {_FIX}")

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        # Strict JSON (strict_json.py): a lone surrogate escape, a key given twice, NaN, a 5000-digit int or deep
        # nesting is refused here, not met later as a traceback where the text is printed or encoded.
        try:
            data = parse_json_text(text, source="manifest", fix=_FIX)
        except JsonFileError as exc:
            raise ArtifactError(str(exc)) from None
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
