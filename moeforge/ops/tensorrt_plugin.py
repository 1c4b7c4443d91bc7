"""What the moeforge TensorRT plugins (Python IPluginV3) share: identity, class boilerplate, registration.

An op's ``tensorrt.py`` states its contract only (output types and shapes, supported formats, ``enqueue``) in a
subclass of ``plugin_base(trt, ...)``; ``creator_class`` and ``register`` do the rest from its ``PluginSpec``.
Classes are built per TensorRT module (``tensorrt`` or ``tensorrt_rtx_bindings``), which the caller passes in:
nothing here imports TensorRT. Kernels are torch on the device pointers TensorRT hands to ``enqueue``
(``device_tensor``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np
import torch

from moeforge.core.errors import MoeforgeError

A = TypeVar("A")

# (PluginFieldCollection, the arrays behind it): a PluginField points at its array without owning it, so whoever
# holds the collection keeps the arrays alive too.
Fields = tuple[Any, list[np.ndarray]]


@dataclass(frozen=True)
class PluginSpec(Generic[A]):
    """A plugin's identity and how its attributes (a frozen dataclass ``A``) travel as plugin fields."""

    name: str
    num_outputs: int
    default_attrs: A  # what the creator advertises as its fields
    from_fields: Callable[[Any], A]  # PluginFieldCollection (or PluginFields) -> attrs, validated
    to_fields: Callable[[Any, A], Fields]  # (trt module, attrs) -> fields
    version: str = "1"
    namespace: str = "moeforge"


class _DeviceArray:
    """A device pointer seen by torch through the CUDA array interface (no copy)."""

    def __init__(self, pointer: int, shape: tuple[int, ...], typestr: str) -> None:
        self.__cuda_array_interface__ = {"data": (int(pointer), False), "shape": tuple(int(d) for d in shape),
                                         "typestr": typestr, "version": 3}


def device_tensor(pointer: int, shape: Any, typestr: str) -> torch.Tensor:
    """torch view of TensorRT's device memory (``typestr``: "<f4", "<f2", "<i4", "<i8")."""
    return torch.as_tensor(_DeviceArray(pointer, tuple(shape), typestr), device="cuda")


# TensorRT DataType names -> CUDA array interface type strings (BF16 is viewed as bfloat16 after the fact).
_TYPESTR = {"FLOAT": "<f4", "HALF": "<f2", "BF16": "<f2", "INT32": "<i4", "INT64": "<i8"}


def desc_tensor(desc: Any, pointer: int) -> torch.Tensor:
    """torch view of the tensor ``enqueue`` got as (PluginTensorDesc ``desc``, device ``pointer``)."""
    dtype = str(desc.type).split(".")[-1]
    tensor = device_tensor(pointer, tuple(desc.dims), _TYPESTR[dtype])
    return tensor.view(torch.bfloat16) if dtype == "BF16" else tensor


def linear_formats(trt: Any, in_out: Any, pos: int, int_types: dict[int, Any]) -> bool:
    """``supports_format_combination`` of an attention-like plugin: every tensor LINEAR; positions in
    ``int_types`` have that integer type; every other tensor one float type (fp32, fp16, bf16), input 0's."""
    desc = in_out[pos].desc
    if desc.format != trt.TensorFormat.LINEAR:
        return False
    if pos in int_types:
        return bool(desc.type == int_types[pos])
    floats = (trt.DataType.FLOAT, trt.DataType.HALF, trt.DataType.BF16)
    return desc.type in floats and bool(desc.type == in_out[0].desc.type)


@functools.cache
def plugin_base(trt: Any, build_interface: Any) -> Any:
    """Base of a plugin class for the TensorRT module ``trt``: the IPluginV3 interfaces initialised, identity and
    fields from the subclass's ``SPEC``, no tactics, ``clone`` with the same attributes. ``build_interface``:
    ``trt.IPluginV3OneBuild``, or ``trt.IPluginV3OneBuildV2`` for a plugin with aliased (in-place) outputs."""
    interfaces = (trt.IPluginV3, trt.IPluginV3OneCore, build_interface, trt.IPluginV3OneRuntime)

    class PluginBase(trt.IPluginV3, trt.IPluginV3OneCore, build_interface, trt.IPluginV3OneRuntime):
        SPEC: PluginSpec[Any]

        def __init__(self, attrs: Any, phase: Any = None) -> None:
            for interface in interfaces:  # pybind11 bases: each must be initialised explicitly
                interface.__init__(self)
            spec = self.SPEC
            self.attrs, self.phase = attrs, phase
            self.num_outputs = spec.num_outputs
            self.plugin_name, self.plugin_version, self.plugin_namespace = spec.name, spec.version, spec.namespace
            self.timing_cache_id = ""

        def get_capability_interface(self, type: Any) -> Any:
            return self

        def configure_plugin(self, inputs: Any, outputs: Any) -> None:
            pass

        def on_shape_change(self, inputs: Any, outputs: Any) -> None:
            pass

        def get_fields_to_serialize(self) -> Any:
            collection, self._field_arrays = self.SPEC.to_fields(trt, self.attrs)
            return collection

        def attach_to_context(self, context: Any) -> Any:
            return self.clone()

        def get_valid_tactics(self) -> list[int]:
            return []

        def set_tactic(self, tactic: int) -> None:
            pass

        def clone(self) -> Any:
            return type(self)(self.attrs, self.phase)

    return PluginBase


def creator_class(trt: Any, plugin_class: Any) -> type:
    """The IPluginCreatorV3One of ``plugin_class`` (a ``plugin_base`` subclass) for the TensorRT module ``trt``."""
    spec: PluginSpec[Any] = plugin_class.SPEC

    class Creator(trt.IPluginCreatorV3One):
        def __init__(self) -> None:
            trt.IPluginCreatorV3One.__init__(self)
            self.name, self.plugin_version, self.plugin_namespace = spec.name, spec.version, spec.namespace
            self.field_names, self._field_arrays = spec.to_fields(trt, spec.default_attrs)

        def create_plugin(self, name: str, fields: Any, phase: Any) -> Any:
            return plugin_class(spec.from_fields(fields), phase)

    Creator.__name__ = Creator.__qualname__ = f"{spec.name}Creator"
    return Creator


_CREATORS: dict[tuple[int, str], Any] = {}  # TensorRT's registry keeps a pointer: creators must stay alive


def register(trt: Any, spec: PluginSpec[Any], creator: Callable[[], type], allow_rtx: bool = False) -> Any:
    """Register the plugin's creator (``creator()`` builds its class) with ``trt.get_plugin_registry()``, once per
    TensorRT module; return the creator.

    Refused for TensorRT-RTX unless ``allow_rtx``: its 1.7 ONNX parser aborts the process when it imports a node
    as a Python plugin, and a registered plugin wins over the node's local function, which RTX otherwise inlines
    (docs/architecture.md, TensorRT target).
    """
    if trt.__name__.startswith("tensorrt_rtx") and not allow_rtx:
        raise MoeforgeError(f"not registering the Python {spec.name} plugin with TensorRT-RTX {trt.__version__}: "
                            "its ONNX parser aborts the process when it imports a node as a Python plugin (and a "
                            "registered plugin wins over the node's local function, which RTX otherwise inlines)")
    key = (id(trt), spec.name)
    if key not in _CREATORS:
        instance = creator()()
        trt.get_plugin_registry().register_creator(instance, spec.namespace)
        _CREATORS[key] = instance
    return _CREATORS[key]
