"""Micro-batches of a pipeline step (runtime/backends/pipeline.py): every token once, in order, logits kept right."""

from __future__ import annotations

import random

import pytest

from moeforge.runtime.backends.base import RowInput, StepInput
from moeforge.runtime.backends.pipeline import Topology, split_micro_batches


def _step(lengths: list[int], logits: list[int] | None = None) -> StepInput:
    rows = []
    for i, n in enumerate(lengths):
        start = 3 * i
        rows.append(RowInput(i, tuple(range(100 * i, 100 * i + n)), start, tuple(range(8 * i, 8 * i + 8)),
                             (logits or [1] * len(lengths))[i]))
    return StepInput(tuple(rows), argmax_only=True)


def _check(step: StepInput, count: int) -> None:
    pieces = split_micro_batches(step, count)
    # Every row's tokens, in order, at the right positions, with its block table.
    seen: dict[int, list[int]] = {}
    for piece in pieces:
        assert piece.step.argmax_only is True
        for row in piece.step.rows:
            original = step.rows[row.slot]
            assert row.block_table == original.block_table
            assert row.start == original.start + len(seen.get(row.slot, []))
            seen.setdefault(row.slot, []).extend(row.token_ids)
    assert {slot: tuple(tokens) for slot, tokens in seen.items()} == {r.slot: r.token_ids for r in step.rows}
    # The kept logits rows: each original row's own, in row order.
    kept = []
    for piece in pieces:
        owners = [row.slot for row in piece.step.rows for _ in range(row.num_logits)]
        kept += [owners[k] for k in piece.keep]
    assert kept == [r.slot for r in step.rows for _ in range(r.num_logits)]
    # About equal tokens: no piece above the target, no more pieces than asked (rows asking for several logits
    # stay whole and may overflow their piece).
    total = sum(len(r.token_ids) for r in step.rows)
    target = -(-total // count)
    if all(r.num_logits == 1 for r in step.rows):
        assert all(piece.num_tokens <= target for piece in pieces)
        assert len(pieces) <= count


@pytest.mark.parametrize("count", [1, 2, 3, 4, 8])
def test_decode_rows_spread_whole(count: int) -> None:
    step = _step([1] * 8)
    pieces = split_micro_batches(step, count)
    assert len(pieces) == min(count, 8)
    assert all(len(row.token_ids) == 1 for piece in pieces for row in piece.step.rows)
    _check(step, count)


def test_one_long_prefill_is_cut_into_token_ranges() -> None:
    step = _step([100])
    pieces = split_micro_batches(step, 4)
    assert [piece.num_tokens for piece in pieces] == [25, 25, 25, 25]
    assert [piece.keep for piece in pieces] == [(), (), (), (0,)]
    _check(step, 4)


def test_multi_logit_rows_stay_whole() -> None:
    step = _step([5, 1, 7], logits=[5, 1, 3])
    for count in (1, 2, 3, 5):
        pieces = split_micro_batches(step, count)
        for piece in pieces:
            for row in piece.step.rows:
                if row.slot in (0, 2):
                    assert row.token_ids == step.rows[row.slot].token_ids
        _check(step, count)


def test_random_mixes() -> None:
    rng = random.Random(7)
    for _ in range(300):
        lengths = [rng.choice([1, 1, 1, rng.randint(1, 64)]) for _ in range(rng.randint(1, 12))]
        _check(_step(lengths), rng.randint(1, 9))


def test_topology_maps_ranks_to_stages() -> None:
    topology = Topology(pp=3, tp=2, rank=3)
    assert (topology.stage, topology.tp_rank) == (1, 1)
    assert topology.peer(2) == 5 and topology.peer(0) == 1
    assert topology.stage_ranks(2) == [4, 5]
    assert not topology.is_first and not topology.is_last


def test_small_steps_are_not_cut_below_the_minimum() -> None:
    """8 decode rows with a 32-token minimum stay one piece; a 100-token prefill is cut in 3 (not 4) pieces."""
    assert len(split_micro_batches(_step([1] * 8), 4, min_tokens=32)) == 1
    pieces = split_micro_batches(_step([100]), 4, min_tokens=32)
    assert [piece.num_tokens for piece in pieces] == [34, 34, 32]
    _check(_step([100]), 3)
