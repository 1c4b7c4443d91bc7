"""The contract every graph pass follows, and the context it reads.

A pass is an object with a ``name`` and ``apply(model, ctx) -> int`` that rewrites the onnx-ir
model in place and returns how many matches it rewrote (0 is a valid answer: the report says so).
Passes read everything they need from ``PassContext`` (the model config, the maximum sequence
length, the target); nothing is global.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

import numpy as np
import onnx_ir as ir

from moeforge.export.config import ModelConfig

Target = Literal["ort", "trt"]

# Opset import of the ONNX Runtime contrib domain (RotaryEmbedding, GroupQueryAttention, MoE, ...).
MS_DOMAIN = "com.microsoft"


@dataclass
class PassContext:
    """Read-only facts a pass may need. ``max_seq_len`` bounds positions (cos/sin caches, KV buffers)."""

    config: ModelConfig
    max_seq_len: int
    target: Target = "ort"
    notes: dict[str, object] = field(default_factory=dict)  # facts one pass hands the next (documented per pass)


@dataclass
class PassReport:
    """What one pass did: how many matches it rewrote and how long it took."""

    name: str
    matches: int
    seconds: float

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "matches": self.matches, "seconds": round(self.seconds, 3)}


class GraphPass(Protocol):
    """A rewrite of the graph; ``apply`` returns the number of matches rewritten."""

    name: str

    def apply(self, model: ir.Model, ctx: PassContext) -> int: ...


def ensure_opset(model: ir.Model, domain: str, version: int) -> None:
    """Declare an opset import the rewritten graph now uses."""
    if model.opset_imports.get(domain, 0) < version:
        model.opset_imports[domain] = version


def add_initializer(graph: ir.Graph, name: str, data: np.ndarray | ir.TensorProtocol) -> ir.Value:
    """Register a constant (a numpy array or an onnx-ir tensor) as initializer ``name``; returns its value."""
    tensor = ir.tensor(data) if isinstance(data, np.ndarray) else data
    value = ir.Value(name=name, shape=ir.Shape(tensor.shape), type=ir.TensorType(tensor.dtype), const_value=tensor)
    graph.register_initializer(value)
    return value
