"""The ``moeforge.MoERouter`` contract: typed attributes, their validation, and the ONNX OpSchema.

Registering the schema lets ``onnx.checker`` and ``onnx.shape_inference`` type a graph that holds the
node (expert_ids int32 [T, top_k], expert_weights float32 [T, top_k]). Dimension letters: T tokens,
E routed experts, G groups (n_group), K = top_k.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

import onnx
from onnx import TensorProto
from onnx.defs import OpSchema

from moeforge.core.errors import MoeforgeError
from moeforge.ops import registration

DOMAIN = "moeforge"
OP_TYPE = "MoERouter"
VERSION = 1
PLUGIN_VERSION = "1"
PLUGIN_NAMESPACE = "moeforge"
INPUTS = ("router_logits", "correction_bias")
OUTPUTS = ("expert_ids", "expert_weights")
ATTRIBUTES = ("scoring", "top_k", "n_group", "topk_group", "group_scoring", "norm_topk_prob", "routed_scaling_factor")


class RouterOpError(MoeforgeError):
    """A MoERouter node or call whose attributes or shapes break the op contract."""


@dataclass(frozen=True)
class RouterAttributes:
    """The routing attributes of one ``moeforge.MoERouter`` node (see moeforge/ops/moe_router/README.md)."""

    scoring: Literal["softmax", "sigmoid"]
    top_k: int
    n_group: int = 1
    topk_group: int = 1
    group_scoring: Literal["max", "top2_sum"] = "max"
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0

    def validate(self, num_experts: int | None = None) -> None:
        """Raise RouterOpError naming the broken rule; ``num_experts`` (E) checks the shape rules too."""
        if self.scoring not in ("softmax", "sigmoid"):
            raise RouterOpError(f"MoERouter: scoring {self.scoring!r} is not 'softmax' or 'sigmoid'")
        if self.group_scoring not in ("max", "top2_sum"):
            raise RouterOpError(f"MoERouter: group_scoring {self.group_scoring!r} is not 'max' or 'top2_sum'")
        if self.top_k < 1:
            raise RouterOpError(f"MoERouter: top_k {self.top_k} must be >= 1")
        if self.n_group < 1 or not 1 <= self.topk_group <= self.n_group:
            raise RouterOpError(f"MoERouter: topk_group {self.topk_group} must be in [1, n_group={self.n_group}]"
                                " (use n_group=1, topk_group=1 for plain top-k)")
        if num_experts is None:
            return
        if self.top_k > num_experts:
            raise RouterOpError(f"MoERouter: top_k {self.top_k} exceeds the {num_experts} experts; lower top_k")
        if num_experts % self.n_group:
            raise RouterOpError(f"MoERouter: {num_experts} experts do not split into n_group={self.n_group} equal"
                                " groups; n_group must divide the expert count")
        per_group = num_experts // self.n_group
        if self.n_group > 1 and self.group_scoring == "top2_sum" and per_group < 2:
            raise RouterOpError("MoERouter: group_scoring 'top2_sum' needs >= 2 experts per group; use 'max'")
        if self.topk_group * per_group < self.top_k:
            raise RouterOpError(f"MoERouter: the kept groups hold {self.topk_group * per_group} experts, fewer than"
                                f" top_k={self.top_k}; raise topk_group or lower top_k")

    def node_attributes(self) -> dict[str, object]:
        """ONNX node attributes (ints for booleans, plus the TensorRT parser's plugin fields)."""
        attrs: dict[str, object] = asdict(self)
        attrs["norm_topk_prob"] = int(self.norm_topk_prob)
        attrs["routed_scaling_factor"] = float(self.routed_scaling_factor)
        return {**attrs, "plugin_version": PLUGIN_VERSION, "plugin_namespace": PLUGIN_NAMESPACE}

    @classmethod
    def from_mapping(cls, attrs: dict[str, object]) -> RouterAttributes:
        """From node attribute values (``{name: value}``); a missing required attribute is an error."""
        missing = [name for name in ("scoring", "top_k") if name not in attrs]
        if missing:
            raise RouterOpError(f"MoERouter: missing required attributes {missing}")
        kwargs: dict[str, Any] = {name: attrs[name] for name in ATTRIBUTES if name in attrs}
        if "norm_topk_prob" in kwargs:
            kwargs["norm_topk_prob"] = bool(kwargs["norm_topk_prob"])
        for name in ("scoring", "group_scoring"):
            value = kwargs.get(name)
            if isinstance(value, bytes):
                kwargs[name] = value.decode()
        out = cls(**kwargs)
        out.validate()
        return out


def _infer(ctx: onnx.shape_inference.InferenceContext) -> None:
    # expert_ids int32 [T, K], expert_weights float32 [T, K]; T from router_logits.
    logits = ctx.get_input_type(0)
    top_k = ctx.get_attribute("top_k")
    dims: list[onnx.TensorShapeProto.Dimension] = []
    if logits is not None and logits.tensor_type.HasField("shape") and top_k is not None:
        shape = logits.tensor_type.shape
        if len(shape.dim) != 2:
            raise RouterOpError(f"MoERouter: router_logits must be rank 2 [T, E], got rank {len(shape.dim)}")
        experts = shape.dim[1]
        if experts.HasField("dim_value"):
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in _node_attributes(ctx)}
            RouterAttributes.from_mapping(attrs).validate(experts.dim_value)
        dims = [shape.dim[0], onnx.TensorShapeProto.Dimension(dim_value=top_k.i)]
    for index, dtype in enumerate((TensorProto.INT32, TensorProto.FLOAT)):
        out = onnx.helper.make_tensor_type_proto(dtype, None)
        if dims:
            out.tensor_type.shape.dim.extend(dims)
        ctx.set_output_type(index, out)


def _node_attributes(ctx: onnx.shape_inference.InferenceContext) -> list[onnx.AttributeProto]:
    return [a for name in ATTRIBUTES if (a := ctx.get_attribute(name)) is not None]


def op_schema() -> OpSchema:
    """A fresh OpSchema object for ``moeforge.MoERouter`` version 1, with type/shape inference."""
    param, attr, kind = OpSchema.FormalParameter, OpSchema.Attribute, OpSchema.AttrType
    optional = OpSchema.FormalParameterOption.Optional
    schema = OpSchema(
        OP_TYPE, DOMAIN, VERSION,
        doc="DeepSeek expert routing: softmax|sigmoid scores, optional correction bias on the choice only, "
            "group-limited top-k with -inf on dropped groups; ids ordered by choice score, ties to the lower id.",
        inputs=[param("router_logits", "T", "[T, E] router logits"),
                param("correction_bias", "T", "[E] added to the scores for the choice only", param_option=optional)],
        outputs=[param("expert_ids", "I", "[T, top_k] chosen experts"),
                 param("expert_weights", "T", "[T, top_k] mixing weights (routed_scaling_factor applied)")],
        type_constraints=[("T", ["tensor(float)"], "float32 scores"), ("I", ["tensor(int32)"], "expert ids")],
        attributes=[
            attr("scoring", kind.STRING, "'softmax' (V2) or 'sigmoid' (V3)", required=True),
            attr("top_k", kind.INT, "experts per token", required=True),
            attr("n_group", onnx.helper.make_attribute("n_group", 1), "expert groups"),
            attr("topk_group", onnx.helper.make_attribute("topk_group", 1), "groups kept per token"),
            attr("group_scoring", onnx.helper.make_attribute("group_scoring", "max"), "'max' or 'top2_sum'"),
            attr("norm_topk_prob", onnx.helper.make_attribute("norm_topk_prob", 0), "renormalise the k weights"),
            attr("routed_scaling_factor", onnx.helper.make_attribute("routed_scaling_factor", 1.0), "weight scale"),
            *registration.plugin_attributes(PLUGIN_VERSION, PLUGIN_NAMESPACE),
        ],
    )
    schema.set_type_and_shape_inference_function(_infer)
    return schema


def register_schema() -> None:
    """Register ``moeforge.MoERouter`` v1 with onnx (idempotent)."""
    registration.register_schema(OP_TYPE, VERSION, DOMAIN, op_schema)


register_schema()
