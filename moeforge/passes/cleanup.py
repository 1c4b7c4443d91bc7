"""Cleanup: constant folding, common-subexpression elimination, no-op reshape removal, Reshape chains collapsed,
dead-code removal."""

from __future__ import annotations

import contextlib
import logging

import onnx_ir as ir
import onnx_ir.passes.common as common
import onnxscript.optimizer
from onnxscript.rewriter.pattern import RewriteRuleSet
from onnxscript.rewriter.rules.common import reshape_reshape_rule

from moeforge.core.log_filters import without_records
from moeforge.passes.base import PassContext


class Cleanup:
    """Fold constants, merge duplicate subexpressions, bypass reshape round trips, collapse Reshape(Reshape(x))
    into one Reshape (onnxscript's rule: a constant outer shape, its 0 resolved; the paged graphs' rotary and
    PagedAttention plumbing left 4 such pairs per layer, each a kernel launch per decode step), drop unused
    nodes/functions/opsets.

    Reports the number of nodes removed (the graph shrinks; nothing changes numerically).
    """

    name = "cleanup"

    def apply(self, model: ir.Model, ctx: PassContext) -> int:
        before = _count_nodes(model)
        with quiet_multi_output_folding():
            onnxscript.optimizer.fold_constants(model)
        common.CommonSubexpressionEliminationPass()(model)
        drop_reshape_round_trips(model.graph)
        common.RemoveUnusedNodesPass()(model)  # first: a dead second consumer blocks the collapse below
        collapse = RewriteRuleSet([reshape_reshape_rule])
        for _ in range(8):  # one sweep shortens a chain of n Reshapes by about half: repeat to a fixed point
            if not collapse.apply_to_model(model):
                break
        common.RemoveUnusedNodesPass()(model)
        common.RemoveUnusedFunctionsPass()(model)  # type: ignore[no-untyped-call]  # onnx-ir: unannotated __init__
        common.RemoveUnusedOpsetsPass()(model)
        return max(before - _count_nodes(model), 0)


# onnxscript's constant folder warns once per constant node it cannot fold because it has several outputs (a Split of
# a constant): nothing is wrong, the node stays as it is, but DeepSeek-V4's step graph has dozens of them and the
# warnings flooded `moeforge compile`'s output.
_FOLDING_LOGGER = "onnxscript.optimizer._constant_folding"


def _is_multi_output_skip(record: logging.LogRecord) -> bool:
    return (isinstance(record.msg, str) and record.msg.startswith("Skipping constant folding for op")
            and "multiple outputs" in record.msg)


def quiet_multi_output_folding() -> contextlib.AbstractContextManager[None]:
    """Drop exactly onnxscript's "Skipping constant folding for op X with multiple outputs" warnings."""
    return without_records(_FOLDING_LOGGER, _is_multi_output_skip)


def _count_nodes(model: ir.Model) -> int:
    return sum(1 for _ in model.graph)


def drop_reshape_round_trips(graph: ir.Graph) -> int:
    """Rewire every Reshape whose output has the same known shape as a tensor it was reshaped from
    (through a chain of Reshapes) to that tensor: Reshape only relabels row-major data, so equal shapes mean
    equal tensors. The exporter and the fusions leave such round trips around attention, e.g.
    q [B, S, H*D] -> [B, S, H, D] -> [B, S, H*D]; at batch 1 decode each costs a kernel launch.
    Symbolic dims compare by name (one name is one runtime value within a graph). Returns the count."""
    outputs = set(graph.outputs)
    count = 0
    for node in list(graph):
        if node.op_type != "Reshape" or node.domain != "" or node.outputs[0] in outputs:
            continue
        target = _static_shape(node.outputs[0])
        if target is None:
            continue
        source = node.inputs[0]
        while source is not None:
            if _static_shape(source) == target:
                ir.convenience.replace_all_uses_with(node.outputs[0], source)
                count += 1
                break
            producer = source.producer()
            if producer is None or producer.op_type != "Reshape" or producer.domain != "":
                break
            source = producer.inputs[0]
    return count


def _static_shape(value: ir.Value) -> tuple[int | str, ...] | None:
    """The shape with every dim an int or a named symbol, else None."""
    if value.shape is None:
        return None
    dims: list[int | str] = []
    for dim in value.shape:
        if isinstance(dim, int):
            dims.append(dim)
        elif isinstance(dim, ir.SymbolicDim) and dim.value is not None:
            dims.append(dim.value)
        else:
            return None
    return tuple(dims)
