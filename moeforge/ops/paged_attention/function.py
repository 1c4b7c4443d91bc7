"""``moeforge::PagedAttention`` as an ONNX local function in standard ops (opset 23), and its node.

The body (shapes: T packed tokens, B sequences, M block-table width, Bs block size, L = M*Bs):
1. per token: its sequence ``seq[t]`` (how many ``query_start_loc[b+1] <= t``), its offset among the
   sequence's new tokens, its position ``seq_lens[b] - n_b + offset`` and its pool slot
   ``(block_tables[b, pos // Bs], pos % Bs)``;
2. ScatterND writes the new keys/values into the pools at those slots (a graph output that the
   runtime binds to the same buffer as the pool input is written in place);
3. per sequence: its keys/values gathered through its block table [B, L, Hkv, D], its new queries
   gathered into a right-padded [B, Smax, Hq, Dk];
4. attention under the mask key_pos <= query_pos (and > query_pos - sliding_window), softmax in fp32;
5. each token's row picked back out of [B, Smax] into [T, Hq, Dv].

Two cores for step 4: ``matmul`` (MatMul / Where / Softmax / MatMul: runs anywhere that has opset-18
ops, the function body shipped in artifacts) and ``attention`` (one opset-23 ``Attention`` node with a
boolean mask, GQA-native: the ONNX Runtime lowering, see ort_lowering.py).

An ONNX function body cannot test whether an optional input was given, so the function is built per
mode: an artifact carries the latent (absorbed MLA) body or the key/value body, never both.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from moeforge.ops.paged_attention.schema import DOMAIN, INPUTS, OP_TYPE, OUTPUTS, PagedAttentionAttrs

Core = Literal["matmul", "attention"]
OPSET = 23
ATTRIBUTE_NAMES = ("scale", "num_heads", "num_kv_heads", "block_size", "sliding_window", "head_size_v",
                   "plugin_version", "plugin_namespace")
_INT64_MAX = np.iinfo(np.int64).max


class _Body:
    """Collects the nodes of the body; values get unique names."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self._count = 0

    def op(self, op_type: str, inputs: list[str], **attrs: Any) -> str:
        """Append a one-output node; its output's name."""
        self._count += 1
        name = f"_pa{self._count}_0"
        self.nodes.append(helper.make_node(op_type, inputs, [name], **attrs))
        return name

    def const(self, array: np.ndarray) -> str:
        return self.op("Constant", [], value=numpy_helper.from_array(np.asarray(array)))

    def ints(self, *values: int) -> str:
        return self.const(np.array(values, np.int64))

    def attr_const(self, attr: str, kind: Literal["int", "float"]) -> str:
        """A Constant whose value is the function attribute ``attr`` (scalar)."""
        name = self.op("Constant", [])
        ref = onnx.AttributeProto()
        ref.name = f"value_{kind}"
        ref.ref_attr_name = attr
        ref.type = onnx.AttributeProto.INT if kind == "int" else onnx.AttributeProto.FLOAT
        self.nodes[-1].attribute.append(ref)
        return name

    def shape(self, value: str, start: int, end: int) -> str:
        return self.op("Shape", [value], start=start, end=end)


def build_function(latent: bool, core: Core = "matmul", opset: int = OPSET) -> onnx.FunctionProto:
    """The FunctionProto ``moeforge.PagedAttention`` for one mode, attributes referenced by name."""
    b = _Body()
    query, key, value, key_cache, value_cache = INPUTS[:5]
    block_tables, seq_lens, query_start_loc = INPUTS[5:]

    # -- 1. token -> sequence, position, slot (int64 index math on tiny tensors) ---------------------------
    qsl = b.op("Cast", [query_start_loc], to=TensorProto.INT64)  # [B+1]
    lens = b.op("Cast", [seq_lens], to=TensorProto.INT64)  # [B]
    tables = b.op("Cast", [block_tables], to=TensorProto.INT64)  # [B, M]
    starts = b.op("Slice", [qsl, b.ints(0), b.ints(-1)])  # [B]
    ends = b.op("Slice", [qsl, b.ints(1), b.ints(_INT64_MAX)])  # [B]
    new = b.op("Sub", [ends, starts])  # [B] n_b
    ctx = b.op("Sub", [lens, new])  # [B] tokens already cached
    zero, one = b.const(np.array(0, np.int64)), b.const(np.array(1, np.int64))
    # The attention core (ORT lowering) reads T from query_start_loc[-1] (the contract: [0, .., T]) and, below, L
    # from block_tables' width, not from query's or the gathered keys' shapes: every layer's index math then reads
    # graph inputs only, and ONNX Runtime's CSE keeps one copy of it for all layers (ort_lowering.py). The shipped
    # body keeps T as query's shape: TensorRT wants shapes from shape tensors, not from an input's values.
    if core == "attention":
        num_tokens = b.op("Squeeze", [b.op("Slice", [qsl, b.ints(-1), b.ints(_INT64_MAX)]), b.ints(0)])  # scalar T
    else:
        num_tokens = b.op("Squeeze", [b.shape(query, 0, 1), b.ints(0)])
    t = b.op("Range", [zero, num_tokens, one])  # [T]
    after = b.op("GreaterOrEqual", [b.op("Unsqueeze", [t, b.ints(1)]), b.op("Unsqueeze", [ends, b.ints(0)])])
    seq = b.op("ReduceSum", [b.op("Cast", [after], to=TensorProto.INT64), b.ints(1)], keepdims=0)  # [T]
    offset = b.op("Sub", [t, b.op("Gather", [starts, seq], axis=0)])  # [T]
    pos = b.op("Add", [b.op("Gather", [ctx, seq], axis=0), offset])  # [T]
    block_size = b.attr_const("block_size", "int")
    block_col = b.op("Unsqueeze", [b.op("Div", [pos, block_size]), b.ints(1)])  # [T, 1]
    block = b.op("GatherElements", [b.op("Gather", [tables, seq], axis=0), block_col], axis=1)  # [T, 1]
    in_block = b.op("Unsqueeze", [b.op("Mod", [pos, block_size]), b.ints(1)])  # [T, 1]
    slots = b.op("Concat", [block, in_block], axis=1)  # [T, 2] (block id, offset)

    # -- 2. write the new tokens into the pools -----------------------------------------------------------
    b.nodes.append(helper.make_node("ScatterND", [key_cache, slots, key], [OUTPUTS[1]]))
    if not latent:
        b.nodes.append(helper.make_node("ScatterND", [value_cache, slots, value], [OUTPUTS[2]]))

    # -- 3. per-sequence keys/values and right-padded queries --------------------------------------------
    # The attention core takes Attention's 3-D layout ([B, S, H*D], heads as attributes): no Transposes, and
    # reshape targets built from the index inputs and attributes only (shared across layers, see step 1).
    width = b.op("Squeeze", [b.shape(tables, 1, 2), b.ints(0)])  # scalar M
    key_len = b.op("Mul", [width, block_size])  # scalar L = M * Bs
    flat_3d = b.op("Concat", [b.ints(0), b.op("Unsqueeze", [key_len, b.ints(0)]), b.ints(-1)], axis=0)  # [0, L, -1]

    def gather_pool(pool: str) -> str:  # [N, Bs, Hkv, D] -> [B, Hkv, L, D] (attention core: [B, L, Hkv*D])
        blocks = b.op("Gather", [pool, tables], axis=0)  # [B, M, Bs, Hkv, D]
        if core == "attention":
            return b.op("Reshape", [blocks, flat_3d])
        flat = b.op("Reshape", [blocks, b.op("Concat", [b.ints(0, -1), b.shape(pool, 2, 4)], axis=0)])
        return b.op("Transpose", [flat], perm=[0, 2, 1, 3])

    keys = gather_pool(OUTPUTS[1])
    if latent:  # the value is the latent's prefix (Hkv = 1, so in the 3-D layout too)
        head_v = b.op("Unsqueeze", [b.attr_const("head_size_v", "int"), b.ints(0)])  # [1]
        values = b.op("Slice", [keys, b.ints(0), head_v, b.ints(2 if core == "attention" else 3)])
    else:
        values = gather_pool(OUTPUTS[2])
    smax = b.op("ReduceMax", [new], keepdims=1)  # [1]
    i = b.op("Range", [zero, b.op("Squeeze", [smax, b.ints(0)]), one])  # [Smax]
    i_row = b.op("Unsqueeze", [i, b.ints(0)])  # [1, Smax]
    q_valid = b.op("Less", [i_row, b.op("Unsqueeze", [new, b.ints(1)])])  # [B, Smax]
    q_index = b.op("Add", [b.op("Unsqueeze", [starts, b.ints(1)]), i_row])  # [B, Smax]
    q_index = b.op("Where", [q_valid, q_index, zero])  # padding rows read token 0 (discarded)
    queries = b.op("Gather", [query, q_index], axis=0)  # [B, Smax, Hq, Dk]
    if core == "attention":
        queries = b.op("Reshape", [queries, b.ints(0, 0, -1)])  # [B, Smax, Hq*Dk]
    else:
        queries = b.op("Transpose", [queries], perm=[0, 2, 1, 3])  # [B, Hq, Smax, Dk]

    # -- 4. mask and attention ----------------------------------------------------------------------------
    q_pos = b.op("Add", [b.op("Unsqueeze", [ctx, b.ints(1)]), i_row])  # [B, Smax]
    q_pos = b.op("Unsqueeze", [q_pos, b.ints(2)])  # [B, Smax, 1]
    k_pos = b.op("Range", [zero, key_len, one])  # [L]
    mask = b.op("LessOrEqual", [k_pos, q_pos])  # [B, Smax, L]
    window = b.op("Cast", [b.attr_const("sliding_window", "int")], to=TensorProto.INT64)
    window = b.op("Where", [b.op("Greater", [window, zero]), window, b.const(np.array(_INT64_MAX // 2, np.int64))])
    mask = b.op("And", [mask, b.op("Greater", [k_pos, b.op("Sub", [q_pos, window])])])
    mask = b.op("Unsqueeze", [mask, b.ints(1)])  # [B, 1, Smax, L]
    # -- 5. back to packed tokens: rows [B*Smax, Hq, Dv] --------------------------------------------------
    if core == "attention":
        out = b.op("Attention", [queries, keys, values, mask])  # [B, Smax, Hq*Dv]
        for name, ref_name, kind in (("scale", "scale", onnx.AttributeProto.FLOAT),
                                     ("q_num_heads", "num_heads", onnx.AttributeProto.INT),
                                     ("kv_num_heads", "num_kv_heads", onnx.AttributeProto.INT)):
            ref = onnx.AttributeProto()
            ref.name, ref.ref_attr_name, ref.type = name, ref_name, kind
            b.nodes[-1].attribute.append(ref)
        heads = [b.op("Unsqueeze", [b.attr_const(a, "int"), b.ints(0)]) for a in ("num_heads", "head_size_v")]
        rows = b.op("Reshape", [out, b.op("Concat", [b.ints(-1), *heads], axis=0)])
    else:
        out = _matmul_core(b, queries, keys, values, mask, b.attr_const("scale", "float"))  # [B, Hq, Smax, Dv]
        rows = b.op("Transpose", [out], perm=[0, 2, 1, 3])  # [B, Smax, Hq, Dv]
        rows = b.op("Reshape", [rows, b.op("Concat", [b.ints(-1), b.shape(rows, 2, 4)], axis=0)])
    flat_index = b.op("Add", [b.op("Mul", [seq, smax]), offset])  # [T]
    b.nodes.append(helper.make_node("Gather", [rows, flat_index], [OUTPUTS[0]], axis=0))

    outputs = list(OUTPUTS[:2]) if latent else list(OUTPUTS)
    return helper.make_function(
        DOMAIN, OP_TYPE, list(INPUTS), outputs, b.nodes,
        opset_imports=[helper.make_opsetid("", opset)], attributes=list(ATTRIBUTE_NAMES),
        doc_string=f"moeforge PagedAttention ({'latent' if latent else 'key/value'} mode, {core} core)",
    )


def _matmul_core(b: _Body, queries: str, keys: str, values: str, mask: str, scale: str) -> str:
    """softmax(Q K^T * scale, masked) V with GQA by reshaping Hq = Hkv * G; softmax in fp32."""
    hkv = b.shape(keys, 1, 2)
    group = b.op("Div", [b.shape(queries, 1, 2), hkv])
    q5 = b.op("Reshape", [queries, b.op("Concat", [b.ints(0), hkv, group, b.ints(-1), b.shape(queries, 3, 4)],
                                        axis=0)])  # [B, Hkv, G, Smax, Dk]
    k5 = b.op("Transpose", [b.op("Unsqueeze", [keys, b.ints(2)])], perm=[0, 1, 2, 4, 3])  # [B, Hkv, 1, Dk, L]
    scores = b.op("Cast", [b.op("MatMul", [q5, k5])], to=TensorProto.FLOAT)  # [B, Hkv, G, Smax, L]
    scores = b.op("Mul", [scores, scale])
    mask5 = b.op("Unsqueeze", [mask, b.ints(1)])  # [B, 1, 1, Smax, L]
    scores = b.op("Where", [mask5, scores, b.const(np.array(-np.inf, np.float32))])
    probs = b.op("CastLike", [b.op("Softmax", [scores], axis=-1), values])
    out = b.op("MatMul", [probs, b.op("Unsqueeze", [values, b.ints(2)])])  # [B, Hkv, G, Smax, Dv]
    return b.op("Reshape", [out, b.op("Concat", [b.ints(0, -1), b.shape(out, 3, 5)], axis=0)])  # [B, Hq, Smax, Dv]


def make_node(inputs: list[str], outputs: list[str], attrs: PagedAttentionAttrs, name: str = "") -> onnx.NodeProto:
    """A ``moeforge::PagedAttention`` node. In latent mode pass "" for value and value_cache, and two outputs."""
    if attrs.latent and (inputs[2] or inputs[4] or len(outputs) != 2):
        raise ValueError("latent mode: value and value_cache must be empty and there are two outputs")
    return helper.make_node(OP_TYPE, inputs, outputs, name=name or None, domain=DOMAIN, **attrs.node_attributes())


def single_op_model(attrs: PagedAttentionAttrs, core: Core = "matmul", opset: int = OPSET) -> onnx.ModelProto:
    """A model of one PagedAttention node (fp32, dynamic dims) carrying its local function: for tests and
    for building a plugin-backed engine of the op alone."""
    float_type, int_type = TensorProto.FLOAT, TensorProto.INT32
    hq, hkv, dv = attrs.num_heads, attrs.num_kv_heads, attrs.head_size_v
    specs: dict[str, tuple[int, list[str | int]]] = {
        "query": (float_type, ["T", hq, "Dk"]), "key": (float_type, ["T", hkv, "Dk"]),
        "value": (float_type, ["T", hkv, dv]), "key_cache": (float_type, ["N", attrs.block_size, hkv, "Dk"]),
        "value_cache": (float_type, ["N", attrs.block_size, hkv, dv]), "block_tables": (int_type, ["B", "M"]),
        "seq_lens": (int_type, ["B"]), "query_start_loc": (int_type, ["B1"])}
    names = [n for n in INPUTS if not (attrs.latent and n in ("value", "value_cache"))]
    inputs = [helper.make_tensor_value_info(n, *specs[n]) for n in names]
    node_inputs = [n if n in names else "" for n in INPUTS]
    out_names = list(OUTPUTS[:2]) if attrs.latent else list(OUTPUTS)
    outputs = [helper.make_tensor_value_info(OUTPUTS[0], float_type, ["T", hq, dv]),
               helper.make_tensor_value_info(OUTPUTS[1], *specs["key_cache"])]
    if not attrs.latent:
        outputs.append(helper.make_tensor_value_info(OUTPUTS[2], *specs["value_cache"]))
    graph = helper.make_graph([make_node(node_inputs, out_names, attrs, name="paged_attention")],
                              "paged_attention", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(DOMAIN, 1)],
                             functions=[build_function(attrs.latent, core, opset)], ir_version=10)
