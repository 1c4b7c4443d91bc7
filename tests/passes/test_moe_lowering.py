"""MoELowering: moeforge.MoERouter -> moeforge.MoEExperts -> standard-op DeepSeek routing + com.microsoft.MoE.

Model level: both DeepSeek presets, ORT before (local functions) vs after, and vs torch.
Unit level: router + experts graphs per routing variant vs eager torch (router reference + experts).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from moeforge.core.config import MoEConfig
from moeforge.model import moe_op
from moeforge.model.moe import apply_experts
from moeforge.model.presets import get_preset
from moeforge.model.routing import route_tokens
from moeforge.ops.moe_router import schema as router_schema
from moeforge.ops.moe_router.function import router_function_proto
from moeforge.ops.moe_router.reference import route
from moeforge.ops.moe_router.schema import RouterAttributes
from moeforge.passes.base import MS_DOMAIN, PassContext
from moeforge.passes.moe_lowering import MoELowering

# Helpers of the shared conftest (pytest's importlib mode registers it under its path-derived name).
from tests.passes.conftest import random_feeds, run_ort

DEEPSEEK = ("tiny-deepseek-v3", "tiny-deepseek-v2")
OPSET = 23


def _ctx(config=None) -> PassContext:
    return PassContext(config=config or get_preset("tiny-deepseek-v3").config, max_seq_len=64)


def _moe_nodes(model: ir.Model, domain: str) -> list[ir.Node]:
    return [n for n in model.graph.all_nodes() if n.domain == domain and n.op_type == "MoE"]


# ------------------------------------------------------------------------------------ model level
@pytest.mark.parametrize("name", DEEPSEEK)
def test_lowers_every_moe_layer_and_keeps_logits(fresh_model, name: str) -> None:
    loaded, model = fresh_model(name)
    config = loaded.model.config
    feeds = random_feeds(config.vocab_size, batch=2, seq=7)
    before = run_ort(model, feeds)[0]

    ctx = _ctx(config)
    count = MoELowering().apply(model, ctx)

    n_moe = config.num_hidden_layers - config.moe.first_k_dense_replace
    assert count == n_moe
    assert not [n for n in model.graph.all_nodes() if n.domain == moe_op.DOMAIN]
    assert not [f for f in model.functions.values() if f.domain == moe_op.DOMAIN]
    assert moe_op.DOMAIN not in model.opset_imports and model.opset_imports[MS_DOMAIN] == 1
    ms_moe = _moe_nodes(model, MS_DOMAIN)
    assert len(ms_moe) == n_moe
    for node in ms_moe:
        attrs = {k: a.value for k, a in node.attributes.items()}
        assert attrs == {"k": config.moe.num_experts_per_tok, "activation_type": "swiglu", "swiglu_fusion": 1,
                         "normalize_routing_weights": 1}

    # One copy of the expert weights: the stacked tensors are gone, fc1/fc2 hold E*(2IH + HI) floats.
    names = list(model.graph.initializers)
    assert not [k for k in names if k.endswith(("experts.gate_proj", "experts.up_proj", "experts.down_proj"))]
    assert not [k for k in names if k.endswith("weight_t")]  # the router keeps its own Gemm weight: no copy
    e, i, h = config.moe.n_routed_experts, config.moe.moe_intermediate_size, config.hidden_size
    expert_floats = sum(v.const_value.size for k, v in model.graph.initializers.items() if ".experts." in k)
    assert expert_floats == n_moe * e * 3 * i * h

    after = run_ort(model, feeds)[0]
    np.testing.assert_allclose(after, before, atol=1e-5, rtol=0)
    with torch.no_grad():
        ref = loaded.model(torch.from_numpy(feeds["input_ids"]), torch.from_numpy(feeds["position_ids"])).logits
    np.testing.assert_allclose(after, ref.numpy(), atol=1e-4, rtol=0)

    assert MoELowering().apply(model, _ctx(config)) == 0  # idempotent: nothing left to lower


def test_no_moe_is_a_no_op(fresh_model) -> None:
    loaded, model = fresh_model("tiny-llama")
    n_nodes = len(list(model.graph))
    assert MoELowering().apply(model, _ctx(loaded.model.config)) == 0
    assert len(list(model.graph)) == n_nodes and MS_DOMAIN not in model.opset_imports


# ------------------------------------------------------------------------------------- unit level
@dataclasses.dataclass(frozen=True)
class Variant:
    scoring: str
    top_k: int
    n_group: int = 1
    topk_group: int = 1
    group_scoring: str = "max"
    norm_topk_prob: int = 1
    routed_scaling_factor: float = 1.0
    experts: int = 8
    with_bias: bool = False  # a correction_bias input (it steers the choice whatever the grouping)

    @property
    def router(self) -> RouterAttributes:
        return RouterAttributes(self.scoring, self.top_k, self.n_group, self.topk_group, self.group_scoring,
                                bool(self.norm_topk_prob), self.routed_scaling_factor)


def _weights(v: Variant, hidden: int, inter: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    e = v.experts
    return {
        "router_weight_t": (rng.standard_normal((hidden, e)) / np.sqrt(hidden) * 2).astype(np.float32),  # [H, E]
        "correction_bias": (rng.standard_normal(e) * 0.1).astype(np.float32),
        "gate_proj": (rng.standard_normal((e, inter, hidden)) / np.sqrt(hidden)).astype(np.float32),
        "up_proj": (rng.standard_normal((e, inter, hidden)) / np.sqrt(hidden)).astype(np.float32),
        "down_proj": (rng.standard_normal((e, hidden, inter)) / np.sqrt(inter)).astype(np.float32),
    }


def _single_node_model(v: Variant, weights: dict[str, np.ndarray], as_inputs: bool = False) -> ir.Model:
    """x [T, H] -> MatMul -> moeforge.MoERouter -> moeforge.MoEExperts -> y, with both local functions.

    Weights are initializers (or graph inputs: weights computed in the graph take the op path)."""
    hidden = weights["router_weight_t"].shape[0]
    names = ["router_weight_t", *(["correction_bias"] if v.with_bias else []), "gate_proj", "up_proj", "down_proj"]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", hidden])]
    if as_inputs:
        inputs += [helper.make_tensor_value_info(k, TensorProto.FLOAT, weights[k].shape) for k in names]
    nodes = [
        helper.make_node("MatMul", ["x", "router_weight_t"], ["logits"], name="router_logits"),
        helper.make_node(router_schema.OP_TYPE, ["logits", "correction_bias" if v.with_bias else ""],
                         ["ids", "weights"], domain=router_schema.DOMAIN, name="router", **v.router.node_attributes()),
        helper.make_node(moe_op.OP_TYPE, ["x", "ids", "weights", "gate_proj", "up_proj", "down_proj"], ["y"],
                         domain=moe_op.DOMAIN, name="moe"),
    ]
    graph = helper.make_graph(
        nodes, "moe", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", hidden])],
        [] if as_inputs else [numpy_helper.from_array(weights[k], k) for k in names],
    )
    proto = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(moe_op.DOMAIN, 1)],
        functions=[router_function_proto(v.router, v.with_bias, OPSET), moe_op.experts_local_function(OPSET)],
        ir_version=10,
    )
    onnx.checker.check_model(proto)
    return ir.serde.deserialize_model(proto)


def _eager(v: Variant, x: np.ndarray, w: dict[str, np.ndarray]) -> np.ndarray:
    """Torch: the router reference, then only the chosen experts."""
    t = {k: torch.from_numpy(a) for k, a in w.items()}
    xt = torch.from_numpy(x)
    with torch.no_grad():
        ids, weights = route(xt @ t["router_weight_t"], t["correction_bias"] if v.with_bias else None, v.router)
        y = apply_experts(xt, ids, weights, t["gate_proj"], t["up_proj"], t["down_proj"])
    return y.numpy()


def _lowered_output(v: Variant, x: np.ndarray, w: dict[str, np.ndarray], as_inputs: bool = False) -> np.ndarray:
    model = _single_node_model(v, w, as_inputs)
    np.testing.assert_allclose(run_ort(model, {"x": x, **(w if as_inputs else {})})[0], _eager(v, x, w), atol=1e-5,
                               rtol=0)  # the local functions, before lowering
    assert MoELowering().apply(model, _ctx()) == 1
    assert not model.functions and len(_moe_nodes(model, MS_DOMAIN)) == 1
    assert not [n for n in model.graph if n.domain == moe_op.DOMAIN]  # router and experts both lowered
    feeds = {"x": x, **(w if as_inputs else {})}
    if as_inputs and not v.with_bias:
        feeds.pop("correction_bias")
    return run_ort(model, feeds)[0]


VARIANTS = {
    "v3_sigmoid_noaux_tc_groups": Variant("sigmoid", 2, 4, 2, "top2_sum", 1, 2.5, with_bias=True),
    "v3_sigmoid_noaux_tc_no_norm": Variant("sigmoid", 3, 4, 2, "top2_sum", 0, 2.5, with_bias=True),
    "v3_sigmoid_n_group_1": Variant("sigmoid", 2, 1, 1, "top2_sum", 1, 2.5),
    "v2_softmax_greedy_no_norm": Variant("softmax", 3, 1, 1, "max", 0, 1.0),
    "v2_softmax_greedy_norm": Variant("softmax", 2, 1, 1, "max", 1, 1.5),
    "v2_softmax_group_limited": Variant("softmax", 3, 4, 2, "max", 0, 1.0),
    "v2_softmax_group_limited_norm": Variant("softmax", 3, 4, 1, "max", 1, 2.0, experts=16),
    "top_k_equals_e_softmax": Variant("softmax", 8, 1, 1, "max", 0, 1.0),
    "top_k_equals_e_sigmoid_groups": Variant("sigmoid", 8, 4, 4, "top2_sum", 1, 2.5, with_bias=True),
}


@pytest.mark.parametrize("variant", VARIANTS.values(), ids=VARIANTS.keys())
def test_single_node_matches_eager_op(variant: Variant) -> None:
    weights = _weights(variant, hidden=32, inter=16, seed=1)
    x = np.random.default_rng(2).standard_normal((37, 32)).astype(np.float32)
    ref = _eager(variant, x, weights)
    np.testing.assert_allclose(_lowered_output(variant, x, weights), ref, atol=1e-5, rtol=0)


def test_weights_computed_in_graph() -> None:
    """Non-constant weights (graph inputs here, dequantised tensors in practice) take the op path."""
    v = VARIANTS["v3_sigmoid_noaux_tc_no_norm"]
    weights = _weights(v, hidden=16, inter=8, seed=3)
    x = np.random.default_rng(4).standard_normal((11, 16)).astype(np.float32)
    np.testing.assert_allclose(_lowered_output(v, x, weights, as_inputs=True), _eager(v, x, weights), atol=1e-5,
                               rtol=0)


@settings(max_examples=12, deadline=None, derandomize=True)
@given(
    data=st.data(), scoring=st.sampled_from(["softmax", "sigmoid"]), n_group=st.sampled_from([1, 2, 4]),
    per_group=st.integers(2, 4), norm=st.integers(0, 1), tokens=st.integers(1, 24),
    hidden=st.sampled_from([8, 16]), inter=st.sampled_from([4, 8]), seed=st.integers(0, 2**16),
)
def test_random_shapes_match_eager_op(data, scoring, n_group, per_group, norm, tokens, hidden, inter, seed) -> None:
    topk_group = data.draw(st.integers(1, n_group))
    top_k = data.draw(st.integers(1, topk_group * per_group if n_group > 1 else n_group * per_group))
    group_scoring = data.draw(st.sampled_from(["max", "top2_sum"]))
    v = Variant(scoring, top_k, n_group, topk_group, group_scoring, norm, data.draw(st.sampled_from([1.0, 2.5])),
                experts=n_group * per_group, with_bias=scoring == "sigmoid")
    weights = _weights(v, hidden, inter, seed)
    x = np.random.default_rng(seed + 1).standard_normal((tokens, hidden)).astype(np.float32)
    np.testing.assert_allclose(_lowered_output(v, x, weights), _eager(v, x, weights), atol=1e-5, rtol=0)


def _experts_reference(x: np.ndarray, w: dict[str, np.ndarray], ids: torch.Tensor, weights: torch.Tensor) -> np.ndarray:
    xt = torch.from_numpy(x)
    out = torch.zeros_like(xt)
    for t in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            e = int(ids[t, slot])
            h = F.silu(xt[t] @ torch.from_numpy(w["gate_proj"][e]).T) * (xt[t] @ torch.from_numpy(w["up_proj"][e]).T)
            out[t] += weights[t, slot] * (h @ torch.from_numpy(w["down_proj"][e]).T)
    return out.numpy()


def test_negative_biased_scores_never_pick_dropped_groups() -> None:
    """-inf (not 0.0) on dropped groups: with every biased score < 0 a 0.0 mask would pick masked experts."""
    v = Variant("sigmoid", 2, 4, 1, "top2_sum", 1, 2.5, with_bias=True)  # one kept group of 2 experts, top-2
    weights = _weights(v, hidden=16, inter=8, seed=5)
    weights["correction_bias"] = np.full(8, -10.0, np.float32) + weights["correction_bias"]  # sigmoid + bias < -9
    x = np.random.default_rng(6).standard_normal((20, 16)).astype(np.float32)

    logits = torch.from_numpy(x) @ torch.from_numpy(weights["router_weight_t"])
    choice = logits.sigmoid() + torch.from_numpy(weights["correction_bias"])
    kept_group = choice.view(-1, 4, 2).sum(-1).argmax(-1, keepdim=True)  # top-2 sum of a 2-expert group = its sum
    ids, _ = route(logits, torch.from_numpy(weights["correction_bias"]), v.router)
    assert bool((ids // 2 == kept_group).all())  # the reference stays inside the kept group
    # A 0.0 fill would leave it (so the comparison below can see that bug).
    in_kept = (torch.arange(8) // 2).unsqueeze(0) == kept_group
    zero_masked_ids = choice.masked_fill(~in_kept, 0.0).topk(2, -1).indices
    assert not bool((zero_masked_ids // 2 == kept_group).any())

    np.testing.assert_allclose(_lowered_output(v, x, weights), _eager(v, x, weights), atol=1e-5, rtol=0)


def test_correction_bias_applies_with_a_single_group() -> None:
    """noaux_tc with n_group 1 (node contract: the bias input always steers the choice).

    The reference here is route_tokens with the model's own noaux_tc config (moeforge/model/routing.py).
    """
    v = Variant("sigmoid", 2, 1, 1, "top2_sum", 1, 2.5, with_bias=True)
    weights = _weights(v, hidden=16, inter=8, seed=7)
    weights["correction_bias"] = np.random.default_rng(8).standard_normal(8).astype(np.float32) * 0.5
    x = np.random.default_rng(9).standard_normal((25, 16)).astype(np.float32)
    cfg = MoEConfig(n_routed_experts=8, n_shared_experts=0, num_experts_per_tok=2, moe_intermediate_size=8,
                    scoring_func="sigmoid", topk_method="noaux_tc", n_group=1, topk_group=1, norm_topk_prob=True,
                    routed_scaling_factor=2.5)
    logits = torch.from_numpy(x) @ torch.from_numpy(weights["router_weight_t"])
    ids, w = route_tokens(logits, torch.from_numpy(weights["correction_bias"]), cfg)
    unbiased_ids, _ = route_tokens(logits, None, dataclasses.replace(cfg, topk_method="greedy"))
    assert not torch.equal(ids.sort(-1).values, unbiased_ids.sort(-1).values)  # the bias matters here
    np.testing.assert_allclose(_lowered_output(v, x, weights), _experts_reference(x, weights, ids, w), atol=1e-5,
                               rtol=0)


def _rank_experts_model(weights: dict[str, np.ndarray], k: str | int = 2) -> ir.Model:
    """One expert-parallel rank's experts node: ids/weights from elsewhere (graph inputs here; the rank's local routing
    in an artifact), ``S`` stacked experts, id ``S`` = another rank's expert with weight 0."""
    names = ("gate_proj", "up_proj", "down_proj")
    node = helper.make_node(moe_op.OP_TYPE, ["x", "ids", "w", *names], ["y"], domain=moe_op.DOMAIN, name="moe")
    graph = helper.make_graph(
        [node], "experts", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", 8]),
                            helper.make_tensor_value_info("ids", TensorProto.INT32, ["T", k]),
                            helper.make_tensor_value_info("w", TensorProto.FLOAT, ["T", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", 8])],
        [numpy_helper.from_array(weights[n], n) for n in names])
    return ir.serde.deserialize_model(helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(moe_op.DOMAIN, 1)],
        functions=[moe_op.experts_local_function(OPSET)], ir_version=10))


def _rank_case() -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """8 experts on this rank; 6 tokens of top-2 that use experts 0, 1, 3 and 6 here (8: another rank's expert)."""
    weights = _weights(VARIANTS["v2_softmax_greedy_norm"], hidden=8, inter=4, seed=10)
    x = np.random.default_rng(11).standard_normal((6, 8)).astype(np.float32)
    ids = np.array([[0, 3], [1, 8], [8, 0], [8, 8], [6, 1], [3, 3]], np.int32)
    w = np.random.default_rng(12).random((6, 2)).astype(np.float32)
    w[ids == 8] = 0.0  # hold_local_experts: another rank's choice weighs 0 here
    t = [torch.from_numpy(weights[k]) for k in ("gate_proj", "up_proj", "down_proj")]
    ref = apply_experts(torch.from_numpy(x), torch.from_numpy(ids), torch.from_numpy(w), *t).numpy()
    return weights, x, ids, w, ref


def _computed_experts(model: ir.Model, weights: dict[str, np.ndarray], feeds: dict[str, np.ndarray]) -> list[int]:
    """The experts a run computes: those whose weights, filled with NaN, make the output NaN (an expert that runs
    on no token, or runs with weight 0 and is skipped, leaves it finite)."""
    proto = ir.serde.serialize_model(model)
    computed = []
    for expert in range(weights["gate_proj"].shape[0]):
        poisoned = onnx.ModelProto()
        poisoned.CopyFrom(proto)
        for tensor in poisoned.graph.initializer:
            array = numpy_helper.to_array(tensor).copy()
            if array.ndim == 3 and array.shape[0] == weights["gate_proj"].shape[0]:
                array[expert] = np.nan
                tensor.CopyFrom(numpy_helper.from_array(array, tensor.name))
        if np.isnan(run_ort(ir.serde.deserialize_model(poisoned), feeds)[0]).any():
            computed.append(expert)
    return computed


def test_an_expert_parallel_ranks_experts_compute_only_the_routed_ones() -> None:
    """Lowered to com.microsoft.MoE, a rank's experts node matches the eager op and computes exactly the experts its
    tokens chose on this rank (counted by poisoning each expert in turn); the dense local function computes all."""
    weights, x, ids, w, ref = _rank_case()
    feeds = {"x": x, "ids": ids, "w": w}
    dense = _rank_experts_model(weights)
    assert _computed_experts(dense, weights, feeds) == list(range(8))  # the function: every expert, every token
    model = _rank_experts_model(weights)
    assert MoELowering().apply(model, _ctx()) == 1
    assert not model.functions and len(_moe_nodes(model, MS_DOMAIN)) == 1
    np.testing.assert_allclose(run_ort(model, feeds)[0], ref, atol=1e-5, rtol=0)
    assert not run_ort(model, feeds)[0][3].any()  # a token with no expert on this rank adds 0
    assert _computed_experts(model, weights, feeds) == [0, 1, 3, 6]
    one_token = {"x": x[4:5], "ids": ids[4:5], "w": w[4:5]}  # a decode step: its two experts only
    assert _computed_experts(model, weights, one_token) == [1, 6]
    nothing_here = {"x": x[3:4], "ids": ids[3:4], "w": w[3:4]}
    assert _computed_experts(model, weights, nothing_here) == []


def test_experts_of_no_static_top_k_are_left_to_their_function() -> None:
    """Ids of unknown K: the kernel's k cannot be set, the node keeps its function (and still computes right)."""
    weights, x, ids, w, ref = _rank_case()
    model = _rank_experts_model(weights, k="K")
    assert MoELowering().apply(model, _ctx()) == 0
    assert len(model.functions) == 1 and moe_op.DOMAIN in model.opset_imports
    np.testing.assert_allclose(run_ort(model, {"x": x, "ids": ids, "w": w})[0], ref, atol=1e-5, rtol=0)
