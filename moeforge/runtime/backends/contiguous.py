"""Per-slot contiguous KV caches: the ``Backend`` half shared by the ONNX Runtime and TensorRT backends.

Cache memory is per layer one buffer [num_slots, Hkv, L, D]; slot s is row s, and ``lengths[s]`` counts the tokens
it holds (the cache's only bookkeeping). A prefill chunk runs alone on its slot, in pieces of at most
``max_prefill_tokens`` where the runtime caps a run (TensorRT's prefill profile), except that fresh prompts of equal
length on consecutive slots run as one batch [B, S] (uncapped runtimes: one run instead of B). Decode rows run
together on the smallest contiguous range of slots that holds them, at most ``max_decode_batch`` wide (TensorRT's
decode profile);
rows in the range with no work this step get a dummy token whose cache write lands at their next free position,
which their own next real token overwrites, so they are unharmed. A decode that verifies speculative draft tokens
(``RowInput.num_logits`` > 1) runs alone, like a prefill chunk (ONNX Runtime's GroupQueryAttention takes several
new tokens on a filled cache only at batch 1); a row may start before its slot's end (the drafts the last
verification rejected), which drops the tokens past its start. A subclass runs one such batch (``_forward``).

Dimension letters: B slots of one run, W tokens of its widest row, V vocabulary.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from moeforge.core.errors import ArtifactError
from moeforge.core.kv_layout import KVCacheSpec
from moeforge.runtime.backends.base import PoolInfo, RowInput, StepInput, check_row_tokens


@dataclass(frozen=True)
class SlotBatch:
    """One run over slots lo..hi-1, right-padded."""

    lo: int
    hi: int
    ids: np.ndarray  # [B, W] int64; an idle slot has one dummy token
    positions: np.ndarray  # [B, W] int64; row b: past[b] .. past[b] + W - 1
    past: np.ndarray  # [B] int64, tokens each slot held before the run
    totals: np.ndarray  # [B] int64, past + the row's real tokens (its attention-mask width)
    real: np.ndarray | None = None  # [B] bool, rows with work (False: an idle slot's dummy token); None: all
    last_only: bool = False  # every row ends at position W - 1 and only that position's logits are read
    all_logits: bool = False  # every position's logits are read (rows verifying speculative draft tokens)


class ContiguousBackend(ABC):
    """A ``Backend`` over per-slot contiguous caches described by ``kv_cache``; subclasses implement
    ``_forward`` (logits [B, W, V] of one ``SlotBatch``, the caches written in place)."""

    multi_logit_rows = True  # rows may ask for num_logits > 1 (speculative verification); see ``Backend``

    def __init__(self, kv_cache: KVCacheSpec, *, num_slots: int, max_seq_len: int, vocab_size: int,
                 max_prefill_tokens: int | None = None, max_decode_batch: int | None = None) -> None:
        if kv_cache.paged:
            raise ArtifactError("this backend runs per-slot contiguous caches and the artifact's kv_cache is paged "
                                "(block pools): run it with the paged backend, or compile without --kv-cache paged")
        self.kv_cache = kv_cache
        if kv_cache.layer_buffers is not None:  # DeepSeek-V4's rings hold the last rows only: no rejected drafts
            self.multi_logit_rows = False  # (a subclass's own False, TensorRT's, stays as it is)
        self._num_slots, self._max_seq_len, self._vocab = num_slots, max_seq_len, vocab_size
        self.max_prefill_tokens = max_prefill_tokens  # None: a prefill chunk runs whole
        self.max_decode_batch = max_decode_batch  # None: all decodes of a step in one run
        self.lengths = [0] * num_slots  # tokens held per slot

    @property
    def num_slots(self) -> int:
        return self._num_slots

    @property
    def max_seq_len(self) -> int:
        return self._max_seq_len

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def kv_pool(self) -> PoolInfo | None:
        """None: per-slot contiguous caches, no block pools."""
        return None

    def release(self, slot: int) -> None:
        self.lengths[slot] = 0

    def op_time_shares(self) -> dict[str, float] | None:
        return None

    def expert_load(self) -> np.ndarray | None:
        """Routed tokens per MoE layer and expert so far, [L_moe, E] int64, where the backend tracks them."""
        return None

    def execute(self, step: StepInput) -> np.ndarray:
        """Run each prefill chunk alone and the decodes batched; logits [sum of num_logits, V] (``Backend.execute``).
        A step of decodes only, on slots lo..hi-1 in row order (steady-state decode), returns the run's logits
        buffer itself, without a copy: valid until the next ``execute``. Rows with ``num_logits`` > 1 (speculative
        verification) run alone."""
        slots = [row.slot for row in step.rows]
        in_order = bool(slots) and slots == list(range(slots[0], slots[-1] + 1))
        if (in_order and all(len(row.token_ids) == 1 for row in step.rows)
                and (self.max_decode_batch is None or len(slots) <= self.max_decode_batch)):
            for row in step.rows:
                self._check(row)
                self.lengths[row.slot] = row.start  # drops rejected draft tokens, if any
            logits = self._decode(slots[0], slots[-1] + 1, [row.token_ids[0] for row in step.rows],
                                  step.argmax_only)
            for slot in slots:
                self.lengths[slot] += 1
            return logits
        offsets = [0]  # row i's logits are out[offsets[i]:offsets[i + 1]]
        for row in step.rows:
            offsets.append(offsets[-1] + row.num_logits)
        out = np.empty((offsets[-1], self._vocab), np.float32)
        decodes, prompts = [], []
        for index, row in enumerate(step.rows):
            self._check(row)
            self.lengths[row.slot] = row.start
            if row.num_logits > 1:  # every position's logits: one run, whatever max_prefill_tokens says
                out[offsets[index]:offsets[index + 1]] = self._verify(row, step.argmax_only)
                self.lengths[row.slot] += len(row.token_ids)
            elif len(row.token_ids) == 1:
                decodes.append((index, row))
            elif row.start == 0 and self.max_prefill_tokens is None:
                prompts.append((index, row))
            else:
                out[offsets[index]] = self._prefill(row)
        for group in _same_length_runs(prompts):
            if len(group) == 1:
                out[offsets[group[0][0]]] = self._prefill(group[0][1])
                continue
            lo, hi = group[0][1].slot, group[-1][1].slot + 1
            ids = np.array([row.token_ids for _, row in group], np.int64)  # [B, S], no padding
            zeros, width = np.zeros(hi - lo, np.int64), ids.shape[1]
            positions = np.broadcast_to(np.arange(width, dtype=np.int64), ids.shape)
            logits = self._forward(SlotBatch(lo, hi, ids, positions, zeros, zeros + width, last_only=True))
            for b, (index, row) in enumerate(group):
                out[offsets[index]] = logits[b, -1]
                self.lengths[row.slot] += width
        pending = sorted(decodes, key=lambda item: item[1].slot)
        while pending:
            lo = pending[0][1].slot
            group = [d for d in pending if self.max_decode_batch is None or d[1].slot < lo + self.max_decode_batch]
            pending = pending[len(group):]
            logits = self._run(lo, group[-1][1].slot + 1, {row.slot: row.token_ids for _, row in group})
            for index, row in group:
                out[offsets[index]] = logits[row.slot - lo, -1]
                self.lengths[row.slot] += 1
        return out

    def _prefill(self, row: RowInput) -> np.ndarray:
        """Feed a prefill chunk in runs of at most ``max_prefill_tokens``; logits [V] of its last token."""
        size = self.max_prefill_tokens or len(row.token_ids)
        last: np.ndarray = np.empty(0, np.float32)
        for begin in range(0, len(row.token_ids), size):
            part = row.token_ids[begin:begin + size]
            last = self._run(row.slot, row.slot + 1, {row.slot: part})[0, -1]
            self.lengths[row.slot] += len(part)
        return last

    def _check(self, row: RowInput) -> None:
        if not 0 <= row.slot < self._num_slots:
            raise ValueError(f"slot {row.slot} is outside 0..{self._num_slots - 1}")
        # Only a backend that verifies drafts has rows that start before the slot's end (the rejected drafts).
        held = self.lengths[row.slot]
        if not (0 <= row.start <= held if self.multi_logit_rows else row.start == held):
            raise ValueError(f"slot {row.slot} holds {held} tokens, the row starts at {row.start}")
        check_row_tokens(row)
        if row.start + len(row.token_ids) > self._max_seq_len:
            raise ValueError(f"slot {row.slot}: {row.start + len(row.token_ids)} tokens exceed max_seq_len "
                             f"{self._max_seq_len}")

    def _decode(self, lo: int, hi: int, tokens: list[int], argmax_only: bool = False) -> np.ndarray:
        """One token per slot lo..hi-1 (every slot of the range has one: no dummy rows); logits [B, V]. The steady
        decode step's path: a subclass may override it to fill its bound buffers straight from these lists.
        ``argmax_only``: see ``StepInput`` (this general path ignores it)."""
        past = np.array(self.lengths[lo:hi], np.int64)
        ids = np.array(tokens, np.int64)[:, None]
        return self._forward(SlotBatch(lo, hi, ids, past[:, None], past, past + 1))[:, -1]

    def _verify(self, row: RowInput, argmax_only: bool = False) -> np.ndarray:
        """Run a row that asks for ``num_logits`` > 1 (speculative verification) alone on its slot, its cache holding
        ``lengths[slot]`` = ``row.start`` tokens; logits [num_logits, V] of its last positions. A subclass may
        override it with a bound run. ``argmax_only``: see ``StepInput`` (this general path ignores it)."""
        end = len(row.token_ids)
        logits = self._run(row.slot, row.slot + 1, {row.slot: row.token_ids}, all_logits=True)
        return logits[0, end - row.num_logits:end]

    def _run(self, lo: int, hi: int, work: dict[int, tuple[int, ...]], *, all_logits: bool = False) -> np.ndarray:
        """Run ``work`` (tokens per slot) on slots lo..hi-1, idle slots with a dummy token; logits [B, W, V] (every
        position's when ``all_logits``, else at least each row's last)."""
        width = max(len(tokens) for tokens in work.values())
        batch = hi - lo
        ids = np.zeros((batch, width), np.int64)
        past = np.array(self.lengths[lo:hi], np.int64)
        totals = past.copy()
        real = np.ones(batch, bool)
        for b, slot in enumerate(range(lo, hi)):
            tokens = work.get(slot)
            if tokens is None:
                tokens, real[b] = (0,), False  # dummy: written at the slot's next free position, overwritten later
            ids[b, :len(tokens)] = tokens
            totals[b] += len(tokens)
        positions = past[:, None] + np.arange(width, dtype=np.int64)  # [B, W]
        return self._forward(SlotBatch(lo, hi, ids, positions, past, totals, real, all_logits=all_logits))

    @abstractmethod
    def _forward(self, batch: SlotBatch) -> np.ndarray:
        """Logits [B, W, V] float32 of ``batch``, its tokens' keys/values written into the slots' caches."""


def _same_length_runs(prompts: list[tuple[int, RowInput]]) -> list[list[tuple[int, RowInput]]]:
    """Fresh prompts (start 0) grouped into runs of consecutive slots with equal lengths: each run is one batch
    [B, S] with no padding and no idle slot (an idle slot would take S dummy tokens past its own length)."""
    runs: list[list[tuple[int, RowInput]]] = []
    for item in sorted(prompts, key=lambda item: item[1].slot):
        last = runs[-1][-1][1] if runs else None
        if last is not None and item[1].slot == last.slot + 1 and len(item[1].token_ids) == len(last.token_ids):
            runs[-1].append(item)
        else:
            runs.append([item])
    return runs
