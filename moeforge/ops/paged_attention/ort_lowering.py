"""ONNX Runtime lowering of ``moeforge::PagedAttention``: no custom-op library, no custom domain left.

ONNX Runtime's CPU provider has no paged-attention kernel (com.microsoft.PagedAttention is CUDA-only),
and a custom-op library cannot be embedded in a C++ service here, so the op must become ops ORT runs.
The lowering swaps each artifact's local function for the ``attention`` core (index math + ScatterND +
Gather as in the portable body, then ONE opset-23 ``Attention`` node, GQA-native and with the value
head size free, instead of MatMul/Where/Softmax/MatMul with explicit head grouping) and inlines it, so
the graph ORT sees has no ``moeforge`` node at all. ScatterND's output is bound by the runtime to the
pool's own buffer, so the new tokens are written in place (checked with data_ptr in the tests).
Why not com.microsoft.GroupQueryAttention: it needs Dk == Dv and a contiguous per-sequence cache it
writes itself, i.e. copies of every sequence's history per step; README.md has the reasoning and the
measured function-body vs lowering step times.
"""

from __future__ import annotations

import onnx

from moeforge.ops.lowering import inline_functions, replace_functions
from moeforge.ops.paged_attention.function import OPSET, Core, build_function
from moeforge.ops.paged_attention.schema import DOMAIN, OP_TYPE


def uses_paged_attention(model: onnx.ModelProto) -> bool:
    return any(n.domain == DOMAIN and n.op_type == OP_TYPE for n in model.graph.node)


def _latent_mode(model: onnx.ModelProto) -> bool:
    modes = {len(n.input) < 3 or not n.input[2]
             for n in model.graph.node if n.domain == DOMAIN and n.op_type == OP_TYPE}
    if len(modes) > 1:
        raise ValueError("a model mixes latent and key/value PagedAttention nodes; one function body per model")
    return modes.pop()


def attach_function(model: onnx.ModelProto, core: Core = "matmul") -> onnx.ModelProto:
    """Give ``model`` (in place) the local function for its PagedAttention nodes, replacing any present."""
    if not uses_paged_attention(model):
        return model
    opset = max(OPSET, next((o.version for o in model.opset_import if o.domain == ""), OPSET))
    replace_functions(model, [build_function(_latent_mode(model), core=core, opset=opset)])
    if not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(DOMAIN, 1))
    return model


def lower_for_ort(model: onnx.ModelProto, core: Core = "attention") -> onnx.ModelProto:
    """A copy of ``model`` with every PagedAttention node replaced by ONNX Runtime-ready standard ops."""
    lowered = onnx.ModelProto()
    lowered.CopyFrom(model)
    if not uses_paged_attention(lowered):
        return lowered
    attach_function(lowered, core=core)
    return inline_functions(lowered, DOMAIN, [OP_TYPE])
