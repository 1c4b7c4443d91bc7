"""The routed-experts custom-op boundary used at export: one ``moeforge.MoEExperts`` node per MoE layer.

Routing is its own op (``moeforge.MoERouter``, moeforge/ops/moe_router/) in front of this one; this op
applies the experts the router chose. Eager torch (``torch.ops.moeforge.moe_experts``) runs the
chosen SwiGLU experts; the ONNX node carries a local function (dense over experts, standard ops
only) so the stateless graph runs in any ONNX Runtime before the lowering pass replaces router +
experts with com.microsoft.MoE.

Node contract (domain ``moeforge``, op ``MoEExperts``, no attributes):
  inputs  x [T, H], expert_ids [T, K] int32, expert_weights [T, K] float32,
          gate_proj [E, I, H], up_proj [E, I, H], down_proj [E, H, I]
  output  y [T, H] = sum_k expert_weights[:, k] * expert_{expert_ids[:, k]}(x)   (shared experts stay outside)
"""

from __future__ import annotations

from typing import Any

import onnx
import onnxscript
import torch
from onnx import TensorProto, helper
from onnx.defs import OpSchema

from moeforge.model.moe import apply_experts

DOMAIN = "moeforge"
OP_TYPE = "MoEExperts"
INPUTS = ("x", "expert_ids", "expert_weights", "gate_proj", "up_proj", "down_proj")


@torch.library.custom_op("moeforge::moe_experts", mutates_args=())
def moe_experts(x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor, gate_proj: torch.Tensor,
                up_proj: torch.Tensor, down_proj: torch.Tensor) -> torch.Tensor:
    """Eager reference: run the chosen SwiGLU experts and mix them with the router's weights."""
    return apply_experts(x, expert_ids, expert_weights, gate_proj, up_proj, down_proj)


@moe_experts.register_fake
def _moe_experts_fake(x: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _register_onnx_schema() -> None:
    if onnx.defs.has(OP_TYPE, DOMAIN):
        return
    param = OpSchema.FormalParameter
    onnx.defs.register_schema(OpSchema(
        OP_TYPE, DOMAIN, 1,
        inputs=[param("x", "T"), param("expert_ids", "I"), param("expert_weights", "tensor(float)"),
                *(param(n, "T") for n in ("gate_proj", "up_proj", "down_proj"))],
        outputs=[param("y", "T")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "float types"),
                          ("I", ["tensor(int32)", "tensor(int64)"], "expert ids")],
    ))


_register_onnx_schema()
_opset = onnxscript.values.Opset(DOMAIN, 1)


def moe_experts_to_onnx(x: Any, expert_ids: Any, expert_weights: Any, gate_proj: Any, up_proj: Any,
                        down_proj: Any) -> Any:
    """custom_translation_table entry: one ``moeforge.MoEExperts`` node. (``Any``: the exporter reads these
    annotations to infer an ONNX signature, and a non-ONNX type such as ``ir.Value`` makes it warn.)"""
    return _opset.MoEExperts(x, expert_ids, expert_weights, gate_proj, up_proj, down_proj)


def experts_local_function(opset: int = 23) -> onnx.FunctionProto:
    """Dense standard-op body of ``moeforge.MoEExperts`` (no routing config: it reads ids and weights).

    Every expert runs on every token and the outputs are mixed with a [T, E] weight matrix that is
    zero off the chosen experts: O(E) compute, but exact and portable (any ONNX runtime, or a
    TensorRT parser that inlines functions).
    """
    nodes: list[onnx.NodeProto] = []

    def node(op: str, inputs: list[str], output: str, **kw: Any) -> str:
        nodes.append(helper.make_node(op, inputs, [output], **kw))
        return output

    # dense_w [T, E] = sum_k w[:, k] * (ids[:, k] == e): Equal, not ScatterElements, so that an id that matches no
    # expert (an expert-parallel rank's id for another rank's expert) adds nothing and repeated ids add up, with
    # ops every runtime (TensorRT included) imports.
    e_dim = node("Shape", ["gate_proj"], "e_dim", start=0, end=1)
    zero = helper.make_tensor("zero64", TensorProto.INT64, [], [0])
    one = helper.make_tensor("one64", TensorProto.INT64, [], [1])
    experts = node("Range", [node("Constant", [], "r0", value=zero),
                             node("Squeeze", [e_dim], "e_scalar"), node("Constant", [], "r1", value=one)], "experts")
    ids = node("Unsqueeze", [node("Cast", ["expert_ids"], "ids64", to=TensorProto.INT64),
                             node("Constant", [], "axis2", value=helper.make_tensor("a2", TensorProto.INT64, [1],
                                                                                    [2]))], "ids_tk1")
    chosen = node("Cast", [node("Equal", [ids, experts], "chosen_b")], "chosen", to=TensorProto.FLOAT)  # [T, K, E]
    wf = node("Cast", ["expert_weights"], "wf", to=TensorProto.FLOAT)
    dense_w = node("Einsum", [chosen, wf], "dense_w", equation="tke,tk->te")  # [T, E]
    gate = node("Einsum", ["x", "gate_proj"], "gate", equation="th,eih->eti")  # [E, T, I]
    up = node("Einsum", ["x", "up_proj"], "up", equation="th,eih->eti")
    h = node("Mul", [node("Mul", [gate, node("Sigmoid", [gate], "sg")], "silu"), up], "h")
    y = node("Einsum", [h, "down_proj"], "ye", equation="eti,ehi->eth")  # [E, T, H]
    out = node("Einsum", [node("Cast", [y], "yf", to=TensorProto.FLOAT), dense_w], "yf_mixed", equation="eth,te->th")
    nodes.append(helper.make_node("CastLike", [out, "x"], ["y"]))
    return helper.make_function(DOMAIN, OP_TYPE, list(INPUTS), ["y"], nodes, [helper.make_opsetid("", opset)])
