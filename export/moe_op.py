"""The MoE custom-op boundary used at export: one ``moeforge.MoE`` ONNX node per MoE layer.

Eager torch (``torch.ops.moeforge.moe``) runs the reference routing + experts; the ONNX node
carries a local function (dense over experts, standard ops only) so the stateless graph runs in
any ONNX Runtime before the lowering pass replaces it with com.microsoft.MoE.

Node contract (domain ``moeforge``, op ``MoE``):
  inputs  x [T, H], router_weight [E, H], correction_bias [E] (zeros when the model has none),
          gate_proj [E, I, H], up_proj [E, I, H], down_proj [E, H, I]
  output  y [T, H] = sum_k w_k * expert_k(x)   (shared experts stay outside the node)
  attrs   scoring ("softmax" | "sigmoid"), top_k, n_group, topk_group, group_scoring ("max" |
          "top2_sum"), norm_topk_prob (0/1), routed_scaling_factor
"""

from __future__ import annotations

import onnx
import onnxscript
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper

from moeforge.export.config import MoEConfig
from moeforge.export.routing import route_tokens

DOMAIN = "moeforge"
OP_TYPE = "MoE"
ATTRIBUTES = ("scoring", "top_k", "n_group", "topk_group", "group_scoring", "norm_topk_prob", "routed_scaling_factor")


def moe_config_from_attributes(
    num_experts: int, scoring: str, top_k: int, n_group: int, topk_group: int, group_scoring: str,
    norm_topk_prob: int, routed_scaling_factor: float,
) -> MoEConfig:
    """The routing attributes of a node, as the MoEConfig that ``route_tokens`` reads."""
    # top2_sum is DeepSeek-V3's noaux_tc, which uses the correction bias even with a single group.
    if group_scoring == "top2_sum":
        method = "noaux_tc"
    else:
        method = "greedy" if n_group == 1 else "group_limited_greedy"
    return MoEConfig(
        n_routed_experts=num_experts, n_shared_experts=0, num_experts_per_tok=top_k, moe_intermediate_size=1,
        scoring_func=scoring, topk_method=method, n_group=n_group, topk_group=topk_group,  # type: ignore[arg-type]
        norm_topk_prob=bool(norm_topk_prob), routed_scaling_factor=routed_scaling_factor,
    )


def node_attributes(moe: MoEConfig) -> dict[str, object]:
    """Attributes of the ``moeforge.MoE`` node for a model's MoE config."""
    return {
        "scoring": moe.scoring_func, "top_k": moe.num_experts_per_tok,
        "n_group": moe.n_group if moe.topk_method != "greedy" else 1,
        "topk_group": moe.topk_group if moe.topk_method != "greedy" else 1,
        "group_scoring": moe.group_scoring, "norm_topk_prob": int(moe.norm_topk_prob),
        "routed_scaling_factor": float(moe.routed_scaling_factor),
    }


@torch.library.custom_op("moeforge::moe", mutates_args=())
def moe(
    x: torch.Tensor, router_weight: torch.Tensor, correction_bias: torch.Tensor, gate_proj: torch.Tensor,
    up_proj: torch.Tensor, down_proj: torch.Tensor, scoring: str, top_k: int, n_group: int, topk_group: int,
    group_scoring: str, norm_topk_prob: int, routed_scaling_factor: float,
) -> torch.Tensor:
    """Eager reference: route with ``route_tokens`` then run the chosen SwiGLU experts."""
    cfg = moe_config_from_attributes(router_weight.shape[0], scoring, top_k, n_group, topk_group, group_scoring,
                                     norm_topk_prob, routed_scaling_factor)
    logits = F.linear(x.float(), router_weight.float())
    ids, weights = route_tokens(logits, correction_bias if cfg.has_correction_bias else None, cfg)
    out = torch.zeros_like(x)
    for e in range(router_weight.shape[0]):
        token_idx, slot = torch.where(ids == e)
        xs = x[token_idx]
        h = F.silu(F.linear(xs, gate_proj[e])) * F.linear(xs, up_proj[e])
        out = out.index_add(0, token_idx, F.linear(h, down_proj[e]) * weights[token_idx, slot, None].to(x.dtype))
    return out


@moe.register_fake
def _moe_fake(x, router_weight, correction_bias, gate_proj, up_proj, down_proj, *args):  # type: ignore[no-untyped-def]
    return torch.empty_like(x)


def _register_onnx_schema() -> None:
    from onnx.defs import OpSchema

    if onnx.defs.has(OP_TYPE, DOMAIN):
        return
    param = OpSchema.FormalParameter
    attr = OpSchema.Attribute
    onnx.defs.register_schema(OpSchema(
        OP_TYPE, DOMAIN, 1,
        inputs=[param(n, "T") for n in ("x", "router_weight", "correction_bias", "gate_proj", "up_proj", "down_proj")],
        outputs=[param("y", "T")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "float types")],
        attributes=[attr("scoring", OpSchema.AttrType.STRING, ""), attr("top_k", OpSchema.AttrType.INT, ""),
                    attr("n_group", OpSchema.AttrType.INT, ""), attr("topk_group", OpSchema.AttrType.INT, ""),
                    attr("group_scoring", OpSchema.AttrType.STRING, ""),
                    attr("norm_topk_prob", OpSchema.AttrType.INT, ""),
                    attr("routed_scaling_factor", OpSchema.AttrType.FLOAT, "")],
    ))


_register_onnx_schema()
_opset = onnxscript.values.Opset(DOMAIN, 1)


def moe_to_onnx(x, router_weight, correction_bias, gate_proj, up_proj, down_proj, scoring: str, top_k: int,  # type: ignore[no-untyped-def]
                n_group: int, topk_group: int, group_scoring: str, norm_topk_prob: int, routed_scaling_factor: float):
    """custom_translation_table entry: one ``moeforge.MoE`` node."""
    return _opset.MoE(x, router_weight, correction_bias, gate_proj, up_proj, down_proj, scoring=scoring, top_k=top_k,
                      n_group=n_group, topk_group=topk_group, group_scoring=group_scoring,
                      norm_topk_prob=norm_topk_prob, routed_scaling_factor=routed_scaling_factor)


def moe_local_function(moe_cfg: MoEConfig, num_experts: int, opset: int = 23) -> onnx.FunctionProto:
    """Dense standard-op body of ``moeforge.MoE`` for one routing config.

    Every expert runs on every token and the outputs are mixed with a [T, E] weight matrix that is
    zero off the chosen experts: O(E) compute, but exact and portable (any ONNX runtime, or a
    TensorRT parser that inlines functions). Routing constants are baked in; the node's attributes
    are declared so the node validates, and they document the routing.
    """
    k = moe_cfg.num_experts_per_tok
    attrs = node_attributes(moe_cfg)
    nodes: list[onnx.NodeProto] = []

    def const(name: str, value, dtype=TensorProto.INT64) -> str:  # type: ignore[no-untyped-def]
        values = value if isinstance(value, list) else [value]
        dims = [len(values)] if isinstance(value, list) else []
        nodes.append(helper.make_node("Constant", [], [name], value=helper.make_tensor(name, dtype, dims, values)))
        return name

    def node(op: str, inputs: list[str], output: str, **kw) -> str:  # type: ignore[no-untyped-def]
        nodes.append(helper.make_node(op, inputs, [output], **kw))
        return output

    xf = node("Cast", ["x"], "xf", to=TensorProto.FLOAT)
    wf = node("Cast", ["router_weight"], "wf", to=TensorProto.FLOAT)
    logits = node("MatMul", [xf, node("Transpose", [wf], "wt", perm=[1, 0])], "logits")  # [T, E]
    scores = node("Softmax", [logits], "scores", axis=-1) if moe_cfg.scoring_func == "softmax" else node(
        "Sigmoid", [logits], "scores")
    choice = scores
    if moe_cfg.has_correction_bias:
        choice = node("Add", [scores, node("Cast", ["correction_bias"], "bf", to=TensorProto.FLOAT)], "choice")
    g = attrs["n_group"]
    if g > 1:  # group-limited: keep the topk_group best groups, -inf elsewhere
        per = num_experts // g
        grouped = node("Reshape", [choice, const("gshape", [-1, g, per])], "grouped")  # [T, G, E/G]
        if moe_cfg.group_scoring == "top2_sum":
            node("TopK", [grouped, const("two", [2])], "top2", axis=-1)
            nodes[-1].output.append("top2_idx")
            gscore = node("ReduceSum", ["top2", const("lastax", [-1])], "gscore", keepdims=0)
        else:
            gscore = node("ReduceMax", [grouped, const("lastax", [-1])], "gscore", keepdims=0)
        nodes.append(helper.make_node("TopK", [gscore, const("tg", [attrs["topk_group"]])], ["gval", "gidx"], axis=-1))
        zeros_g = node("Mul", [gscore, const("zero_f", 0.0, TensorProto.FLOAT)], "zeros_g")
        ones_g = node("Add", [node("Mul", ["gval", const("zero_f2", 0.0, TensorProto.FLOAT)], "zg2"),
                              const("one_f", 1.0, TensorProto.FLOAT)], "ones_g")
        gmask = node("ScatterElements", [zeros_g, "gidx", ones_g], "gmask", axis=1)  # [T, G] 1 = kept
        emask = node("Reshape", [node("Expand", [node("Unsqueeze", [gmask, const("ax2", [2])], "gmask3"),
                                                 const("eshape", [1, 1, per])], "emask3"),
                                 const("fshape", [0, num_experts])], "emask")
        keep = node("Cast", [emask], "keep", to=TensorProto.BOOL)
        choice = node("Where", [keep, choice, const("ninf", float("-inf"), TensorProto.FLOAT)], "masked")
    nodes.append(helper.make_node("TopK", [choice, const("k", [k])], ["cval", "ids"], axis=-1))
    w = node("GatherElements", [scores, "ids"], "w", axis=1)  # [T, K] unbiased scores
    if moe_cfg.norm_topk_prob:
        denom = node("Add", [node("ReduceSum", [w, const("lastax2", [-1])], "wsum", keepdims=1),
                             const("tiny", 1e-20, TensorProto.FLOAT)], "denom")
        w = node("Div", [w, denom], "wn")
    w = node("Mul", [w, const("rsf", float(moe_cfg.routed_scaling_factor), TensorProto.FLOAT)], "ws")
    dense_w = node("ScatterElements", [node("Mul", [scores, const("zero_f3", 0.0, TensorProto.FLOAT)], "zeros_e"),
                                       "ids", w], "dense_w", axis=1)  # [T, E]
    xt = "x"
    gate = node("Einsum", [xt, "gate_proj"], "gate", equation="th,eih->eti")  # [E, T, I]
    up = node("Einsum", [xt, "up_proj"], "up", equation="th,eih->eti")
    h = node("Mul", [node("Mul", [gate, node("Sigmoid", [gate], "sg")], "silu"), up], "h")
    y = node("Einsum", [h, "down_proj"], "ye", equation="eti,ehi->eth")  # [E, T, H]
    dw = node("Cast", [dense_w], "dwc", to=TensorProto.FLOAT)
    out = node("Einsum", [node("Cast", [y], "yf", to=TensorProto.FLOAT), dw], "yf_mixed", equation="eth,te->th")
    nodes.append(helper.make_node("CastLike", [out, "x"], ["y"]))
    return helper.make_function(
        DOMAIN, OP_TYPE, ["x", "router_weight", "correction_bias", "gate_proj", "up_proj", "down_proj"], ["y"],
        nodes, [helper.make_opsetid("", opset)], attributes=list(ATTRIBUTES),
    )
