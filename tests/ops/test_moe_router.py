"""moeforge.MoERouter: torch reference vs its ONNX function body on ORT vs its ORT lowering (com.microsoft.MoE).

Inputs are built so the answer is unique up to exact ties: logits and biases on coarse grids (so
equal inputs give bit-identical scores in every backend and the tie rule decides), and examples with
near-ties that are not exact (where fp32 rounding could differ between backends) are rejected.
Dimension letters: T tokens, E experts, G groups, K = top_k, H hidden, I expert intermediate.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from hypothesis import assume, event, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from moeforge.core.config import MoEConfig
from moeforge.model import moe_op
from moeforge.model.moe import apply_experts
from moeforge.model.routing import route_tokens, router_attributes
from moeforge.ops.moe_router import schema
from moeforge.ops.moe_router.function import attach_function, check_nodes, router_function_proto
from moeforge.ops.moe_router.reference import route
from moeforge.ops.moe_router.schema import RouterAttributes, RouterOpError
from moeforge.passes.base import MS_DOMAIN, PassContext
from moeforge.passes.moe_lowering import MoELowering

OPSET = 23


# --------------------------------------------------------------------------------------- backends
def _router_node(attrs: RouterAttributes, has_bias: bool) -> onnx.NodeProto:
    return helper.make_node(schema.OP_TYPE, ["logits", "bias" if has_bias else ""], ["ids", "weights"],
                            domain=schema.DOMAIN, name="router", **attrs.node_attributes())


def _model(nodes, inputs, outputs, attrs: RouterAttributes, has_bias: bool, inits=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "router", inputs, outputs, list(inits))
    proto = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(schema.DOMAIN, 1)],
        functions=[router_function_proto(attrs, has_bias, OPSET), moe_op.experts_local_function(OPSET)],
        ir_version=10)
    onnx.checker.check_model(proto, full_check=True)  # the registered schema types the router node
    return proto


def _session(proto: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _io(attrs: RouterAttributes, experts: int, has_bias: bool) -> list[onnx.ValueInfoProto]:
    inputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["T", experts])]
    return inputs + ([helper.make_tensor_value_info("bias", TensorProto.FLOAT, [experts])] if has_bias else [])


def run_function(attrs: RouterAttributes, logits: np.ndarray, bias: np.ndarray | None) -> tuple[np.ndarray, ...]:
    """The op's local function on ONNX Runtime (no custom-op library: ORT inlines it)."""
    k = attrs.top_k
    outputs = [helper.make_tensor_value_info("ids", TensorProto.INT32, ["T", k]),
               helper.make_tensor_value_info("weights", TensorProto.FLOAT, ["T", k])]
    proto = _model([_router_node(attrs, bias is not None)], _io(attrs, logits.shape[1], bias is not None), outputs,
                   attrs, bias is not None)
    feeds = {"logits": logits, **({"bias": bias} if bias is not None else {})}
    ids, weights = _session(proto).run(None, feeds)
    return ids, weights


def run_lowering(attrs: RouterAttributes, logits: np.ndarray, bias: np.ndarray | None, x: np.ndarray,
                 experts: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Router + experts lowered by the real pass; returns (MoE output [T, H], implied weights [T, E]).

    The implied weights are what com.microsoft.MoE mixes with: softmax(router_probs) (its renormalised
    routing) times routed_scaling_factor (folded into fc2) times the pass's output scale.
    """
    num_experts, hidden = logits.shape[1], x.shape[1]
    inputs = [*_io(attrs, num_experts, bias is not None), helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                                      ["T", hidden])]
    experts_node = helper.make_node(moe_op.OP_TYPE, ["x", "ids", "weights", "gate_proj", "up_proj", "down_proj"],
                                    ["y"], domain=moe_op.DOMAIN, name="moe")
    proto = _model([_router_node(attrs, bias is not None), experts_node], inputs,
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", hidden])], attrs, bias is not None,
                   [numpy_helper.from_array(a, k) for k, a in experts.items()])
    model = ir.serde.deserialize_model(proto)
    assert MoELowering().apply(model, PassContext(config=None, max_seq_len=1)) == 1
    assert {(n.domain, n.op_type) for n in model.graph} >= {(MS_DOMAIN, "MoE")}
    assert not [n for n in model.graph if n.domain == schema.DOMAIN] and not model.functions
    values = {v.name: v for n in model.graph for v in n.outputs}
    extra = [values["moe/router_probs"] if "moe/router_probs" in values else values["moe/log_scores"]]
    if "moe/chosen_score_sum" in values:
        extra.append(values["moe/chosen_score_sum"])
    model.graph.outputs.extend(extra)
    feeds = {"logits": logits, "x": x, **({"bias": bias} if bias is not None else {})}
    y, router_probs, *scale = _session(ir.serde.serialize_model(model)).run(None, feeds)
    implied = torch.from_numpy(router_probs).softmax(-1).numpy() * np.float32(attrs.routed_scaling_factor)
    if scale:
        implied = implied * scale[0]
    return y, implied


def dense(ids: np.ndarray, weights: np.ndarray, experts: int) -> np.ndarray:
    out = np.zeros((ids.shape[0], experts), np.float32)
    np.put_along_axis(out, ids.astype(np.int64), weights, axis=1)
    return out


# ------------------------------------------------------------------ independent statement (numpy)
def numpy_route(attrs: RouterAttributes, logits: np.ndarray, bias: np.ndarray | None) -> list[list[int]]:
    """Token by token, float64, stable argsort (the tie rule): the expected ids, in order."""
    out = []
    for row in logits.astype(np.float64):
        scores = np.exp(row - row.max()) / np.exp(row - row.max()).sum() if attrs.scoring == "softmax" \
            else 1 / (1 + np.exp(-row))
        choice = scores + (bias if bias is not None else 0.0)
        if attrs.n_group > 1:
            groups = choice.reshape(attrs.n_group, -1)
            best = -np.sort(-groups, axis=1)
            gscore = best[:, 0] + best[:, 1] if attrs.group_scoring == "top2_sum" else best[:, 0]
            kept = np.argsort(-gscore, kind="stable")[: attrs.topk_group]
            mask = np.zeros(groups.shape, bool)
            mask[kept] = True
            choice = np.where(mask.reshape(-1), choice, -np.inf)
        out.append(np.argsort(-choice, kind="stable")[: attrs.top_k].tolist())
    return out


def _well_separated(attrs: RouterAttributes, logits: np.ndarray, bias: np.ndarray | None) -> bool:
    """False when two choice (or group) scores are within 1e-5 without being exactly the same inputs.

    Exact ties come from identical inputs (bit-identical in every backend); a near-tie from different
    inputs could round either way in fp32, so such examples prove nothing about the tie rule."""
    b = bias if bias is not None else np.zeros(logits.shape[1], np.float32)
    for row in logits.astype(np.float64):
        scores = np.exp(row - row.max()) / np.exp(row - row.max()).sum() if attrs.scoring == "softmax" \
            else 1 / (1 + np.exp(-row))
        keys = list(zip(row.tolist(), b.tolist(), strict=True))
        choice = scores + b
        items = [(choice[i], (keys[i],)) for i in range(len(keys))]
        if attrs.n_group > 1:
            per = len(keys) // attrs.n_group
            for g in range(attrs.n_group):
                idx = sorted(range(g * per, (g + 1) * per), key=lambda i: -choice[i])[: 2 if attrs.group_scoring
                                                                                   == "top2_sum" else 1]
                items.append((sum(choice[i] for i in idx), tuple(sorted(keys[i] for i in idx))))
        for i, (v1, k1) in enumerate(items):
            for v2, k2 in items[i + 1:]:
                if len(k1) == len(k2) and sorted(k1) != sorted(k2) and abs(v1 - v2) < 1e-5:
                    return False
    return True


# ------------------------------------------------------------------------------------- strategies
@st.composite
def router_cases(draw):
    scoring = draw(st.sampled_from(["softmax", "sigmoid"]))
    n_group = draw(st.sampled_from([1, 1, 2, 4]))
    group_scoring = draw(st.sampled_from(["max", "top2_sum"]))
    per_group = draw(st.integers(2 if (group_scoring == "top2_sum" and n_group > 1) else 1, 4))
    experts = n_group * per_group
    topk_group = draw(st.integers(1, n_group))
    cap = topk_group * per_group  # the most experts the kept groups hold (= E when every group is kept)
    top_k = cap if draw(st.integers(0, 3)) == 0 else draw(st.integers(1, cap))
    attrs = RouterAttributes(scoring, top_k, n_group, topk_group, group_scoring, draw(st.booleans()),
                             draw(st.sampled_from([1.0, 2.5])))
    tokens = draw(st.sampled_from([1, 1, 2, 5]))
    grid = st.integers(-6, 6).map(lambda v: v / 2)  # logits on a 0.5 grid: ties are frequent and exact
    kind = draw(st.sampled_from(["grid", "all_tied", "tied_groups"]))
    if kind == "all_tied":
        logits = np.full((tokens, experts), draw(grid), np.float32)
    else:
        logits = np.array(draw(st.lists(st.lists(grid, min_size=experts, max_size=experts), min_size=tokens,
                                        max_size=tokens)), np.float32)
        if kind == "tied_groups" and n_group > 1:
            # Every group a permutation of the first: all group scores tie exactly.
            perm = draw(st.permutations(range(per_group)))
            logits = np.concatenate([logits[:, :per_group][:, perm]] * n_group, axis=1)
    bias = None
    if draw(st.booleans()):
        bias = np.array(draw(st.lists(st.integers(-4, 4).map(lambda v: v / 8), min_size=experts, max_size=experts)),
                        np.float32)
        if kind != "grid":
            bias = np.full(experts, bias[0], np.float32)  # keep the constructed ties
    return attrs, logits, bias


def _experts(num_experts: int, hidden: int, inter: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "gate_proj": (rng.standard_normal((num_experts, inter, hidden)) / np.sqrt(hidden)).astype(np.float32),
        "up_proj": (rng.standard_normal((num_experts, inter, hidden)) / np.sqrt(hidden)).astype(np.float32),
        "down_proj": (rng.standard_normal((num_experts, hidden, inter)) / np.sqrt(inter)).astype(np.float32),
    }


# ------------------------------------------------------------------------------------------ tests
@settings(max_examples=60, deadline=None, derandomize=True)
@given(case=router_cases())
def test_reference_function_and_lowering_agree(case) -> None:
    attrs, logits, bias = case
    assume(_well_separated(attrs, logits, bias))
    for label, hit in (("T=1", logits.shape[0] == 1), ("top_k=E", attrs.top_k == logits.shape[1]),
                       ("n_group=1", attrs.n_group == 1),
                       ("topk_group=n_group>1", attrs.topk_group == attrs.n_group > 1),
                       ("bias", bias is not None), ("tied rows", bool((logits == logits[:, :1]).all()))):
        event(f"{label}: {hit}")
    event(f"{attrs.scoring} {attrs.group_scoring} norm={attrs.norm_topk_prob}")
    ref_ids, ref_w = route(torch.from_numpy(logits), None if bias is None else torch.from_numpy(bias), attrs)
    ref_ids, ref_w = ref_ids.numpy(), ref_w.numpy()
    assert ref_ids.dtype == np.int32 and ref_ids.shape == ref_w.shape == (logits.shape[0], attrs.top_k)
    assert ref_ids.tolist() == numpy_route(attrs, logits, bias)  # ids and their order, tie rule included

    fn_ids, fn_w = run_function(attrs, logits, bias)
    np.testing.assert_array_equal(fn_ids, ref_ids)
    np.testing.assert_allclose(fn_w, ref_w, atol=1e-5, rtol=0)

    num_experts = logits.shape[1]
    x = np.random.default_rng(num_experts).standard_normal((logits.shape[0], 8)).astype(np.float32)
    experts = _experts(num_experts, hidden=8, inter=4, seed=attrs.top_k)
    y, implied = run_lowering(attrs, logits, bias, x, experts)
    ref_dense = dense(ref_ids, ref_w, num_experts)
    np.testing.assert_array_equal(implied > 0, ref_dense > 0)  # the same experts chosen
    np.testing.assert_allclose(implied, ref_dense, atol=1e-5, rtol=0)
    t = {k: torch.from_numpy(a) for k, a in experts.items()}
    ref_y = apply_experts(torch.from_numpy(x), torch.from_numpy(ref_ids), torch.from_numpy(ref_w), t["gate_proj"],
                          t["up_proj"], t["down_proj"]).numpy()
    np.testing.assert_allclose(y, ref_y, atol=1e-5, rtol=0)


@pytest.mark.parametrize("attrs", [
    RouterAttributes("softmax", 3),  # V2 greedy, one group
    RouterAttributes("sigmoid", 4, n_group=4, topk_group=2, group_scoring="top2_sum", norm_topk_prob=True),
    RouterAttributes("softmax", 2, n_group=4, topk_group=3, group_scoring="max"),
], ids=["greedy", "groups_top2_sum", "groups_max"])
def test_exact_ties_go_to_the_lower_expert_id(attrs: RouterAttributes) -> None:
    """All scores equal: groups 0.. are kept and experts 0.. chosen, in that order, by every backend."""
    logits = np.zeros((3, 8), np.float32)
    bias = np.zeros(8, np.float32) if attrs.scoring == "sigmoid" else None
    expected = [list(range(attrs.top_k))] * 3
    ref_ids, _ = route(torch.from_numpy(logits), None if bias is None else torch.from_numpy(bias), attrs)
    assert ref_ids.tolist() == expected
    assert run_function(attrs, logits, bias)[0].tolist() == expected
    _, implied = run_lowering(attrs, logits, bias, np.ones((3, 4), np.float32), _experts(8, 4, 2, 0))
    assert [np.flatnonzero(row).tolist() for row in implied] == expected


def test_export_routing_is_the_reference() -> None:
    """route_tokens (what the torch model runs) = the op reference under router_attributes, for V2 and V3."""
    v3 = MoEConfig(n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4, moe_intermediate_size=8,
                   scoring_func="sigmoid", topk_method="noaux_tc", n_group=4, topk_group=2, norm_topk_prob=True,
                   routed_scaling_factor=2.5)
    v2 = MoEConfig(n_routed_experts=16, n_shared_experts=2, num_experts_per_tok=3, moe_intermediate_size=8,
                   scoring_func="softmax", topk_method="greedy", n_group=4, topk_group=2)
    assert router_attributes(v3) == RouterAttributes("sigmoid", 4, 4, 2, "top2_sum", True, 2.5)
    assert router_attributes(v2) == RouterAttributes("softmax", 3, 1, 1, "max", False, 1.0)  # greedy: one group
    gen = torch.Generator().manual_seed(0)
    logits, bias = (torch.randn(9, 16, generator=gen) * 2).round() / 2, torch.rand(16, generator=gen) * 0.1
    for moe, b in ((v3, bias), (v2, None)):
        ids, w = route_tokens(logits, b, moe)
        attrs = router_attributes(moe)
        assert ids.tolist() == numpy_route(attrs, logits.numpy(), None if b is None else b.numpy())
        ref_ids, ref_w = route(logits, b, attrs)
        assert torch.equal(ids, ref_ids.long()) and torch.equal(w, ref_w)


# ------------------------------------------------------------------------------------ bad input
BAD = {
    "top_k_above_E": (RouterAttributes("softmax", 9), 8, "exceeds the 8 experts"),
    "n_group_not_dividing_E": (RouterAttributes("softmax", 2, n_group=3, topk_group=1), 8, "n_group must divide"),
    "topk_group_above_n_group": (RouterAttributes("softmax", 2, n_group=2, topk_group=3), 8, "topk_group 3"),
    "kept_groups_too_small": (RouterAttributes("softmax", 3, n_group=4, topk_group=1), 8, "raise topk_group"),
    "top2_sum_single_expert_groups": (RouterAttributes("sigmoid", 2, 8, 4, "top2_sum"), 8, "use 'max'"),
    "unknown_scoring": (RouterAttributes("relu", 2), 8, "scoring 'relu'"),
}


@pytest.mark.parametrize("attrs,experts,message", BAD.values(), ids=BAD.keys())
def test_bad_attributes_are_refused_clearly(attrs: RouterAttributes, experts: int, message: str) -> None:
    with pytest.raises(RouterOpError, match=message):
        attrs.validate(experts)
    with pytest.raises(RouterOpError, match=message):  # the torch reference
        route(torch.zeros(2, experts), None, attrs)
    # onnx shape inference / checker, through the registered schema
    node = helper.make_node(schema.OP_TYPE, ["logits"], ["ids", "weights"], domain=schema.DOMAIN,
                            **attrs.node_attributes())
    graph = helper.make_graph(
        [node], "bad", [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["T", experts])],
        [helper.make_tensor_value_info("ids", TensorProto.INT32, ["T", attrs.top_k]),
         helper.make_tensor_value_info("weights", TensorProto.FLOAT, ["T", attrs.top_k])])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                    helper.make_opsetid(schema.DOMAIN, 1)])
    with pytest.raises(RouterOpError, match=message):
        onnx.shape_inference.infer_shapes(proto, strict_mode=True)


def test_schema_infers_output_types_and_shapes() -> None:
    attrs = RouterAttributes("sigmoid", 2, 4, 2, "top2_sum", True, 2.5)
    node = _router_node(attrs, has_bias=True)
    graph = helper.make_graph([node], "g", _io(attrs, 8, True), [helper.make_tensor_value_info("ids", 0, None),
                                                                 helper.make_tensor_value_info("weights", 0, None)])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                    helper.make_opsetid(schema.DOMAIN, 1)])
    graph_out = onnx.shape_inference.infer_shapes(proto, strict_mode=True).graph.output
    inferred = {v.name: v.type.tensor_type for v in graph_out}
    assert inferred["ids"].elem_type == TensorProto.INT32 and inferred["weights"].elem_type == TensorProto.FLOAT
    assert [d.dim_param or d.dim_value for d in inferred["ids"].shape.dim] == ["T", 2]


def test_one_function_per_model_routing_config() -> None:
    model = ir.Model(ir.Graph([], [], nodes=[], opset_imports={"": OPSET}), ir_version=10)
    attrs = RouterAttributes("sigmoid", 2, 4, 2, "top2_sum", True, 2.5)
    attach_function(model, attrs, has_bias=True)
    attach_function(model, attrs, has_bias=True)  # idempotent
    with pytest.raises(RouterOpError, match="another routing config"):
        attach_function(model, RouterAttributes("softmax", 2), has_bias=False)
    check_nodes(model)


def test_lowering_refuses_a_router_node_that_differs_from_its_function() -> None:
    """The function body is specialised to one config and ignores node attributes: a node declaring another
    routing would run differently before (function) and after (lowering from its attributes) the pass."""
    function_attrs = RouterAttributes("sigmoid", 2, 4, 2, "top2_sum", True, 2.5)
    node_attrs = RouterAttributes("sigmoid", 2, 4, 1, "top2_sum", True, 2.5)  # topk_group differs
    experts = _experts(8, hidden=8, inter=4, seed=0)
    inputs = [*_io(node_attrs, 8, True), helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", 8])]
    experts_node = helper.make_node(moe_op.OP_TYPE, ["x", "ids", "weights", "gate_proj", "up_proj", "down_proj"],
                                    ["y"], domain=moe_op.DOMAIN, name="moe")
    proto = _model([_router_node(node_attrs, True), experts_node], inputs,
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", 8])], function_attrs, True,
                   [numpy_helper.from_array(a, k) for k, a in experts.items()])
    with pytest.raises(RouterOpError, match=r"router: its attributes .* differ from the MoERouter function"):
        MoELowering().apply(ir.serde.deserialize_model(proto), PassContext(config=None, max_seq_len=1))
    with pytest.raises(RouterOpError, match="re-export"):
        check_nodes(ir.serde.deserialize_model(proto))


# ------------------------------------------------------------------------------- exported model
@pytest.mark.heavy  # one tiny-deepseek-v3 export (~20 s)
def test_exported_deepseek_v3_carries_router_nodes_and_runs_without_custom_ops(tmp_path) -> None:
    """The stateless export: one MoERouter (+ function) per MoE layer; a fresh ORT process runs it = torch."""
    from moeforge.compile.onnx_export import export_stateless
    from moeforge.model.loader import load_model

    loaded = load_model("tiny-deepseek-v3")
    config = loaded.model.config
    model = export_stateless(loaded.model)
    routers = [n for n in model.graph if (n.domain, n.op_type) == (schema.DOMAIN, schema.OP_TYPE)]
    assert len(routers) == config.num_hidden_layers - config.moe.first_k_dense_replace
    assert (schema.DOMAIN, schema.OP_TYPE, "") in model.functions
    check_nodes(model)
    for node in routers:
        attrs = {k: a.value for k, a in node.attributes.items()}
        assert attrs["plugin_version"] == "1" and attrs["plugin_namespace"] == "moeforge"
        assert node.inputs[1] is not None  # V3: the correction bias
        assert [u.node.op_type for out in node.outputs for u in out.uses()] == [moe_op.OP_TYPE] * 2

    path = tmp_path / "model.onnx"
    ir.save(model, path)
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (2, 5)).astype(np.int64)
    np.save(tmp_path / "ids.npy", ids)
    code = ("import sys, numpy as np, onnxruntime as ort; s = ort.InferenceSession(sys.argv[1], "
            "providers=['CPUExecutionProvider']); ids = np.load(sys.argv[2]); "
            "pos = np.tile(np.arange(ids.shape[1]), (ids.shape[0], 1)); "
            "np.save(sys.argv[3], s.run(['logits'], {'input_ids': ids, 'position_ids': pos})[0])")
    proc = subprocess.run([sys.executable, "-c", code, str(path), str(tmp_path / "ids.npy"), str(tmp_path / "out.npy")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    with torch.no_grad():
        ref = loaded.model(torch.from_numpy(ids), torch.arange(5).expand(2, 5)).logits.numpy()
    np.testing.assert_allclose(np.load(tmp_path / "out.npy"), ref, atol=1e-4, rtol=0)
