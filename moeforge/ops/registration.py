"""Registering a plugin op's ONNX schema with onnx's process-global registry (idempotent).

A registered schema lets ``onnx.checker``, ``onnx.shape_inference`` and onnxscript type a graph holding the node.
The TensorRT side (plugin creators) registers through ``moeforge/ops/tensorrt_plugin.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import onnx
from onnx.defs import OpSchema


def register_schema(op_type: str, version: int, domain: str, build: Callable[[], OpSchema]) -> None:
    """Register the schema ``build()`` makes, unless onnx already has ``domain.op_type`` at ``version`` (the
    registry refuses a second registration, and every import of an op module would make one)."""
    if not onnx.defs.has(op_type, version, domain):
        onnx.defs.register_schema(build())


def plugin_attributes(version: str, namespace: str) -> list[OpSchema.Attribute]:
    """The two schema attributes every plugin op carries for TensorRT's plugin lookup (with their defaults)."""
    return [OpSchema.Attribute("plugin_version", onnx.helper.make_attribute("plugin_version", version),
                               "TensorRT plugin version"),
            OpSchema.Attribute("plugin_namespace", onnx.helper.make_attribute("plugin_namespace", namespace),
                               "TensorRT plugin namespace")]
