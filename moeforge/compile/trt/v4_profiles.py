"""Optimisation profiles of a DeepSeek-V4 TensorRT engine (``--target trt`` on a V4 model, contiguous cache).

V4's step graph (moeforge/compile/v4_export.py) varies along named dimensions, each given a (min, opt, max) range
per profile: batch B (input_ids / position_ids [B, S], every cache buffer [B, rows, w], whose rows and width are
static), sequence S, and total_sequence_length L where the graph takes attention_mask [B, L] (the longest row's
cached + new tokens, up to max_seq_len; only its width is read).
Profiles, as the other families' (engine_build.BuildOptions):
  decode   S = 1, B in 1..max_batch;
  prefill  S in 1..max_prefill_tokens, B in 1..max_prefill_batch;
both L in 1..max_seq_len.
Paged (``--kv-cache paged``, built with ``--build-only``: no moeforge backend runs paged engines): the paged profiles
(paged_profiles.py) under the V4 export's names for two of its dimensions, ``tokens`` and ``num_seqs + 1``.
"""

from __future__ import annotations

import dataclasses

from moeforge.compile.trt.paged_profiles import paged_profiles
from moeforge.compile.trt.profiles import ProfileSpec

Range = tuple[int, int, int]  # (min, opt, max)
# paged_profiles' names -> the V4 paged export's (torch.export.Dim names; query_start_loc's is an expression)
PAGED_NAMES = {"num_tokens": "tokens", "num_seqs_plus_1": "num_seqs + 1"}


def v4_profiles(max_seq_len: int, max_batch: int, max_prefill_batch: int, max_prefill_tokens: int
                ) -> list[ProfileSpec]:
    """The decode and prefill profiles of a V4 engine, ranges by dimension name."""
    context: Range = (1, max(1, max_seq_len // 2), max_seq_len)
    decode_batch: Range = (1, max(1, max_batch // 2), max_batch)
    prefill_batch: Range = (1, 1, max_prefill_batch)
    prefill_tokens: Range = (1, max(1, max_prefill_tokens // 2), max_prefill_tokens)
    decode = {"batch": decode_batch, "sequence": (1, 1, 1), "total_sequence_length": context}
    prefill = {"batch": prefill_batch, "sequence": prefill_tokens, "total_sequence_length": context}
    return [ProfileSpec("decode", decode_batch, (1, 1, 1), decode),
            ProfileSpec("prefill", prefill_batch, prefill_tokens, prefill)]


def v4_paged_profiles(block_size: int, max_seq_len: int, max_batch: int, max_prefill_tokens: int
                      ) -> list[ProfileSpec]:
    """``paged_profiles`` with the V4 paged graph's dimension names."""
    return [dataclasses.replace(spec, dims={PAGED_NAMES.get(name, name): r for name, r in spec.dims.items()})
            for spec in paged_profiles(block_size, max_seq_len, max_batch, max_prefill_tokens)]
