"""RotaryFusion: every rope application becomes one com.microsoft.RotaryEmbedding, logits unchanged.

Parity runs ORT with its own optimisations off, before vs after the pass, at positions that start
at 100 and jump (so a wrong cache row, layout or amplitude shows).
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import onnx_ir as ir
import pytest
import torch

from moeforge.compile.onnx_export import export_stateless
from moeforge.model.model import CausalLM, init_random_weights
from moeforge.model.presets import get_preset
from moeforge.model.rope import rope_inverse_frequencies
from moeforge.passes.base import MS_DOMAIN, PassContext
from moeforge.passes.cleanup import Cleanup
from moeforge.passes.rotary import COS_CACHE, SIN_CACHE, RotaryFusion

from .conftest import PRESET_NAMES, random_feeds, run_ort

MAX_SEQ_LEN = 256
POSITIONS = np.array([np.arange(100, 107), [100, 101, 102, 150, 151, 152, 153]], dtype=np.int64)  # [B=2, S=7]


def _feeds(vocab: int) -> dict[str, np.ndarray]:
    feeds = random_feeds(vocab, batch=2, seq=7, seed=3)
    feeds["position_ids"] = POSITIONS
    return feeds


def _ctx(config) -> PassContext:
    return PassContext(config=config, max_seq_len=MAX_SEQ_LEN)


def _ropes(model: ir.Model) -> list[ir.Node]:
    return [n for n in model.graph if n.op_type == "RotaryEmbedding" and n.domain == MS_DOMAIN]


def _rope_slices(model: ir.Model) -> list[ir.Node]:
    """Slices feeding a Mul: the exporter's rope halves / even-odd dims (nothing else slices into a Mul)."""
    return [
        n for n in model.graph if n.op_type == "Slice" and any(u.node.op_type == "Mul" for u in n.outputs[0].uses())
    ]


def _attr(node: ir.Node, name: str) -> int:
    return node.attributes[name].as_int()


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_fuses_every_rope_application_with_parity(fresh_model, name):
    loaded, model = fresh_model(name)
    config = loaded.config
    feeds = _feeds(config.vocab_size)
    before = run_ort(model, feeds)[0]
    assert len(_rope_slices(model)) == 4 * config.num_hidden_layers  # the helper sees the pattern

    count = RotaryFusion().apply(model, _ctx(config))

    assert count == 2 * config.num_hidden_layers
    ops = Counter(n.op_type for n in model.graph)
    assert ops["Cos"] == ops["Sin"] == 0
    assert _rope_slices(model) == []
    assert model.opset_imports[MS_DOMAIN] == 1
    ropes = _ropes(model)
    assert len(ropes) == count
    position_ids = next(v for v in model.graph.inputs if v.name == "position_ids")
    cos_cache, sin_cache = model.graph.initializers[COS_CACHE], model.graph.initializers[SIN_CACHE]
    half = config.rope_dim // 2
    assert cos_cache.const_value.shape == sin_cache.const_value.shape == (MAX_SEQ_LEN, half)
    for node in ropes:
        assert _attr(node, "interleaved") == int(config.rope.interleaved)
        assert _attr(node, "rotary_embedding_dim") == config.rope_dim
        assert list(node.inputs) == [node.inputs[0], position_ids, cos_cache, sin_cache]
        assert node.inputs[0].shape[2] == _attr(node, "num_heads") * config.rope_dim  # [B, S, H*D]
    # q and k per layer: GQA Hq and Hkv heads; MLA q_pe has H heads, the shared k_pe one.
    k_heads = 1 if config.mla is not None else config.num_key_value_heads
    heads = Counter(_attr(n, "num_heads") for n in ropes)
    assert heads == Counter([config.num_attention_heads, k_heads] * config.num_hidden_layers)

    np.testing.assert_allclose(run_ort(model, feeds)[0], before, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_cache_rows_are_the_models_cos_sin(fresh_model, name):
    # Independent of the pass's formula: the torch module's own (float32) cos/sin at these positions.
    loaded, model = fresh_model(name)
    RotaryFusion().apply(model, _ctx(loaded.config))
    with torch.no_grad():
        cos, sin = loaded.model.model.rotary(torch.from_numpy(POSITIONS))  # [B, S, D/2]
    table = {name: model.graph.initializers[name].const_value.numpy() for name in (COS_CACHE, SIN_CACHE)}
    np.testing.assert_allclose(table[COS_CACHE][POSITIONS], cos.numpy(), rtol=0, atol=1e-5)
    np.testing.assert_allclose(table[SIN_CACHE][POSITIONS], sin.numpy(), rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_wrong_interleaved_attribute_breaks_parity(fresh_model, name):
    # Negative control for the parity test above: the layout attribute matters at these positions.
    loaded, model = fresh_model(name)
    feeds = _feeds(loaded.config.vocab_size)
    before = run_ort(model, feeds)[0]
    RotaryFusion().apply(model, _ctx(loaded.config))
    for node in _ropes(model):
        node.attributes["interleaved"] = ir.AttrInt64("interleaved", 1 - _attr(node, "interleaved"))
    assert np.abs(run_ort(model, feeds)[0] - before).max() > 1e-3


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_fuses_after_cleanup(fresh_model, name):
    # The ORT pipeline runs Cleanup (constant folding, CSE) before this pass.
    loaded, model = fresh_model(name)
    ctx = _ctx(loaded.config)
    Cleanup().apply(model, ctx)
    assert RotaryFusion().apply(model, ctx) == 2 * loaded.config.num_hidden_layers


def test_layout_mismatch_leaves_graph_untouched(fresh_model):
    loaded, model = fresh_model("tiny-llama")
    before = ir.serde.serialize_model(model).SerializeToString()
    config = loaded.config
    wrong = dataclasses.replace(config, rope=dataclasses.replace(config.rope, interleaved=True))

    assert RotaryFusion().apply(model, _ctx(wrong)) == 0
    assert ir.serde.serialize_model(model).SerializeToString() == before


def test_second_application_finds_nothing(fresh_model):
    loaded, model = fresh_model("tiny-llama")
    ctx = _ctx(loaded.config)
    assert RotaryFusion().apply(model, ctx) == 2 * loaded.config.num_hidden_layers
    nodes = len(list(model.graph))
    assert RotaryFusion().apply(model, ctx) == 0
    assert len(list(model.graph)) == nodes


def test_position_past_the_cache_fails_the_run(fresh_model):
    # Documented limit: the caches have max_seq_len rows; ORT's CPU kernel range-checks positions.
    loaded, model = fresh_model("tiny-llama")
    RotaryFusion().apply(model, _ctx(loaded.config))
    feeds = random_feeds(loaded.config.vocab_size, batch=1, seq=2)
    feeds["position_ids"] = np.array([[MAX_SEQ_LEN - 1, MAX_SEQ_LEN]], dtype=np.int64)
    with pytest.raises(Exception, match="out of range"):
        run_ort(model, feeds)


@pytest.fixture(scope="module")
def yarn_amplitude_model():
    """tiny-deepseek-v2 with mscale != mscale_all_dim, so cos/sin carry a YaRN amplitude != 1.

    (The preset itself has mscale == mscale_all_dim: amplitude exactly 1, nothing to fold.)
    """
    preset = get_preset("tiny-deepseek-v2")
    rope = dataclasses.replace(preset.config.rope, mscale=1.0, mscale_all_dim=0.707)
    config = dataclasses.replace(preset.config, rope=rope)
    model = CausalLM(config, "absorb")
    init_random_weights(model, preset.seed)
    return config, export_stateless(model.eval())


def _copy(model: ir.Model) -> ir.Model:
    return ir.serde.deserialize_model(ir.serde.serialize_model(model))


def test_yarn_amplitude_is_folded_into_the_caches(yarn_amplitude_model):
    config, exported = yarn_amplitude_model
    _, amplitude = rope_inverse_frequencies(config.rope, config.rope_dim, config.max_position_embeddings)
    assert abs(amplitude - 1) > 0.01
    model = _copy(exported)
    feeds = _feeds(config.vocab_size)
    before = run_ort(model, feeds)[0]

    assert RotaryFusion().apply(model, _ctx(config)) == 2 * config.num_hidden_layers

    # Row 0 is position 0: cos = amplitude, sin = 0.
    cos_cache = model.graph.initializers[COS_CACHE].const_value.numpy()
    np.testing.assert_allclose(cos_cache[0], np.full(config.rope_dim // 2, amplitude), rtol=1e-6)
    np.testing.assert_allclose(run_ort(model, feeds)[0], before, rtol=0, atol=1e-5)


def test_amplitude_mismatch_is_not_fused(yarn_amplitude_model):
    # The graph scales cos/sin, the preset's config says amplitude 1: rewriting would change logits.
    _, exported = yarn_amplitude_model
    model = _copy(exported)
    assert RotaryFusion().apply(model, _ctx(get_preset("tiny-deepseek-v2").config)) == 0
    assert Counter(n.op_type for n in model.graph)["Cos"] == 1
