"""The ``moeforge.SparseMLA`` contract (DeepSeek-V3.2 sparse attention over the absorbed MLA latent): names,
attributes and modes. Dimension letters: B batch, S new tokens, H heads, C = R + Dr latent width, R kv_lora_rank,
Hi / Di indexer heads / head size, L rows the op attends over, Lmax buffer length, K = min(topk, L).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import onnx
from onnx.defs import OpSchema

from moeforge.ops import registration

DOMAIN = "moeforge"
VERSION = 1
OP_TYPE = "SparseMLA"  # stateless: the new rows are all the rows
CACHED_OP_TYPE = "SparseMLACache"  # contiguous cache buffers, written in place
PAGED_OP_TYPE = "SparseMLAPaged"  # block pools (the engine's blocks), written in place; packed tokens
PLUGIN_VERSION = "1"
PLUGIN_NAMESPACE = "moeforge"
INPUTS = ("query", "latent", "index_q", "index_w", "index_k", "positions")
CACHED_INPUTS = (*INPUTS, "past_latent", "past_index", "attention_mask")
OUTPUTS = ("output",)
CACHED_OUTPUTS = ("output", "present_latent", "present_index")
# Paged: the six inputs with B = T packed tokens and S = 1, then the pools and PagedAttention's step inputs.
PAGED_INPUTS = (*INPUTS, "latent_pool", "index_pool", "block_tables", "seq_lens", "query_start_loc")
PAGED_OUTPUTS = ("output", "latent_pool_out", "index_pool_out")
Mode = Literal["stateless", "contiguous", "paged"]


@dataclass(frozen=True)
class SparseMLAAttrs:
    """topk: rows kept per query; scale: MLA's softmax scale; index_scale: Di^-0.5; kv_rank: R (value width)."""

    topk: int
    scale: float
    index_scale: float
    kv_rank: int

    def as_dict(self) -> dict[str, int | float]:
        return {"topk": self.topk, "scale": self.scale, "index_scale": self.index_scale, "kv_rank": self.kv_rank}


def _infer(ctx: onnx.shape_inference.InferenceContext) -> None:
    # output [B, H, S, R] from query [B, H, S, C]; the cached form's presents have their past's type and shape.
    query, kv_rank = ctx.get_input_type(0), ctx.get_attribute("kv_rank")
    out = onnx.helper.make_tensor_type_proto(onnx.TensorProto.FLOAT, None)
    if query is not None and query.tensor_type.HasField("shape") and kv_rank is not None:
        dims = list(query.tensor_type.shape.dim)[:3]
        out.tensor_type.shape.dim.extend([*dims, onnx.TensorShapeProto.Dimension(dim_value=kv_rank.i)])
    ctx.set_output_type(0, out)
    for index in (1, 2):
        if ctx.get_num_outputs() > index:
            past = ctx.get_input_type(5 + index)
            if past is not None:
                ctx.set_output_type(index, past)


def op_schema(op_type: str = OP_TYPE) -> OpSchema:
    """A fresh OpSchema for ``moeforge.SparseMLA`` (or its cached form) version 1."""
    param, attr, kind = OpSchema.FormalParameter, OpSchema.Attribute, OpSchema.AttrType
    cached = op_type == CACHED_OP_TYPE
    paged = op_type == PAGED_OP_TYPE
    docs = {"query": "[B, H, S, C] absorbed query", "latent": "[B, S, C] new latent rows (all rows if stateless)",
            "index_q": "[B, S, Hi, Di] indexer queries (rotated)", "index_w": "[B, S, Hi] indexer head weights",
            "index_k": "[B, S, Di] new indexer keys", "positions": "[B, S] int64 query positions",
            "past_latent": "[B, 1, Lmax, C] latent buffer", "past_index": "[B, 1, Lmax, Di] indexer key buffer",
            "attention_mask": "[B, L] int64: its width L is the rows attended over (cached + new)",
            "latent_pool": "[N, Bs, 1, C] latent pool", "index_pool": "[N, Bs, 1, Di] indexer key pool",
            "block_tables": "[B, M] int32", "seq_lens": "[B] int32", "query_start_loc": "[B+1] int32"}
    names = PAGED_INPUTS if paged else CACHED_INPUTS if cached else INPUTS
    types = {"positions": "I", "attention_mask": "I", "block_tables": "J", "seq_lens": "J", "query_start_loc": "J"}
    inputs = [param(n, types.get(n, "T"), docs[n]) for n in names]
    outputs = [param(n, "T", n) for n in (PAGED_OUTPUTS if paged else CACHED_OUTPUTS if cached else OUTPUTS)]
    schema = OpSchema(
        op_type, DOMAIN, VERSION,
        doc="DeepSeek Sparse Attention: lightning-indexer top-k, then MLA over the selected latent rows only.",
        inputs=inputs, outputs=outputs,
        type_constraints=[("T", ["tensor(float)"], "float32"), ("I", ["tensor(int64)"], "positions"),
                          ("J", ["tensor(int32)"], "paged step inputs")],
        attributes=[
            attr("topk", kind.INT, "rows kept per query", required=True),
            attr("scale", kind.FLOAT, "attention softmax scale", required=True),
            attr("index_scale", kind.FLOAT, "indexer score scale (Di^-0.5)", required=True),
            attr("kv_rank", kind.INT, "R: value width (first R latent dims)", required=True),
            *registration.plugin_attributes(PLUGIN_VERSION, PLUGIN_NAMESPACE),
        ],
    )
    schema.set_type_and_shape_inference_function(_infer)
    return schema


def register_schema() -> None:
    """Register both forms with onnx (idempotent)."""
    registration.register_schema(OP_TYPE, VERSION, DOMAIN, op_schema)
    registration.register_schema(CACHED_OP_TYPE, VERSION, DOMAIN, lambda: op_schema(CACHED_OP_TYPE))
    registration.register_schema(PAGED_OP_TYPE, VERSION, DOMAIN, lambda: op_schema(PAGED_OP_TYPE))


register_schema()
