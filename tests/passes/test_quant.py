"""Weight quantisation passes: the numpy quantisers, the portable Q/DQ graph against ONNX Runtime's own
DequantizeLinear, the MatMulNBits / QMoE lowering against the portable graph, AWQ, exact FP8 recovery,
and mixed precision choosing a planted outlier layer."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moeforge.model.fp8 import dequantize_fp8_blockwise, quantize_fp8_blockwise
from moeforge.passes.base import PassContext
from moeforge.passes.pipeline import ort_pipeline, run_passes
from moeforge.passes.quant_lowering import QuantLowering
from moeforge.passes.quant_math import awq_search, fake_quantize, quantize, quantize_asym, quantize_fp8_exact
from moeforge.passes.quant_weights import QuantConfig, WeightQuantization, quant_targets
from moeforge.passes.sparse_experts import SparseExperts
from moeforge.quant.sensitivity import choose_kept, measure

from .conftest import run_ort

CALIB_TEXT = ["The lighthouse keeper wrote the weather in his logbook every night.",
              "Bread needs flour, water, salt and yeast.", "The train left the station late."]


@pytest.fixture(scope="module")
def ort_graphs(stateless_models) -> dict[str, tuple[object, ir.Model]]:
    """name -> (LoadedModel, graph after the ONNX Runtime pipeline: GQA cache I/O, packing, MoE)."""
    out = {}
    for name in ("tiny-llama", "tiny-deepseek-v3"):
        loaded, model = stateless_models[name]
        copy = ir.serde.deserialize_model(ir.serde.serialize_model(model))
        run_passes(copy, PassContext(config=loaded.config, max_seq_len=256), ort_pipeline())
        out[name] = (loaded, copy)
    return out


def _copy(model: ir.Model) -> ir.Model:
    return ir.serde.deserialize_model(ir.serde.serialize_model(model))


def _feeds(model: ir.Model, vocab: int, seq: int = 9) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    feeds = {"input_ids": rng.integers(0, vocab, (1, seq)), "position_ids": np.arange(seq)[None],
             "attention_mask": np.ones((1, seq), np.int64)}
    for value in model.graph.inputs:
        if value.name.startswith("past_key_values."):
            _, heads, _, dim = value.shape
            feeds[value.name] = np.zeros((1, heads, seq, dim), np.float32)
    return feeds


def _logits(model: ir.Model, feeds, optimize: bool = False) -> np.ndarray:
    names = [v.name for v in model.graph.outputs]
    return run_ort(model, feeds, optimize=optimize)[names.index("logits")]


# ---------------------------------------------------------------------------------------- quantisers
@settings(max_examples=30, deadline=None)
@given(st.sampled_from(["int8", "int4"]), st.sampled_from([None, 16, 32]), st.integers(0, 2**31 - 1))
def test_rounding_error_is_at_most_half_a_step(kind, block, seed):
    w = np.random.default_rng(seed).standard_normal((64, 24)).astype(np.float32) * 3
    q = quantize(w, kind, block)
    step = q.scale[None, :] if block is None else np.repeat(q.scale, block, axis=0)
    assert np.all(np.abs(q.dequantize() - w) <= step / 2 * (1 + 1e-5))
    low, high = (-8, 7) if kind == "int4" else (-127, 127)
    assert q.values.min() >= low and q.values.max() <= high


def test_block_must_divide_k():
    with pytest.raises(ValueError, match="does not divide"):
        quantize(np.ones((48, 4), np.float32), "int4", 32)


def test_fp8_recovers_checkpoint_blocks_exactly():
    # A DeepSeek-style FP8 weight [out, in] with 128 x 128 block scales (moeforge/model/fp8.py, an independent
    # implementation), dequantised as the loader does, comes back bit-exact; plain RTN does not.
    torch.manual_seed(0)
    w = torch.randn(320, 256) * torch.rand(320, 1) * 3
    q, scale_inv = quantize_fp8_blockwise(w, 128)
    weight = dequantize_fp8_blockwise(q, scale_inv, 128).numpy().T.copy()  # ours: [K=in, N=out]
    assert np.array_equal(quantize_fp8_exact(weight, 128).dequantize(), weight)
    assert not np.array_equal(fake_quantize(weight, "fp8", 128), weight)


def test_asym_recovers_q4_1_blocks():
    # llama.cpp Q4_1 (SmolLM2's GGUF layer weights): per 32-block w = d * q + m, q in 0..15, written here
    # independently (blocks along K of our [K, N] layout). Min-max asymmetric int4 brings them back up to fp32
    # rounding; symmetric int4 cannot (its grid is centred on 0).
    rng = np.random.default_rng(0)
    k, n = 128, 24
    d = rng.uniform(0.001, 0.05, (k // 32, 1, n)).astype(np.float32)
    m = rng.uniform(-0.4, 0.0, (k // 32, 1, n)).astype(np.float32)
    q = rng.integers(0, 16, (k // 32, 32, n))
    q[:, 0], q[:, 1] = 0, 15  # each block reaches both ends, as Q4_1's min/max rounding makes it
    w = (d * q + m).reshape(k, n).astype(np.float32)
    a = quantize_asym(w, 32)
    assert a.codes.dtype == np.uint8 and a.codes.max() <= 15
    np.testing.assert_allclose(a.dequantize(), w, atol=1e-6, rtol=0)
    np.testing.assert_array_equal(a.codes, q.reshape(k, n))
    np.testing.assert_allclose(a.zero_point() * a.scale, -m[:, 0], rtol=1e-5, atol=1e-7)
    assert np.abs(fake_quantize(w, "int4", 32) - w).max() > 100 * np.abs(a.dequantize() - w).max()
    # 8-bit min-max blocks reproduce Q4_1 too: 255 = 15 * 17, so level q lands on code 17 q.
    a8 = quantize_asym(w, 32, bits=8)
    np.testing.assert_array_equal(a8.codes, 17 * q.reshape(k, n))
    np.testing.assert_allclose(a8.dequantize(), w, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="does not divide"):
        quantize_asym(np.ones((48, 4), np.float32), 32)


def test_awq_beats_rtn_on_activation_outliers():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 128)).astype(np.float32)
    x[:, :4] *= 30  # a few salient input channels, as in real LLM activations
    w = rng.standard_normal((128, 64)).astype(np.float32) * 0.05
    s, alpha = awq_search(w, x, np.abs(x).mean(0), "int4", 32)
    rtn = np.square(x @ fake_quantize(w, "int4", 32) - x @ w).mean()
    awq = np.square((x / s) @ fake_quantize(w * s[:, None], "int4", 32) - x @ w).mean()
    assert alpha > 0 and awq < 0.8 * rtn


# ---------------------------------------------------------------------------------------- graph passes
def _fake_quantised_logits(base, feeds, kind, block, dense=None, experts=None):
    """Reference: logits of the fp32 graph with every weight replaced by dequantise(quantise(W)) in numpy
    (2D weights by ``dense``, MoE experts [K, N] each by ``experts``; default symmetric ``kind``/``block``);
    returns (logits, quant targets)."""
    reference = _copy(base)
    targets = quant_targets(reference)
    for target in targets:
        w = target.node.inputs[target.index].const_value.numpy()
        if target.is_moe:
            per_expert = experts or (lambda m: fake_quantize(m, kind, block))
            fq = np.stack([per_expert(w[e].T).T for e in range(w.shape[0])])
        else:
            fq = dense(w) if dense is not None else fake_quantize(w, kind, block)
        target.node.inputs[target.index].const_value = ir.tensor(fq.astype(np.float32), name=target.name)
    return _logits(reference, feeds), targets


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-deepseek-v3"])
@pytest.mark.parametrize(("kind", "block"), [("int8", None), ("int4", 32), ("fp8", 32), ("int8", 16)])
def test_qdq_graph_equals_fake_quantised_weights(ort_graphs, name, kind, block):
    loaded, base = ort_graphs[name]
    feeds = _feeds(base, loaded.config.vocab_size)
    expected, targets = _fake_quantised_logits(base, feeds, kind, block)
    portable = _copy(base)
    count = WeightQuantization(QuantConfig(kind, block)).apply(portable, None)
    assert count == len(targets) > 0
    ops = [n.op_type for n in portable.graph]
    assert ops.count("DequantizeLinear") == count
    # ONNX Runtime's DequantizeLinear kernel (optimisations off) computes exactly our dequantised weights.
    np.testing.assert_allclose(_logits(portable, feeds), expected, atol=2e-5, rtol=1e-5)
    # Zero points are absent (symmetric), as TensorRT requires.
    assert all(len(n.inputs) == 2 for n in portable.graph if n.op_type == "DequantizeLinear")
    # Lowered with fp32 activations (accuracy_level 0) the integer kernels give the same logits.
    lowered = _copy(portable)
    rewritten = QuantLowering(accuracy_level=0).apply(lowered, None)
    lowered_ops = [n.op_type for n in lowered.graph]
    if kind == "fp8":
        assert rewritten == 0  # no fp8 GEMM on ORT CPU: DQ + MatMul stay
        return
    assert lowered_ops.count("DequantizeLinear") == 0
    assert lowered_ops.count("MatMulNBits") + 3 * lowered_ops.count("QMoE") >= count - 1
    if name == "tiny-deepseek-v3":
        assert lowered_ops.count("QMoE") == 2 and "MoE" not in lowered_ops
        assert lowered_ops.count("Gemm") == 2  # the routers (router logits = Gemm) stay fp32
    # Block-wise 8-bit QMoE always quantises activations to int8 (ORT's documented behaviour): looser.
    atol = 0.1 if (name == "tiny-deepseek-v3" and kind == "int8" and block) else 2e-4
    np.testing.assert_allclose(_logits(lowered, feeds, optimize=True), expected, atol=atol)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-deepseek-v3"])
def test_asym_graph_and_exact_fast_lowering(ort_graphs, name, bits):
    # int4-asym / int8-asym (head included here): every 2D MatMul weight and every MoE expert is min-max blocks
    # with a float offset (numpy quantize_asym).
    kind = f"int{bits}"
    loaded, base = ort_graphs[name]
    feeds = _feeds(base, loaded.config.vocab_size)

    def asym(w):
        return quantize_asym(w, 32, bits).dequantize()
    expected, targets = _fake_quantised_logits(base, feeds, kind, 32, dense=asym, experts=asym)
    portable = _copy(base)
    count = WeightQuantization(QuantConfig(kind, 32, asymmetric=True, head_asymmetric=True)).apply(portable, None)
    dense = sum(not t.is_moe for t in targets)
    assert count == len(targets) and dense > 0
    offsets = [n for n in portable.graph if n.op_type == "Add" and (n.outputs[0].name or "").endswith(".blocks_offset")]
    assert len(offsets) == len(targets)
    dqs = [n for n in portable.graph if n.op_type == "DequantizeLinear"]
    assert sum(n.inputs[0].dtype == (ir.DataType.UINT4 if bits == 4 else ir.DataType.UINT8) for n in dqs) == count
    # Standard ONNX ops only (DequantizeLinear, Reshape, Add), run by ONNX Runtime with optimisations off.
    np.testing.assert_allclose(_logits(portable, feeds), expected, atol=2e-5, rtol=1e-5)
    lowered = _copy(portable)
    QuantLowering(accuracy_level=0).apply(lowered, None)
    SparseExperts(accuracy_level=0).apply(lowered, None)
    nbits = [n for n in lowered.graph if n.op_type == "MatMulNBits"]
    # Fast exact form: MatMulNBits on its default zero point (no zero_points input) + the block offsets'
    # share as (block sums of x) @ offsets, the sums a ReduceSum over a Reshape (no [K, K/32] indicator MatMul).
    assert len(nbits) == dense and all(len(n.inputs) == 3 and n.attributes["bits"].as_int() == bits for n in nbits)
    offset_matmuls = [n for n in lowered.graph if n.op_type == "MatMul" and (n.inputs[1].name or "").endswith(
        ".block_offset")]
    assert len(offset_matmuls) == dense
    sums = [m.inputs[0].producer() for m in offset_matmuls]
    assert all(s is not None and s.op_type == "ReduceSum" for s in sums)
    assert all((s.inputs[0].producer() or s).op_type == "Reshape" for s in sums if s is not None)
    assert not any((n.inputs[1].name or "").endswith(".block_indicator") for n in lowered.graph
                   if n.op_type == "MatMul")
    ops = [n.op_type for n in lowered.graph]
    assert "DequantizeLinear" not in ops and not any(n.op_type == "Add" and (n.outputs[0].name or "").endswith(
        ".blocks_offset") for n in lowered.graph)
    if name == "tiny-deepseek-v3":  # the experts: one If per expert over MatMulNBits + offsets (sparse_experts)
        experts = loaded.config.moe.n_routed_experts
        assert "QMoE" not in ops and "MoE" not in ops and ops.count("If") == 2 * experts
    np.testing.assert_allclose(_logits(lowered, feeds, optimize=True), expected, atol=2e-4)


@pytest.mark.parametrize("bits", [4, 8])
def test_asym_digit_lowering_is_one_matmulnbits_and_keeps_the_residual(ort_graphs, bits):
    # --asym-offsets digit: one MatMulNBits per dense projection over [x, block sums of x] with integer zero points,
    # no float offsets. With fp32 activations (accuracy level 0) its logits stay close to the exact weights', and
    # the residual it carries matters: zeroing the extra blocks' scales (integer zero points alone, ORT's own
    # asymmetric int4) is several times further off.
    loaded, base = ort_graphs["tiny-llama"]
    feeds = _feeds(base, loaded.config.vocab_size)
    portable = _copy(base)
    WeightQuantization(QuantConfig(f"int{bits}", 32, asymmetric=True, head_asymmetric=True)).apply(portable, None)
    exact = _logits(portable, feeds)
    lowered = _copy(portable)
    dense = QuantLowering(accuracy_level=0, asym_offsets="digit").apply(lowered, None)
    nbits = [n for n in lowered.graph if n.op_type == "MatMulNBits"]
    assert dense == len(nbits) > 0
    ops = [n.op_type for n in lowered.graph]
    assert "DequantizeLinear" not in ops and not any((n.inputs[1].name or "").endswith(".block_offset")
                                                    for n in lowered.graph if n.op_type == "MatMul")
    for node in nbits:
        widened = node.inputs[0].producer()
        assert widened is not None and widened.op_type == "Concat" and len(node.inputs) == 4
        k = widened.inputs[0].shape[-1] if widened.inputs[0].shape is not None else None
        assert k is None or node.attributes["K"].as_int() == k + k // 32
    digit = _logits(lowered, feeds)
    dropped = _copy(lowered)
    for node in (n for n in dropped.graph if n.op_type == "MatMulNBits"):
        k, n = node.attributes["K"].as_int(), node.attributes["N"].as_int()
        main = -(-(k - k // 33) // 32)  # the weight's own blocks; the rest hold the residual
        scales = node.inputs[2].const_value.numpy().reshape(n, -1).copy()
        scales[:, main:] = 0
        node.inputs[2].const_value = ir.tensor(scales.reshape(node.inputs[2].const_value.shape.numpy()),
                                               name=node.inputs[2].name)
    no_residual = _logits(dropped, feeds)
    scale = np.abs(exact).max()
    err_digit, err_dropped = np.abs(digit - exact).max(), np.abs(no_residual - exact).max()
    assert err_digit < 0.05 * scale, (err_digit, scale)
    assert err_digit * 4 < err_dropped, (err_digit, err_dropped)


def test_router_and_embedding_stay_fp32(ort_graphs):
    _, base = ort_graphs["tiny-deepseek-v3"]
    model = _copy(base)
    WeightQuantization(QuantConfig("int4", 32)).apply(model, None)
    routers = 0
    for node in model.graph:
        if node.op_type == "Gather" and node.inputs[0].const_value is not None:
            assert node.inputs[0].dtype == ir.DataType.FLOAT
        if node.op_type in ("Gemm", "MatMul") and "gate.weight" in (node.inputs[1].name or ""):
            routers += 1
            assert node.inputs[1].producer() is None and node.inputs[1].dtype == ir.DataType.FLOAT
    assert routers == 2  # both MoE layers' router logits were found (and left fp32)


def test_awq_graph_matches_its_reference(ort_graphs):
    # AWQ: W * s quantised, activation * (1/s): the graph must equal x/s @ fq(W*s) computed in numpy.
    loaded, base = ort_graphs["tiny-llama"]
    feeds = _feeds(base, loaded.config.vocab_size)
    model, reference = _copy(base), _copy(base)
    rng = np.random.default_rng(1)
    scales = {}
    for target, ref_target in zip(quant_targets(model), quant_targets(reference), strict=True):
        s = rng.uniform(0.5, 2.0, target.shape[0]).astype(np.float32)
        scales[target.name] = s
        w = ref_target.node.inputs[1].const_value.numpy()
        fq = fake_quantize(w * s[:, None], "int4", 32) / s[:, None]
        ref_target.node.inputs[1].const_value = ir.tensor(fq.astype(np.float32), name=ref_target.name)
    WeightQuantization(QuantConfig("int4", 32, awq_scales=scales)).apply(model, None)
    assert sum(n.op_type == "Mul" and (n.outputs[0].name or "").endswith("awq_input") for n in model.graph) == 9
    np.testing.assert_allclose(_logits(model, feeds), _logits(reference, feeds), atol=1e-4, rtol=1e-4)


def test_mixed_precision_keeps_the_planted_outlier_layer(ort_graphs):
    loaded, base = ort_graphs["tiny-llama"]
    model = _copy(base)
    targets = quant_targets(model)
    planted = targets[4]  # layer 1's packed q/k/v projection
    w = planted.node.inputs[1].const_value.numpy().copy()
    rng = np.random.default_rng(0)
    rows = np.arange(0, w.shape[0], 32) + rng.integers(0, 32, w.shape[0] // 32)
    w[rows, :] = 25 * np.abs(w).max() * np.sign(rng.standard_normal((len(rows), w.shape[1])))  # one per block
    planted.node.inputs[1].const_value = ir.tensor(w, name=planted.name)
    prompts = [loaded.tokenizer.encode(t) for t in CALIB_TEXT]
    rows_kl = measure(model, prompts, "int4", 32)
    assert len(rows_kl) == len(targets)
    kept = choose_kept(rows_kl, 1 / len(targets))
    assert [r.name for r in kept] == [planted.name], [(r.label, r.kl) for r in rows_kl]
    assert rows_kl[0].kl > 1.5 * rows_kl[1].kl


def test_kept_parts_are_served_once_and_recomputed_past_the_cap(monkeypatch):
    # The experts' scales/offsets made with their codes are kept until written (_KeptParts); past the byte cap, or
    # read a second time, they are recomputed rather than lost.
    import moeforge.passes.quant_weights as qw

    recomputed = []

    def recompute(e):
        recomputed.append(e)
        return {"scale": np.full(4, -e, np.float32), "offset": np.full(4, -10 * e, np.float32)}

    monkeypatch.setattr(qw, "PENDING_SCALE_BYTES", 40)  # room for one expert's two parts (32 bytes)
    kept = qw._KeptParts(recompute)
    kept.keep(1, {"scale": np.full(4, 1, np.float32), "offset": np.full(4, 10, np.float32)})
    kept.keep(2, {"scale": np.full(4, 2, np.float32), "offset": np.full(4, 20, np.float32)})  # over the cap
    scale, offset = kept.reader("scale"), kept.reader("offset")
    assert scale(1)[0] == 1 and offset(1)[0] == 10 and recomputed == []
    assert scale(2)[0] == -2 and recomputed == [2]  # not kept: recomputed
    assert scale(1)[0] == -1 and recomputed == [2, 1]  # served once, then recomputed
    kept.keep(3, {"scale": np.full(4, 3, np.float32), "offset": np.full(4, 30, np.float32)})  # room again
    assert offset(3)[0] == 30 and scale(3)[0] == 3 and recomputed == [2, 1]
