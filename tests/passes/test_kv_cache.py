"""KV-cache insertion: GroupQueryAttention with in-place cache buffers; MLA caches only the latent."""

import collections

import numpy as np
import onnx_ir as ir
import pytest
import torch

from moeforge.core.kv_layout import contiguous_spec
from moeforge.passes.base import PassContext
from moeforge.passes.cleanup import Cleanup
from moeforge.passes.kv_cache_io import KVCacheInsertion
from moeforge.runtime.backends.onnxruntime import OrtSession


def _cached_graph(fresh_model, name, tmp_path):
    loaded, model = fresh_model(name)
    ctx = PassContext(loaded.config, 128)
    rewritten = KVCacheInsertion().apply(model, ctx)
    Cleanup().apply(model, ctx)
    path = tmp_path / "model.onnx"
    ir.save(model, path, external_data="model.onnx.data")
    return loaded, model, rewritten, path


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-deepseek-v3", "tiny-deepseek-v2"])
def test_prefill_then_decode_matches_torch(fresh_model, tmp_path, name):
    loaded, model, rewritten, path = _cached_graph(fresh_model, name, tmp_path)
    config = loaded.config
    assert rewritten == config.num_hidden_layers
    ops = collections.Counter(n.op_type for n in model.graph)
    assert ops["GroupQueryAttention"] == config.num_hidden_layers and ops["Attention"] == 0
    # No Concat-grown caches: cache inputs feed only the attention nodes.
    for value in model.graph.inputs:
        if value.name.startswith("past_key_values."):
            assert {use.node.op_type for use in value.uses()} == {"GroupQueryAttention"}

    session = OrtSession(path, kv_cache=contiguous_spec(config, max_seq_len=128), optimize=False)
    session.allocate(batch=1, max_len=40)
    buffers_before = [b.ctypes.data for b in session.buffers]
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (1, 24))
    reference = loaded.model(torch.tensor(ids), torch.arange(24)[None]).logits.detach().numpy()
    steps = [session.forward(ids[:, :16], np.arange(16)[None], np.ones((1, 16), np.int64))]
    for t in range(16, 24):
        steps.append(session.forward(ids[:, t : t + 1], np.array([[t]]), np.ones((1, t + 1), np.int64)))
    np.testing.assert_allclose(np.concatenate(steps, axis=1), reference, atol=1e-4, rtol=0)
    # The cache was written in place: same buffers, now holding 24 tokens and nothing beyond.
    assert [b.ctypes.data for b in session.buffers] == buffers_before
    assert np.abs(session.buffers[0][:, :, :24]).max() > 0
    assert np.abs(session.buffers[0][:, :, 24:]).max() == 0


def test_mla_graph_caches_only_the_latent(fresh_model, tmp_path):
    loaded, model, _, _ = _cached_graph(fresh_model, "tiny-deepseek-v3", tmp_path)
    mla = loaded.config.mla
    cache_inputs = [v for v in model.graph.inputs if v.name.startswith("past_key_values.")]
    assert len(cache_inputs) == loaded.config.num_hidden_layers  # one tensor per layer
    for value in cache_inputs:
        assert value.name.endswith(".latent")
        _, heads, _, width = value.shape
        assert heads == 1 and width == mla.kv_lora_rank + mla.qk_rope_head_dim


def test_gqa_graph_has_genai_names(fresh_model, tmp_path):
    loaded, model, _, _ = _cached_graph(fresh_model, "tiny-llama", tmp_path)
    names = {v.name for v in model.graph.inputs}
    for layer in range(loaded.config.num_hidden_layers):
        assert {f"past_key_values.{layer}.key", f"past_key_values.{layer}.value"} <= names
    assert "attention_mask" in names
    outputs = {v.name for v in model.graph.outputs}
    assert {"logits", "present.0.key", "present.0.value"} <= outputs
    key = next(v for v in model.graph.inputs if v.name == "past_key_values.0.key")
    assert list(key.shape)[1] == loaded.config.num_key_value_heads and list(key.shape)[3] == loaded.config.head_dim


def test_rope_folds_into_attention_for_gqa(fresh_model, tmp_path):
    from moeforge.passes.rotary import RotaryFusion

    loaded, model = fresh_model("tiny-llama")  # head size 16: GQA's rotary accepts multiples of 16
    ctx = PassContext(loaded.config, 128)
    assert RotaryFusion().apply(model, ctx) == 2 * loaded.config.num_hidden_layers
    KVCacheInsertion().apply(model, ctx)
    Cleanup().apply(model, ctx)
    ops = collections.Counter(n.op_type for n in model.graph)
    assert ops["RotaryEmbedding"] == 0
    assert all(n.attributes.get_int("do_rotary", 0) == 1 for n in model.graph if n.op_type == "GroupQueryAttention")
    path = tmp_path / "model.onnx"
    ir.save(model, path, external_data="model.onnx.data")
    session = OrtSession(path, kv_cache=contiguous_spec(loaded.config, max_seq_len=128))
    session.allocate(batch=1, max_len=32)
    ids = np.random.default_rng(1).integers(0, loaded.config.vocab_size, (1, 20))
    reference = loaded.model(torch.tensor(ids), torch.arange(20)[None]).logits.detach().numpy()
    steps = [session.forward(ids[:, :12], np.arange(12)[None], np.ones((1, 12), np.int64))]
    for t in range(12, 20):
        steps.append(session.forward(ids[:, t : t + 1], np.array([[t]]), np.ones((1, t + 1), np.int64)))
    np.testing.assert_allclose(np.concatenate(steps, axis=1), reference, atol=1e-4, rtol=0)
