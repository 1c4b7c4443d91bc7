"""The ``moeforge::PagedAttention`` contract as data, and its ONNX OpSchema (with shape inference).

Letters: T packed new tokens, B sequences, Hq query heads, Hkv key/value heads, Dk key head size,
Dv value head size, N pool blocks, Bs block size, M blocks per block-table row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import onnx
from onnx.defs import OpSchema

from moeforge.ops import registration

DOMAIN = "moeforge"
OP_TYPE = "PagedAttention"
VERSION = 1
PLUGIN_VERSION = "1"
PLUGIN_NAMESPACE = "moeforge"

# Input order is the contract (a TensorRT plugin reads them by index).
INPUTS = ("query", "key", "value", "key_cache", "value_cache", "block_tables", "seq_lens", "query_start_loc")
OUTPUTS = ("output", "key_cache_out", "value_cache_out")
Q, K, V, KC, VC, BT, SL, QSL = range(8)


@dataclass(frozen=True)
class PagedAttentionAttrs:
    """Attributes of one node. ``latent``: absorbed-MLA mode (no value / value_cache: the value is the
    first ``head_size_v`` dims of the single latent pool); it is not an attribute, it is the absence of
    the value inputs."""

    scale: float
    num_heads: int
    num_kv_heads: int
    block_size: int
    head_size_v: int
    sliding_window: int = 0  # 0 = none; else a query sees keys at positions (p - window, p]
    latent: bool = False

    def __post_init__(self) -> None:
        if self.num_heads < 1 or self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a positive multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        if self.block_size < 1 or self.head_size_v < 1 or self.sliding_window < 0:
            raise ValueError(f"block_size ({self.block_size}) and head_size_v ({self.head_size_v}) must be >= 1, "
                             f"sliding_window ({self.sliding_window}) >= 0")
        if self.latent and self.num_kv_heads != 1:
            raise ValueError("latent (absorbed MLA) mode has one KV head")

    def node_attributes(self) -> dict[str, Any]:
        """The ONNX attributes, as written on a node (plugin_version/namespace for TensorRT included)."""
        return {"scale": float(self.scale), "num_heads": self.num_heads, "num_kv_heads": self.num_kv_heads,
                "block_size": self.block_size, "sliding_window": self.sliding_window,
                "head_size_v": self.head_size_v, "plugin_version": PLUGIN_VERSION,
                "plugin_namespace": PLUGIN_NAMESPACE}


def _infer(ctx: onnx.shape_inference.InferenceContext) -> None:  # pragma: no cover - called from C++
    """output [T, Hq, Dv]; key_cache_out / value_cache_out = the pools' types and shapes."""
    query = ctx.get_input_type(Q)
    if query is None or not query.HasField("tensor_type"):
        return
    out = onnx.TypeProto()
    out.tensor_type.elem_type = query.tensor_type.elem_type
    if query.tensor_type.HasField("shape"):
        dims = query.tensor_type.shape.dim
        shape = out.tensor_type.shape
        for source in (dims[0], dims[1]):
            shape.dim.add().CopyFrom(source)
        attr = ctx.get_attribute("head_size_v")
        dv = shape.dim.add()
        if attr is not None:
            dv.dim_value = attr.i
    ctx.set_output_type(0, out)
    for index, source in ((1, KC), (2, VC)):
        if index < ctx.get_num_outputs() and source < ctx.get_num_inputs():
            pool = ctx.get_input_type(source)
            if pool is not None:
                ctx.set_output_type(index, pool)


def op_schema() -> OpSchema:
    """A fresh OpSchema object for ``moeforge::PagedAttention`` version 1."""
    fp = OpSchema.FormalParameter
    optional = OpSchema.FormalParameterOption.Optional
    inputs = [
        fp("query", "T", "[T, Hq, Dk] new tokens' queries (RoPE applied)"),
        fp("key", "T", "[T, Hkv, Dk] new keys (latent mode: [T, 1, R+Dr] new latents)"),
        fp("value", "T", "[T, Hkv, Dv] new values; empty in latent mode", param_option=optional),
        fp("key_cache", "T", "[N, Bs, Hkv, Dk] key pool (latent mode: the latent pool [N, Bs, 1, R+Dr])"),
        fp("value_cache", "T", "[N, Bs, Hkv, Dv] value pool; empty in latent mode", param_option=optional),
        fp("block_tables", "tensor(int32)", "[B, M] pool block ids of each sequence, in token order"),
        fp("seq_lens", "tensor(int32)", "[B] tokens of each sequence after this step, new ones included"),
        fp("query_start_loc", "tensor(int32)", "[B+1] offsets of each sequence's new tokens in T"),
    ]
    outputs = [
        fp("output", "T", "[T, Hq, Dv]"),
        fp("key_cache_out", "T", "key_cache with the new keys written (same buffer where the runtime allows)"),
        fp("value_cache_out", "T", "value_cache with the new values written; absent in latent mode",
           param_option=optional),
    ]
    attr = OpSchema.Attribute
    attributes = [
        attr("scale", OpSchema.AttrType.FLOAT, "softmax scale"),
        attr("num_heads", OpSchema.AttrType.INT, "Hq"),
        attr("num_kv_heads", OpSchema.AttrType.INT, "Hkv (1 in latent mode)"),
        attr("block_size", OpSchema.AttrType.INT, "Bs, tokens per pool block"),
        attr("sliding_window", onnx.helper.make_attribute("sliding_window", 0), "0 = none"),
        attr("head_size_v", OpSchema.AttrType.INT, "Dv (latent mode: the value prefix R of the latent)"),
        *registration.plugin_attributes(PLUGIN_VERSION, PLUGIN_NAMESPACE),
    ]
    schema = OpSchema(
        OP_TYPE, DOMAIN, VERSION, doc="Paged attention over a block pool; see moeforge/ops/paged_attention/README.md",
        inputs=inputs, outputs=outputs, attributes=attributes,
        type_constraints=[("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "float types")],
    )
    schema.set_type_and_shape_inference_function(_infer)
    return schema


def register_schema() -> None:
    """Register the schema with onnx (process-global, idempotent), so the checker, shape inference and
    onnxscript know the op."""
    registration.register_schema(OP_TYPE, VERSION, DOMAIN, op_schema)
