"""`moeforge compile tiny-deepseek-v3 --target trt --kv-cache paged`: a TensorRT-RTX plan for SM89 built on CPU
from a graph with moeforge.MoERouter / MoEExperts and moeforge.PagedAttention nodes (plugin conventions, local
functions inlined by the parser), its profiles, and the lowered graph's logits (ORT) against PyTorch."""

from collections import Counter, defaultdict

import numpy as np
import onnx
import pytest
import torch

from moeforge.compile.driver import CompileOptions, compile_model
from moeforge.core.artifact import load_artifact
from moeforge.model.loader import load_model
from moeforge.verify.golden import load_golden

from .conftest import needs_trt_rtx

pytestmark = [needs_trt_rtx, pytest.mark.heavy]

MODEL = "tiny-deepseek-v3"
MAX_SEQ_LEN, BLOCK_SIZE, PREFILL_TOKENS, MAX_BATCH = 64, 16, 32, 4
FUNCTIONS = ("PagedAttention", "MoERouter", "MoEExperts")


@pytest.fixture(scope="module")
def paged_artifact(tmp_path_factory):
    out = tmp_path_factory.mktemp("trt_paged") / MODEL
    options = CompileOptions.from_flags(model=MODEL, output_dir=out, target="trt", kv_cache="paged",
                                        build_only=True,  # no moeforge backend runs paged engines yet
                                        kv_block_size=BLOCK_SIZE,
                                        max_seq_len=MAX_SEQ_LEN, max_prefill_tokens=PREFILL_TOKENS, max_batch=MAX_BATCH,
                                        trt_impl="tensorrt-rtx", sm=89, progress=False)
    return load_artifact(compile_model(options).output_dir)


def test_plan_profiles_and_manifest(paged_artifact):
    m = paged_artifact.manifest
    engine = m.engine
    plan = paged_artifact.root / engine["plan_file"]
    assert plan.is_file() and plan.stat().st_size == engine["plan_bytes"] > 0
    assert engine["impl"] == "tensorrt-rtx" and engine["compute_capability"] == "SM89" and m.precision == "fp16"
    assert m.kv_cache.layout == "mla_latent" and m.kv_cache.block_size == BLOCK_SIZE and m.kv_cache.dtype == "float16"
    inputs = {t["name"]: t for t in engine["inputs"]}
    layers = m.config().num_hidden_layers
    latent = m.config().mla.latent_dim
    for i in range(layers):  # half pools [N, Bs, 1, R+Dr], N dynamic
        assert inputs[f"kv_pool.{i}.latent"] == {"name": f"kv_pool.{i}.latent", "dtype": "half",
                                                 "shape": [-1, BLOCK_SIZE, 1, latent]}
    assert {t["name"]: t["dtype"] for t in engine["outputs"]}["logits"] == "float"
    decode, prefill = engine["profiles"]
    assert (decode["name"], prefill["name"]) == ("decode", "prefill")
    max_blocks = MAX_SEQ_LEN // BLOCK_SIZE
    # decode: one token per sequence; prefill: packed chunks of up to PREFILL_TOKENS tokens, logits for each
    assert decode["shapes"]["input_ids"] == [[1], [MAX_BATCH // 2], [MAX_BATCH]]
    assert decode["shapes"]["query_start_loc"] == [[2], [MAX_BATCH // 2 + 1], [MAX_BATCH + 1]]
    assert prefill["shapes"]["input_ids"][2] == prefill["shapes"]["logits_indices"][2] == [PREFILL_TOKENS]
    for profile in (decode, prefill):
        assert profile["shapes"]["block_tables"][2] == [MAX_BATCH, max_blocks]
        assert profile["shapes"]["kv_pool.0.latent"][2] == [MAX_BATCH * max_blocks, BLOCK_SIZE, 1, latent]


def test_graph_keeps_plugin_convention_nodes_with_functions(paged_artifact):
    proto = onnx.load(str(paged_artifact.model_path), load_external_data=False)
    config = paged_artifact.manifest.config()
    counts = Counter(n.op_type for n in proto.graph.node if n.domain == "moeforge")
    moe_layers = config.num_hidden_layers - config.moe.first_k_dense_replace
    assert counts == {"PagedAttention": config.num_hidden_layers, "MoERouter": moe_layers, "MoEExperts": moe_layers}
    assert {f.name for f in proto.functions} == set(FUNCTIONS)
    for node in proto.graph.node:
        if node.op_type in ("PagedAttention", "MoERouter"):  # MoEExperts: a local function only, no plugin
            attrs = {a.name: a for a in node.attribute}
            assert attrs["plugin_version"].s == b"1" and attrs["plugin_namespace"].s == b"moeforge"
        if node.op_type == "PagedAttention":  # latent mode: value / value_cache bound to empty tensors
            assert len(node.input) == 8 and all(node.input)


def test_parsed_network_inlines_router_and_paged_attention(paged_artifact):
    """The parser inlined each node's local function (layers tagged with the calling node), no plugin layer."""
    from moeforge.compile.trt.engine_build import ParsedNetwork
    from moeforge.runtime.backends.trt_adapter import load_tensorrt

    parsed = ParsedNetwork(load_tensorrt("tensorrt-rtx"), paged_artifact.model_path)
    net = parsed.network
    by_call: dict[tuple[str, str], Counter] = defaultdict(Counter)
    for i in range(net.num_layers):
        layer = net.get_layer(i)
        meta = layer.metadata or ""  # "[ONNX Layer: <body node> | <calling node> (<function>)]"
        if " | " in meta and meta.rstrip("]").endswith(")"):
            call, function = meta.rstrip("]").split(" | ", 1)[1].rsplit(" (", 1)
            by_call[(function.rstrip(")"), call)][str(layer.type).split(".")[-1]] += 1
    types = parsed.layer_types()
    assert not {"PLUGIN", "PLUGIN_V2", "PLUGIN_V3"} & set(types)
    config = paged_artifact.manifest.config()
    calls = Counter(function for function, _ in by_call)
    moe_layers = config.num_hidden_layers - config.moe.first_k_dense_replace
    assert calls == {"PagedAttention": config.num_hidden_layers, "MoERouter": moe_layers, "MoEExperts": moe_layers}
    for (function, _), kinds in by_call.items():
        if function == "PagedAttention":  # pool write, masked fp32 softmax, two matmuls (scores, mix)
            assert kinds["SCATTER"] == 1 and kinds["SOFTMAX"] == 1 and kinds["MATRIX_MULTIPLY"] == 2
            assert kinds["GATHER"] >= 2  # block tables -> pool blocks, queries -> padded rows
        if function == "MoERouter":  # group top-k, expert top-k in fp32
            assert kinds["TOPK"] >= 2
    assert types["SCATTER"] >= config.num_hidden_layers


def test_golden_of_lowered_graph_matches_pytorch(paged_artifact):
    """ORT on the exact fp16 graph the engine was built from (PagedAttention body inlined, latent inputs bound
    to empties) against PyTorch fp32, for every prompt token's logits [P, V]."""
    feeds, golden = load_golden(paged_artifact.root)
    assert "block_tables" in feeds and not any(k.startswith("kv_pool.") for k in feeds)
    loaded = load_model(MODEL, mla_impl="absorb")
    ids = torch.tensor(feeds["input_ids"])[None]
    with torch.no_grad():
        ref = loaded.model(ids, torch.arange(ids.shape[1])[None], None).logits[0].numpy()
    assert golden.shape == ref.shape
    assert np.abs(golden - ref).max() < 2e-2 * np.abs(ref).max()
    assert (golden.argmax(-1) == ref.argmax(-1)).mean() >= 0.9


def test_lowered_graph_decodes_over_pools_like_pytorch(paged_artifact):
    """The fp16 TRT-form graph on ORT: a 2-sequence prefill into the pools, then packed decode steps reading them
    back through the block tables (sequence 1's blocks after sequence 0's), against PyTorch fp32."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(paged_artifact.model_path), providers=["CPUExecutionProvider"])
    pools = {i.name: np.zeros((2 * 2, BLOCK_SIZE, *i.shape[2:]), np.float16) for i in session.get_inputs()
             if i.name.startswith("kv_pool.")}
    outputs = [o.name for o in session.get_outputs()]
    loaded = load_model(MODEL, mla_impl="absorb")
    rng = np.random.default_rng(0)
    seqs = [list(rng.integers(0, loaded.config.vocab_size, 20)), list(rng.integers(0, loaded.config.vocab_size, 7))]
    tables = np.array([[0, 1], [2, 3]], np.int32)
    lens = [0, 0]
    steps = [[20, 7], [1, 1], [1, 1]]  # new tokens per sequence per step (prefill, then decodes)
    got = [[], []]
    for step, counts in enumerate(steps):
        ids, pos = [], []
        for b, n in enumerate(counts):
            ids += seqs[b][lens[b]:lens[b] + n] if step == 0 else [int(rng.integers(0, loaded.config.vocab_size))]
            if step:
                seqs[b].append(ids[-1])
            pos += list(range(lens[b], lens[b] + n))
            lens[b] += n
        starts = np.cumsum([0, *counts])
        feeds = {"input_ids": np.array(ids, np.int64), "position_ids": np.array(pos, np.int64),
                 "block_tables": tables, "seq_lens": np.array(lens, np.int32),
                 "query_start_loc": starts.astype(np.int32), "logits_indices": (starts[1:] - 1).astype(np.int64),
                 **pools}
        result = dict(zip(outputs, session.run(outputs, feeds), strict=True))
        pools = {name: result[name.replace("kv_pool.", "kv_pool_out.")] for name in pools}
        for b in range(2):
            got[b].append(result["logits"][b])
    for b in range(2):
        with torch.no_grad():
            ref = loaded.model(torch.tensor([seqs[b]]), torch.arange(len(seqs[b]))[None], None).logits[0].numpy()
        expect = ref[[len(seqs[b]) - 3, len(seqs[b]) - 2, len(seqs[b]) - 1]]  # the last prefill token, 2 decodes
        assert np.abs(np.stack(got[b]) - expect).max() < 2e-2 * np.abs(expect).max()


def test_latent_node_parses_only_with_bound_empty_inputs(tmp_path):
    """RTX 1.7 rejects a local-function node with an unset optional input (latent mode's value/value_cache);
    bound to empty tensors by ``paged_inputs`` it parses (and still computes the reference on ORT)."""
    import onnx_ir as ir
    import onnxruntime as ort

    from moeforge.compile.trt.engine_build import EngineBuildError, ParsedNetwork
    from moeforge.ops.paged_attention.function import single_op_model
    from moeforge.ops.paged_attention.reference import paged_attention
    from moeforge.ops.paged_attention.schema import PagedAttentionAttrs
    from moeforge.passes.trt_paged import TrtPagedInputs
    from moeforge.runtime.backends.trt_adapter import load_tensorrt

    attrs = PagedAttentionAttrs(scale=0.2, num_heads=4, num_kv_heads=1, block_size=4, head_size_v=8, latent=True)
    proto = single_op_model(attrs)
    dims = {v.name: v.type.tensor_type.shape.dim for v in proto.graph.input}
    for dim in (dims["query"][2], dims["key"][2], dims["key_cache"][3]):
        dim.dim_value = 12  # Dk = R + Dr static, as in an exported graph
    trt = load_tensorrt("tensorrt-rtx")
    onnx.save(proto, tmp_path / "unset.onnx")
    with pytest.raises(EngineBuildError, match="Invalid Node"):
        ParsedNetwork(trt, tmp_path / "unset.onnx")
    model = ir.serde.deserialize_model(proto)
    assert TrtPagedInputs().apply(model, None) == 1
    ir.save(model, tmp_path / "bound.onnx")
    kinds = ParsedNetwork(trt, tmp_path / "bound.onnx").layer_types()
    assert kinds["SCATTER"] == 1 and kinds["SOFTMAX"] == 1

    rng = np.random.default_rng(0)
    lens, new = np.array([6, 3], np.int32), np.array([2, 3], np.int32)  # seq 0 decodes 2 after 4; seq 1 prefills
    t = int(new.sum())
    feeds = {"query": rng.standard_normal((t, 4, 12), np.float32), "key": rng.standard_normal((t, 1, 12), np.float32),
             "key_cache": rng.standard_normal((5, 4, 1, 12), np.float32),
             "block_tables": np.array([[1, 3], [4, 0]], np.int32), "seq_lens": lens,
             "query_start_loc": np.array([0, 2, 5], np.int32)}
    session = ort.InferenceSession(str(tmp_path / "bound.onnx"), providers=["CPUExecutionProvider"])
    out, pool = session.run(None, feeds)
    torch_in = {k: torch.from_numpy(v) for k, v in feeds.items()}
    ref_out, ref_pool, _ = paged_attention(torch_in["query"], torch_in["key"], None, torch_in["key_cache"], None,
                                           torch_in["block_tables"], torch_in["seq_lens"],
                                           torch_in["query_start_loc"], attrs)
    np.testing.assert_allclose(out, ref_out.numpy(), atol=1e-5)
    np.testing.assert_array_equal(pool, ref_pool.numpy())


def test_contiguous_engine_runner_refuses_paged_engines(paged_artifact):
    from moeforge.core.errors import MoeforgeError
    from moeforge.runtime.backends.tensorrt import TrtEngine

    with pytest.raises(MoeforgeError, match="paged TensorRT engine"):
        TrtEngine.from_artifact(paged_artifact)
