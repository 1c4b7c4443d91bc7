"""Cleanup: constant folding, common-subexpression elimination, dead-code removal."""

from __future__ import annotations

import onnx_ir as ir
import onnx_ir.passes.common as common
import onnxscript.optimizer

from moeforge.graph_passes.base import PassContext


class Cleanup:
    """Fold constants, merge duplicate subexpressions, drop unused nodes/functions/opsets.

    Reports the number of nodes removed (the graph shrinks; nothing changes numerically).
    """

    name = "cleanup"

    def apply(self, model: ir.Model, ctx: PassContext) -> int:
        before = _count_nodes(model)
        onnxscript.optimizer.fold_constants(model)
        common.CommonSubexpressionEliminationPass()(model)
        common.RemoveUnusedNodesPass()(model)
        common.RemoveUnusedFunctionsPass()(model)
        common.RemoveUnusedOpsetsPass()(model)
        return max(before - _count_nodes(model), 0)


def _count_nodes(model: ir.Model) -> int:
    return sum(1 for _ in model.graph)
