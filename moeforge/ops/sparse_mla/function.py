"""``moeforge.SparseMLA`` / ``moeforge.SparseMLACache`` as ONNX local functions in standard ops (opset 23).

Body (letters in schema.py):
0. (SparseMLACache) ScatterND writes the new latent / indexer rows into the buffers [B, 1, Lmax, *] at
   (b, 0, positions[b, s]) -- a graph output bound to the input's buffer is written in place -- and the first
   L indexer rows are read back (L: attention_mask's width, the longest row's cached + new tokens): index_k
   [B, L, Di]. The latent buffer is never sliced: step 2 gathers from it as [B*Lmax, C] (a free reshape).
1. indexer: index = MatMul(index_w [B,S,1,Hi], Relu(MatMul(index_q, index_k^T)) * index_scale) -> [B, S, L],
   -inf where key > position; TopK(min(topk, L)) -> rows [B, S, K] (allowed: score > -inf).
2. Gather(latent as [B*L, C], rows + b*L) -> picked [B, S, K, C]: K rows per query, whatever L is.
3. attention of query [B, S, H, C] over picked: MatMul -> scale -> -inf where not allowed -> Softmax -> MatMul
   with picked[..., :R] -> out [B, H, S, R].
(SparseMLAPaged) Step 0 writes each packed token's rows into the pools [N, Bs, 1, *] at its slot
(block_tables[seq, pos // Bs], pos % Bs) and reads its sequence's L = M*Bs indexer keys through its block table
(the indexer's O(L) work); step 2 gathers the K selected latent rows straight from the pool.
The attribute values are baked into the body (one function per model; every layer shares them).
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import onnx
import onnx_ir as ir
from onnx import helper, numpy_helper

from moeforge.ops.sparse_mla.schema import (
    CACHED_INPUTS,
    CACHED_OP_TYPE,
    CACHED_OUTPUTS,
    DOMAIN,
    INPUTS,
    OP_TYPE,
    OUTPUTS,
    PAGED_INPUTS,
    PAGED_OP_TYPE,
    PAGED_OUTPUTS,
    Mode,
    SparseMLAAttrs,
)

OPSET = 23
Core = Literal["matmul", "attention"]
ATTRIBUTE_NAMES = ("topk", "scale", "index_scale", "kv_rank", "plugin_version", "plugin_namespace")


class _Body:
    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self._count = 0

    def op(self, op_type: str, inputs: list[str], outputs: list[str] | None = None, **attrs: Any) -> str:
        self._count += 1
        names = outputs or [f"_sm{self._count}_0"]
        self.nodes.append(helper.make_node(op_type, inputs, names, **attrs))
        return names[0]

    def op2(self, op_type: str, inputs: list[str], **attrs: Any) -> tuple[str, str]:
        self._count += 1
        names = [f"_sm{self._count}_0", f"_sm{self._count}_1"]
        self.nodes.append(helper.make_node(op_type, inputs, names, **attrs))
        return names[0], names[1]

    def const(self, array: np.ndarray) -> str:
        return self.op("Constant", [], value=numpy_helper.from_array(np.asarray(array)))

    def ints(self, *values: int) -> str:
        return self.const(np.array(values, np.int64))

    def dim(self, value: str, axis: int) -> str:
        """Shape(value)[axis] as int64 [1]."""
        return self.op("Shape", [value], start=axis, end=axis + 1)


def _cache_rows(body: _Body, past: str, new: str, positions: str, out: str) -> str:
    """ScatterND the new rows [B, S, W] into past [B, 1, Lmax, W] at (b, 0, positions) -> ``out``; returns its
    first L rows as [B, L, W], L the width of attention_mask."""
    b, s = body.dim(positions, 0), body.dim(positions, 1)
    shape = body.op("Concat", [b, s], axis=0)  # [2]: B, S
    arange = body.op("Range", [body.const(np.array(0, np.int64)), body.op("Squeeze", [b]),
                               body.const(np.array(1, np.int64))])  # [B]
    batch = body.op("Expand", [body.op("Unsqueeze", [arange, body.ints(1)]), shape])  # [B, S]
    zero = body.op("Mul", [batch, body.const(np.array(0, np.int64))])
    index = body.op("Concat", [body.op("Unsqueeze", [t, body.ints(2)]) for t in (batch, zero, positions)],
                    axis=2)  # [B, S, 3]
    body.op("ScatterND", [past, index, new], outputs=[out])  # updates [B, S, W] at [B, S, 3] indices
    length = body.dim("attention_mask", 1)  # [1]: L
    rows = body.op("Slice", [out, body.ints(0), length, body.ints(2)])  # [B, 1, L, W]
    return body.op("Squeeze", [rows, body.ints(1)])


def _paged_rows(body: _Body, positions: str) -> tuple[str, str]:
    """Paged mode: write the new rows into both pools at each token's slot, and return (rowmap [T, L]: the flat
    pool row of each of the token's sequence's L = M*Bs positions, T packed tokens with S = 1)."""
    block_size = body.dim("latent_pool", 1)  # [1]
    pos = body.op("Reshape", [positions, body.ints(-1)])  # [T]
    starts = body.op("Cast", [body.op("Slice", ["query_start_loc", body.ints(1), body.ints(2**62), body.ints(0)])],
                     to=onnx.TensorProto.INT64)  # [B]: the end of each sequence's tokens
    tokens = body.op("Range", [body.const(np.array(0, np.int64)), body.op("Squeeze", [body.dim(pos, 0)]),
                               body.const(np.array(1, np.int64))])  # [T]
    seq = body.op("ReduceSum", [body.op("Cast", [body.op("LessOrEqual", [starts, body.op("Unsqueeze", [
        tokens, body.ints(1)])])], to=onnx.TensorProto.INT64), body.ints(1)], keepdims=0)  # [T]: its sequence
    tables = body.op("Cast", ["block_tables"], to=onnx.TensorProto.INT64)  # [B, M]
    width = body.dim(tables, 1)  # [1]: M
    block = body.op("GatherND", [tables, body.op("Concat", [body.op("Unsqueeze", [seq, body.ints(1)]),
                                                            body.op("Unsqueeze", [body.op("Div", [pos, block_size]),
                                                                                  body.ints(1)])], axis=1)])  # [T]
    slot = body.op("Concat", [body.op("Unsqueeze", [t, body.ints(1)]) for t in (
        block, body.op("Mod", [pos, block_size]), body.op("Mul", [pos, body.const(np.array(0, np.int64))]))],
        axis=1)  # [T, 3]: (block, offset, head 0)
    for pool, new, out in (("latent_pool", "latent", "latent_pool_out"), ("index_pool", "index_k", "index_pool_out")):
        rows = body.op("Reshape", [new, body.op("Concat", [body.ints(-1), body.dim(new, 2)], axis=0)])  # [T, W]
        body.op("ScatterND", [pool, slot, rows], outputs=[out])
    length = body.op("Mul", [width, block_size])  # [1]: L = M * Bs
    j = body.op("Range", [body.const(np.array(0, np.int64)), body.op("Squeeze", [length]),
                          body.const(np.array(1, np.int64))])  # [L]
    blocks = body.op("Gather", [tables, body.op("Div", [j, block_size])], axis=1)  # [B, L]
    rowmap = body.op("Add", [body.op("Mul", [blocks, block_size]), body.op("Mod", [j, block_size])])  # [B, L]
    return body.op("Gather", [rowmap, seq], axis=0), length  # [T, L]


def _flat(body: _Body, value: str, width_axis: int) -> tuple[str, str]:
    """value [..., W] as [rows, W]; returns (flat, W as [1])."""
    width = body.dim(value, width_axis)
    return body.op("Reshape", [value, body.op("Concat", [body.ints(-1), width], axis=0)]), width


def _attention_core(body: _Body, query: str, picked: str, values: str, valid: str, rows: str, scale: float) -> str:
    """Step 3 as ONE opset-23 ``Attention`` node: every query (b, s) is its own batch entry with H query heads over
    one shared key/value head of K picked rows (GQA-native, value head R != key head C). Returns [B, S, H, R]."""
    heads, width = body.dim(query, 2), body.dim(query, 3)
    k_rows = body.dim(rows, 2)  # [1]: K
    q = body.op("Reshape", [query, body.op("Concat", [body.ints(-1), heads, body.ints(1), width], axis=0)])
    k = body.op("Reshape", [picked, body.op("Concat", [body.ints(-1, 1), k_rows, width], axis=0)])  # [BS, 1, K, C]
    v = body.op("Reshape", [values, body.op("Concat", [body.ints(-1, 1), k_rows, body.dim(values, 3)], axis=0)])
    mask = body.op("Reshape", [valid, body.op("Concat", [body.ints(-1, 1, 1), k_rows], axis=0)])  # [BS, 1, 1, K]
    out = body.op("Attention", [q, k, v, mask], scale=float(scale))  # [B*S, H, 1, R]
    lead = body.op("Shape", [rows], start=0, end=2)  # [2]: B, S
    return body.op("Reshape", [out, body.op("Concat", [lead, heads, body.ints(-1)], axis=0)])  # [B, S, H, R]


def function_proto(attrs: SparseMLAAttrs, mode: Mode, core: Core = "matmul") -> onnx.FunctionProto:
    """The local function of one mode with ``attrs`` baked in. ``core``: step 3 as MatMul / Where / Softmax /
    MatMul (``matmul``: the body artifacts carry and the ONNX Runtime lowering's default) or one opset-23
    ``Attention`` node (``attention``: ``ort_lowering.lower_for_ort(model, "attention")``)."""
    body = _Body()
    inputs = list({"contiguous": CACHED_INPUTS, "paged": PAGED_INPUTS}.get(mode, INPUTS))
    outputs = list({"contiguous": CACHED_OUTPUTS, "paged": PAGED_OUTPUTS}.get(mode, OUTPUTS))
    latent, index_k, positions = "latent", "index_k", "positions"
    rowmap = None
    stride_of, stride_axis = latent, 1  # rows per batch entry of the tensor the latent rows are gathered from
    if mode == "contiguous":
        _cache_rows(body, "past_latent", "latent", positions, "present_latent")
        latent, stride_of, stride_axis = "present_latent", "present_latent", 2  # gathered from the whole buffer
        index_k = _cache_rows(body, "past_index", "index_k", positions, "present_index")
    elif mode == "paged":
        rowmap, _ = _paged_rows(body, positions)
        flat_index, _ = _flat(body, "index_pool_out", 3)  # [N*Bs, Di], the new rows written
        index_k = body.op("Gather", [flat_index, rowmap], axis=0)  # [T, L, Di]: this token's sequence
    # Float constants take the activations' type (CastLike): a half-precision graph (TensorRT target) retypes the
    # inputs, not the constants inside this body.
    neg_inf = body.op("CastLike", [body.const(np.array(-np.inf, np.float32)), "query"])
    # 1. indexer scores [B, S, L] and the top-K rows. The keys [B, L, Di] are read once, untransposed: the small
    # queries are transposed instead, and the head-weighted sum runs on [B, L, S, Hi].
    length = body.dim(index_k, 1)  # [1]
    heads, dims = body.dim("index_q", 2), body.dim("index_q", 3)
    q_flat = body.op("Reshape", ["index_q", body.op("Concat", [body.ints(0), body.ints(-1), dims], axis=0)])
    q_t = body.op("Transpose", [q_flat], perm=[0, 2, 1])  # [B, Di, S*Hi]
    dots = body.op("Relu", [body.op("MatMul", [index_k, q_t])])  # [B, L, S*Hi]
    dots = body.op("Reshape", [dots, body.op("Concat", [body.ints(0, 0, -1), heads], axis=0)])  # [B, L, S, Hi]
    weights = body.op("Mul", [body.op("Unsqueeze", ["index_w", body.ints(1)]),
                              body.op("CastLike", [body.const(np.array(attrs.index_scale, np.float32)),
                                                   "index_w"])])  # [B, 1, S, Hi]
    index = body.op("ReduceSum", [body.op("Mul", [dots, weights]), body.ints(3)], keepdims=0)  # [B, L, S]
    index = body.op("Transpose", [index], perm=[0, 2, 1])  # [B, S, L]
    key_pos = body.op("Range", [body.const(np.array(0, np.int64)), body.op("Squeeze", [length]),
                                body.const(np.array(1, np.int64))])  # [L]
    allowed = body.op("LessOrEqual", [key_pos, body.op("Unsqueeze", [positions, body.ints(2)])])  # [B, S, L]
    index = body.op("Where", [allowed, index, neg_inf])
    k = body.op("Min", [length, body.ints(attrs.topk)])
    top, rows = body.op2("TopK", [index, k], axis=-1, largest=1, sorted=1)  # [B, S, K]
    valid = body.op("Greater", [top, neg_inf])
    # 2. gather the K selected latent rows per query
    if rowmap is None:  # stateless: row r of batch b is flat row b*L + r; contiguous: b*Lmax + r (no copy)
        batch = body.dim(positions, 0)
        stride = body.op("Squeeze", [body.dim(stride_of, stride_axis)])
        offsets = body.op("Mul", [body.op("Range", [body.const(np.array(0, np.int64)), body.op("Squeeze", [batch]),
                                                    body.const(np.array(1, np.int64))]), stride])
        offsets = body.op("Reshape", [offsets, body.ints(-1, 1, 1)])  # [B, 1, 1]
        flat_rows = body.op("Reshape", [body.op("Add", [rows, offsets]), body.ints(-1)])  # [B*S*K]
        flat, width = _flat(body, latent, 2 if mode == "stateless" else 3)  # [B*L, C] / [B*Lmax, C]
    else:  # paged (S = 1): position r of token t's sequence is pool row rowmap[t, r]
        picked_rows = body.op("GatherElements", [rowmap, body.op("Reshape", [rows, body.ints(0, -1)])], axis=1)
        flat_rows = body.op("Reshape", [picked_rows, body.ints(-1)])  # [T*K]
        flat, width = _flat(body, "latent_pool_out", 3)  # [N*Bs, C]
    picked = body.op("Gather", [flat, flat_rows], axis=0)  # [B*S*K, C]
    picked = body.op("Reshape", [picked, body.op("Concat", [body.op("Shape", [rows]), width], axis=0)])  # [B,S,K,C]
    # 3. attention over the picked rows
    query = body.op("Transpose", ["query"], perm=[0, 2, 1, 3])  # [B, S, H, C]
    values = body.op("Slice", [picked, body.ints(0), body.ints(attrs.kv_rank), body.ints(3)])  # [B, S, K, R]
    if core == "attention":
        out = _attention_core(body, query, picked, values, valid, rows, attrs.scale)
    else:
        scores = body.op("MatMul", [query, body.op("Transpose", [picked], perm=[0, 1, 3, 2])])  # [B, S, H, K]
        scores = body.op("Mul", [scores, body.op("CastLike", [body.const(np.array(attrs.scale, np.float32)),
                                                              "query"])])
        scores = body.op("Where", [body.op("Unsqueeze", [valid, body.ints(2)]), scores, neg_inf])
        probs = body.op("Softmax", [scores], axis=-1)
        out = body.op("MatMul", [probs, values])  # [B, S, H, R]
    body.op("Transpose", [out], outputs=["output"], perm=[0, 2, 1, 3])
    op_type = {"contiguous": CACHED_OP_TYPE, "paged": PAGED_OP_TYPE}.get(mode, OP_TYPE)
    return helper.make_function(DOMAIN, op_type, inputs, outputs, body.nodes, [helper.make_opsetid("", OPSET)],
                                attributes=list(ATTRIBUTE_NAMES))


def node_attrs(node: ir.Node) -> SparseMLAAttrs:
    a = node.attributes
    return SparseMLAAttrs(topk=a["topk"].as_int(), scale=a["scale"].as_float(),
                          index_scale=a["index_scale"].as_float(), kv_rank=a["kv_rank"].as_int())


def attach_function(model: ir.Model, attrs: SparseMLAAttrs, mode: Mode) -> None:
    """Give ``model`` the function of ``mode`` (replacing one of the same op already there)."""
    proto = function_proto(attrs, mode)
    function = ir.serde.deserialize_function(proto)
    model.functions[function.identifier()] = function
    model.opset_imports.setdefault(DOMAIN, 1)
