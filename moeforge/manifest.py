"""The artifact manifest: the typed contract every backend reads (``manifest.json``).

``TensorSpec`` (graph I/O), ``KVCacheSpec`` (cache layout: contiguous per-slot buffers or paged pools,
bytes per token / block), ``Manifest`` (format version, model config, I/O, KV layout, passes, target,
precision, quantisation choices, TensorRT engine, tool versions, file hashes). Writing and loading the
directory lives in ``moeforge/artifact.py``.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import platform
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from moeforge.errors import MoeforgeError

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
