"""RmsNormFusion and SkipRmsNormFusion: one fused node per norm site, counts derived from the config,
logits unchanged (ORT, its own optimisations off) after each pass; small hand-written graphs for the
cases the exporter does not produce (no weight, fp16 casts, unused sum, unsupported shapes).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from moeforge.core.config import ModelConfig
from moeforge.passes.base import MS_DOMAIN, PassContext
from moeforge.passes.rms_norm import RmsNormFusion, SkipRmsNormFusion

from .conftest import PRESET_NAMES, random_feeds, run_ort

SLN = "SimplifiedLayerNormalization"
SKIP = "SkipSimplifiedLayerNormalization"


def expected_norm_sites(config: ModelConfig) -> int:
    layers = config.num_hidden_layers
    sites = 2 * layers + 1  # input_layernorm + post_attention_layernorm per layer, then the final norm
    if config.mla is not None:
        sites += layers  # kv_a_layernorm on the compressed kv latent (every MLA layer)
        if config.mla.q_lora_rank is not None:
            sites += layers  # q_a_layernorm, only when queries are low-rank too (V3 yes, V2-Lite no)
    return sites


def expected_skip_sites(config: ModelConfig) -> int:
    # A layer adds two residuals: x + attn feeds post_attention_layernorm, and x + mlp feeds the next
    # layer's input_layernorm (or the final norm after the last layer). Layer 0's input_layernorm
    # reads the embedding (no Add) and the MLA latent norms read projections, so the norms fed by an
    # Add are exactly the 2 residual adds per layer.
    return 2 * config.num_hidden_layers


def _ops(model: ir.Model) -> Counter[str]:
    return Counter(n.op_type for n in model.graph)


def _assert_same_logits(model: ir.Model, feeds: dict[str, np.ndarray], reference: np.ndarray) -> None:
    np.testing.assert_allclose(run_ort(model, feeds)[0], reference, rtol=0, atol=1e-5)


def _ctx(config: ModelConfig) -> PassContext:
    return PassContext(config=config, max_seq_len=64)


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_fuses_every_norm_site_with_parity(fresh_model, name):
    loaded, model = fresh_model(name)
    config, ctx = loaded.config, _ctx(loaded.config)
    feeds = random_feeds(config.vocab_size, batch=2, seq=7)
    reference = run_ort(model, feeds)[0]
    norms, skips = expected_norm_sites(config), expected_skip_sites(config)
    assert _ops(model)["RMSNormalization"] == norms  # the exporter still emits what the counts assume

    assert RmsNormFusion().apply(model, ctx) == norms
    ops = _ops(model)
    assert ops[SLN] == norms
    assert ops["RMSNormalization"] == ops["Pow"] == ops["ReduceMean"] == ops["ConstantOfShape"] == 0
    _assert_same_logits(model, feeds, reference)

    assert SkipRmsNormFusion().apply(model, ctx) == skips
    ops = _ops(model)
    assert ops[SKIP] == skips
    assert ops[SLN] == norms - skips  # layer 0's input norm and the MLA latent norms have no Add
    assert model.opset_imports[MS_DOMAIN] == 1
    assert not [n for n in model.graph if n.op_type == SLN and n.inputs[0].producer() is not None
                and n.inputs[0].producer().op_type == "Add"]
    _assert_same_logits(model, feeds, reference)

    # Everything fusable is fused: a second run finds nothing.
    assert RmsNormFusion().apply(model, ctx) == 0
    assert SkipRmsNormFusion().apply(model, ctx) == 0


def test_parity_check_catches_a_wrong_fusion(fresh_model):
    loaded, model = fresh_model("tiny-llama")
    ctx = _ctx(loaded.config)
    feeds = random_feeds(loaded.config.vocab_size, batch=2, seq=7)
    reference = run_ort(model, feeds)[0]
    RmsNormFusion().apply(model, ctx)
    SkipRmsNormFusion().apply(model, ctx)
    # A fusion that lost the weight (the classic bug: gamma = ones) must fail the parity assertion.
    skip = next(n for n in model.graph if n.op_type == SKIP)
    hidden = skip.inputs[2].shape[0]
    ones = ir.Value(name="ones_gamma", shape=ir.Shape([hidden]), type=ir.TensorType(ir.DataType.FLOAT),
                    const_value=ir.tensor(np.ones(hidden, np.float32), name="ones_gamma"))
    model.graph.register_initializer(ones)
    skip.replace_input_with(2, ones)
    with pytest.raises(AssertionError):
        _assert_same_logits(model, feeds, reference)


# ---------------------------------------------------------------------------------- hand-written graphs
def _parse(text: str) -> ir.Model:
    """ONNX text -> onnx-ir with inferred shapes (the passes read shapes and dtypes)."""
    proto = onnx.shape_inference.infer_shapes(onnx.parser.parse_model(text), strict_mode=True)
    return ir.serde.deserialize_model(proto)


def _feeds(model: ir.Model, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    sizes = {"B": 2, "S": 7}
    return {
        v.name: rng.standard_normal([sizes.get(str(d), d) for d in v.shape]).astype(v.dtype.numpy())
        for v in model.graph.inputs
    }


def _run_and_compare(model: ir.Model, fuse, atol: float = 1e-5) -> int:
    feeds = _feeds(model)
    reference = run_ort(model, feeds)
    count = fuse(model)
    for got, want in zip(run_ort(model, feeds), reference, strict=True):
        np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=0, atol=atol)
    return count


def _rms(model: ir.Model) -> int:
    return RmsNormFusion().apply(model, None)  # type: ignore[arg-type]  # the passes read nothing from ctx


def _skip(model: ir.Model) -> int:
    return SkipRmsNormFusion().apply(model, None)


OPSET = '<ir_version: 10, opset_import: ["" : 23]>'


def test_norm_without_a_weight_mul_is_still_fused():
    # Decision: an RMSNormalization that no weight Mul can absorb becomes SLN(x, scale) on its own
    # (the same numbers, no run-time ones tensor, and the skip fusion can then see it). A ones scale
    # (the exporter's ConstantOfShape of x's shape) becomes a constant ones[H].
    model = _parse(OPSET + """
    g (float[B, S, 8] x, float[8] s, float[8] w) => (float[B, S, 8] y, float[B, S, 8] z) {
        shape = Shape(x)
        ones = ConstantOfShape<value = float[1] {1.0}>(shape)
        n1 = RMSNormalization<epsilon = 1e-6>(x, ones)
        y = Relu(n1)
        n2 = RMSNormalization<epsilon = 1e-6>(x, s)
        z = Mul(w, n2)
    }""")
    assert _run_and_compare(model, _rms) == 2
    norms = [n for n in model.graph if n.op_type == SLN]
    assert len(norms) == 2 and _ops(model)["RMSNormalization"] == 0
    # The second norm's scale is not ones, so the weight Mul could not be folded: it stays.
    assert norms[1].inputs[1].name == "s" and _ops(model)["Mul"] == 1
    assert _ops(model)["ConstantOfShape"] == _ops(model)["Shape"] == 0  # the ones plumbing is gone
    assert all(n.attributes["stash_type"].as_int() == 1 for n in norms)
    assert all(n.attributes["epsilon"].as_float() == pytest.approx(1e-6) for n in norms)


def test_fp16_export_pattern_reads_x_directly():
    # What the exporter emits for an fp16 model: x.float() is a Cast that also feeds the ones'
    # Shape, and the result is cast back before the weight Mul. One SLN(x, w) replaces all of it.
    model = _parse(OPSET + """
    g (float16[B, S, 16] x, float16[16] w) => (float16[B, S, 16] y) {
        xf = Cast<to = 1>(x)
        shape = Shape<start = 0>(xf)
        ones = ConstantOfShape<value = float[1] {1.0}>(shape)
        normed = RMSNormalization<axis = -1, epsilon = 1e-6, stash_type = 1>(xf, ones)
        normed16 = Cast<to = 10>(normed)
        y = Mul(w, normed16)
    }""")
    # fp16 output: the fused kernel rounds once instead of twice, a difference of at most one ulp.
    assert _run_and_compare(model, _rms, atol=4e-3) == 1
    (node,) = list(model.graph)
    assert node.op_type == SLN and node.inputs[0].name == "x" and node.inputs[1].name == "w"


def test_skip_fusion_wires_the_sum_only_where_it_is_reused():
    # h = a + b is the residual stream (used again by the next Add): output 3 replaces it.
    # The last sum feeds only the final norm: decision: fuse anyway with output 0 only, so the sum
    # is never written out (ORT's kernel computes it internally either way).
    model = _parse(OPSET + """
    g (float[B, S, 8] a, float[B, S, 8] b, float[B, S, 8] c, float[8] w1, float[8] w2)
        => (float[B, S, 8] y1, float[B, S, 8] y2) {
        h = Add(a, b)
        n1 = RMSNormalization<epsilon = 1e-6>(h, w1)
        y1 = Relu(n1)
        h2 = Add(h, c)
        y2 = RMSNormalization<epsilon = 1e-5>(h2, w2)
    }""")
    assert _rms(model) == 2
    assert _run_and_compare(model, _skip) == 2
    assert _ops(model) == Counter({SKIP: 2, "Relu": 1})
    reused, final = (n for n in model.graph if n.op_type == SKIP)
    assert reused.domain == MS_DOMAIN and [v.name for v in reused.inputs] == ["a", "b", "w1"]
    assert len(reused.outputs) == 4 and reused.outputs[1].name == reused.outputs[2].name == ""
    assert final.inputs[0] is reused.outputs[3]  # the residual stream now comes from output 3
    assert len(final.outputs) == 1 and final.outputs[0].is_graph_output()
    assert reused.attributes["epsilon"].as_float() == pytest.approx(1e-6)
    assert final.attributes["epsilon"].as_float() == pytest.approx(1e-5)


def test_unsupported_sites_are_left_alone():
    # Norm over the last two axes: SLN(axis=-1) would be wrong, so nothing is touched.
    model = _parse(OPSET + """
    g (float[B, S, 8] x, float[S, 8] s) => (float[B, S, 8] y) {
        y = RMSNormalization<axis = -2>(x, s)
    }""")
    before = ir.serde.serialize_model(model).SerializeToString()
    assert _rms(model) == 0
    assert ir.serde.serialize_model(model).SerializeToString() == before

    # Add with a broadcast bias, and rank-4 activations: ORT's skip kernel takes neither.
    model = _parse(OPSET + """
    g (float[B, S, 8] x, float[8] bias, float[2, B, S, 8] u, float[2, B, S, 8] v, float[8] w)
        => (float[B, S, 8] y, float[2, B, S, 8] z) {
        h = Add(x, bias)
        y = RMSNormalization(h, w)
        k = Add(u, v)
        z = RMSNormalization(k, w)
    }""")
    assert _rms(model) == 2
    assert _run_and_compare(model, _skip) == 0
    assert _ops(model) == Counter({"Add": 2, SLN: 2})
