"""Optimisation profiles of a paged TensorRT engine (``--target trt --kv-cache paged``).

A paged step packs every sequence's new tokens into one batch, so the graph's inputs vary along named
dimensions (moeforge/passes/paged_kv.py), each given a (min, opt, max) range per profile:
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

from moeforge.compile.trt.profiles import ProfileSpec

Range = tuple[int, int, int]  # (min, opt, max)


def paged_profiles(block_size: int, max_seq_len: int, max_batch: int, max_prefill_tokens: int) -> list[ProfileSpec]:
    """The decode and prefill profiles of a paged engine, ranges by dimension name."""
    max_blocks = -(-max_seq_len // block_size)
    pool = max_batch * max_blocks
    common = {"max_blocks": (1, max(1, max_blocks // 2), max_blocks), "num_blocks": (1, max(1, pool // 2), pool)}
    decode_batch: Range = (1, max(1, max_batch // 2), max_batch)
    prefill_batch: Range = (1, 1, max_batch)
    prefill_tokens: Range = (1, max(1, max_prefill_tokens // 2), max_prefill_tokens)
    decode = {"num_tokens": decode_batch, "num_seqs": decode_batch, "num_logits": decode_batch,
              "num_seqs_plus_1": _plus_one(decode_batch), **common}
    prefill = {"num_tokens": prefill_tokens, "num_seqs": prefill_batch, "num_logits": prefill_tokens,
               "num_seqs_plus_1": _plus_one(prefill_batch), **common}
    return [ProfileSpec("decode", decode_batch, (1, 1, 1), decode),
            ProfileSpec("prefill", prefill_batch, prefill_tokens, prefill)]


def _plus_one(r: Range) -> Range:
    return r[0] + 1, r[1] + 1, r[2] + 1
