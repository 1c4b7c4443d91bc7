"""Scheduler tests with a fake model: no weights, no tensors, block ids and token ids only.

The fake model keeps a cache memory (pool index -> value). The "KV" of position p is
``mix(KV of p - 1, token p)``, and the KV of p - 1 is read back from the pool index the block table
gives, so the next token (last KV mod VOCAB) depends on every earlier token *as stored in the blocks
the scheduler handed out*. A wrong index, a block reused while another request still reads it, or a
bad prefix-cache hit changes the tokens; every request must therefore produce exactly the tokens
of ``reference`` (a closed form) and of its solo run, whatever batching and preemption did.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from moeforge.runtime.kv_cache_manager import KVCacheConfig, KVCacheManager
from moeforge.runtime.request import Request, RequestStatus
from moeforge.runtime.sampler import SamplingParams
from moeforge.runtime.scheduler import Scheduler, SchedulerConfig, SchedulerOutput

B = 4  # block size: small, so that requests cross many block boundaries
VOCAB = 32
_MOD = (1 << 61) - 1
_ROOT = 12345  # "KV" before position 0


def mix(prev: int, token: int) -> int:
    return (prev * 1_000_003 + token + 1) % _MOD


def reference(prompt: list[int], max_tokens: int, stop: tuple[int, ...] = ()) -> list[int]:
    """The tokens the fake model generates for ``prompt`` when every KV is where it should be."""
    kv = _ROOT
    for token in prompt:
        kv = mix(kv, token)
    out: list[int] = []
    while True:
        out.append(kv % VOCAB)
        if out[-1] in stop or len(out) == max_tokens:
            return out
        kv = mix(kv, out[-1])


class FakeModel:
    """Computes a step from the scheduler's output alone, through a shared cache memory."""

    def __init__(self) -> None:
        self.memory: dict[int, int] = {}  # pool index -> KV value

    def step(self, out: SchedulerOutput) -> dict[int, int]:
        sampled = {}
        # In scheduling order: a request may hit a block that an earlier entry fills this step.
        for s in out.scheduled:
            table = s.block_table
            assert len(table) == -(-(s.start + s.num_tokens) // B)
            indices = [table[p // B] * B + p % B for p in s.positions]  # what a paged backend derives
            kv = _ROOT if s.start == 0 else self.memory[table[(s.start - 1) // B] * B + (s.start - 1) % B]
            for token, index in zip(s.token_ids, indices, strict=True):
                kv = mix(kv, token)
                self.memory[index] = kv
            if s.completes_prompt:
                sampled[s.request_id] = kv % VOCAB
        return sampled


def make(num_blocks: int = 64, *, budget: int = 32, max_seqs: int = 16, chunk: int | None = None,
         max_model_len: int = 256, prefix_caching: bool = True) -> Scheduler:
    kv = KVCacheManager(KVCacheConfig(num_blocks=num_blocks, block_size=B, enable_prefix_caching=prefix_caching))
    config = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                             long_prefill_chunk=chunk, max_model_len=max_model_len)
    return Scheduler(config, kv)


def req(request_id: int, prompt: list[int], max_tokens: int = 8, stop: tuple[int, ...] = ()) -> Request:
    return Request(request_id, list(prompt), SamplingParams(max_tokens=max_tokens, stop_token_ids=stop))


def check_output(sched: Scheduler, out: SchedulerOutput) -> None:
    """What every step must satisfy, whatever the workload."""
    ids = [s.request_id for s in out.scheduled]
    assert len(ids) == len(set(ids)), "a request scheduled twice in one step"
    assert out.num_batched_tokens == sum(s.num_tokens for s in out.scheduled)
    assert out.num_batched_tokens <= sched.config.max_num_batched_tokens
    assert len(out.scheduled) <= len(sched.running) <= sched.config.max_num_seqs
    chunk = sched.config.long_prefill_chunk
    for s in out.scheduled:
        assert s.num_tokens >= 1
        assert len(s.block_table) == -(-(s.start + s.num_tokens) // B)
        if s.is_prefill_chunk and chunk is not None:
            assert s.num_tokens <= chunk
        if not s.is_prefill_chunk:
            assert s.num_tokens == 1 and s.completes_prompt


def run(sched: Scheduler, model: FakeModel, max_steps: int) -> list[SchedulerOutput]:
    """Step until nothing is unfinished; fail after ``max_steps`` (a deadlock or a livelock)."""
    outputs = []
    while sched.has_unfinished():
        assert len(outputs) < max_steps, f"not finished after {max_steps} steps"
        out = sched.schedule()
        check_output(sched, out)
        sched.update(out, model.step(out))
        outputs.append(out)
    return outputs


def solo(prompt: list[int], max_tokens: int, stop: tuple[int, ...] = ()) -> list[int]:
    """The request run alone with a big pool."""
    sched = make(num_blocks=256, budget=64)
    s = req(0, prompt, max_tokens, stop)
    sched.add(s)
    run(sched, FakeModel(), max_steps=len(prompt) + max_tokens)
    assert s.status in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED)
    return s.output_token_ids


def assert_no_blocks_held(sched: Scheduler) -> None:
    pool = sched.kv.pool
    assert pool.num_free_blocks == pool.num_blocks
    assert all(b.ref_count == 0 for b in pool.blocks)


# -- single requests ------------------------------------------------------------------------------

@pytest.mark.parametrize(("prompt_len", "max_tokens"), [(1, 1), (3, 5), (4, 4), (17, 9)])
def test_solo_run_matches_reference(prompt_len, max_tokens):
    prompt = [(7 * i + 3) % VOCAB for i in range(prompt_len)]
    assert solo(prompt, max_tokens) == reference(prompt, max_tokens)


def test_chunked_prefill_is_contiguous_and_samples_once():
    sched = make(budget=64, chunk=16)
    prompt = [(5 * i) % VOCAB for i in range(50)]
    s = req(0, prompt, max_tokens=3)
    sched.add(s)
    outputs = run(sched, FakeModel(), max_steps=10)
    steps = [out.scheduled[0] for out in outputs]
    assert [(x.start, x.num_tokens) for x in steps] == [(0, 16), (16, 16), (32, 16), (48, 2), (50, 1), (51, 1)]
    assert [x.is_prefill_chunk for x in steps] == [True] * 4 + [False] * 2
    assert [x.completes_prompt for x in steps] == [False] * 3 + [True] * 3
    assert [t for x in steps[:4] for t in x.token_ids] == prompt
    # A decode feeds the token sampled by the step before.
    assert steps[4].token_ids == [s.output_token_ids[0]] and steps[5].token_ids == [s.output_token_ids[1]]
    assert s.output_token_ids == reference(prompt, 3) and s.status is RequestStatus.FINISHED_LENGTH
    assert_no_blocks_held(sched)


def test_stop_token_finishes_and_is_kept():
    prompt = [1, 2, 3, 4, 5]
    full = reference(prompt, 10)
    stop = full[3]
    expected = full[:full.index(stop) + 1]
    sched = make()
    s = req(0, prompt, max_tokens=10, stop=(stop,))
    sched.add(s)
    run(sched, FakeModel(), max_steps=20)
    assert s.status is RequestStatus.FINISHED_STOPPED and s.finish_reason == "stop"
    assert s.output_token_ids == expected


# -- batching -------------------------------------------------------------------------------------

def test_budget_and_max_num_seqs_are_respected():
    rng = random.Random(0)
    sched = make(budget=16, max_seqs=3, chunk=8)
    reqs = [req(i, [rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))], rng.randint(1, 10)) for i in range(10)]
    for s in reqs:
        sched.add(s)
    outputs = run(sched, FakeModel(), max_steps=200)  # check_output asserts both limits every step
    assert max(out.num_batched_tokens for out in outputs) == 16  # the budget did bind
    assert max(len(out.scheduled) for out in outputs) == 3  # and so did max_num_seqs
    for s in reqs:
        assert s.output_token_ids == reference(s.prompt_token_ids, s.params.max_tokens)


def test_admission_is_first_come_first_served():
    sched = make(budget=64, max_seqs=2)
    order = [7, 3, 9, 1, 5]  # arrival order, deliberately not id order
    for request_id in order:
        sched.add(req(request_id, [request_id] * 6, max_tokens=4))
    first_seen: list[int] = []
    for out in run(sched, FakeModel(), max_steps=50):
        first_seen += [s.request_id for s in out.scheduled if s.request_id not in first_seen]
    assert first_seen == order


def test_requests_join_and_leave_between_steps():
    sched = make(budget=8, max_seqs=8)
    model = FakeModel()
    rng = random.Random(1)
    reqs: list[Request] = []
    finished_ids: list[int] = []
    mixed_step = False
    for step in range(200):
        if step < 12 and step % 2 == 0:  # a new request every other step, while others decode
            reqs.append(req(len(reqs), [rng.randrange(VOCAB) for _ in range(rng.randint(3, 20))], rng.randint(1, 8)))
            sched.add(reqs[-1])
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        check_output(sched, out)
        kinds = {s.is_prefill_chunk for s in out.scheduled}
        mixed_step |= kinds == {True, False}
        finished_ids += [s.request_id for s in sched.update(out, model.step(out))]
    assert not sched.has_unfinished()
    assert mixed_step  # a prefill chunk shared a step with decodes
    assert sorted(finished_ids) == list(range(len(reqs)))
    assert finished_ids != sorted(finished_ids)  # short requests left before older long ones
    for s in reqs:
        assert s.output_token_ids == reference(s.prompt_token_ids, s.params.max_tokens)
    assert_no_blocks_held(sched)


def test_prefix_cache_hits_skip_computation():
    sched = make()
    model = FakeModel()
    prefix = list(range(16))  # 4 full blocks
    first, second = req(0, [*prefix, 20, 21, 22, 23]), req(1, [*prefix, 30, 31, 32])
    sched.add(first)
    out = sched.schedule()
    sched.update(out, model.step(out))
    sched.add(second)
    out = sched.schedule()
    entry = next(s for s in out.scheduled if s.request_id == 1)
    assert second.num_cached_tokens == 16 and entry.start == 16 and entry.token_ids == [30, 31, 32]
    sched.update(out, model.step(out))
    run(sched, model, max_steps=20)
    for s in (first, second):
        assert s.output_token_ids == reference(s.prompt_token_ids, 8)


# -- leaving early --------------------------------------------------------------------------------

def test_abort_frees_blocks():
    sched = make(budget=16, max_seqs=2)
    model = FakeModel()
    a, b, c = req(0, [1] * 10, 20), req(1, [2] * 10, 20), req(2, [3] * 10, 20)
    for s in (a, b, c):
        sched.add(s)
    for _ in range(3):
        out = sched.schedule()
        sched.update(out, model.step(out))
    assert [s.request_id for s in sched.running] == [0, 1] and list(sched.waiting) == [c]
    assert sched.abort(0) and sched.abort(2)  # one running, one waiting
    assert not sched.abort(0) and not sched.abort(99)
    assert a.status is c.status is RequestStatus.FINISHED_ABORTED and a.finish_reason == "abort"
    assert sched.kv.num_free_blocks == sched.kv.config.num_blocks - len(sched.kv.block_table(1))
    assert 0 not in sched.kv
    out = sched.schedule()
    assert out.finished == [0, 2]
    # Aborted while its step is in flight: update ignores it.
    assert sched.abort(1)
    sched.update(out, model.step(out))
    assert b.status is RequestStatus.FINISHED_ABORTED and not sched.has_unfinished()
    assert_no_blocks_held(sched)


def test_finish_ends_a_request_at_once_and_the_next_step_reports_it():
    sched = make(budget=16, max_seqs=2)
    model = FakeModel()
    a, b, c = req(0, [1] * 6, 10), req(1, [2] * 6, 10), req(2, [3] * 6, 10)
    for s in (a, b, c):
        sched.add(s)
    out = sched.schedule()
    sched.update(out, model.step(out))
    assert set(sched.requests) == {0, 1, 2} and list(sched.waiting) == [c]
    with pytest.raises(ValueError, match="RUNNING is not a finished status"):
        sched.finish(0, RequestStatus.RUNNING)
    assert a.status is RequestStatus.RUNNING and 0 in sched.kv  # a refused finish changes nothing
    assert sched.finish(0, RequestStatus.FINISHED_STOPPED)  # running: e.g. a stop string the engine found
    assert sched.finish(2, RequestStatus.FINISHED_ERROR, "why")  # waiting
    assert (a.status, a.finish_reason, a.error) == (RequestStatus.FINISHED_STOPPED, "stop", None)
    assert (c.status, c.finish_reason, c.error) == (RequestStatus.FINISHED_ERROR, "error", "why")
    assert set(sched.requests) == {1} and sched.running == [b] and not sched.waiting and 0 not in sched.kv
    assert not sched.finish(0, RequestStatus.FINISHED_ABORTED)  # already finished: nothing changes
    assert a.status is RequestStatus.FINISHED_STOPPED
    out = sched.schedule()
    assert out.finished == [0, 2] and [s.request_id for s in out.scheduled] == [1]
    sched.update(out, model.step(out))
    run(sched, model, max_steps=20)
    assert b.output_token_ids == reference(b.prompt_token_ids, 10)
    assert not sched.requests and not sched.running and not sched.waiting
    assert_no_blocks_held(sched)


def test_bad_requests_finish_with_an_error_and_do_not_block_others():
    sched = make(num_blocks=8, max_model_len=40)  # the cache holds 32 tokens
    good = [req(0, [1, 2, 3], 5), req(4, [4, 5, 6, 7, 8], 6)]
    empty, too_long, too_big = req(1, [], 4), req(2, [1] * 30, 11), req(3, [2] * 36, 1)
    for s in (good[0], empty, too_long, too_big, good[1]):
        sched.add(s)
    for s, words in ((empty, "prompt is empty"), (too_long, "exceeds max_model_len (40)"),
                     (too_big, "does not fit in the KV cache")):
        assert s.status is RequestStatus.FINISHED_ERROR and s.finish_reason == "error"
        assert words in s.error and s.output_token_ids == []
    assert len(too_long.prompt_token_ids) == 30  # rejected, never truncated
    outputs = run(sched, FakeModel(), max_steps=20)
    assert outputs[0].finished == [1, 2, 3]
    for s in good:
        assert s.output_token_ids == reference(s.prompt_token_ids, s.params.max_tokens)
    sched.add(req(9, [1], 1))
    with pytest.raises(ValueError, match="already scheduled"):
        sched.add(req(9, [1], 1))


def test_request_that_outgrows_the_whole_cache_is_refused_at_once():
    # prompt + max_tokens - 1 positions of KV (the last sampled token needs none) must fit the whole cache: a
    # request that would outgrow it is refused before it runs, not failed after generating part of its output.
    sched = make(num_blocks=4, budget=16)  # 16 tokens in all
    big, edge, small = req(0, [1] * 10, 8), req(1, [3] * 10, 7), req(2, [2] * 3, 2)
    for request in (big, edge, small):
        sched.add(request)
    outputs = run(sched, FakeModel(), max_steps=50)
    assert big.status is RequestStatus.FINISHED_ERROR and "does not fit in the KV cache" in big.error
    assert "--kv-blocks" in big.error and not big.output_token_ids and big.num_computed_tokens == 0
    assert any(big.request_id in out.finished for out in outputs)
    assert edge.output_token_ids == reference(edge.prompt_token_ids, 7)  # 10 + 7 - 1 = 16 positions: fits
    assert small.output_token_ids == reference(small.prompt_token_ids, 2)
    assert_no_blocks_held(sched)


# -- preemption -----------------------------------------------------------------------------------

def test_preempted_request_recomputes_its_output_tokens():
    sched = make(num_blocks=4, budget=16, prefix_caching=False)
    model = FakeModel()
    a, b = req(0, [1] * 6, 8), req(1, [2] * 6, 8)
    sched.add(a)
    sched.add(b)
    preempted_at = None
    outputs = run(sched, model, max_steps=40)
    for step, out in enumerate(outputs):
        if out.preempted:
            assert out.preempted == [1] and preempted_at is None  # the newer one; once is enough here
            preempted_at = step
            assert 1 not in out.num_scheduled_tokens
    assert preempted_at is not None
    redo = next(s for out in outputs[preempted_at + 1:] for s in out.scheduled if s.request_id == 1)
    # Recomputed from position 0 (no prefix cache here): its prompt and the outputs it had so far.
    assert redo.start == 0 and redo.is_prefill_chunk and len(redo.token_ids) > 6
    assert redo.token_ids == (b.prompt_token_ids + b.output_token_ids)[:len(redo.token_ids)]
    assert a.output_token_ids == reference(a.prompt_token_ids, 8)
    assert b.output_token_ids == reference(b.prompt_token_ids, 8)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_under_memory_pressure_gives_solo_tokens(prefix_caching):
    rng = random.Random(42)
    requests = [([rng.randrange(VOCAB) for _ in range(rng.randint(8, 40))], rng.randint(8, 32)) for _ in range(16)]
    need = sum(-(-(len(p) + m) // B) for p, m in requests)  # blocks if all ran at once
    num_blocks = need // 3
    assert num_blocks >= max(-(-(len(p) + m) // B) for p, m in requests)  # each fits alone
    sched = make(num_blocks=num_blocks, budget=48, max_seqs=16, chunk=16, prefix_caching=prefix_caching)
    reqs = [req(i, p, m) for i, (p, m) in enumerate(requests)]
    for s in reqs:
        sched.add(s)
    # Progress bound: the oldest unfinished request is running (or admitted this step) and is never
    # preempted, so it computes >= 1 token per step and needs at most prompt + max_tokens of them.
    bound = sum(len(p) + m for p, m in requests)
    outputs = run(sched, FakeModel(), max_steps=bound)
    assert sum(len(out.preempted) for out in outputs) >= 3  # the pool really was short
    for s, (p, m) in zip(reqs, requests, strict=True):
        assert s.status is RequestStatus.FINISHED_LENGTH
        assert s.output_token_ids == solo(p, m) == reference(p, m)
    assert_no_blocks_held(sched)


# -- contract misuse ------------------------------------------------------------------------------

def test_schedule_and_update_are_paired():
    sched = make()
    model = FakeModel()
    sched.add(req(0, [1, 2, 3], 2))
    out = sched.schedule()
    with pytest.raises(RuntimeError, match="before update"):
        sched.schedule()
    with pytest.raises(ValueError, match="no sampled token"):
        sched.update(out, {})
    sched.update(out, model.step(out))
    with pytest.raises(ValueError, match="latest schedule"):
        sched.update(out, model.step(out))


def test_config_is_validated():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_batched_tokens=0)
    with pytest.raises(ValueError, match="long_prefill_chunk"):
        SchedulerConfig(long_prefill_chunk=0)


# -- random workloads -----------------------------------------------------------------------------

PREFIXES = [[], [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9], [5] * 12]
STOP = 3


class SchedulerMachine(RuleBasedStateMachine):
    """Random add / abort / step against a small cache; each finished request is checked against
    ``reference`` and the block accounting after every rule."""

    def __init__(self) -> None:
        super().__init__()
        # 10 blocks of 4: some requests (up to 48 tokens) cannot finish even alone.
        self.sched = make(num_blocks=10, budget=10, max_seqs=3, chunk=6, max_model_len=48)
        self.kv = self.sched.kv
        self.model = FakeModel()
        self.requests: dict[int, Request] = {}

    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(0, 5), max_size=14),
          max_tokens=st.integers(1, 30), stop=st.booleans())
    def add(self, prefix, suffix, max_tokens, stop):
        s = req(len(self.requests), prefix + suffix, max_tokens, (STOP,) if stop else ())
        self.sched.add(s)
        self.requests[s.request_id] = s
        if not s.prompt_token_ids or s.num_prompt_tokens + max_tokens > 48:
            assert s.status is RequestStatus.FINISHED_ERROR

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def abort(self, data):
        s = self.requests[data.draw(st.sampled_from(sorted(self.requests)))]
        was_unfinished = not s.is_finished
        assert self.sched.abort(s.request_id) == was_unfinished
        assert s.is_finished and s.request_id not in self.kv

    @rule()
    def step(self):
        out = self.sched.schedule()
        try:
            check_output(self.sched, out)
            for s in out.scheduled:
                assert self.requests[s.request_id].status is RequestStatus.RUNNING
            for request_id in out.preempted:
                assert self.requests[request_id].status is RequestStatus.PREEMPTED
        finally:  # keep schedule/update paired, so that teardown does not bury a failure under another
            finished = self.sched.update(out, self.model.step(out))
        for s in finished:
            assert s.status in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED)

    @invariant()
    def blocks_are_accounted_for(self):
        pool = self.kv.pool
        free = pool.free_block_ids()
        used = [b.block_id for b in pool.blocks if b.ref_count > 0]
        assert sorted(free + used) == list(range(pool.num_blocks))  # no leak
        tables = [self.kv.block_table(s.request_id) for s in self.sched.running]
        for block in pool.blocks:
            assert block.ref_count == sum(block.block_id in table for table in tables)
        if not self.sched.running:
            assert pool.num_free_blocks == pool.num_blocks

    @invariant()
    def queues_are_consistent(self):
        running, waiting = self.sched.running, list(self.sched.waiting)
        assert [s.arrival for s in running] == sorted(s.arrival for s in running)
        assert [s.arrival for s in waiting] == sorted(s.arrival for s in waiting)  # FCFS, preempted first
        if running and waiting:
            assert running[-1].arrival < waiting[0].arrival
        for s in running:
            # Between steps every allocated token has been computed, and a sample is pending or made.
            assert s.status is RequestStatus.RUNNING
            assert self.kv.num_allocated_tokens(s.request_id) == s.num_computed_tokens < s.num_tokens
        for s in waiting:
            assert s.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert s.request_id not in self.kv and s.num_computed_tokens == 0
        unfinished = {s.request_id for s in self.requests.values() if not s.is_finished}
        assert unfinished == {s.request_id for s in running + waiting} == set(self.sched.requests)
        for s in running:  # the cache manager learns a sampled token only when its decode is scheduled
            assert s.num_tokens - self.kv.num_known_tokens(s.request_id) in (0, 1)

    @invariant()
    def tokens_match_reference(self):
        for s in self.requests.values():
            expected = reference(s.prompt_token_ids, s.params.max_tokens, s.params.stop_token_ids)
            if s.status in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED):
                assert s.output_token_ids == expected
            else:
                assert s.output_token_ids == expected[:s.num_output_tokens]

    def teardown(self):
        # Whatever happened, the remaining work finishes in bounded steps and returns every block.
        bound = sum(s.num_tokens + s.params.max_tokens for s in self.requests.values()) + 1
        run(self.sched, self.model, max_steps=bound)
        self.tokens_match_reference()
        for s in self.requests.values():
            assert s.is_finished
            assert (s.status is RequestStatus.FINISHED_ERROR) == (s.error is not None)
        assert_no_blocks_held(self.sched)


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=100, stateful_step_count=30, deadline=None, derandomize=True)
