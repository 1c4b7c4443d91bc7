"""TensorRT plugins for moeforge.MoERouter and moeforge.PagedAttention (plugins/*/tensorrt.py).

CPU: the plugins' torch compute against independent references, their serialisation and type rules,
and TensorRT-RTX building nodes that follow the plugin conventions by inlining their local functions.
GPU (marked, skipped without CUDA and full TensorRT): the plugin running inside an engine.
"""

import numpy as np
import onnx
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

from moeforge.core.config import MoEConfig
from moeforge.model.routing import route_tokens
from moeforge.ops.moe_router import tensorrt as router_plugin
from moeforge.ops.moe_router.tensorrt import RouterAttrs, route
from moeforge.ops.paged_attention import tensorrt as paged_plugin
from moeforge.ops.paged_attention.tensorrt import PagedAttentionAttrs, paged_attention

from .conftest import full_tensorrt_with_gpu, needs_trt_rtx

V3 = MoEConfig(n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4, moe_intermediate_size=8,
               scoring_func="sigmoid", topk_method="noaux_tc", n_group=4, topk_group=2, norm_topk_prob=True,
               routed_scaling_factor=2.5)
V2 = MoEConfig(n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=3, moe_intermediate_size=8,
               scoring_func="softmax", topk_method="group_limited_greedy", n_group=4, topk_group=2,
               norm_topk_prob=False, routed_scaling_factor=1.5)


def _attrs(moe: MoEConfig) -> RouterAttrs:
    return RouterAttrs(scoring=moe.scoring_func, top_k=moe.num_experts_per_tok, n_group=moe.n_group,
                       topk_group=moe.topk_group, group_scoring=moe.group_scoring,
                       norm_topk_prob=int(moe.norm_topk_prob), routed_scaling_factor=moe.routed_scaling_factor)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), v3=st.booleans(), tokens=st.integers(1, 9))
def test_router_matches_reference(seed, v3, tokens):
    moe = V3 if v3 else V2
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, moe.n_routed_experts, generator=gen)
    bias = torch.randn(moe.n_routed_experts, generator=gen) * 0.1 if v3 else None
    ids, weights = route(logits, bias, _attrs(moe))
    ref_ids, ref_weights = route_tokens(logits, bias, moe)
    assert ids.dtype == torch.int32 and ids.shape == (tokens, moe.num_experts_per_tok)
    for t in range(tokens):
        want = dict(zip(ref_ids[t].tolist(), ref_weights[t].tolist(), strict=True))
        got = dict(zip(ids[t].tolist(), weights[t].tolist(), strict=True))
        assert got.keys() == want.keys()
        assert all(abs(got[e] - want[e]) < 1e-5 for e in got)
    # Descending by choice score (scores + bias).
    scores = logits.sigmoid() if v3 else logits.softmax(-1)
    choice = scores + bias if bias is not None else scores
    picked = choice.gather(1, ids.long())
    assert (picked[:, :-1] >= picked[:, 1:]).all()


def test_router_ties_go_to_lower_index():
    logits = torch.zeros(2, 8)  # every score equal
    ids, weights = route(logits, None, RouterAttrs(scoring="sigmoid", top_k=3, n_group=1, topk_group=1))
    assert ids.tolist() == [[0, 1, 2], [0, 1, 2]]
    assert torch.allclose(weights, torch.full((2, 3), 1 / 3))


def _dense_attention(q, k, v, scale, window):
    """q [n, Hq, D] at the last n of t positions, k/v [t, Hkv, D] -> [n, Hq, Dv] (plain softmax attention)."""
    n, t = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    out = torch.empty(n, q.shape[1], v.shape[2])
    for i in range(n):
        p = t - n + i
        lo = max(0, p - window + 1) if window else 0
        s = torch.einsum("hd,khd->hk", q[i], k[lo:p + 1]) * scale
        out[i] = torch.einsum("hk,khd->hd", s.softmax(-1), v[lo:p + 1])
    return out


@pytest.mark.parametrize("latent,window", [(False, 0), (False, 3), (True, 0)])
def test_paged_attention_matches_dense(latent, window):
    """Two sequences in scattered blocks: a prefill step (5 and 3 tokens), then one decode token each."""
    torch.manual_seed(0)
    hq, hkv, dk, dv, bs = (4, 1, 12, 8, 4) if latent else (4, 2, 8, 8, 4)
    attrs = PagedAttentionAttrs(scale=dk**-0.5, num_heads=hq, num_kv_heads=hkv, block_size=bs,
                                sliding_window=window, head_size_v=dv)
    key_cache = torch.zeros(8, bs, hkv, dk)
    value_cache = torch.zeros(0) if latent else torch.zeros(8, bs, hkv, dv)
    tables = torch.tensor([[5, 2, 7], [1, 6, 0]], dtype=torch.int32)
    history = {0: ([], []), 1: ([], [])}
    for lengths, totals in (([5, 3], [5, 3]), ([1, 1], [6, 4])):
        tokens = sum(lengths)
        q, k = torch.randn(tokens, hq, dk), torch.randn(tokens, hkv, dk)
        v = torch.zeros(0) if latent else torch.randn(tokens, hkv, dv)
        starts = torch.tensor([0, lengths[0], tokens], dtype=torch.int32)
        out = paged_attention(q, k, v, key_cache, value_cache, tables, torch.tensor(totals, dtype=torch.int32),
                              starts, attrs)
        for b in range(2):
            lo, hi = int(starts[b]), int(starts[b + 1])
            history[b][0].append(k[lo:hi])
            history[b][1].append(k[lo:hi, :, :dv] if latent else v[lo:hi])
            keys, values = torch.cat(history[b][0]), torch.cat(history[b][1])
            want = _dense_attention(q[lo:hi], keys, values, attrs.scale, window)
            assert torch.allclose(out[lo:hi], want, atol=1e-5)
            # The cache holds every token at its block/row.
            for p in range(keys.shape[0]):
                assert torch.equal(key_cache[tables[b, p // bs], p % bs], keys[p])


@needs_trt_rtx
def test_plugin_objects_serialise_and_type():
    import tensorrt_rtx_bindings as trt

    plugin_cls, creator_cls = router_plugin.plugin_classes(trt)
    attrs = RouterAttrs(scoring="softmax", top_k=3, n_group=2, topk_group=1, group_scoring="max",
                        norm_topk_prob=0, routed_scaling_factor=2.5)
    plugin = plugin_cls(attrs)
    again = creator_cls().create_plugin("r", plugin.get_fields_to_serialize(), trt.TensorRTPhase.RUNTIME)
    assert again.attrs == attrs and plugin.clone().attrs == attrs and type(plugin.clone()) is plugin_cls
    assert (plugin.plugin_name, plugin.plugin_version, plugin.plugin_namespace) == ("MoERouter", "1", "moeforge")
    creator = creator_cls()
    assert (creator.name, creator.plugin_version, creator.plugin_namespace) == ("MoERouter", "1", "moeforge")
    assert plugin.get_output_data_types([trt.DataType.FLOAT]) == [trt.DataType.INT32, trt.DataType.FLOAT]
    bad = plugin_cls(RouterAttrs(scoring="softmax", top_k=3, n_group=2, topk_group=3)).get_fields_to_serialize()
    with pytest.raises(ValueError, match="topk_group"):  # the creator validates what it deserialises
        creator.create_plugin("r", bad, trt.TensorRTPhase.RUNTIME)

    plugin_cls, creator_cls = paged_plugin.plugin_classes(trt)
    attrs = PagedAttentionAttrs(scale=0.125, num_heads=8, num_kv_heads=2, block_size=16, sliding_window=4,
                                head_size_v=64)
    plugin = plugin_cls(attrs)
    again = creator_cls().create_plugin("p", plugin.get_fields_to_serialize(), trt.TensorRTPhase.RUNTIME)
    assert again.attrs == attrs
    half = trt.DataType.HALF
    assert plugin.get_output_data_types([half, half, half, half, half] + [trt.DataType.INT32] * 3) == [half] * 3
    assert [plugin.get_aliased_input(i) for i in range(3)] == [-1, 3, 4]  # caches updated in place


def _router_function() -> onnx.FunctionProto:
    """A simple standard-op body (sigmoid scores, top-k, renormalised weights): what TensorRT inlines."""
    nodes = [
        helper.make_node("Sigmoid", ["router_logits"], ["scores"]),
        helper.make_node("Add", ["scores", "correction_bias"], ["choice"]),
        helper.make_node("Constant", [], ["k"], value=helper.make_tensor("k", TensorProto.INT64, [1], [2])),
        helper.make_node("TopK", ["choice", "k"], ["top", "ids64"], axis=-1),
        helper.make_node("Cast", ["ids64"], ["expert_ids"], to=TensorProto.INT32),
        helper.make_node("GatherElements", ["scores", "ids64"], ["picked"], axis=-1),
        helper.make_node("ReduceSum", ["picked", "axes"], ["total"], keepdims=1),
        helper.make_node("Constant", [], ["axes"], value=helper.make_tensor("axes", TensorProto.INT64, [1], [-1])),
        helper.make_node("Div", ["picked", "total"], ["expert_weights"]),
    ]
    nodes.insert(6, nodes.pop(7))  # axes before ReduceSum
    return helper.make_function("moeforge", "MoERouter", ["router_logits", "correction_bias"],
                                ["expert_ids", "expert_weights"], nodes, [helper.make_opsetid("", 23)])


def _paged_function() -> onnx.FunctionProto:
    """A simple body: attention of each token with itself over its heads (outputs of the right shapes),
    caches passed through. Enough for the parser's function path; the semantics are the plugin's."""
    nodes = [
        helper.make_node("Identity", ["value"], ["output"]),
        helper.make_node("Identity", ["key_cache"], ["key_cache_out"]),
        helper.make_node("Identity", ["value_cache"], ["value_cache_out"]),
    ]
    inputs = ["query", "key", "value", "key_cache", "value_cache", "block_tables", "seq_lens", "query_start_loc"]
    return helper.make_function("moeforge", "PagedAttention", inputs,
                                ["output", "key_cache_out", "value_cache_out"], nodes, [helper.make_opsetid("", 23)])


@needs_trt_rtx
def test_plugin_convention_nodes_build_on_cpu(tmp_path):
    """MoERouter / PagedAttention nodes (op type = plugin name, plugin_version, plugin_namespace) with local
    functions: TensorRT-RTX (no plugin registered) inlines the functions and builds an SM89 plan."""
    from moeforge.compile.trt.engine_build import BuildOptions, ParsedNetwork, build_engine
    from moeforge.runtime.backends.trt_adapter import load_tensorrt

    common = {"domain": "moeforge", "plugin_version": "1", "plugin_namespace": "moeforge"}
    router = helper.make_node("MoERouter", ["logits", "bias"], ["ids", "weights"], scoring="sigmoid", top_k=2,
                              n_group=1, topk_group=1, group_scoring="top2_sum", norm_topk_prob=1,
                              routed_scaling_factor=1.0, **common)
    paged = helper.make_node("PagedAttention", ["q", "k", "v", "kc", "vc", "tables", "lens", "starts"],
                             ["out", "kc_out", "vc_out"], scale=0.25, num_heads=2, num_kv_heads=2, block_size=4,
                             sliding_window=0, head_size_v=4, **common)
    f16, i32 = TensorProto.FLOAT16, TensorProto.INT32
    inputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["T", 8]),
              helper.make_tensor_value_info("bias", TensorProto.FLOAT, [8])]
    inputs += [helper.make_tensor_value_info(n, f16, ["T", 2, 4]) for n in ("q", "k", "v")]
    inputs += [helper.make_tensor_value_info(n, f16, [6, 4, 2, 4]) for n in ("kc", "vc")]
    inputs += [helper.make_tensor_value_info("tables", i32, ["B", 3]),
               helper.make_tensor_value_info("lens", i32, ["B"]),
               helper.make_tensor_value_info("starts", i32, ["B1"])]
    graph = helper.make_graph([router, paged], "plugins", inputs,
                              [helper.make_tensor_value_info("ids", i32, ["T", 2]),
                               helper.make_tensor_value_info("weights", TensorProto.FLOAT, ["T", 2]),
                               helper.make_tensor_value_info("out", f16, ["T", 2, 4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid("moeforge", 1)],
                              functions=[_router_function(), _paged_function()])
    onnx.checker.check_model(model)
    path = tmp_path / "plugins.onnx"
    onnx.save(model, path)
    types = dict(ParsedNetwork(load_tensorrt("tensorrt-rtx"), path).layer_types())
    assert types.get("TOPK") == 1 and not {"PLUGIN", "PLUGIN_V2", "PLUGIN_V3"} & set(types)
    # Profiles: T and B are axis 0 of their inputs; "B1" (B + 1) is axis 0 too.
    info = build_engine(path, tmp_path / "plugins.plan", BuildOptions(impl="tensorrt-rtx", sm=89, max_batch=2))
    assert info.plan_bytes > 0 and info.compute_capability == "SM89"


@pytest.mark.gpu
@pytest.mark.skipif(not full_tensorrt_with_gpu(), reason="needs an NVIDIA GPU and full TensorRT (TensorRT-RTX 1.7 "
                    "aborts when its parser imports a Python plugin)")
def test_router_plugin_runs_in_engine(tmp_path):
    import tensorrt as trt

    router_plugin.register(trt)
    node = helper.make_node("MoERouter", ["logits", "bias"], ["ids", "weights"], domain="moeforge",
                            plugin_version="1", plugin_namespace="moeforge", scoring="sigmoid", top_k=4, n_group=4,
                            topk_group=2, group_scoring="top2_sum", norm_topk_prob=1, routed_scaling_factor=2.5)
    graph = helper.make_graph([node], "r", [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["T", 16]),
                                            helper.make_tensor_value_info("bias", TensorProto.FLOAT, [16])],
                              [helper.make_tensor_value_info("ids", TensorProto.INT32, None),
                               helper.make_tensor_value_info("weights", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid("moeforge", 1)])
    onnx.save(model, tmp_path / "r.onnx")
    from polygraphy.backend.trt import EngineFromNetwork, NetworkFromOnnxPath, TrtRunner

    logits = np.random.default_rng(0).standard_normal((5, 16)).astype(np.float32)
    bias = (np.random.default_rng(1).standard_normal(16) * 0.1).astype(np.float32)
    with TrtRunner(EngineFromNetwork(NetworkFromOnnxPath(str(tmp_path / "r.onnx")))) as runner:
        out = runner.infer({"logits": logits, "bias": bias})
    ids, weights = route(torch.tensor(logits), torch.tensor(bias), _attrs(V3))
    assert np.array_equal(out["ids"], ids.numpy()) and np.allclose(out["weights"], weights.numpy(), atol=1e-5)


@needs_trt_rtx
def test_python_plugins_refuse_tensorrt_rtx():
    """Registering would make the parser import the node as a Python plugin, which aborts RTX 1.7."""
    import tensorrt_rtx_bindings as trt

    from moeforge.core.errors import MoeforgeError

    for module in (router_plugin, paged_plugin):
        with pytest.raises(MoeforgeError, match="aborts the process"):
            module.register(trt)
    names = {c.name for c in trt.get_plugin_registry().all_creators}
    assert not {"MoERouter", "PagedAttention"} & names
