"""MoE lowering: each ``moeforge.MoERouter`` -> ``moeforge.MoEExperts`` pair -> standard ops + ``com.microsoft.MoE``.

The exporter emits, per MoE layer, the router logits (Gemm), one ``moeforge.MoERouter`` node
(ops/moe_router) and one ``moeforge.MoEExperts`` node (moeforge/model/moe_op.py) that applies the
chosen experts; both carry local functions (the experts one runs every expert on every token, O(E)).
ONNX Runtime's contrib ``MoE`` op runs only the chosen experts, but its routing is fixed (softmax
over all experts, top-k, renormalise), so the router is lowered by
``moeforge.ops.moe_router.ort_lowering`` into a ``router_probs`` input that makes the op's fixed
routing reproduce DeepSeek's weights exactly (see that module), and the experts become the op:

    router_probs, output_scale = lower_router(MoERouter node)          [T, E], [T, 1] | None
    y = com.microsoft.MoE(x, router_probs, fc1 [E, 2I, H], , fc2 [E, H, I],
                          k=K, activation_type="swiglu", swiglu_fusion=1, normalize_routing_weights=1)
    if output_scale: y = y * output_scale                               (norm_topk_prob off)

Weights: ``fc1[:, 0::2] = gate_proj``, ``fc1[:, 1::2] = up_proj`` (rows g0, u0, g1, u1, ...: the
interleaved layout the CPU kernel requires with swiglu_fusion=1) and ``fc2 = down_proj *
routed_scaling_factor`` (exact: the op is linear after the activation and has no fc2 bias). They
replace the stacked ``gate_proj`` / ``up_proj`` / ``down_proj`` initializers, which are removed when
nothing else reads them, so the artifact holds one copy of the expert weights. The router node is
removed once nothing else reads its outputs.

A MoEExperts node whose ids/weights do not come from a MoERouter node -- an expert-parallel rank's, fed by its local
routing (ids 0 .. S - 1 its experts, S another rank's with weight 0) -- becomes a com.microsoft.MoE over the rank's S
experts whose router_probs is Log of the dense [T, S] weights, times their row sum (``_lower_local``): the rank
computes only the experts routed to it, where the node's dense local function computes all S on every token. One
whose ids have no static K is left to its function.

Glossary of dimension letters:
    T  tokens (batch * sequence, flattened by the exporter before the MoE nodes)
    H  hidden size
    I  expert intermediate size (moe_intermediate_size)
    E  routed experts (n_routed_experts)
    K  experts per token (top_k = num_experts_per_tok)

Only nodes of the main graph are lowered (the exporter never puts a MoE node in a subgraph).
"""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir
from onnx_ir import convenience

from moeforge.model import moe_op
from moeforge.ops.expert_stack import ExpertStack, experts_of, map_tensor
from moeforge.ops.moe_router import schema as router_schema
from moeforge.ops.moe_router.function import check_nodes
from moeforge.ops.moe_router.ort_lowering import lower_router
from moeforge.ops.node_builder import NodeBuilder, const_array, const_tensor
from moeforge.passes.base import MS_DOMAIN, PassContext, ensure_opset, required

log = logging.getLogger(__name__)

# Input positions of the moeforge.MoEExperts node (moe_op node contract).
_X, _IDS, _WEIGHTS, _GATE, _UP, _DOWN = range(6)


class MoELowering:
    """Replace every MoERouter -> MoEExperts pair by standard-op routing + one ``com.microsoft.MoE``.

    Returns the number of MoE layers lowered. Afterwards each ``moeforge`` local function no node calls
    is removed (and the ``moeforge`` opset import with the last one), and ``com.microsoft`` is declared.
    """

    name = "moe_lowering"

    def apply(self, model: ir.Model, ctx: PassContext) -> int:
        # Lowering reads each node's attributes, its local function runs one specialised config: refuse
        # nodes that disagree with the function (the artifact would route differently before and after).
        check_nodes(model, require_function=False)
        graph = model.graph
        pairs: list[tuple[ir.Node | None, ir.Node]] = []
        for node in graph:
            if (node.domain, node.op_type) != (moe_op.DOMAIN, moe_op.OP_TYPE):
                continue
            router = _router_of(node)
            if router is None and not _lowerable_local(node):
                log.info("%s: ids/weights of no static shape; left to its local function", node.name)
                continue
            pairs.append((router, node))
        # ReduceSum with axes as an input and TopK with k as an input need opset >= 13 (exporter: 23).
        if pairs and model.opset_imports.get("", 0) < 13:
            raise ValueError("moe_lowering needs default-domain opset >= 13")
        prefixes: set[str] = set()
        for i, (router, node) in enumerate(pairs):
            # New value names are "<prefix>/<stem>": the prefix must be unique (names are SSA).
            prefix = node.name or f"moe_lowering_{i}"
            while prefix in prefixes:
                prefix = f"{prefix}_{i}"
            prefixes.add(prefix)
            if router is None:
                _lower_local(graph, node, prefix)
            else:
                _lower(graph, router, node, prefix)
        if pairs:
            ensure_opset(model, MS_DOMAIN, 1)
        _drop_unused_moe_functions(model)
        return len(pairs)


def _router_of(node: ir.Node) -> ir.Node | None:
    """The MoERouter node whose outputs 0 and 1 are this experts node's ids and weights, if any."""
    ids, weights = node.inputs[_IDS], node.inputs[_WEIGHTS]
    if ids is None or weights is None:
        return None
    router = ids.producer()
    if router is None or (router.domain, router.op_type) != (router_schema.DOMAIN, router_schema.OP_TYPE):
        return None
    if weights.producer() is not router or ids.index() != 0 or weights.index() != 1:
        return None
    return router


# --------------------------------------------------------------------------------------- lowering
def _lower(graph: ir.Graph, router: ir.Node, node: ir.Node, prefix: str) -> None:
    x, gate, up, down = (node.inputs[i] for i in (_X, _GATE, _UP, _DOWN))
    if x is None or gate is None or up is None or down is None:
        raise ValueError(f"{node.name}: moeforge.MoEExperts needs all six inputs")
    num_experts = _num_experts(node, router, gate)

    b = NodeBuilder(graph, prefix)
    f32 = ir.DataType.FLOAT
    # com.microsoft.MoE has fp32 CPU kernels only; the router runs in fp32 in the reference too.
    x_dtype = x.dtype
    xf = x if x_dtype == f32 else b.op("Cast", [x], {"to": f32}, "x_f32")

    routing = lower_router(b, router, num_experts)
    fc1, fc2 = _expert_weights(b, gate, up, down, routing.routed_scaling_factor)
    moe_out = b.op(
        "MoE", [xf, routing.router_probs, fc1, None, fc2],
        {"k": routing.top_k, "activation_type": "swiglu", "swiglu_fusion": 1, "normalize_routing_weights": 1},
        "routed", domain=MS_DOMAIN,
    )
    y = moe_out
    if routing.output_scale is not None:
        y = b.op("Mul", [moe_out, routing.output_scale], None, "routed_unnormalised")
    _replace_experts_node(graph, b, node, y)
    if not any(out.uses() or out.is_graph_output() for out in router.outputs):
        graph.remove(router, safe=True)


def _replace_experts_node(graph: ir.Graph, b: NodeBuilder, node: ir.Node, y: ir.Value) -> None:
    """Put ``b``'s nodes before the experts ``node``, cast ``y`` (float32) back to the node's output type, make it
    the node's output (same name) and drop the node and the stacked weights nothing else reads."""
    x = node.inputs[_X]
    x_dtype = x.dtype if x is not None else None
    if x_dtype != ir.DataType.FLOAT and x_dtype is not None:
        y = b.op("Cast", [y], {"to": x_dtype}, "routed_cast")
    stacked = [node.inputs[i] for i in (_GATE, _UP, _DOWN)]  # read before the node is removed (it lets go of them)
    old_out = node.outputs[0]
    y.dtype = required(old_out.dtype, f"{old_out.name}: dtype")
    y.shape = old_out.shape
    graph.insert_before(node, b.nodes)
    convenience.replace_all_uses_with(old_out, y, replace_graph_outputs=True)
    out_name = old_out.name
    old_out.name = None
    graph.remove(node, safe=True)
    y.name = out_name  # keep the value name stable for whoever reads the graph next
    for value in stacked:
        if value is not None:
            _drop_if_unused_initializer(graph, value)


def _lowerable_local(node: ir.Node) -> bool:
    """An experts node fed by ids/weights of some other producer (an expert-parallel rank's local routing) can be
    lowered when its ids' K and its stacked experts' count are static."""
    ids, gate = node.inputs[_IDS], node.inputs[_GATE]
    return (ids is not None and ids.shape is not None and len(ids.shape) == 2 and isinstance(ids.shape[1], int)
            and gate is not None and gate.shape is not None and isinstance(gate.shape[0], int))


def _lower_local(graph: ir.Graph, node: ir.Node, prefix: str) -> None:
    """An expert-parallel rank's ``MoEExperts`` (ids local to the rank, ``S`` = another rank's expert, weight 0 there;
    ``moeforge/model/moe.py`` ``hold_local_experts``) -> com.microsoft.MoE over the rank's S experts, so the rank
    computes only the experts its tokens were routed to (the local function computes all S on every token):

        dense_w [T, S] = sum_k w[:, k] * (ids[:, k] == s)          (another rank's id matches no s: adds nothing)
        router_probs   = Log(dense_w)                              (-inf where the token has no expert here)
        y = MoE(x, router_probs, fc1, , fc2, k=K, normalize_routing_weights=1) * ReduceSum(dense_w, -1)

    The kernel's softmax over a row's finite entries is dense_w / its sum; the sum puts the router's weights back
    (routed_scaling_factor is already in them). A pick at -inf has weight 0 and the kernel skips it (checked: an
    expert filled with NaN that no token chose leaves the output finite), and a token with no expert on this rank
    gets 0 (its row of the kernel output is 0, times a sum of 0)."""
    x, ids, weights, gate, up, down = (node.inputs[i] for i in (_X, _IDS, _WEIGHTS, _GATE, _UP, _DOWN))
    if x is None or ids is None or weights is None or gate is None or up is None or down is None:
        raise ValueError(f"{node.name}: moeforge.MoEExperts needs all six inputs")
    slots, top_k = required(gate.shape, f"{gate.name}: shape")[0], required(ids.shape, f"{ids.name}: shape")[1]
    if not isinstance(slots, int) or not isinstance(top_k, int):  # _lowerable_local checked both
        raise ValueError(f"{node.name}: the experts count and top-k must be static")

    b = NodeBuilder(graph, prefix)
    f32 = ir.DataType.FLOAT
    x_dtype = x.dtype
    xf = x if x_dtype == f32 else b.op("Cast", [x], {"to": f32}, "x_f32")
    ids64 = b.op("Cast", [ids], {"to": ir.DataType.INT64}, "ids_i64")
    column = b.op("Unsqueeze", [ids64, b.const_i64([2])], None, "ids_tk1")  # [T, K, 1]
    match = b.op("Equal", [column, b.initializer(np.arange(slots, dtype=np.int64), "slots")], None, "held_tks")
    onehot = b.op("Cast", [match], {"to": f32}, "held_tks_f32")  # [T, K, S]
    dense_w = b.op("Einsum", [onehot, b.as_f32(weights, "weights_f32")], {"equation": "tks,tk->ts"}, "dense_w")
    router_probs = b.op("Log", [dense_w], None, "router_probs")  # [T, S], -inf off the rank's chosen experts
    weight_sum = b.op("ReduceSum", [dense_w, b.const_i64([-1])], {"keepdims": 1}, "weight_sum")  # [T, 1]
    fc1, fc2 = _expert_weights(b, gate, up, down, 1.0)
    moe_out = b.op(
        "MoE", [xf, router_probs, fc1, None, fc2],
        {"k": min(top_k, slots), "activation_type": "swiglu", "swiglu_fusion": 1, "normalize_routing_weights": 1},
        "routed", domain=MS_DOMAIN,
    )
    y = b.op("Mul", [moe_out, weight_sum], None, "routed_weighted")
    _replace_experts_node(graph, b, node, y)


def _num_experts(node: ir.Node, router: ir.Node, gate: ir.Value) -> int:
    logits = router.inputs[0]
    if logits is not None and logits.shape is not None and len(logits.shape) == 2 and isinstance(logits.shape[1], int):
        return logits.shape[1]
    if gate.shape is not None and isinstance(gate.shape[0], int):
        return gate.shape[0]
    array = const_array(gate)
    if array is not None:
        return int(array.shape[0])
    raise ValueError(f"{node.name}: the number of experts is not static")


def _expert_weights(b: NodeBuilder, gate: ir.Value, up: ir.Value, down: ir.Value,
                    rsf: float) -> tuple[ir.Value, ir.Value]:
    """fc1 [E, 2I, H] interleaved gate/up rows, fc2 [E, H, I] = down * routed_scaling_factor."""
    g, u, d = const_tensor(gate), const_tensor(up), const_tensor(down)
    gate_of, up_of = experts_of(g), experts_of(u)
    # Computed when the artifact is written (lazy), from the stacked tensors, which are read only then; expert by
    # expert where the sources are (a streamed compile: ops/expert_stack.py).
    if g is not None and u is not None and gate_of is not None and up_of is not None:
        e, i, h = g.shape.numpy()
        fc1 = b.initializer_tensor(ExpertStack(lambda k: _interleave(gate_of(k)[None], up_of(k)[None])[0],
                                               ir.DataType.FLOAT, (e, 2 * i, h)),
                                   _derived_name(gate, "fc1_gate_up_interleaved", strip="gate_proj"))
    elif g is not None and u is not None and g.dtype == ir.DataType.FLOAT and u.dtype == ir.DataType.FLOAT:
        e, i, h = g.shape.numpy()
        fc1 = b.lazy_initializer(lambda: _interleave(g.numpy(), u.numpy()), ir.DataType.FLOAT, (e, 2 * i, h),
                                 _derived_name(gate, "fc1_gate_up_interleaved", strip="gate_proj"))
    elif g is not None and u is not None:
        fc1 = b.initializer(_interleave(g.numpy(), u.numpy()),
                            _derived_name(gate, "fc1_gate_up_interleaved", strip="gate_proj"))
    else:
        # Weights computed in the graph (e.g. dequantised): stack [E, I, 2, H] then merge I and 2.
        g3 = b.op("Unsqueeze", [b.as_f32(gate, "gate_f32"), b.const_i64([2])], None, "gate_e_i_1_h")
        u3 = b.op("Unsqueeze", [b.as_f32(up, "up_f32"), b.const_i64([2])], None, "up_e_i_1_h")
        stacked = b.op("Concat", [g3, u3], {"axis": 2}, "gate_up_e_i_2_h")
        shape = b.op("Shape", [stacked], None, "gate_up_shape")
        e_dim = b.op("Slice", [shape, b.const_i64([0]), b.const_i64([1])], None, "gate_up_e")
        h_dim = b.op("Slice", [shape, b.const_i64([3]), b.const_i64([4])], None, "gate_up_h")
        target = b.op("Concat", [e_dim, b.const_i64([-1]), h_dim], {"axis": 0}, "fc1_shape")
        fc1 = b.op("Reshape", [stacked, target], None, "fc1_gate_up_interleaved")
    if d is not None:
        fc2 = b.initializer_tensor(map_tensor(d, lambda w: (w.astype(np.float32) * np.float32(rsf)).astype(np.float32),
                                              ir.DataType.FLOAT, d.shape.numpy()),
                                   _derived_name(down, "fc2_down_scaled", strip="down_proj"))
    elif rsf == 1.0:
        fc2 = b.as_f32(down, "down_f32")
    else:
        fc2 = b.op("Mul", [b.as_f32(down, "down_f32"), b.const_f32(rsf)], None, "fc2_down_scaled")
    return fc1, fc2


# ------------------------------------------------------------------------------------ utilities
def _interleave(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """fc1 [E, 2I, H]: rows g0, u0, g1, u1, ... (the layout swiglu_fusion=1 reads), float32."""
    fc1 = np.empty((gate.shape[0], 2 * gate.shape[1], gate.shape[2]), np.float32)
    fc1[:, 0::2] = gate.astype(np.float32, copy=False)
    fc1[:, 1::2] = up
    return fc1


def _derived_name(value: ir.Value, suffix: str, strip: str = "") -> str:
    # "...experts.gate_proj" -> "...experts.fc1_gate_up_interleaved": the new tensor sits next to
    # the ones it replaces in a name-sorted listing of the artifact.
    base = value.name or "moe"
    if strip and base.endswith(strip):
        return base[: -len(strip)] + suffix
    return f"{base}.{suffix}"


def _drop_if_unused_initializer(graph: ir.Graph, value: ir.Value) -> None:
    # Removing the replaced stacked tensors keeps one copy of the expert weights in the artifact.
    if (value.is_initializer() and not value.uses() and not value.is_graph_output()
            and value.name is not None and value.name in graph.initializers):
        graph.initializers.pop(value.name)


def _drop_unused_moe_functions(model: ir.Model) -> None:
    """Remove each moeforge local function no node calls; the moeforge opset import goes with the last one."""
    functions = model.functions

    def called() -> set[tuple[str, str, str]]:
        nodes = [*model.graph.all_nodes(), *(n for f in functions.values() for n in f)]
        return {(n.domain, n.op_type, n.overload) for n in nodes if n.domain == moe_op.DOMAIN}

    used = called()
    for key in [k for k, f in functions.items() if f.domain == moe_op.DOMAIN and k not in used]:
        del functions[key]
    if not any(n.domain == moe_op.DOMAIN for n in model.graph.all_nodes()) and not any(
            f.domain == moe_op.DOMAIN for f in functions.values()):
        model.opset_imports.pop(moe_op.DOMAIN, None)
