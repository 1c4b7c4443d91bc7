"""DeepSeek-V4 through the TensorRT target: ``moeforge compile tiny-deepseek-v4 --target trt --build-only`` builds an
SM89 TensorRT-RTX plan on CPU from V4's step graph (its KV cache in standard ONNX ops), with two changes for TensorRT:
the routed experts exported dense over experts (the parser has no NonZero; moeforge/model/dense_experts.py) and the
Sinkhorn sums of the hyper-connections as MatMuls (Myelin otherwise fuses 39 rounds into one exponentially large
kernel; moeforge/passes/trt_normalize_sums.py). The lowered graph run by ONNX Runtime equals PyTorch (fp32) and stays
within half-precision error (the fp16 graph the plan is built from); the registry refuses to run the plan (no moeforge
backend binds V4's buffers on TensorRT yet), so the compile needs --build-only."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch

from moeforge.compile.driver import CompileOptions, compile_model
from moeforge.core.errors import MoeforgeError
from moeforge.model.dense_experts import DenseRoutedExperts, apply_experts_dense, dense_routed_experts
from moeforge.model.hyper_connections import sinkhorn
from moeforge.model.loader import load_model
from moeforge.model.moe import RoutedExperts, apply_experts
from moeforge.model.presets import get_preset
from moeforge.passes.base import PassContext
from moeforge.passes.trt_normalize_sums import SumsAsMatMul

from .conftest import needs_trt_rtx

MODEL = "tiny-deepseek-v4"
MAX_SEQ_LEN, PREFILL_TOKENS, MAX_BATCH = 64, 32, 4
# Batch 2, prefill 24 (the 8-token window wraps, CSA entries of 4 and HCA entries of 16 close, the indexer picks 4 of
# 6), a decode, a chunk of 2, a decode, a chunk of 12 that closes the second HCA entry.
STEPS = [0, 24, 25, 27, 28, 40]


def _options(tmp_path, **flags):
    return CompileOptions.from_flags(model=MODEL, output_dir=tmp_path / "out", target="trt", max_seq_len=MAX_SEQ_LEN,
                                     max_prefill_tokens=PREFILL_TOKENS, max_batch=MAX_BATCH, trt_impl="tensorrt-rtx",
                                     sm=89, progress=False, **flags)


def _reference(loaded, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        positions = torch.arange(ids.shape[1])[None].repeat(ids.shape[0], 1)
        return loaded.model(torch.tensor(ids), positions).logits.numpy()


def test_dense_experts_equal_the_sparse_loop():
    """Same mix as ``apply_experts`` (NonZero per expert); an expert-parallel rank's id E (another rank's expert)
    adds nothing; a clamped SwiGLU too."""
    gen = torch.Generator().manual_seed(0)
    t, h, i, e = 7, 16, 12, 5
    x = torch.randn(t, h, generator=gen)
    gate, up, down = (torch.randn(e, i, h, generator=gen), torch.randn(e, i, h, generator=gen),
                      torch.randn(e, h, i, generator=gen))
    ids = torch.tensor([[0, 4], [1, 2], [5, 5], [3, 0], [2, 2], [4, 5], [1, 3]])  # 5 = E: held by another rank
    weights = torch.rand(t, 2, generator=gen)
    for limit in (None, 1.5):
        want = apply_experts(x, ids, weights, gate, up, down, limit)
        got = apply_experts_dense(x, ids, weights, gate, up, down, limit)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(apply_experts_dense(x, ids[2:3].expand(t, 2), weights, gate, up, down), torch.zeros(t, h))


def test_dense_routed_experts_swap_keeps_names_and_restores():
    loaded = load_model(MODEL)
    model = loaded.model
    names = {n: p.data_ptr() for n, p in model.named_parameters()}
    ids = torch.tensor([[1, 40, 7, 300, 2, 9, 11, 5, 8]])
    positions = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        want = model(ids, positions).logits
        with dense_routed_experts(model) as swapped:
            assert swapped == loaded.config.num_hidden_layers
            assert {n: p.data_ptr() for n, p in model.named_parameters()} == names  # same tensors, same names
            assert all(isinstance(m, DenseRoutedExperts) for m in model.modules() if isinstance(m, RoutedExperts))
            got = model(ids, positions).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not any(isinstance(m, DenseRoutedExperts) for m in model.modules())


def _sinkhorn_graph(iters: int, tmp_path, rewrite: bool):
    class Sinkhorn(torch.nn.Module):
        def forward(self, comb: torch.Tensor) -> torch.Tensor:
            return sinkhorn(comb, iters, 1e-6)

    example = torch.rand(3, 4, 4) + 0.1
    program = torch.onnx.export(Sinkhorn(), (example,), dynamo=True, opset_version=23, input_names=["comb"],
                                output_names=["out"], dynamic_shapes=({0: torch.export.Dim("T")},))
    assert program is not None
    model = program.model
    matches = SumsAsMatMul().apply(model, PassContext(config=get_preset(MODEL).config, max_seq_len=8)) if rewrite else 0
    path = tmp_path / f"sinkhorn_{iters}_{rewrite}.onnx"
    ir.save(model, path)
    return path, matches


def test_sinkhorn_sums_become_matmuls_with_the_same_values(tmp_path):
    from moeforge.core.ort_session import make_session

    comb = np.random.default_rng(0).random((6, 4, 4)).astype(np.float32) + 0.1
    before, _ = _sinkhorn_graph(20, tmp_path, rewrite=False)
    after, matches = _sinkhorn_graph(20, tmp_path, rewrite=True)
    assert matches == 2 * 20 - 1  # every column and row normalisation
    ops = Counter(n.op_type for n in onnx.load(str(after)).graph.node)
    assert ops["ReduceSum"] == 0 and ops["MatMul"] == 39
    want = make_session(before, providers=["CPUExecutionProvider"]).run(None, {"comb": comb})[0]
    got = make_session(after, providers=["CPUExecutionProvider"]).run(None, {"comb": comb})[0]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(torch.from_numpy(got), sinkhorn(torch.from_numpy(comb), 20, 1e-6))


@needs_trt_rtx
def test_sinkhorn_plan_stays_small_with_matmuls(tmp_path):
    """Why the pass exists: TensorRT-RTX's plan for fused Sinkhorn rounds grows exponentially (4 rounds: ~15 MB; 20
    end in std::bad_alloc), with the sums as MatMuls 20 rounds stay a few MB."""
    from moeforge.compile.trt.engine_build import ParsedNetwork
    from moeforge.runtime.backends.trt_adapter import load_tensorrt

    trt = load_tensorrt("tensorrt-rtx")

    def plan_bytes(path):
        parsed = ParsedNetwork(trt, path)
        config = parsed.builder.create_builder_config()
        trt.set_target(config, 89)
        profile = parsed.builder.create_optimization_profile()
        profile.set_shape("comb", (1, 4, 4), (8, 4, 4), (64, 4, 4))
        config.add_optimization_profile(profile)
        plan = parsed.builder.build_serialized_network(parsed.network, config)
        assert plan is not None
        return plan.nbytes

    fused = plan_bytes(_sinkhorn_graph(4, tmp_path, rewrite=False)[0])
    matmuls = plan_bytes(_sinkhorn_graph(20, tmp_path, rewrite=True)[0])
    assert matmuls < 8 << 20 and fused > 2 * matmuls


@pytest.mark.heavy
def test_fp32_lowering_matches_pytorch(tmp_path):
    """The TensorRT lowering of V4's step (dense experts, Sinkhorn MatMuls) run by ONNX Runtime, teacher-forced over
    prefill, decodes and chunks of a batch of 2, equals PyTorch's full-sequence forward."""
    from moeforge.compile.trt.lowering_check import run_steps
    from moeforge.compile.v4_export import export_v4_step
    from moeforge.core.kv_layout import static_spec
    from moeforge.passes.pipeline import run_passes
    from moeforge.passes.trt_lowering import trt_v4_pipeline

    loaded = load_model(MODEL)
    config = loaded.config
    model = export_v4_step(loaded.model, static_spec(config, max_seq_len=MAX_SEQ_LEN, dtype="float32"),
                           dense_experts=True)
    reports = run_passes(model, PassContext(config=config, max_seq_len=MAX_SEQ_LEN), trt_v4_pipeline("fp32"))
    assert config.hyper_connections is not None
    rounds = 2 * config.hyper_connections.sinkhorn_iters - 1
    assert {r.name: r.matches for r in reports}["sums_as_matmul"] == 2 * config.num_hidden_layers * rounds
    path = tmp_path / "model.onnx"
    ir.save(model, path, external_data="model.onnx.data")
    ops = Counter(n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node)
    assert ops["NonZero"] == 0 and ops["ScatterND"] > 0 and ops["TopK"] > 0
    ids = np.random.default_rng(0).integers(0, config.vocab_size, size=(2, STEPS[-1]))
    got, want = run_steps(path, ids, STEPS), _reference(loaded, ids)
    assert np.abs(got - want).max() < 1e-4
    assert (got.argmax(-1) == want.argmax(-1)).all()


@pytest.fixture(scope="module")
def v4_engine(tmp_path_factory):
    from moeforge.core.artifact import load_artifact

    options = _options(tmp_path_factory.mktemp("trt_v4"), build_only=True)  # no moeforge backend runs it yet
    return load_artifact(compile_model(options).output_dir)


@pytest.mark.heavy
@needs_trt_rtx
def test_plan_profiles_and_manifest(v4_engine):
    m = v4_engine.manifest
    engine = m.engine
    assert engine is not None and (v4_engine.root / engine["plan_file"]).stat().st_size == engine["plan_bytes"] > 0
    assert engine["impl"] == "tensorrt-rtx" and engine["compute_capability"] == "SM89" and m.precision == "fp16"
    assert m.kv_cache.layout == "v4_hybrid" and m.kv_cache.dtype == "float16" and not m.kv_cache.paged
    inputs = {t["name"]: t for t in engine["inputs"]}
    config = m.config()
    for layer, names in enumerate(m.kv_cache.past_input_names):  # half buffers [B, rows, w], rows static
        for j, name in enumerate(names):
            assert inputs[name] == {"name": name, "dtype": "half",
                                    "shape": [-1, *(int(d) for d in m.kv_cache.buffer_shape(j, layer)[1:])]}
    assert {t["name"]: t["dtype"] for t in engine["outputs"]}["logits"] == "float"
    decode, prefill = engine["profiles"]
    assert decode["shapes"]["input_ids"] == [[1, 1], [MAX_BATCH // 2, 1], [MAX_BATCH, 1]]
    assert prefill["shapes"]["input_ids"][2] == [2, PREFILL_TOKENS]
    if "attention_mask" in inputs:  # its width is the context (cached + new tokens): up to max_seq_len in both
        assert decode["shapes"]["attention_mask"] == [[1, 1], [MAX_BATCH // 2, MAX_SEQ_LEN // 2],
                                                      [MAX_BATCH, MAX_SEQ_LEN]]
        assert prefill["shapes"]["attention_mask"][2] == [2, MAX_SEQ_LEN]
    passes = {p["name"]: p["matches"] for p in m.passes}
    assert config.hyper_connections is not None
    assert passes["sums_as_matmul"] == 2 * config.num_hidden_layers * (2 * config.hyper_connections.sinkhorn_iters - 1)
    types = engine["layer_types"]
    assert types["SCATTER"] > 0 and types["TOPK"] > 0 and not {"PLUGIN", "PLUGIN_V2", "PLUGIN_V3"} & set(types)


@pytest.mark.heavy
@needs_trt_rtx
def test_plan_header_reads_without_gpu(v4_engine):
    from moeforge.compile.trt.engine_build import plan_diagnostics
    from moeforge.runtime.backends.trt_adapter import load_tensorrt

    _, flags = plan_diagnostics(load_tensorrt("tensorrt-rtx"), (v4_engine.root / "model.plan").read_bytes())
    assert "MALFORMED_ENGINE" not in flags and "VERSION_MISMATCH" not in flags


@pytest.mark.heavy
@needs_trt_rtx
def test_fp16_graph_of_the_plan_matches_pytorch(v4_engine):
    """The graph the plan was built from (fp16; norms, softmax and the router fp32; no NonZero, no ORT-only op) run by
    ONNX Runtime stays within half-precision error of PyTorch, and so do the saved golden logits. (Seed 0: the ids of
    seed 1 give one token a 1e-4 gap between its 2nd and 3rd expert scores, which fp16 upstream flips; every later
    token then reads that token's different cache rows.)"""
    from moeforge.compile.trt.lowering_check import run_steps
    from moeforge.verify.golden import load_golden

    proto = onnx.load(str(v4_engine.model_path), load_external_data=False)
    ops = Counter((n.domain, n.op_type) for n in proto.graph.node)
    assert not [op for op in ops if op[0]], "custom-domain / ORT-only ops must not reach TensorRT"
    assert ops[("", "NonZero")] == 0 and ops[("", "ReduceSum")] < ops[("", "MatMul")]
    loaded = load_model(MODEL)
    ids = np.random.default_rng(0).integers(0, loaded.config.vocab_size, size=(2, STEPS[-1]))
    got, want = run_steps(v4_engine.model_path, ids, STEPS), _reference(loaded, ids)
    assert np.abs(got - want).max() < 2e-2 * np.abs(want).max()
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9
    feeds, golden = load_golden(v4_engine.root)
    assert "past_lengths" not in feeds
    ref = _reference(loaded, np.asarray(feeds["input_ids"]))
    assert golden.shape == ref.shape and np.abs(golden - ref).max() < 2e-2 * np.abs(ref).max()


@pytest.mark.heavy
@needs_trt_rtx
def test_running_the_plan_is_refused_with_the_reason(v4_engine):
    from moeforge.core.errors import ArtifactError
    from moeforge.runtime.backends.base import BackendOptions
    from moeforge.runtime.backends.registry import open_backend

    with pytest.raises(ArtifactError, match=r"v4_hybrid.*--target ort"):
        open_backend(v4_engine, BackendOptions(), num_slots=1)


def test_compile_refuses_before_loading(tmp_path, monkeypatch):
    """Without --build-only (no backend runs the plan) and with --quant (not checked on V4's graph): refused before
    the model loads, nothing written; --plan refuses alike."""
    import moeforge.compile.driver as driver
    from moeforge.compile.plan import check_compile

    def no_load(*args, **kwargs):
        raise AssertionError("the model must not load")

    monkeypatch.setattr(driver, "open_source", no_load)
    with pytest.raises(MoeforgeError, match=r"DeepSeek-V4 builds an engine no moeforge backend runs.*v4_hybrid.*"
                                            r"--target ort.*--build-only"):
        compile_model(_options(tmp_path))
    with pytest.raises(MoeforgeError, match=r"--quant int8 with --target trt is not available for DeepSeek-V4"):
        compile_model(_options(tmp_path, build_only=True, quant="int8"))
    with pytest.raises(MoeforgeError, match="no moeforge backend runs"):
        check_compile(_options(tmp_path))
    assert not (tmp_path / "out").exists()


@pytest.mark.heavy
@needs_trt_rtx
def test_paged_plan_builds(tmp_path):
    """--kv-cache paged --build-only: V4's pools and block tables, profiles under its export's dimension names."""
    out = compile_model(_options(tmp_path, kv_cache="paged", build_only=True))
    engine = out.manifest.engine
    assert engine is not None and (out.output_dir / engine["plan_file"]).stat().st_size > 0
    assert out.manifest.kv_cache.layout == "v4_hybrid" and out.manifest.kv_cache.paged
    decode = engine["profiles"][0]["shapes"]
    assert decode["input_ids"] == [[1], [MAX_BATCH // 2], [MAX_BATCH]]
    assert decode["query_start_loc"] == [[2], [MAX_BATCH // 2 + 1], [MAX_BATCH + 1]]
