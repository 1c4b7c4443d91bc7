"""What the plugins' ONNX Runtime lowerings share: swapping a model's local functions and inlining them."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import onnx
import onnx.inliner


def replace_functions(model: onnx.ModelProto, functions: Sequence[onnx.FunctionProto]) -> None:
    """Give ``model`` (in place) ``functions``, dropping any local function of the same (domain, name) first."""
    names = {(f.domain, f.name) for f in functions}
    kept = [f for f in model.functions if (f.domain, f.name) not in names]
    del model.functions[:]
    model.functions.extend([*kept, *functions])


def inline_functions(model: onnx.ModelProto, domain: str, names: Iterable[str]) -> onnx.ModelProto:
    """``model`` with every call of ``domain``'s functions ``names`` inlined; ``domain`` loses its opset import
    when no node of it is left, so ONNX Runtime sees no custom domain."""
    lowered = onnx.inliner.inline_selected_functions(model, [(domain, name) for name in names], exclude=False)
    if not any(n.domain == domain for n in lowered.graph.node):
        kept = [o for o in lowered.opset_import if o.domain != domain]
        del lowered.opset_import[:]
        lowered.opset_import.extend(kept)
    return lowered
