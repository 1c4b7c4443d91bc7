"""The contract every graph pass follows, and the context it reads.

A pass is an object with a ``name`` and ``apply(model, ctx) -> int`` that rewrites the onnx-ir
model in place and returns how many matches it rewrote (0 is a valid answer: the report says so).
Passes read everything they need from ``PassContext`` (the model config, the maximum sequence
length); nothing is global.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeVar

import numpy as np
import onnx_ir as ir

from moeforge.core.config import ModelConfig

if TYPE_CHECKING:
    from onnxscript.rewriter import pattern

_T = TypeVar("_T")

# Opset import of the ONNX Runtime contrib domain (RotaryEmbedding, GroupQueryAttention, MoE, ...).
MS_DOMAIN = "com.microsoft"


@dataclass(frozen=True)
class PassContext:
    """Read-only facts a pass may need. ``max_seq_len`` bounds positions (cos/sin caches, KV buffers).
    What varies per compile beyond these (block size, quantisation choices) is the pass object's own argument."""

    config: ModelConfig
    max_seq_len: int
    # A streamed compile's weights do not fit in memory: a pass that runs the graph in ONNX Runtime (calibration)
    # writes it to a scratch folder beside this artifact path and lets ONNX Runtime map the weights
    # (``quant/calibration.py``). None: the graph is serialised in memory, as the in-memory compile always did.
    artifact_dir: Path | None = None
    progress: bool = False  # a pass that takes long shows a bar (the compile's --progress)


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

    @property
    def name(self) -> str:
        """The pass's name in reports and the manifest (usually a class attribute)."""
        ...

    def apply(self, model: ir.Model, ctx: PassContext) -> int: ...


def ensure_opset(model: ir.Model, domain: str, version: int) -> None:
    """Declare an opset import the rewritten graph now uses."""
    if model.opset_imports.get(domain, 0) < version:
        model.opset_imports[domain] = version


def add_initializer(graph: ir.Graph, name: str, data: np.ndarray | ir.TensorProtocol) -> ir.Value:
    """Register a constant (a numpy array or an onnx-ir tensor) as initializer ``name``; returns its value."""
    tensor = ir.tensor(data) if isinstance(data, np.ndarray) else data
    value = ir.Value(name=name, shape=ir.Shape(tensor.shape.numpy()), type=ir.TensorType(tensor.dtype),
                     const_value=tensor)
    graph.register_initializer(value)
    return value


def required(value: _T | None, what: str) -> _T:
    """``value``, which the caller needs to be set (an input, a producer, a dtype, a shape); raises a
    ValueError naming ``what`` when it is None."""
    if value is None:
        raise ValueError(f"{what} is missing")
    return value


def rewrite_rule(rule_class: type[pattern.RewriteRuleClassBase], *args: object) -> pattern.RewriteRule:
    """``rule_class.rule(*args)``, typed: onnxscript leaves ``RewriteRuleClassBase.rule`` unannotated."""
    build: Callable[..., pattern.RewriteRule] = rule_class.rule
    return build(*args)


def token_input(graph: ir.Graph) -> ir.Value:
    """The graph input that carries the tokens: ``input_ids`` [B, S], or on a later pipeline stage the hidden state
    ``hidden_states_in`` [B, S, H] (``moeforge/model/pipeline_stages.py``); its first two axes are batch and tokens."""
    for value in graph.inputs:
        if value.name in ("input_ids", "hidden_states_in"):
            return value
    raise ValueError("the graph has neither an input_ids nor a hidden_states_in input")

