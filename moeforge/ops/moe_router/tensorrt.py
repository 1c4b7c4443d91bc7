"""TensorRT IPluginV3 for ``moeforge.MoERouter`` (plugin name MoERouter, version "1", namespace "moeforge").

Dimension letters: T tokens, E routed experts, G groups, K = top_k.

Contract (the ONNX node, which also carries a standard-op local function for runtimes without the plugin):
    inputs   router_logits float32 [T, E], correction_bias float32 [E] (optional)
    outputs  expert_ids int32 [T, K], expert_weights float32 [T, K]
    attrs    scoring softmax|sigmoid, top_k, n_group, topk_group, group_scoring max|top2_sum,
             norm_topk_prob 0/1, routed_scaling_factor
Experts come in descending order of (score + bias), ties to the lower index; the weights are the
unbiased scores of the chosen experts, renormalised when norm_topk_prob, times routed_scaling_factor
(semantics: moeforge/ops/moe_router/README.md; moeforge/model/routing.py runs the same rule in the torch model).

The "kernel" is torch on the device pointers TensorRT hands to ``enqueue`` (``route`` below, which is
also what the CPU tests check). The plugin classes are built per TensorRT module (``tensorrt`` or
``tensorrt_rtx_bindings``) by ``plugin_classes`` on the shared boilerplate of moeforge/ops/tensorrt_plugin.py;
nothing imports TensorRT at module import.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from moeforge.ops.tensorrt_plugin import PluginSpec, creator_class, device_tensor, plugin_base
from moeforge.ops.tensorrt_plugin import register as register_plugin

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
    arrays: list[np.ndarray] = [np.array([getattr(attrs, n)], np.int32)
                                for n in ("top_k", "n_group", "topk_group", "norm_topk_prob")]
    arrays.append(np.array([attrs.routed_scaling_factor], np.float32))
    arrays += [np.frombuffer(getattr(attrs, n).encode(), np.int8).copy() for n in ("scoring", "group_scoring")]
    names = ("top_k", "n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor", "scoring", "group_scoring")
    kinds = [kind.INT32] * 4 + [kind.FLOAT32, kind.CHAR, kind.CHAR]
    fields = [trt.PluginField(n, a, k) for n, a, k in zip(names, arrays, kinds, strict=True)]
    return trt.PluginFieldCollection(fields), arrays


def _checked_attrs(fields: Any) -> RouterAttrs:
    attrs = attrs_from_fields(fields)
    attrs.validate()
    return attrs


SPEC = PluginSpec(name=PLUGIN_NAME, num_outputs=2, default_attrs=RouterAttrs(), from_fields=_checked_attrs,
                  to_fields=attrs_to_fields, version=PLUGIN_VERSION, namespace=PLUGIN_NAMESPACE)


@functools.cache
def plugin_classes(trt: Any) -> tuple[type, type]:
    """(MoERouterPlugin, MoERouterCreator) for the TensorRT module ``trt``."""
    base: Any = plugin_base(trt, trt.IPluginV3OneBuild)  # Any: a class made at run time, for this module

    class MoERouterPlugin(base):
        SPEC = SPEC

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
                return bool(desc.type == trt.DataType.FLOAT)
            return bool(desc.type == (trt.DataType.INT32 if pos == num_inputs else trt.DataType.FLOAT))

        def enqueue(self, input_desc: Any, output_desc: Any, inputs: Any, outputs: Any, workspace: Any,
                    stream: int) -> None:
            tokens, experts = input_desc[0].dims[0], input_desc[0].dims[1]
            external = torch.cuda.ExternalStream(stream)  # type: ignore[no-untyped-call]  # unannotated in torch
            with torch.cuda.stream(external):
                logits = device_tensor(inputs[0], (tokens, experts), "<f4")
                bias = device_tensor(inputs[1], (experts,), "<f4") if len(inputs) > 1 else None
                ids, weights = route(logits, bias, self.attrs)
                device_tensor(outputs[0], ids.shape, "<i4").copy_(ids)
                device_tensor(outputs[1], weights.shape, "<f4").copy_(weights)

    return MoERouterPlugin, creator_class(trt, MoERouterPlugin)


def register(trt: Any, allow_rtx: bool = False) -> Any:
    """Register the creator with ``trt.get_plugin_registry()`` (once per module; refused for TensorRT-RTX unless
    ``allow_rtx``, see ``plugins/tensorrt_plugin.register``); return it."""
    return register_plugin(trt, SPEC, lambda: plugin_classes(trt)[1], allow_rtx)
