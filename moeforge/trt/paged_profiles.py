"""Optimisation profiles of a paged TensorRT engine (``--target trt --kv-cache paged``).

A paged step packs every sequence's new tokens into one batch, so the graph's inputs vary along named
dimensions (graph_passes/paged_kv.py), each given a (min, opt, max) range per profile:
  num_tokens T (input_ids, position_ids [T]), num_seqs B (seq_lens [B], block_tables [B, M]),
  num_seqs_plus_1 (query_start_loc [B+1]), max_blocks M (block-table width, up to ceil(max_seq_len / Bs)),
  num_blocks N (pools [N, Bs, Hkv, D]: up to max_batch * M blocks, every sequence at full length),
  num_logits K (logits_indices [K], logits [K, V]).
Profiles:
  decode   T = B in 1..max_batch (one token per sequence), K up to max_batch;
  prefill  T in 1..max_prefill_tokens mixing up to max_batch sequences (prefill chunks and decodes),
           K up to T (every token projected: the golden check's prefill).
"""

from __future__ import annotations

from typing import Any

from moeforge.trt.build import ProfileSpec


def paged_profiles(options: Any) -> list[ProfileSpec]:  # BuildOptions (paged_block_size and max_seq_len set)
    """The decode and prefill profiles of a paged engine, ranges by dimension name."""
    block_size = int(options.paged_block_size)
    max_blocks = -(-int(options.max_seq_len) // block_size)
    batch, tokens = options.max_batch, options.max_prefill_tokens
    pool = max_batch_blocks = batch * max_blocks
    common = {"max_blocks": (1, max(1, max_blocks // 2), max_blocks),
              "num_blocks": (1, max(1, max_batch_blocks // 2), pool)}
    decode_batch = (1, max(1, batch // 2), batch)
    prefill_batch = (1, 1, batch)
    prefill_tokens = (1, max(1, tokens // 2), tokens)
    decode = {"num_tokens": decode_batch, "num_seqs": decode_batch, "num_logits": decode_batch,
              "num_seqs_plus_1": tuple(b + 1 for b in decode_batch), **common}
    prefill = {"num_tokens": prefill_tokens, "num_seqs": prefill_batch, "num_logits": prefill_tokens,
               "num_seqs_plus_1": tuple(b + 1 for b in prefill_batch), **common}
    return [ProfileSpec("decode", decode_batch, (1, 1, 1), decode),
            ProfileSpec("prefill", prefill_batch, prefill_tokens, prefill)]
