"""TensorRT IPluginV3 for ``moeforge.MoERouter`` (plugin name MoERouter, version "1", namespace "moeforge").

Dimension letters: T tokens, E routed experts, G groups, K = top_k.

Contract (the ONNX node, which also carries a standard-op local function for runtimes without the plugin):
    inputs   router_logits float32 [T, E], correction_bias float32 [E] (optional)
    outputs  expert_ids int32 [T, K], expert_weights float32 [T, K]
    attrs    scoring softmax|sigmoid, top_k, n_group, topk_group, group_scoring max|top2_sum,
             norm_topk_prob 0/1, routed_scaling_factor
Experts come in descending order of (score + bias), ties to the lower index; the weights are the
unbiased scores of the chosen experts, renormalised when norm_topk_prob, times routed_scaling_factor
(semantics: export/routing.py, shared/notes/deepseek.md).

The "kernel" is torch on the device pointers TensorRT hands to ``enqueue`` (``route`` below, which is
also what the CPU tests check). The plugin classes are built per TensorRT module (``tensorrt`` or
``tensorrt_rtx_bindings``) by ``plugin_classes``; nothing imports TensorRT at module import.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

PLUGIN_NAME, PLUGIN_VERSION, PLUGIN_NAMESPACE = "MoERouter", "1", "moeforge"


@dataclass(frozen=True)
class RouterAttrs:
    scoring: str = "sigmoid"
    top_k: int = 8
    n_group: int = 1
    topk_group: int = 1
    group_scoring: str = "top2_sum"
    norm_topk_prob: int = 1
    routed_scaling_factor: float = 1.0

    def validate(self, experts: int | None = None) -> None:
        if self.scoring not in ("softmax", "sigmoid") or self.group_scoring not in ("max", "top2_sum"):
            raise ValueError(f"MoERouter: bad scoring {self.scoring!r} / group_scoring {self.group_scoring!r}")
        if self.top_k < 1 or self.n_group < 1 or not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"MoERouter: bad top_k/n_group/topk_group {self.top_k}/{self.n_group}/{self.topk_group}")
        if experts is not None and (experts % self.n_group or self.top_k > experts):
            raise ValueError(f"MoERouter: {experts} experts do not fit n_group {self.n_group} / top_k {self.top_k}")


# --------------------------------------------------------------------------------------------- compute
def route(logits: torch.Tensor, bias: torch.Tensor | None, attrs: RouterAttrs) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (+ bias [E]) -> (expert_ids int32 [T, K], weights float32 [T, K]); any device."""
    logits = logits.float()
    scores = logits.softmax(-1) if attrs.scoring == "softmax" else logits.sigmoid()
    choice = scores + bias.float() if bias is not None else scores
    tokens, experts = choice.shape
    if attrs.n_group > 1:
        grouped = choice.view(tokens, attrs.n_group, experts // attrs.n_group)  # [T, G, E/G]
        if attrs.group_scoring == "top2_sum":
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)
        else:
            group_scores = grouped.amax(-1)
        # Best topk_group groups, ties to the lower group (stable sort), others masked with -inf.
        kept = torch.sort(group_scores, dim=-1, descending=True, stable=True).indices[:, : attrs.topk_group]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, kept, True)
        choice = choice.masked_fill(~keep.repeat_interleave(experts // attrs.n_group, dim=1), float("-inf"))
    ids = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, : attrs.top_k]  # ties -> lower id
    weights = scores.gather(1, ids)
    if attrs.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return ids.to(torch.int32), weights * attrs.routed_scaling_factor


class _DeviceArray:
    """A device pointer seen by torch through the CUDA array interface (no copy)."""

    def __init__(self, pointer: int, shape: tuple[int, ...], typestr: str) -> None:
        self.__cuda_array_interface__ = {"data": (int(pointer), False), "shape": tuple(int(d) for d in shape),
                                         "typestr": typestr, "version": 3}


def device_tensor(pointer: int, shape: Any, typestr: str) -> torch.Tensor:
    """torch view of TensorRT's device memory (``typestr``: "<f4", "<f2", "<i4", "<i8")."""
    return torch.as_tensor(_DeviceArray(pointer, tuple(shape), typestr), device="cuda")


# ------------------------------------------------------------------------------------------ TensorRT glue
def attrs_from_fields(fields: Any) -> RouterAttrs:
    """PluginFieldCollection (or an iterable of PluginField) -> RouterAttrs; unknown names are ignored."""
    values: dict[str, Any] = {}
    for field in fields:
        data = field.data
        if field.name in ("scoring", "group_scoring"):
            raw = bytes(np.asarray(data, dtype=np.uint8)) if not isinstance(data, str | bytes) else data
            values[field.name] = (raw.decode() if isinstance(raw, bytes) else raw).rstrip("\0")
        elif field.name == "routed_scaling_factor":
            values[field.name] = float(np.asarray(data).reshape(-1)[0])
        elif field.name in RouterAttrs.__dataclass_fields__:
            values[field.name] = int(np.asarray(data).reshape(-1)[0])
    return RouterAttrs(**values)


def attrs_to_fields(trt: Any, attrs: RouterAttrs) -> tuple[Any, list[np.ndarray]]:
    """(PluginFieldCollection, the arrays behind it): a PluginField points at its array without owning it,
    so the caller keeps the arrays alive as long as the collection."""
    kind = trt.PluginFieldType
    arrays = [np.array([getattr(attrs, n)], np.int32) for n in ("top_k", "n_group", "topk_group", "norm_topk_prob")]
    arrays.append(np.array([attrs.routed_scaling_factor], np.float32))
    arrays += [np.frombuffer(getattr(attrs, n).encode(), np.int8).copy() for n in ("scoring", "group_scoring")]
    names = ("top_k", "n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor", "scoring", "group_scoring")
    kinds = [kind.INT32] * 4 + [kind.FLOAT32, kind.CHAR, kind.CHAR]
    fields = [trt.PluginField(n, a, k) for n, a, k in zip(names, arrays, kinds, strict=True)]
    return trt.PluginFieldCollection(fields), arrays


@functools.cache
def plugin_classes(trt: Any) -> tuple[type, type]:
    """(MoERouterPlugin, MoERouterCreator) for the TensorRT module ``trt``."""

    class MoERouterPlugin(trt.IPluginV3, trt.IPluginV3OneCore, trt.IPluginV3OneBuild, trt.IPluginV3OneRuntime):
        def __init__(self, attrs: RouterAttrs, phase: Any = None) -> None:
            trt.IPluginV3.__init__(self)
            trt.IPluginV3OneCore.__init__(self)
            trt.IPluginV3OneBuild.__init__(self)
            trt.IPluginV3OneRuntime.__init__(self)
            self.attrs, self.phase = attrs, phase
            self.num_outputs = 2
            self.plugin_name, self.plugin_version, self.plugin_namespace = PLUGIN_NAME, PLUGIN_VERSION, PLUGIN_NAMESPACE
            self.timing_cache_id = ""

        def get_capability_interface(self, type: Any) -> Any:
            return self

        def get_output_data_types(self, input_types: Any) -> list[Any]:
            return [trt.DataType.INT32, trt.DataType.FLOAT]

        def get_output_shapes(self, inputs: Any, shape_inputs: Any, expr_builder: Any) -> list[Any]:
            shape = trt.DimsExprs(2)
            shape[0] = inputs[0][0]  # T
            shape[1] = expr_builder.constant(self.attrs.top_k)
            return [shape, trt.DimsExprs(shape)]

        def supports_format_combination(self, pos: int, in_out: Any, num_inputs: int) -> bool:
            desc = in_out[pos].desc
            if desc.format != trt.TensorFormat.LINEAR:
                return False
            if pos < num_inputs:
                return desc.type == trt.DataType.FLOAT
            return desc.type == (trt.DataType.INT32 if pos == num_inputs else trt.DataType.FLOAT)

        def configure_plugin(self, inputs: Any, outputs: Any) -> None:
            pass

        def on_shape_change(self, inputs: Any, outputs: Any) -> None:
            pass

        def get_fields_to_serialize(self) -> Any:
            collection, self._field_arrays = attrs_to_fields(trt, self.attrs)
            return collection

        def enqueue(self, input_desc: Any, output_desc: Any, inputs: Any, outputs: Any, workspace: Any,
                    stream: int) -> None:
            tokens, experts = input_desc[0].dims[0], input_desc[0].dims[1]
            with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
                logits = device_tensor(inputs[0], (tokens, experts), "<f4")
                bias = device_tensor(inputs[1], (experts,), "<f4") if len(inputs) > 1 else None
                ids, weights = route(logits, bias, self.attrs)
                device_tensor(outputs[0], ids.shape, "<i4").copy_(ids)
                device_tensor(outputs[1], weights.shape, "<f4").copy_(weights)

        def attach_to_context(self, context: Any) -> Any:
            return self.clone()

        def get_valid_tactics(self) -> list[int]:
            return []

        def set_tactic(self, tactic: int) -> None:
            pass

        def clone(self) -> Any:
            return MoERouterPlugin(self.attrs, self.phase)

    class MoERouterCreator(trt.IPluginCreatorV3One):
        def __init__(self) -> None:
            trt.IPluginCreatorV3One.__init__(self)
            self.name, self.plugin_version, self.plugin_namespace = PLUGIN_NAME, PLUGIN_VERSION, PLUGIN_NAMESPACE
            self.field_names, self._field_arrays = attrs_to_fields(trt, RouterAttrs())

        def create_plugin(self, name: str, fields: Any, phase: Any) -> Any:
            attrs = attrs_from_fields(fields)
            attrs.validate()
            return MoERouterPlugin(attrs, phase)

    return MoERouterPlugin, MoERouterCreator


_REGISTERED: dict[int, Any] = {}  # creators must outlive the registry's use of them


def register(trt: Any, allow_rtx: bool = False) -> Any:
    """Register the creator with ``trt.get_plugin_registry()`` (once per module); return it.

    Do not register Python plugins for a TensorRT-RTX 1.7 build: its parser aborts the process when it
    imports a node as a Python plugin (see docs/architecture.md, TensorRT target).
    """
    if trt.__name__.startswith("tensorrt_rtx") and not allow_rtx:
        from moeforge.errors import MoeforgeError

        raise MoeforgeError(f"not registering the Python {PLUGIN_NAME} plugin with TensorRT-RTX {trt.__version__}: "
                            "its ONNX parser aborts the process when it imports a node as a Python plugin (and a "
                            "registered plugin wins over the node's local function, which RTX otherwise inlines)")
    key = id(trt)
    if key not in _REGISTERED:
        _, creator_cls = plugin_classes(trt)
        creator = creator_cls()
        trt.get_plugin_registry().register_creator(creator, PLUGIN_NAMESPACE)
        _REGISTERED[key] = creator
    return _REGISTERED[key]
