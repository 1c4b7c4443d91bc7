"""The ONNX local function of ``moeforge.MoERouter``: the op in standard ops (opset >= 13).

Any ONNX runtime (and TensorRT's parser when no plugin is registered) runs a ``MoERouter`` node by
inlining this body. The body is specialised to one routing config (the attributes and whether a
correction bias is given): every MoE layer of a model shares its routing config, and
``attach_function`` refuses a second, different one. Dimension letters: T tokens, E experts,
G groups (n_group), K = top_k.

    scores  = Softmax(logits) | Sigmoid(logits)                         [T, E]
    choice  = scores + correction_bias                                  [T, E]
    if n_group > 1:
        grouped = Reshape(choice, [T, G, E/G])
        gscore  = ReduceSum(TopK(grouped, 1 | 2).values)                [T, G]   max | top2_sum
        kept    = ScatterElements(False[T, G], TopK(gscore, topk_group).indices, True)
        choice  = Reshape(Where(kept[..., None], grouped, -inf), [T, E])
    _, ids  = TopK(choice, K)               descending, ties -> lower index (ONNX TopK rule)
    w       = GatherElements(scores, ids)   (/ (ReduceSum(w) + 1e-20) if norm_topk_prob) * routed_scaling_factor
    outputs   Cast(ids, int32) [T, K], w [T, K]
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir

from moeforge.ops.moe_router.schema import ATTRIBUTES, DOMAIN, OP_TYPE, RouterAttributes, RouterOpError
from moeforge.ops.node_builder import NodeBuilder

NEG_INF = float("-inf")  # exact: a dropped group can never win, whatever the sign of the biased scores
_CONFIG_KEY = "moeforge.router_config"  # function metadata: the routing config the body is specialised to


def scores_and_choice(
    b: NodeBuilder, logits: ir.Value, bias: ir.Value | None, attrs: RouterAttributes
) -> tuple[ir.Value, ir.Value]:
    """Emit scores [T, E] and the choice scores [T, E] (biased, -inf outside the kept groups)."""
    logits = b.as_f32(logits, "logits_f32")
    if attrs.scoring == "softmax":
        scores = b.op("Softmax", [logits], {"axis": -1}, "scores")
    else:
        scores = b.op("Sigmoid", [logits], None, "scores")
    choice = scores
    if bias is not None:
        choice = b.op("Add", [scores, b.as_f32(bias, "bias_f32")], None, "choice")
    if attrs.n_group > 1:
        choice = _mask_dropped_groups(b, choice, attrs)
    return scores, choice


def _mask_dropped_groups(b: NodeBuilder, choice: ir.Value, attrs: RouterAttributes) -> ir.Value:
    # Reshape with 0 copies T from the input (robust to T == 0, unlike -1 there); -1 infers E/G.
    grouped = b.op("Reshape", [choice, b.const_i64([0, attrs.n_group, -1])], None, "grouped")  # [T, G, E/G]
    n_top = 2 if attrs.group_scoring == "top2_sum" else 1  # 1 = max (V2), 2 = top2_sum (V3)
    best, _ = b.op_multi("TopK", [grouped, b.const_i64([n_top])], {"axis": -1}, ("group_best", "group_best_idx"))
    gscore = b.op("ReduceSum", [best, b.const_i64([-1])], {"keepdims": 0}, "group_score")  # [T, G]
    _, gidx = b.op_multi("TopK", [gscore, b.const_i64([attrs.topk_group])], {"axis": -1}, ("kept_vals", "kept_idx"))
    kept = scatter_true(b, gscore, gidx, "kept_groups")  # [T, G] bool
    kept3 = b.op("Unsqueeze", [kept, b.const_i64([-1])], None, "kept_groups3")  # [T, G, 1]
    masked = b.op("Where", [kept3, grouped, b.const_f32(NEG_INF)], None, "grouped_masked")
    return b.op("Reshape", [masked, b.const_i64([0, -1])], None, "choice_masked")  # [T, E]


def scatter_true(b: NodeBuilder, like: ir.Value, idx: ir.Value, name: str) -> ir.Value:
    """bool tensor shaped like ``like`` [T, N], True at ``idx`` [T, k] along axis 1."""
    falses = b.op("ConstantOfShape", [b.op("Shape", [like], None, f"{name}_shape")],
                  {"value": ir.tensor(np.array([False]))}, f"{name}_zeros")
    trues = b.op("Expand", [b.const_bool(True), b.op("Shape", [idx], None, f"{name}_idx_shape")], None, f"{name}_ones")
    return b.op("ScatterElements", [falses, idx, trues], {"axis": 1}, name)


def router_function(attrs: RouterAttributes, has_bias: bool, opset: int = 23) -> ir.Function:
    """The ``moeforge.MoERouter`` function body for one routing config."""
    attrs.validate()
    if opset < 13:
        raise RouterOpError("MoERouter function body needs default-domain opset >= 13 (TopK/ReduceSum inputs)")
    b = NodeBuilder(None, "")
    logits = ir.Value(name="router_logits")
    bias_input = ir.Value(name="correction_bias")  # always declared (a node may pass it); read only if has_bias
    scores, choice = scores_and_choice(b, logits, bias_input if has_bias else None, attrs)
    _, idx = b.op_multi("TopK", [choice, b.const_i64([attrs.top_k])], {"axis": -1}, ("topk_vals", "topk_idx"))
    weights = b.op("GatherElements", [scores, idx], {"axis": 1}, "picked_scores")  # [T, K] unbiased
    if attrs.norm_topk_prob:
        total = b.op("ReduceSum", [weights, b.const_i64([-1])], {"keepdims": 1}, "picked_sum")
        denom = b.op("Add", [total, b.const_f32(1e-20)], None, "picked_sum_eps")
        weights = b.op("Div", [weights, denom], None, "picked_norm")
    weights = b.op("Mul", [weights, b.const_f32(attrs.routed_scaling_factor)], None, "expert_weights")
    ids = b.op("Cast", [idx], {"to": ir.DataType.INT32}, "expert_ids")
    graph = ir.Graph([logits, bias_input], [ids, weights], nodes=b.nodes,
                     opset_imports={"": opset}, name=OP_TYPE)
    function = ir.Function(DOMAIN, OP_TYPE, graph=graph, attributes=[])
    function.metadata_props[_CONFIG_KEY] = _config_key(attrs, has_bias)
    return function


def _config_key(attrs: RouterAttributes, has_bias: bool) -> str:
    return repr((attrs, has_bias))


def router_function_proto(attrs: RouterAttributes, has_bias: bool, opset: int = 23) -> onnx.FunctionProto:
    """``router_function`` serialised, with the attribute names declared (so nodes that carry them validate)."""
    proto = ir.serde.serialize_function(router_function(attrs, has_bias, opset))
    proto.attribute.extend([*ATTRIBUTES, "plugin_version", "plugin_namespace"])
    return proto


def check_nodes(model: ir.Model, *, require_function: bool = True) -> None:
    """Every MoERouter node of the main graph matches the routing config its function is specialised to.

    The function body is built for one config (it ignores node attributes), so a node whose attributes
    or bias differ would run another routing than it declares. ``require_function=False``: a model
    without the function passes (a pass that replaces the nodes does not need it)."""
    function = model.functions.get((DOMAIN, OP_TYPE, ""))
    nodes = [n for n in model.graph.all_nodes() if (n.domain, n.op_type) == (DOMAIN, OP_TYPE)]
    if nodes and function is None and require_function:
        raise RouterOpError("MoERouter nodes without their local function: call attach_function")
    for node in nodes:
        attrs = RouterAttributes.from_mapping({k: a.value for k, a in node.attributes.items()})
        has_bias = len(node.inputs) > 1 and node.inputs[1] is not None
        if function is not None and function.metadata_props.get(_CONFIG_KEY) != _config_key(attrs, has_bias):
            raise RouterOpError(
                f"{node.name}: its attributes / bias {_config_key(attrs, has_bias)} differ from the MoERouter "
                f"function's config {function.metadata_props.get(_CONFIG_KEY)}: the function body is specialised "
                "to one routing config per model, so every MoERouter node must carry it (re-export the model)")


def attach_function(model: ir.Model, attrs: RouterAttributes, has_bias: bool) -> None:
    """Give ``model`` the MoERouter function for this config; refuse a different config already there."""
    key = (DOMAIN, OP_TYPE, "")
    existing = model.functions.get(key)
    if existing is not None:
        if existing.metadata_props.get(_CONFIG_KEY) != _config_key(attrs, has_bias):
            raise RouterOpError("MoERouter: the model already holds a router function for another routing config;"
                                " every MoE layer of one model must share its routing attributes")
        return
    proto = router_function_proto(attrs, has_bias, model.opset_imports.get("", 23))
    function = ir.serde.deserialize_function(proto)
    function.metadata_props[_CONFIG_KEY] = _config_key(attrs, has_bias)
    model.functions[key] = function
    model.opset_imports.setdefault(DOMAIN, 1)
