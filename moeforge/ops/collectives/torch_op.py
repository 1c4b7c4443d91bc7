"""Tensor-parallel collectives as torch custom ops that export to ONNX Runtime's contrib collectives.

``torch.ops.moeforge.all_reduce(x, group_size)`` sums ``x`` over the ranks; ``all_gather(x, axis, group_size)``
concatenates every rank's ``x`` along ``axis``. Eagerly they call ``torch.distributed`` (any backend: gloo on
CPU); with one rank, or no process group, they are the identity. Exported, they are exactly
``com.microsoft.AllReduce`` and ``com.microsoft.AllGather(axis, group_size)``: the ops ONNX Runtime's CUDA execution
provider runs over NCCL. On CPU the runtime maps the same nodes to Python custom ops on gloo
(``moeforge/ops/collectives/ort.py``), so one graph serves both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import onnx
import onnxscript
import torch
import torch.distributed as dist

MS_DOMAIN = "com.microsoft"
ALL_REDUCE = "AllReduce"
ALL_GATHER = "AllGather"
COLLECTIVE_OPS = (ALL_REDUCE, ALL_GATHER)


def _active(group_size: int) -> bool:
    if group_size <= 1:
        return False
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"a tensor-parallel collective over {group_size} ranks ran without a torch.distributed "
                           "process group: call torch.distributed.init_process_group first")
    if dist.get_world_size() != group_size:
        raise RuntimeError(f"this rank's model was split {group_size} ways but the process group has "
                           f"{dist.get_world_size()} ranks")
    return True


@torch.library.custom_op("moeforge::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """Sum of ``x`` over the ``group_size`` ranks (a fresh tensor; ``x`` is unchanged)."""
    out = x.clone()
    if _active(group_size):
        dist.all_reduce(out)
    return out


@all_reduce.register_fake
def _all_reduce_fake(x: torch.Tensor, group_size: int) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("moeforge::all_gather", mutates_args=())
def all_gather(x: torch.Tensor, axis: int, group_size: int) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``axis`` in rank order."""
    if not _active(group_size):
        return x.clone()
    parts = [torch.empty_like(x) for _ in range(group_size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=axis)


@all_gather.register_fake
def _all_gather_fake(x: torch.Tensor, axis: int, group_size: int) -> torch.Tensor:
    shape = list(x.shape)
    shape[axis] = shape[axis] * group_size
    return x.new_empty(shape)


def _register_onnx_schemas() -> None:
    """The contrib schemas (as ONNX Runtime declares them), so onnxscript can build the nodes; the onnx package
    does not ship com.microsoft schemas."""
    param, attr = onnx.defs.OpSchema.FormalParameter, onnx.defs.OpSchema.Attribute
    types = ["tensor(float)", "tensor(float16)", "tensor(double)"]
    if not onnx.defs.has(ALL_REDUCE, MS_DOMAIN):
        onnx.defs.register_schema(onnx.defs.OpSchema(
            ALL_REDUCE, MS_DOMAIN, 1, inputs=[param("input", "T")], outputs=[param("output", "T")],
            type_constraints=[("T", types, "float tensors")]))
    if not onnx.defs.has(ALL_GATHER, MS_DOMAIN):
        onnx.defs.register_schema(onnx.defs.OpSchema(
            ALL_GATHER, MS_DOMAIN, 1, inputs=[param("input", "T")], outputs=[param("output", "T")],
            type_constraints=[("T", types, "float tensors")],
            attributes=[attr("axis", onnx.defs.OpSchema.AttrType.INT, "the axis to gather on"),
                        attr("group_size", onnx.defs.OpSchema.AttrType.INT, "ranks in the group")]))


_register_onnx_schemas()
_ms = onnxscript.values.Opset(MS_DOMAIN, 1)


def all_reduce_to_onnx(x: Any, group_size: int) -> Any:
    """custom_translation_table entry: ``com.microsoft.AllReduce`` (its schema has no attributes)."""
    return _ms.AllReduce(x)


def all_gather_to_onnx(x: Any, axis: int, group_size: int) -> Any:
    """custom_translation_table entry: ``com.microsoft.AllGather``. ``axis`` is made non-negative: the contrib
    schema's shape inference indexes the input shape with it as given."""
    return _ms.AllGather(x, axis=axis, group_size=group_size)


TRANSLATIONS: dict[Callable[..., Any], Callable[..., Any]] = {torch.ops.moeforge.all_reduce.default: all_reduce_to_onnx,
                torch.ops.moeforge.all_gather.default: all_gather_to_onnx}
