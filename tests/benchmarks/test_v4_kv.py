"""benchmarks/v4_kv.py without compiling: its two models are peers, and its KV numbers are what a sequence holds."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import v4_kv

from moeforge.core.kv_layout import contiguous_spec, paged_spec
from moeforge.core.kv_layout_v4 import default_block_size
from moeforge.model.presets import get_preset


def test_the_two_models_have_similar_size_and_v4_caches_less_per_token():
    v3, v4 = v4_kv.bench_v3(65536), v4_kv.bench_v4(65536)
    assert abs(v3.num_parameters() / v4.num_parameters() - 1) < 0.05
    assert (v3.num_hidden_layers, v3.hidden_size) == (v4.num_hidden_layers, v4.hidden_size)
    attn = v4.compressed_attention
    assert attn is not None and {"compressed_sparse_attention", "heavily_compressed_attention"} <= set(
        attn.layer_types)
    assert v4.kv_cache_values_per_token() < v3.kv_cache_values_per_token() / 5


def test_a_sequence_holds_its_tokens_contiguous_and_whole_blocks_paged():
    v3 = get_preset("tiny-deepseek-v3").config
    kv = contiguous_spec(v3, max_seq_len=64)
    assert v4_kv.sequence_bytes(kv, 50) == 50 * kv.bytes_per_token
    assert v4_kv.slot_bytes(kv) == 64 * kv.bytes_per_token  # a slot is max_seq_len long whatever it holds

    v4 = get_preset("tiny-deepseek-v4").config
    kv = contiguous_spec(v4, max_seq_len=64)  # every compress rate divides 64: entries are exact
    assert v4_kv.sequence_bytes(kv, 64) == v4_kv.slot_bytes(kv) == kv.bytes_for(64)
    assert v4_kv.sequence_bytes(kv, 0) == kv.bytes_per_sequence > 0  # the rings, before any token
    block = default_block_size(v4, 16)
    pools = paged_spec(v4, max_seq_len=64, block_size=block)
    assert v4_kv.slot_bytes(pools) is None
    assert v4_kv.sequence_bytes(pools, block + 1) == 2 * pools.bytes_per_block
    row = v4_kv.kv_row(pools, [block])
    assert row["bytes_per_token_at_" + str(block)] == pools.bytes_per_block / block


def test_full_size_v4_flash_caches_a_fraction_of_v3_contiguous():
    rows = {(r["model"], r["cache"]): r for r in v4_kv.full_size_kv([4096, 32768])}
    v3, flash = rows[("deepseek-v3", "contiguous")], rows[("deepseek-v4-flash", "contiguous")]
    assert flash["bytes_at_32768"] < v3["bytes_at_32768"] / 5
    assert flash["bytes_per_sequence"] > 0 and v3["bytes_per_sequence"] == 0  # V4's rings, per sequence
