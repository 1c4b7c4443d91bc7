"""The artifact manifest: the typed contract every backend reads (``manifest.json``).

``TensorSpec`` (graph I/O), ``KVCacheSpec`` (cache layout: contiguous per-slot buffers or paged pools,
bytes per token / block), ``Manifest`` (format version, model config, I/O, KV layout, passes, target,
precision, quantisation choices, TensorRT engine, tool versions, file hashes). Writing and loading the
directory lives in ``moeforge/artifact.py``.
"""

from __future__ import annotations

import importlib.metadata
import json
import platform
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from moeforge import __version__
from moeforge.errors import ArtifactError
from moeforge.export.config import ModelConfig
from moeforge.kv_layout import KVCacheSpec

FORMAT_VERSION = 1
MANIFEST_FILE = "manifest.json"
MODEL_FILE = "model.onnx"
GENAI_CONFIG_FILE = "genai_config.json"


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
    quantization: dict[str, Any] | None = None  # moeforge/quant/ summary: scheme, block, per-weight choices

    def config(self) -> ModelConfig:
        """The model config as a ``moeforge.export.config.ModelConfig``."""
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
