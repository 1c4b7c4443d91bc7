"""Static activation quantisation (w8a8): calibrated ranges against independent computations (numpy on a
hand-built graph, PyTorch hooks on tiny-llama), percentile vs min-max on a planted outlier, and the quantised
graph -- as ONNX Runtime fuses it -- against a numpy fake-quant reference."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, numpy_helper
from onnx import helper as oh

from moeforge.passes.base import PassContext
from moeforge.passes.pipeline import ort_pipeline, run_passes
from moeforge.passes.quant_activations import (
    ActivationQuantization,
    OrtActivationLowering,
    fake_quantize_activation,
)
from moeforge.passes.quant_math import fake_quantize
from moeforge.passes.quant_weights import QuantConfig, WeightQuantization, quant_targets
from moeforge.quant.act_calibration import ActivationPlan, ActivationSpec, calibrate, percentile_from_top, top_count

V, K, N = 64, 256, 128
OUTLIER_TOKEN = 7


def _toy(outlier: float | None = None) -> tuple[ir.Model, np.ndarray, np.ndarray]:
    """input_ids -> Gather(table [V, K]) = x -> MatMul(W1 [K, N]) = h -> MatMul(W2) = logits: x is the table's
    rows, so its range is known without running anything. Returns (model, table, W1)."""
    rng = np.random.default_rng(0)
    table = rng.standard_normal((V, K)).astype(np.float32)
    if outlier is not None:
        table[OUTLIER_TOKEN, 3] = outlier
    w1 = rng.standard_normal((K, N)).astype(np.float32)
    w2 = rng.standard_normal((N, V)).astype(np.float32)
    nodes = [oh.make_node("Gather", ["table", "input_ids"], ["x"]), oh.make_node("MatMul", ["x", "w1"], ["h"]),
             oh.make_node("MatMul", ["h", "w2"], ["logits"])]
    graph = oh.make_graph(
        nodes, "toy", [oh.make_tensor_value_info("input_ids", TensorProto.INT64, [1, "s"])],
        [oh.make_tensor_value_info("logits", TensorProto.FLOAT, [1, "s", V]),
         oh.make_tensor_value_info("h", TensorProto.FLOAT, [1, "s", N])],
        [numpy_helper.from_array(a, n) for a, n in ((table, "table"), (w1, "w1"), (w2, "w2"))])
    proto = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)])
    proto.ir_version = 10
    return ir.serde.deserialize_model(proto), table, w1


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, V, 40).tolist() for _ in range(3)]
    prompts[1][5] = OUTLIER_TOKEN
    return prompts


def _optimized(model: ir.Model, path) -> tuple[ort.InferenceSession, list[str]]:
    """A session with ONNX Runtime's full optimisations (its QDQ fusion) and the op types it ended up running."""
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(path)
    options.log_severity_level = 3
    session = ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    return session, [n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node]


def test_minmax_and_percentile_ranges_on_a_planted_outlier():
    model, table, _ = _toy(outlier=1000.0)
    prompts = _prompts()
    x = np.abs(table[np.concatenate(prompts)])  # the activation, independently: rows of the table
    minmax = calibrate(model, ["x"], prompts, ActivationSpec("int8", "minmax"))["x"]
    pct = calibrate(model, ["x"], prompts, ActivationSpec("int8", "percentile", 99.9))["x"]
    assert minmax == 1000.0
    assert pct == pytest.approx(float(np.percentile(x, 99.9)), rel=1e-6)
    assert pct < 10 < minmax  # the outlier stretches min-max; the percentile ignores it
    assert ActivationSpec("int8").scale(minmax) == pytest.approx(1000.0 / 127)
    assert ActivationSpec("fp8").scale(minmax) == pytest.approx(1000.0 / 448)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 3000), p=st.floats(50.001, 100.0), seed=st.integers(0, 2**16))
def test_streamed_percentile_equals_numpy(n, p, seed):
    """The calibration keeps only each tensor's largest values; the percentile from them is numpy's."""
    values = np.abs(np.random.default_rng(seed).standard_normal(n)).astype(np.float32)
    top = np.sort(values)[n - top_count(n, p):]
    assert percentile_from_top(top, n, p) == pytest.approx(float(np.percentile(values, p)), rel=1e-6, abs=1e-7)


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_quantised_graph_equals_numpy_fake_quant(tmp_path, dtype):
    """h = fq(x) @ fq(W1) with the calibrated scale, through ORT's own optimiser (int8: fused MatMulIntegerToFloat,
    whose default U8S8 kernel saturates on AVX2 -- the uint8 re-encoding must keep it exact). The 99th percentile
    range clips ~1% of x: int8 codes at -128/127, float8 at +-448."""
    model, table, w1 = _toy()
    prompts = _prompts()
    spec = ActivationSpec(dtype, "percentile", 99.0)
    plan = ActivationPlan(spec, calibrate(model, ["x"], prompts, spec))
    WeightQuantization(QuantConfig(kind=dtype, block_size=None)).apply(model, PassContext(config=None, max_seq_len=64))
    passes = [ActivationQuantization(plan.scales, dtype)] + ([OrtActivationLowering()] if dtype == "int8" else [])
    for graph_pass in passes:
        assert graph_pass.apply(model, PassContext(config=None, max_seq_len=64)) == 1
    q = next(n for n in model.graph if n.op_type == "QuantizeLinear")
    scale = float(q.inputs[1].const_value.numpy())
    expected_amax = np.percentile(np.abs(table[np.concatenate(prompts)]), 99.0)
    assert scale == pytest.approx(expected_amax / (127.0 if dtype == "int8" else 448.0), rel=1e-6)
    session, ops = _optimized(model, tmp_path / "opt.onnx")
    if dtype == "int8":
        assert ops.count("MatMulIntegerToFloat") == 1, ops
    ids = np.concatenate(prompts)[None]
    x = table[ids[0]]
    assert (np.abs(x) > expected_amax).any()  # some values are clipped
    h = session.run(["h"], {"input_ids": ids})[0][0]
    reference = fake_quantize_activation(x, scale, dtype).astype(np.float64) @ \
        fake_quantize(w1, dtype, None).astype(np.float64)
    np.testing.assert_allclose(h, reference, rtol=0, atol=2e-5 * np.abs(reference).max())
    assert np.abs(h - x @ w1).max() > 1e-2 * np.abs(reference).max()  # really quantised


@pytest.fixture(scope="module")
def tiny_llama(stateless_models):
    """(loaded, ORT-pipeline graph, prompts, PyTorch nn.Linear inputs [tokens, K] per module on those prompts)."""
    loaded, exported = stateless_models["tiny-llama"]
    model = ir.serde.deserialize_model(ir.serde.serialize_model(exported))
    run_passes(model, PassContext(config=loaded.config, max_seq_len=256), ort_pipeline())
    prompts = [np.random.default_rng(s).integers(0, loaded.config.vocab_size, 12 + s).tolist() for s in range(3)]
    seen: dict[str, list[np.ndarray]] = {}
    hooks = [module.register_forward_pre_hook(
        lambda mod, args, name=name: seen.setdefault(name, []).append(args[0].reshape(-1, args[0].shape[-1]).numpy()))
        for name, module in loaded.model.named_modules() if isinstance(module, torch.nn.Linear)]
    with torch.inference_mode():
        for ids in prompts:  # one prefill each, like the calibration runner
            loaded.model(torch.tensor([ids]), torch.arange(len(ids))[None])
    for hook in hooks:
        hook.remove()
    return loaded, model, prompts, {name: np.concatenate(rows) for name, rows in seen.items()}


def _copy(model: ir.Model) -> ir.Model:
    return ir.serde.deserialize_model(ir.serde.serialize_model(model))


def test_tiny_llama_scales_match_pytorch_activations(tiny_llama):
    """Each quantised MatMul's scale is max|x| / 127 with x its PyTorch nn.Linear input on the same prompts."""
    loaded, graph, prompts, inputs = tiny_llama
    model = _copy(graph)
    ctx = PassContext(config=loaded.config, max_seq_len=256)
    plan = ActivationPlan.calibrate(model, ActivationSpec("int8", "minmax"), prompts)  # no smoothing, keep none
    # graph order per layer: packed q/k/v (reads q_proj's input), o_proj, packed gate/up, down_proj
    modules = [f"model.layers.{i}.{m}" for i in range(loaded.config.num_hidden_layers)
               for m in ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj")]
    expected = [float(np.abs(inputs[m]).max()) for m in modules]
    assert list(plan.amax.values()) == pytest.approx(expected, rel=1e-4)
    WeightQuantization(QuantConfig(kind="int8", block_size=None)).apply(model, ctx)
    assert ActivationQuantization(plan.scales, "int8").apply(model, ctx) == len(modules)
    graph_scales = {n.inputs[0].name: float(n.inputs[1].const_value.numpy()) for n in model.graph
                    if n.op_type == "QuantizeLinear"}
    assert [graph_scales[name] for name in plan.amax] == pytest.approx([e / 127 for e in expected], rel=1e-4)
    head = next(n for n in model.graph if any(o.name == "logits" for o in n.outputs))
    assert head.inputs[0].producer().op_type != "DequantizeLinear"  # the LM head keeps fp32 activations
    assert OrtActivationLowering().apply(model, ctx) == len(modules)


def test_smoothquant_scales_and_kept_down_proj_match_pytorch(tiny_llama):
    """SmoothQuant s_j = max|x_j|^a / max|W_j|^(1-a) (normalised), from PyTorch's o_proj input and weight; the range
    is taken over x / s; down_proj (default --act-keep-fp32) gets no Q/DQ."""
    loaded, graph, prompts, inputs = tiny_llama
    model = _copy(graph)
    spec = ActivationSpec("int8", "minmax", alpha=0.5, keep=("down_proj",))
    plan = ActivationPlan.calibrate(model, spec, prompts)
    assert plan.kept == [f"model_layers_{i}_mlp_down_proj" for i in range(loaded.config.num_hidden_layers)]
    targets = {t.label: t for t in quant_targets(model)}
    for i in range(loaded.config.num_hidden_layers):
        x = inputs[f"model.layers.{i}.self_attn.o_proj"]
        w = loaded.model.get_submodule(f"model.layers.{i}.self_attn.o_proj").weight.detach().numpy()  # [N, K]
        s = np.sqrt(np.abs(x).max(0)) / np.sqrt(np.abs(w).max(0))
        s = s / np.sqrt(s.max() * s.min())
        name = targets[f"model_layers_{i}_self_attn_o_proj"].name
        np.testing.assert_allclose(plan.smoothing[name], s, rtol=1e-4)
        assert plan.amax[f"{name}.awq_input"] == pytest.approx(float(np.abs(x / s).max()), rel=1e-4)
    ctx = PassContext(config=loaded.config, max_seq_len=256)
    WeightQuantization(QuantConfig(kind="int8", block_size=None, awq_scales=plan.smoothing)).apply(model, ctx)
    assert ActivationQuantization(plan.scales, "int8").apply(model, ctx) == 3 * loaded.config.num_hidden_layers
    for i in range(loaded.config.num_hidden_layers):
        down = targets[f"model_layers_{i}_mlp_down_proj"].node
        assert down.inputs[1].producer().op_type == "DequantizeLinear"  # int8 weights ...
        assert down.inputs[0].producer().op_type != "DequantizeLinear"  # ... fp32 activations
