"""MoE lowering: each ``moeforge.MoE`` node -> DeepSeek routing in standard ops + one ``com.microsoft.MoE``.

The exporter emits one ``moeforge.MoE`` node per MoE layer (see ``moeforge.export.moe_op``): its
local function runs every expert on every token (O(E) compute). ONNX Runtime's contrib ``MoE`` op
runs only the chosen experts, but its routing is fixed (softmax over all experts, top-k, optional
renormalisation). DeepSeek routing does not fit that directly (sigmoid scores, a correction bias
that steers the *choice* but not the *weights*, group-limited top-k), so this pass computes the
choice with standard ops and hands the op a router input that makes its fixed routing reproduce
DeepSeek's weights exactly:

    router_probs = Where(chosen, Log(scores), -inf)        [T, E]
    softmax(router_probs) over the chosen experts = s_k / sum_chosen(s)   (the renormalised weights)

Emitted per MoE node (fp32; other float types are cast to fp32 around it):

    logits  = MatMul(x, router_weight^T)                    [T, E]   (W^T precomputed as an initializer)
    scores  = Softmax(logits) | Sigmoid(logits)              [T, E]
    choice  = scores + correction_bias                       [T, E]   (Add skipped when the bias is all 0)
    if n_group > 1:                                                   (group-limited top-k)
        gscore = ReduceSum(TopK(Reshape(choice, [T, G, E/G]), n_top).values)   n_top 1 = max, 2 = top2_sum
        kept   = ScatterElements(False[T, G], TopK(gscore, topk_group).indices, True)
        choice = Where(Reshape(Expand(kept[..., None], [1, 1, E/G]), [T, E]), choice, -inf)
    chosen  = ScatterElements(False[T, E], TopK(choice, K).indices, True)       [T, E] bool
    y = com.microsoft.MoE(x, Where(chosen, Log(scores), -inf), fc1 [E, 2I, H], , fc2 [E, H, I],
                          k=K, activation_type="swiglu", swiglu_fusion=1, normalize_routing_weights=1)
    if not norm_topk_prob:
        y = y * ReduceSum(Where(chosen, scores, 0), -1, keepdims=1)        (undo the op's renormalisation)

Weights: ``fc1[:, 0::2] = gate_proj``, ``fc1[:, 1::2] = up_proj`` (rows g0, u0, g1, u1, ...: the
interleaved layout the CPU kernel requires with swiglu_fusion=1) and ``fc2 = down_proj *
routed_scaling_factor`` (exact: the op is linear after the activation and has no fc2 bias). They
replace the stacked ``gate_proj`` / ``up_proj`` / ``down_proj`` initializers, which are removed when
nothing else reads them, so the artifact holds one copy of the expert weights.

Glossary of dimension letters:
    T  tokens (batch * sequence, flattened by the exporter before the MoE node)
    H  hidden size
    I  expert intermediate size (moe_intermediate_size)
    E  routed experts (n_routed_experts)
    G  expert groups (n_group); E/G experts per group
    K  experts per token (top_k = num_experts_per_tok)

Facts the pass writes for later passes: ``ctx.notes["moe_lowering"] = {"lowered": n}``.
Only nodes of the main graph are lowered (the exporter never puts a MoE node in a subgraph).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir
from onnx_ir import convenience

from moeforge.export import moe_op
from moeforge.graph_passes.base import MS_DOMAIN, PassContext, ensure_opset

log = logging.getLogger(__name__)

# Fill for "not chosen" in router_probs and for experts of dropped groups in the choice scores.
# -inf is exact by construction: exp(-inf - max) == 0 exactly, whatever the magnitude of the
# log-scores, and it stays -inf under an fp16 conversion (where -1e30 would overflow to -inf anyway).
# ORT's MoE kernel and TopK accept it (checked: identical to -1e30 on CPU, /tmp/proto_ort q4).
# Dropped groups MUST be -inf, not 0.0: biased sigmoid scores can be negative, and a 0.0 fill then
# lets an expert of a dropped group win the top-k (the HF DeepseekV3 bug route_tokens avoids).
NEG_INF = float("-inf")

# Input positions of the moeforge.MoE node (moe_op node contract).
_X, _ROUTER, _BIAS, _GATE, _UP, _DOWN = range(6)


@dataclass(frozen=True)
class _Routing:
    """The routing attributes of one ``moeforge.MoE`` node."""

    scoring: str
    top_k: int
    n_group: int
    topk_group: int
    group_scoring: str
    norm_topk_prob: bool
    routed_scaling_factor: float

    @classmethod
    def from_node(cls, node: ir.Node) -> _Routing:
        a = node.attributes
        missing = [name for name in moe_op.ATTRIBUTES if name not in a]
        if missing:
            raise ValueError(f"{node.name}: moeforge.MoE node lacks attributes {missing}")
        routing = cls(
            scoring=a["scoring"].as_string(), top_k=a["top_k"].as_int(), n_group=a["n_group"].as_int(),
            topk_group=a["topk_group"].as_int(), group_scoring=a["group_scoring"].as_string(),
            norm_topk_prob=bool(a["norm_topk_prob"].as_int()),
            routed_scaling_factor=a["routed_scaling_factor"].as_float(),
        )
        if routing.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"{node.name}: unknown scoring {routing.scoring!r}")
        if routing.group_scoring not in ("max", "top2_sum"):
            raise ValueError(f"{node.name}: unknown group_scoring {routing.group_scoring!r}")
        return routing


class MoELowering:
    """Replace every ``moeforge.MoE`` node by standard-op DeepSeek routing + one ``com.microsoft.MoE``.

    Returns the number of MoE nodes lowered. Afterwards the ``moeforge`` local function and opset
    import are removed when no ``moeforge.MoE`` node is left, and ``com.microsoft`` is declared.
    """

    name = "moe_lowering"

    def apply(self, model: ir.Model, ctx: PassContext) -> int:
        graph = model.graph
        targets = [n for n in graph if n.domain == moe_op.DOMAIN and n.op_type == moe_op.OP_TYPE]
        # ReduceSum with axes as an input and TopK with k as an input need opset >= 13 (exporter: 23).
        if targets and model.opset_imports.get("", 0) < 13:
            raise ValueError("moe_lowering needs default-domain opset >= 13")
        prefixes: set[str] = set()
        for i, node in enumerate(targets):
            # New value names are "<prefix>/<stem>": the prefix must be unique (names are SSA).
            prefix = node.name or f"moe_lowering_{i}"
            while prefix in prefixes:
                prefix = f"{prefix}_{i}"
            prefixes.add(prefix)
            _lower(graph, node, prefix)
        if targets:
            ensure_opset(model, MS_DOMAIN, 1)
        _drop_unused_moe_function(model)
        ctx.notes[self.name] = {"lowered": len(targets)}
        return len(targets)


# --------------------------------------------------------------------------------------- lowering
def _lower(graph: ir.Graph, node: ir.Node, prefix: str) -> None:
    routing = _Routing.from_node(node)
    x, router_w, bias, gate, up, down = (node.inputs[i] for i in range(6))
    if any(v is None for v in (x, router_w, bias, gate, up, down)):
        raise ValueError(f"{node.name}: moeforge.MoE needs all six inputs")
    num_experts = _num_experts(node, router_w, gate)
    _check_routing(node, routing, num_experts)

    b = _Builder(graph, prefix)
    f32 = ir.DataType.FLOAT
    # com.microsoft.MoE has fp32 CPU kernels only; the router runs in fp32 in the reference too.
    x_dtype = x.dtype
    xf = x if x_dtype == f32 else b.op("Cast", [x], {"to": f32}, "x_f32")

    # ---- router logits and scores
    w_np = _const_array(router_w)
    if w_np is not None:
        w_t = np.ascontiguousarray(w_np.astype(np.float32).T)  # [H, E]: MatMul(x, W^T) without a Transpose node
        wt = b.initializer(w_t, _derived_name(router_w, "weight_t", strip="weight"))
    else:
        wt = b.op("Transpose", [_as_f32(b, router_w, "router_w_f32")], {"perm": [1, 0]}, "router_w_t")
    logits = b.op("MatMul", [xf, wt], None, "router_logits")  # [T, E]
    if routing.scoring == "softmax":
        scores = b.op("Softmax", [logits], {"axis": -1}, "scores")
    else:
        scores = b.op("Sigmoid", [logits], None, "scores")

    # ---- choice scores: + correction bias (choice only; the weights stay unbiased)
    choice = scores
    bias_np = _const_array(bias)
    if bias_np is None or np.any(bias_np != 0):  # all-zero bias (models without one) adds nothing
        choice = b.op("Add", [scores, _as_f32(b, bias, "bias_f32")], None, "choice")

    # ---- chosen mask [T, E]
    if routing.top_k == num_experts:
        # Every expert is chosen whatever the groups say: TopK(k=E) returns all indices.
        chosen = None
    else:
        if routing.n_group > 1:
            choice = _mask_dropped_groups(b, choice, routing, num_experts)
        _, idx = b.op_multi("TopK", [choice, b.const_i64([routing.top_k])], {"axis": -1}, ("topk_vals", "topk_idx"))
        chosen = _scatter_true(b, choice, idx, "chosen")

    # ---- router input of com.microsoft.MoE
    # Log of the scores (not the raw logits, even for softmax): one formula for both scorings, and
    # the op's softmax over the chosen entries then rebuilds exactly the reference's s_k / sum(s).
    log_scores = b.op("Log", [scores], None, "log_scores")
    if chosen is None:
        router_probs = log_scores
    else:
        router_probs = b.op("Where", [chosen, log_scores, b.const_f32(NEG_INF)], None, "router_probs")

    # ---- expert weights
    fc1, fc2 = _expert_weights(b, gate, up, down, routing.routed_scaling_factor)

    moe_out = b.op(
        "MoE", [xf, router_probs, fc1, None, fc2],
        {"k": routing.top_k, "activation_type": "swiglu", "swiglu_fusion": 1, "normalize_routing_weights": 1},
        "routed", domain=MS_DOMAIN,
    )
    y = moe_out
    if not routing.norm_topk_prob:
        # The op always renormalises over the chosen experts; DeepSeek-V2 keeps the raw softmax
        # weights, so scale each token back by the sum of its chosen (unbiased) scores.
        picked = scores if chosen is None else b.op("Where", [chosen, scores, b.const_f32(0.0)], None, "chosen_scores")
        wsum = b.op("ReduceSum", [picked, b.const_i64([-1])], {"keepdims": 1}, "chosen_score_sum")  # [T, 1]
        y = b.op("Mul", [moe_out, wsum], None, "routed_unnormalised")
    if x_dtype != f32 and x_dtype is not None:
        y = b.op("Cast", [y], {"to": x_dtype}, "routed_cast")

    old_out = node.outputs[0]
    y.dtype = old_out.dtype
    y.shape = old_out.shape
    graph.insert_before(node, b.nodes)
    convenience.replace_all_uses_with(old_out, y, replace_graph_outputs=True)
    out_name = old_out.name
    old_out.name = None
    graph.remove(node, safe=True)
    y.name = out_name  # keep the value name stable for whoever reads the graph next
    for value in (router_w, bias, gate, up, down):
        _drop_if_unused_initializer(graph, value)


def _check_routing(node: ir.Node, r: _Routing, num_experts: int) -> None:
    if not 1 <= r.top_k <= num_experts:
        raise ValueError(f"{node.name}: top_k {r.top_k} outside [1, {num_experts}]")
    if r.n_group > 1:
        if num_experts % r.n_group:
            raise ValueError(f"{node.name}: {num_experts} experts do not split into {r.n_group} groups")
        per_group = num_experts // r.n_group
        if r.group_scoring == "top2_sum" and per_group < 2:
            raise ValueError(f"{node.name}: top2_sum group scoring needs >= 2 experts per group")
        if not 1 <= r.topk_group <= r.n_group or r.topk_group * per_group < r.top_k:
            raise ValueError(f"{node.name}: topk_group {r.topk_group} keeps fewer than top_k {r.top_k} experts")


def _num_experts(node: ir.Node, router_w: ir.Value, gate: ir.Value) -> int:
    for value in (router_w, gate):
        if value.shape is not None and isinstance(value.shape[0], int):
            return value.shape[0]
        array = _const_array(value)
        if array is not None:
            return int(array.shape[0])
    raise ValueError(f"{node.name}: the number of experts is not static")


def _mask_dropped_groups(b: _Builder, choice: ir.Value, r: _Routing, num_experts: int) -> ir.Value:
    """Keep the topk_group best groups of the choice scores; -inf on every expert of the others."""
    per_group = num_experts // r.n_group
    # Reshape with 0 copies T from the input (robust to T == 0, unlike -1).
    grouped = b.op("Reshape", [choice, b.const_i64([0, r.n_group, per_group])], None, "grouped")  # [T, G, E/G]
    # Group score = sum of the group's best n_top choice scores: n_top 1 is "max" (V2), 2 "top2_sum" (V3).
    n_top = 2 if r.group_scoring == "top2_sum" else 1
    best, _ = b.op_multi("TopK", [grouped, b.const_i64([n_top])], {"axis": -1}, ("group_best", "group_best_idx"))
    gscore = b.op("ReduceSum", [best, b.const_i64([-1])], {"keepdims": 0}, "group_score")  # [T, G]
    _, gidx = b.op_multi("TopK", [gscore, b.const_i64([r.topk_group])], {"axis": -1}, ("kept_vals", "kept_idx"))
    kept = _scatter_true(b, gscore, gidx, "kept_groups")  # [T, G] bool
    kept3 = b.op("Unsqueeze", [kept, b.const_i64([-1])], None, "kept_groups3")  # [T, G, 1]
    kept_e = b.op("Expand", [kept3, b.const_i64([1, 1, per_group])], None, "kept_experts3")  # [T, G, E/G]
    kept_mask = b.op("Reshape", [kept_e, b.const_i64([0, num_experts])], None, "kept_experts")  # [T, E]
    return b.op("Where", [kept_mask, choice, b.const_f32(NEG_INF)], None, "choice_masked")


def _scatter_true(b: _Builder, like: ir.Value, idx: ir.Value, name: str) -> ir.Value:
    """bool tensor shaped like ``like`` [T, N], True at ``idx`` [T, k] along axis 1 (exact, no ties)."""
    falses = b.op("ConstantOfShape", [b.op("Shape", [like], None, f"{name}_shape")],
                  {"value": ir.tensor(np.array([False]))}, f"{name}_zeros")
    trues = b.op("Expand", [b.const_bool(True), b.op("Shape", [idx], None, f"{name}_idx_shape")], None, f"{name}_ones")
    return b.op("ScatterElements", [falses, idx, trues], {"axis": 1}, name)


def _expert_weights(b: _Builder, gate: ir.Value, up: ir.Value, down: ir.Value, rsf: float) -> tuple[ir.Value, ir.Value]:
    """fc1 [E, 2I, H] interleaved gate/up rows, fc2 [E, H, I] = down * routed_scaling_factor."""
    g, u, d = _const_array(gate), _const_array(up), _const_array(down)
    if g is not None and u is not None:
        g32 = g.astype(np.float32, copy=False)
        fc1_np = np.empty((g.shape[0], 2 * g.shape[1], g.shape[2]), np.float32)
        fc1_np[:, 0::2] = g32  # rows g0, u0, g1, u1, ...: the layout swiglu_fusion=1 reads
        fc1_np[:, 1::2] = u
        fc1 = b.initializer(fc1_np, _derived_name(gate, "fc1_gate_up_interleaved", strip="gate_proj"))
    else:
        # Weights computed in the graph (e.g. dequantised): stack [E, I, 2, H] then merge I and 2.
        g3 = b.op("Unsqueeze", [_as_f32(b, gate, "gate_f32"), b.const_i64([2])], None, "gate_e_i_1_h")
        u3 = b.op("Unsqueeze", [_as_f32(b, up, "up_f32"), b.const_i64([2])], None, "up_e_i_1_h")
        stacked = b.op("Concat", [g3, u3], {"axis": 2}, "gate_up_e_i_2_h")
        shape = b.op("Shape", [stacked], None, "gate_up_shape")
        e_dim = b.op("Slice", [shape, b.const_i64([0]), b.const_i64([1])], None, "gate_up_e")
        h_dim = b.op("Slice", [shape, b.const_i64([3]), b.const_i64([4])], None, "gate_up_h")
        target = b.op("Concat", [e_dim, b.const_i64([-1]), h_dim], {"axis": 0}, "fc1_shape")
        fc1 = b.op("Reshape", [stacked, target], None, "fc1_gate_up_interleaved")
    if d is not None:
        fc2_np = (d.astype(np.float32) * np.float32(rsf)).astype(np.float32)
        fc2 = b.initializer(fc2_np, _derived_name(down, "fc2_down_scaled", strip="down_proj"))
    elif rsf == 1.0:
        fc2 = _as_f32(b, down, "down_f32")
    else:
        fc2 = b.op("Mul", [_as_f32(b, down, "down_f32"), b.const_f32(rsf)], None, "fc2_down_scaled")
    return fc1, fc2


# ------------------------------------------------------------------------------------ utilities
class _Builder:
    """Collects the new nodes (inserted before the MoE node) and registers new initializers."""

    def __init__(self, graph: ir.Graph, prefix: str) -> None:
        self.graph = graph
        self.prefix = prefix
        self.nodes: list[ir.Node] = []
        self._consts = 0

    def _name(self, stem: str) -> str:
        return f"{self.prefix}/{stem}"

    def op(self, op_type: str, inputs: list[ir.Value | None], attributes: dict | None, out: str,
           domain: str = "") -> ir.Value:
        return self.op_multi(op_type, inputs, attributes, (out,), domain=domain)[0]

    def op_multi(self, op_type: str, inputs: list[ir.Value | None], attributes: dict | None,
                 outs: tuple[str, ...], domain: str = "") -> list[ir.Value]:
        attrs = convenience.convert_attributes(attributes or {})
        node = ir.Node(domain, op_type, inputs, attributes=attrs, num_outputs=len(outs),
                       name=self._name(f"{op_type}_{outs[0]}"))
        for value, stem in zip(node.outputs, outs, strict=True):
            value.name = self._name(stem)
        self.nodes.append(node)
        return list(node.outputs)

    def _const(self, array: np.ndarray) -> ir.Value:
        self._consts += 1
        return self.op("Constant", [], {"value": ir.tensor(array)}, f"const_{self._consts}")

    def const_i64(self, values: list[int]) -> ir.Value:
        return self._const(np.array(values, np.int64))

    def const_f32(self, value: float) -> ir.Value:
        return self._const(np.array(value, np.float32))

    def const_bool(self, value: bool) -> ir.Value:
        return self._const(np.array([value]))

    def initializer(self, array: np.ndarray, name: str) -> ir.Value:
        unique, i = name, 1
        while unique in self.graph.initializers:
            unique, i = f"{name}_{i}", i + 1
        tensor = ir.tensor(array, name=unique)
        value = ir.Value(name=unique, shape=ir.Shape(array.shape), type=ir.TensorType(tensor.dtype),
                         const_value=tensor)
        self.graph.register_initializer(value)
        return value


def _const_array(value: ir.Value) -> np.ndarray | None:
    """The value's data if it is a constant (initializer or Constant node output), else None."""
    if value.const_value is not None and not value.is_graph_input():
        return value.const_value.numpy()
    node = value.producer()
    if node is not None and (node.domain, node.op_type) == ("", "Constant") and "value" in node.attributes:
        return node.attributes["value"].as_tensor().numpy()
    return None


def _as_f32(b: _Builder, value: ir.Value, stem: str) -> ir.Value:
    if value.dtype == ir.DataType.FLOAT:
        return value
    return b.op("Cast", [value], {"to": ir.DataType.FLOAT}, stem)


def _derived_name(value: ir.Value, suffix: str, strip: str = "") -> str:
    # "...experts.gate_proj" -> "...experts.fc1_gate_up_interleaved": the new tensor sits next to
    # the ones it replaces in a name-sorted listing of the artifact.
    base = value.name or "moe"
    if strip and base.endswith(strip):
        return base[: -len(strip)] + suffix
    return f"{base}.{suffix}"


def _drop_if_unused_initializer(graph: ir.Graph, value: ir.Value) -> None:
    # Removing the replaced stacked tensors keeps one copy of the expert weights in the artifact.
    if value.is_initializer() and not value.uses() and not value.is_graph_output() and value.name in graph.initializers:
        graph.initializers.pop(value.name)


def _drop_unused_moe_function(model: ir.Model) -> None:
    """Remove the moeforge.MoE local function (and the moeforge opset) once no node calls it."""

    def calls(nodes) -> bool:  # type: ignore[no-untyped-def]
        return any(n.domain == moe_op.DOMAIN for n in nodes)

    still_used = calls(model.graph.all_nodes())
    still_used = still_used or any(calls(f) for f in model.functions.values() if f.domain != moe_op.DOMAIN)
    if still_used:
        return
    for key in [k for k, f in model.functions.items() if f.domain == moe_op.DOMAIN]:
        del model.functions[key]
    model.opset_imports.pop(moe_op.DOMAIN, None)
