"""A small onnx-ir node builder: named nodes, constants and initializers for a rewrite or a function body.

Used by the MoE lowering and by the MoERouter op's function body and ORT lowering, so both emit the
same routing nodes. New value names are ``<prefix>/<stem>`` (names must stay unique: SSA).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import onnx_ir as ir
from onnx_ir import convenience


class NodeBuilder:
    """Collects new nodes in order (the caller inserts them); registers initializers on ``graph``."""

    def __init__(self, graph: ir.Graph | None, prefix: str) -> None:
        self.graph = graph  # None when building a function body (no initializers there)
        self.prefix = prefix
        self.nodes: list[ir.Node] = []
        self._consts = 0

    def _name(self, stem: str) -> str:
        return f"{self.prefix}/{stem}" if self.prefix else stem

    def op(self, op_type: str, inputs: list[ir.Value | None], attributes: dict[str, Any] | None, out: str,
           domain: str = "") -> ir.Value:
        return self.op_multi(op_type, inputs, attributes, (out,), domain=domain)[0]

    def op_multi(self, op_type: str, inputs: list[ir.Value | None], attributes: dict[str, Any] | None,
                 outs: tuple[str, ...], domain: str = "") -> list[ir.Value]:
        attrs = convenience.convert_attributes(attributes or {})
        node = ir.Node(domain, op_type, inputs, attributes=attrs, num_outputs=len(outs),
                       name=self._name(f"{op_type}_{outs[0]}"))
        for value, stem in zip(node.outputs, outs, strict=True):
            value.name = self._name(stem)
        self.nodes.append(node)
        return list(node.outputs)

    def _const(self, array: np.ndarray) -> ir.Value:
        self._consts += 1
        return self.op("Constant", [], {"value": ir.tensor(array)}, f"const_{self._consts}")

    def const_i64(self, values: list[int]) -> ir.Value:
        return self._const(np.array(values, np.int64))

    def const_f32(self, value: float) -> ir.Value:
        return self._const(np.array(value, np.float32))

    def const_bool(self, value: bool) -> ir.Value:
        return self._const(np.array([value]))

    def as_f32(self, value: ir.Value, stem: str) -> ir.Value:
        if value.dtype == ir.DataType.FLOAT:
            return value
        return self.op("Cast", [value], {"to": ir.DataType.FLOAT}, stem)

    def initializer(self, array: np.ndarray, name: str) -> ir.Value:
        unique = self._unique_initializer_name(name)
        return self._register(ir.tensor(array, name=unique), unique)

    def lazy_initializer(self, compute: Callable[[], np.ndarray], dtype: ir.DataType, shape: Sequence[int],
                         name: str) -> ir.Value:
        """An initializer computed only when read (``compute`` -> an array of ``dtype`` and ``shape``): a weight
        transform that holds no copy until the artifact writer reads it, one tensor at a time."""
        unique = self._unique_initializer_name(name)
        return self._register(lazy_tensor(compute, dtype, shape, unique), unique)

    def initializer_tensor(self, tensor: ir.TensorProtocol, name: str) -> ir.Value:
        """An initializer holding ``tensor`` as it is (e.g. a lazy ``ExpertStack``), under a unique ``name``."""
        unique = self._unique_initializer_name(name)
        tensor.name = unique
        return self._register(tensor, unique)

    def _unique_initializer_name(self, name: str) -> str:
        if self.graph is None:
            raise ValueError("initializers need a graph (function bodies use Constant nodes)")
        unique, i = name, 1
        while unique in self.graph.initializers:
            unique, i = f"{name}_{i}", i + 1
        return unique

    def _register(self, tensor: ir.TensorProtocol, name: str) -> ir.Value:
        assert self.graph is not None
        value = ir.Value(name=name, shape=ir.Shape(tensor.shape.numpy()), type=ir.TensorType(tensor.dtype),
                         const_value=tensor)
        self.graph.register_initializer(value)
        return value


def lazy_tensor(compute: Callable[[], np.ndarray], dtype: ir.DataType, shape: Sequence[int],
                name: str | None = None) -> ir.LazyTensor:
    """A tensor whose values ``compute`` makes when something reads them (nothing cached: each read computes)."""
    return ir.LazyTensor(lambda: ir.tensor(compute(), name=name), dtype, ir.Shape(list(shape)), name=name)


def const_tensor(value: ir.Value) -> ir.TensorProtocol | None:
    """The value's tensor if it is a constant (initializer or Constant node output), else None; nothing read."""
    if value.const_value is not None and not value.is_graph_input():
        return value.const_value
    node = value.producer()
    if node is not None and (node.domain, node.op_type) == ("", "Constant") and "value" in node.attributes:
        return node.attributes["value"].as_tensor()
    return None


def const_array(value: ir.Value) -> np.ndarray | None:
    """The value's data if it is a constant (initializer or Constant node output), else None."""
    if value.const_value is not None and not value.is_graph_input():
        return value.const_value.numpy()
    node = value.producer()
    if node is not None and (node.domain, node.op_type) == ("", "Constant") and "value" in node.attributes:
        return node.attributes["value"].as_tensor().numpy()
    return None
