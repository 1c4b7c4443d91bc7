"""The KV layout module: the names and shapes every stage reads, for each layout and target."""

from __future__ import annotations

from moeforge.core.kv_layout import KVCacheSpec, contiguous_spec, paged_spec, static_spec
from moeforge.model.presets import get_preset

LLAMA = get_preset("tiny-llama").config  # GQA: 2 layers, 2 kv heads of 16
DEEPSEEK = get_preset("tiny-deepseek-v3").config  # absorbed MLA: 3 layers, latent 32 + 8


def test_contiguous_names_and_shapes():
    gqa = contiguous_spec(LLAMA, max_seq_len=64)
    assert gqa.past_input_names[1] == ["past_key_values.1.key", "past_key_values.1.value"]
    assert gqa.present_output_names[1] == ["present.1.key", "present.1.value"]
    assert gqa.shape == ["batch_size", 2, "max_sequence_length", 16] and not gqa.paged
    assert gqa.bytes_per_token == 2 * 2 * 16 * 2 * 4
    mla = contiguous_spec(DEEPSEEK, max_seq_len=64, dtype="int8")
    assert mla.past_input_names[0] == ["past_key_values.0.latent"]
    assert mla.present_output_names[0] == ["present.0.latent", "present.0.latent_v"]  # GroupQueryAttention's two
    assert mla.shape == ["batch_size", 1, "max_sequence_length", 40] and mla.bytes_per_token == 40 * 3


def test_static_cache_of_the_tensorrt_target():
    mla = static_spec(DEEPSEEK, max_seq_len=64, dtype="float16")
    assert mla.shape == ["batch_size", 1, 64, 40] and mla.present_output_names[2] == ["present.2.latent"]
    assert static_spec(LLAMA, max_seq_len=32, dtype="float16").bytes_per_token == 2 * 2 * 16 * 2 * 2


def test_paged_pools():
    gqa = paged_spec(LLAMA, max_seq_len=64, block_size=8)
    assert gqa.past_input_names[0] == ["kv_pool.0.key", "kv_pool.0.value"]
    assert gqa.present_output_names[0] == ["kv_pool_out.0.key", "kv_pool_out.0.value"]
    assert gqa.shape == ["num_blocks", 8, 2, 16] and gqa.bytes_per_block == gqa.bytes_per_token * 8
    mla = paged_spec(DEEPSEEK, max_seq_len=64, block_size=4)
    assert mla.shape == ["num_blocks", 4, 1, 40] and mla.present_output_names[0] == ["kv_pool_out.0.latent"]


def test_round_trip_through_the_manifest_form():
    for spec in (contiguous_spec(LLAMA, max_seq_len=64), paged_spec(DEEPSEEK, max_seq_len=64, block_size=4),
                 static_spec(DEEPSEEK, max_seq_len=64, dtype="bfloat16")):
        assert KVCacheSpec.from_dict(spec.to_dict()) == spec
