"""ONNX Runtime lowering of ``moeforge::SparseMLA`` / ``SparseMLACache`` / ``SparseMLAPaged``.

ONNX Runtime has no DSA kernel on any provider, and a custom-op library cannot be embedded in a C++ service here,
so the op must become ops ORT runs: the lowering rebuilds each form's body with the model's attributes and inlines
it, so the graph ORT sees has no ``moeforge`` node. ScatterND's outputs are still bound to the buffers' / pools' own
memory by the runtime (in place). Steps 0-2 (cache writes, indexer scores, TopK, Gather of the K picked latent
rows) are the portable body's; step 3 has two cores, chosen by measurement (benchmarks/sparse_attention.py,
``sparse`` vs ``sparse_attention_core``):

- ``matmul`` (default): MatMul / Where / Softmax / MatMul with the H heads of a query as the rows of one GEMM
  against its K picked rows. Measured faster on CPU at 1K-4K contexts (6.3 vs 6.8 ms per decode step at 4K,
  top-256; README.md has the table), within noise at 16K.
- ``attention``: one opset-23 ``Attention`` node per layer, each query its own batch entry with H query heads over
  one key/value head (MQA). ONNX Runtime's CPU kernel broadcasts that one head to all H, which costs more than it
  saves here; kept for providers whose Attention kernel is fused (GPU).

The attribute values are per model, not per layer (``function.py`` bakes them in), so the lowering reads them off
the nodes and refuses a model whose layers disagree.
"""

from __future__ import annotations

import onnx

from moeforge.core.errors import ArtifactError
from moeforge.ops.lowering import inline_functions, replace_functions
from moeforge.ops.sparse_mla.function import Core, function_proto
from moeforge.ops.sparse_mla.schema import CACHED_OP_TYPE, DOMAIN, OP_TYPE, PAGED_OP_TYPE, Mode, SparseMLAAttrs

_MODES: dict[str, Mode] = {OP_TYPE: "stateless", CACHED_OP_TYPE: "contiguous", PAGED_OP_TYPE: "paged"}


def uses_sparse_mla(model: onnx.ModelProto) -> bool:
    return any(n.domain == DOMAIN and n.op_type in _MODES for n in model.graph.node)


def _attrs(node: onnx.NodeProto) -> SparseMLAAttrs:
    values = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    return SparseMLAAttrs(topk=int(values["topk"]), scale=float(values["scale"]),
                          index_scale=float(values["index_scale"]), kv_rank=int(values["kv_rank"]))


def lower_for_ort(model: onnx.ModelProto, core: Core = "matmul") -> onnx.ModelProto:
    """A copy of ``model`` with every SparseMLA node replaced by ONNX Runtime-ready standard ops, step 3 by the
    ``core`` named (module docstring)."""
    lowered = onnx.ModelProto()
    lowered.CopyFrom(model)
    nodes = [n for n in lowered.graph.node if n.domain == DOMAIN and n.op_type in _MODES]
    if not nodes:
        return lowered
    found: dict[str, SparseMLAAttrs] = {}
    for node in nodes:
        attrs = _attrs(node)
        if found.setdefault(node.op_type, attrs) != attrs:
            raise ArtifactError(f"{node.name or node.op_type}: SparseMLA attributes {attrs} differ from another "
                                f"layer's {found[node.op_type]}; the lowering bakes one set into the function "
                                "(recompile the artifact with moeforge compile)")
    replace_functions(lowered, [function_proto(attrs, _MODES[op_type], core) for op_type, attrs in found.items()])
    return inline_functions(lowered, DOMAIN, found)

