"""A model step that raises fails only its own requests: the engine keeps serving, frees their blocks and
drops the prefix-cache keys the failed step registered (their blocks hold no KV).

The fake paged backend stores a "KV" per pool index: the KV of position p is ``mix(KV of p - 1, token p)``,
with KV of p - 1 read back through the block table, and the logits are one-hot at ``KV % VOCAB``. So a
request's tokens equal ``reference`` only if every block it reads was written by a step that ran: a
prefix-cache hit on a block of the failed step reads a never-written index and changes the tokens.
"""

from __future__ import annotations

import string
import sys
from pathlib import Path

import numpy as np
import pytest

from moeforge.runtime.backends.base import PoolInfo, StepInput
from moeforge.runtime.engine import (
    CacheOptions,
    EngineConfig,
    EngineConfigError,
    LLMEngine,
    RequestOutput,
    SchedulingOptions,
)
from moeforge.runtime.kv_cache_manager import KVCacheConfig, KVCacheManager
from moeforge.runtime.request import Request, RequestStatus
from moeforge.runtime.sampler import SamplingParams
from moeforge.runtime.scheduler import Scheduler, SchedulerConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: shared helpers
from letter_tokenizer import letter_tokenizer

BS = 4
VOCAB = 64
_MOD = (1 << 61) - 1
_ROOT = 12345
_UNWRITTEN = 777  # what a pool index no step wrote reads as
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


def mix(prev: int, token: int) -> int:
    return (prev * 1_000_003 + token + 1) % _MOD


def reference(prompt: list[int], max_tokens: int) -> list[int]:
    kv = _ROOT
    for token in prompt:
        kv = mix(kv, token)
    out = []
    while len(out) < max_tokens:
        out.append(kv % VOCAB)
        kv = mix(kv, out[-1])
    return out


class FakePagedBackend:
    """A paged ``Backend`` without tensors (see the module docstring); ``fail_on`` = execute calls that raise."""

    def __init__(self, num_blocks: int = 32, fail_on: tuple[int, ...] = ()) -> None:
        self.kv_pool = PoolInfo(num_blocks=num_blocks, block_size=BS)
        self.num_slots, self.max_seq_len, self.vocab_size = 4, 64, VOCAB
        self.memory: dict[int, int] = {}
        self.calls = 0
        self.fail_on = fail_on
        self.slots_in_use: set[int] = set()  # slots given rows and not released since

    def execute(self, step: StepInput) -> np.ndarray:
        self.calls += 1
        slots = [row.slot for row in step.rows]
        assert len(set(slots)) == len(slots) and all(0 <= slot < self.num_slots for slot in slots)
        self.slots_in_use.update(slots)
        if self.calls in self.fail_on:
            raise RuntimeError("device lost")
        logits = np.zeros((len(step.rows), VOCAB), np.float32)
        for b, row in enumerate(step.rows):
            table = row.block_table
            assert table is not None

            def pool_index(p: int) -> int:
                return table[p // BS] * BS + p % BS  # noqa: B023 -- used within the iteration

            kv = _ROOT if row.start == 0 else self.memory.get(pool_index(row.start - 1), _UNWRITTEN)
            for i, token in enumerate(row.token_ids):
                kv = mix(kv, token)
                self.memory[pool_index(row.start + i)] = kv
            logits[b, kv % VOCAB] = 1.0
        return logits

    def release(self, slot: int) -> None:
        self.slots_in_use.discard(slot)

    def op_time_shares(self) -> None:
        return None


PROMPTS = [list(range(1, 12)), list(range(20, 31)), list(range(40, 45))]  # 11, 11 and 5 tokens


def test_a_failed_step_fails_its_requests_and_the_engine_keeps_serving():
    backend = FakePagedBackend(fail_on=(1,))
    engine = LLMEngine(backend, config=EngineConfig(scheduling=SchedulingOptions(max_num_seqs=2)))
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]  # the third waits: max_num_seqs=2
    outputs = {o.request_id: o for o in engine.step()}  # the failing step: the first two prompts
    assert sorted(outputs) == ids[:2]
    for out in outputs.values():
        assert out.finished and out.finish_reason == "error" and out.token_ids == []
        assert "device lost" in out.error and "RuntimeError" in out.error
    assert engine.metrics.failed_steps == 1
    stats = engine.kv.stats()
    assert stats.blocks_in_use == 0 and stats.cached_blocks == 0  # nothing leaked, no key without KV

    results = {}
    while engine.has_unfinished():  # the waiting request runs as if nothing happened
        results.update({o.request_id: o for o in engine.step() if o.finished})
    assert results[ids[2]].error is None and results[ids[2]].token_ids == reference(PROMPTS[2], 6)

    # The failed prompts again: computed afresh (no hit on the failed step's blocks), solo tokens.
    again = engine.generate(PROMPTS[:2], GREEDY)
    assert [o.token_ids for o in again] == [reference(p, 6) for p in PROMPTS[:2]]
    assert engine.kv.stats().blocks_in_use == 0


def test_a_failed_decode_keeps_the_keys_of_steps_that_ran():
    """Call 1 prefills 11 tokens (blocks 0-1 full), call 2 fills block 2, call 6 would fill block 3 and
    fails: blocks 0-2 stay findable, block 3 (never written) does not."""
    backend = FakePagedBackend(fail_on=(6,))
    engine = LLMEngine(backend, config=EngineConfig(scheduling=SchedulingOptions(max_num_seqs=2)))
    failed = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=10, ignore_eos=True))[0]
    assert failed.finish_reason == "error" and failed.token_ids == reference(PROMPTS[0], 5)
    assert engine.kv.stats().cached_blocks == 3
    prompt = PROMPTS[0] + failed.token_ids + [9]  # 17 tokens: its first 4 blocks are lookable
    hits = engine.kv.stats().hits
    again = engine.generate([prompt], GREEDY)[0]
    assert engine.kv.stats().hits - hits == 3
    assert again.token_ids == reference(prompt, 6)


def test_scheduler_fail_rolls_back_same_step_keys_and_accepts_a_new_schedule():
    kv = KVCacheManager(KVCacheConfig(num_blocks=16, block_size=BS))
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), kv)
    first, second = (Request(i, list(range(1, 12)), GREEDY) for i in (0, 1))
    scheduler.add(first)
    scheduler.add(second)
    out = scheduler.schedule()
    assert kv.stats().hits == 2  # the second shares the first's blocks in the same step
    with pytest.raises(RuntimeError, match="before update"):
        scheduler.schedule()
    failed = scheduler.fail(out, "boom")
    assert failed == [first, second] and all(s.status is RequestStatus.FINISHED_ERROR for s in failed)
    assert "boom" in first.error
    assert kv.stats().cached_blocks == 0 and kv.num_free_blocks == 16
    third = Request(2, list(range(1, 12)), GREEDY)
    scheduler.add(third)
    out = scheduler.schedule()  # accepted again; nothing cached to hit
    assert out.scheduled[0].start == 0 and kv.stats().hits == 2
    scheduler.update(out, {2: 5})
    assert kv.stats().cached_blocks == 2  # committed by update


@pytest.mark.parametrize("kv_blocks", [0, -3])
def test_kv_blocks_must_be_positive(kv_blocks):
    with pytest.raises(EngineConfigError, match=r"CacheOptions\(kv_blocks="):
        EngineConfig(cache=CacheOptions(kv_blocks=kv_blocks))


def test_block_size_must_match_a_paged_backend():
    with pytest.raises(EngineConfigError, match=r"CacheOptions\(block_size=16\).*block size 4"):
        LLMEngine(FakePagedBackend(), config=EngineConfig(cache=CacheOptions(block_size=16)))
    engine = LLMEngine(FakePagedBackend(num_blocks=7), config=EngineConfig(cache=CacheOptions(block_size=BS)))
    assert (engine.kv.block_size, engine.kv.config.num_blocks) == (BS, 7)
    assert engine.kv.config.enable_prefix_caching


def test_a_request_too_big_for_the_pool_names_kv_blocks():
    engine = LLMEngine(
        FakePagedBackend(num_blocks=3), config=EngineConfig(scheduling=SchedulingOptions(max_num_seqs=2)))
    big, small = engine.generate([list(range(1, 20)), PROMPTS[2]], GREEDY)
    assert big.finish_reason == "error" and "CacheOptions(kv_blocks=...)" in big.error
    assert small.token_ids == reference(PROMPTS[2], 6)


def test_a_request_is_forgotten_once_its_final_output_is_returned():
    engine = LLMEngine(FakePagedBackend(), config=EngineConfig(scheduling=SchedulingOptions(max_num_seqs=2)))
    request_id = engine.add_request(PROMPTS[2], GREEDY)
    while True:
        (out,) = engine.step()
        if out.finished:
            break
        assert request_id in engine.requests and request_id in engine.scheduler.requests
        assert engine.requests[request_id].slot is not None
    assert out.token_ids == reference(PROMPTS[2], 6)
    assert request_id not in engine.requests and request_id not in engine.scheduler.requests
    assert request_id not in engine.kv and not engine.has_unfinished()
    assert engine.step() == []  # nothing left to report


def test_many_requests_ending_every_way_leave_nothing_behind():
    """Length, stop token, stop string, aborts (waiting and running), a failed step, a prompt too big for the
    pool, preemptions: each request gets exactly one final output, and afterwards no engine or scheduler
    structure holds a request, and every slot and block is free."""
    backend = FakePagedBackend(num_blocks=12, fail_on=(5,))
    letters = letter_tokenizer(string.ascii_lowercase, VOCAB)
    engine = LLMEngine(backend, tokenizer=letters,
                       config=EngineConfig(scheduling=SchedulingOptions(max_num_seqs=3, max_num_batched_tokens=16)))
    rng = np.random.default_rng(0)
    added: dict[int, tuple[list[int], SamplingParams]] = {}
    for i in range(12):
        prompt = rng.integers(0, VOCAB, int(rng.integers(2, 24))).tolist()
        full = reference(prompt, 8)
        stop_strings = (letters.decode(full[3:5]),) if i % 3 == 1 else ()
        stop_token_ids = (full[4],) if i % 3 == 2 else ()
        params = SamplingParams(max_tokens=8, ignore_eos=True, stop_strings=stop_strings,
                                stop_token_ids=stop_token_ids)
        added[engine.add_request(prompt, params)] = prompt, params
    too_big = list(range(50)), SamplingParams(max_tokens=8, ignore_eos=True)  # 13 blocks: rejected by the scheduler
    too_big_id = engine.add_request(*too_big)
    added[too_big_id] = too_big
    finals: dict[int, list[RequestOutput]] = {request_id: [] for request_id in added}
    steps = 0
    while engine.has_unfinished():
        steps += 1
        assert steps < 500
        for out in engine.step():
            if out.finished:
                finals[out.request_id].append(out)
        if steps == 3:
            engine.abort(engine.scheduler.waiting[0].request_id)
            engine.abort(engine.scheduler.running[-1].request_id)

    assert all(len(outs) == 1 for outs in finals.values())  # exactly one final output each
    stopped_by = set()
    for request_id, (out,) in finals.items():
        prompt, params = added[request_id]
        full = reference(prompt, 8)
        assert out.token_ids == full[:len(out.token_ids)]
        if out.finish_reason == "length":
            assert out.token_ids == full
        elif out.finish_reason == "stop":
            by_token = out.token_ids[-1] in params.stop_token_ids
            decoded = letters.decode(out.token_ids)  # the text ends where the stop string begins
            by_string = any(stop in decoded and out.text == decoded[:decoded.find(stop)]
                            for stop in params.stop_strings)
            assert by_token or by_string
            stopped_by |= {"token"} if by_token else {"string"}
    assert stopped_by == {"token", "string"}
    assert "does not fit in the KV cache" in finals[too_big_id][0].error
    assert {outs[0].finish_reason for outs in finals.values()} == {"length", "stop", "abort", "error"}
    assert engine.metrics.preemptions > 0 and engine.metrics.failed_steps == 1
    assert not engine.requests and not engine.scheduler.requests
    assert not engine.scheduler.waiting and not engine.scheduler.running
    assert not any(request_id in engine.kv for request_id in added) and engine.kv.stats().blocks_in_use == 0
    assert backend.slots_in_use == set()


def test_a_thousand_requests_leave_no_state_behind():
    """Issue 16's leak check: after 1,000 requests (served in waves, a tenth aborted mid-run, some with logprobs)
    the engine, its scheduler, cache manager and backend hold nothing for any of them."""
    backend = FakePagedBackend(num_blocks=64)
    engine = LLMEngine(backend, config=EngineConfig(
        scheduling=SchedulingOptions(max_num_seqs=8, max_num_batched_tokens=64)))
    rng = np.random.default_rng(1)
    finished = 0
    for wave in range(100):
        ids = [engine.add_request(rng.integers(0, VOCAB, int(rng.integers(2, 12))).tolist(),
                                  SamplingParams(max_tokens=int(rng.integers(1, 6)), ignore_eos=True,
                                                 logprobs=2 if wave % 2 else None)) for _ in range(10)]
        finished += sum(out.finished for out in engine.step())
        if ids[wave % 10] in engine.requests:
            engine.abort(ids[wave % 10])  # mid-run: it still ends exactly once
        while engine.has_unfinished():
            finished += sum(out.finished for out in engine.step())
    assert finished == 1000
    assert not engine.requests and not engine.scheduler.requests and not engine.scheduler.running
    assert engine.kv.stats().blocks_in_use == 0 and backend.slots_in_use == set()
    assert len(engine._free_slots) == backend.num_slots
