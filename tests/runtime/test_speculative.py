"""Prompt-lookup speculative decoding: the n-gram drafter, the scheduler and cache accounting of draft tokens (with
the fake model of test_scheduler.py, whose every token depends on every KV value stored where the block tables
say), and the engine on compiled artifacts, whose greedy output must stay PyTorch's token for token."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import pytest

from moeforge.compile.driver import CompileOptions, compile_model
from moeforge.model.loader import load_model
from moeforge.runtime.backends.base import StepInput
from moeforge.runtime.engine import EngineConfig, EngineConfigError, LLMEngine, SchedulingOptions, SpeculativeOptions
from moeforge.runtime.kv_cache_manager import KVCacheConfig, KVCacheManager
from moeforge.runtime.request import Request, RequestStatus
from moeforge.runtime.sampler import SamplingParams
from moeforge.runtime.scheduler import SchedulerOutput
from moeforge.runtime.speculative import Drafter, NgramIndex
from moeforge.verify.generate import generate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: shared helpers
from letter_tokenizer import letter_tokenizer

from tests.runtime.test_scheduler import _ROOT, VOCAB, B, make, mix, reference

# -- the drafter ----------------------------------------------------------------------------------

def brute_force_draft(seq: list[int], k: int, max_ngram: int) -> list[int]:
    """What ``NgramIndex.propose`` must return: scan for the latest earlier occurrence of the longest tail."""
    for n in range(min(max_ngram, len(seq) - 1), 0, -1):
        for start in range(len(seq) - n - 1, -1, -1):
            if seq[start:start + n] == seq[-n:]:
                return seq[start + n:start + n + k]
    return []


def test_ngram_index_proposes_what_followed_the_latest_longest_match():
    index = NgramIndex(max_ngram=3)
    index.extend([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3])
    assert index.propose(2) == [7, 5]  # the latest "1 2 3" is followed by 7 5, not the first one's 9
    index.extend([9])
    assert index.propose(4) == [1, 2, 3, 7]  # "1 2 3 9" occurred once: what followed it
    assert NgramIndex().propose(3) == [] and NgramIndex(max_ngram=2).propose(0) == []
    lonely = NgramIndex()
    lonely.extend([4, 5, 6])
    assert lonely.propose(3) == []  # no tail occurred before
    with pytest.raises(ValueError, match="min_ngram"):
        NgramIndex(max_ngram=1, min_ngram=2)


def test_ngram_index_grown_token_by_token_equals_a_scan_of_the_whole_sequence():
    rng = random.Random(0)
    for trial in range(30):
        vocab = rng.choice([2, 3, 5, 12])
        index, seq = NgramIndex(max_ngram=trial % 4 + 1), []
        for _ in range(60):
            new = [rng.randrange(vocab) for _ in range(rng.choice([1, 1, 1, 3]))]  # runs of accepted tokens too
            index.extend(new)
            seq += new
            k = rng.randint(1, 6)
            assert index.propose(k) == brute_force_draft(seq, k, index.max_ngram), (seq, k)


def test_the_draft_length_follows_acceptance_and_pauses_after_misses():
    drafter = Drafter(6, max_ngram=2)
    assert drafter.propose([1, 2, 3, 4, 5, 6, 7, 8, 1, 2]) == [3, 4, 5, 6, 7, 8]
    drafter.record(6, 2)  # some accepted: one more than that next time
    assert drafter.propose([]) == [3, 4, 5]
    drafter.record(3, 3)  # all accepted: two more
    assert len(drafter.propose([])) == 5
    drafter.record(5, 0)  # none: half as many, and a pause of 1, 3, 7 ... steps as misses repeat
    assert drafter.propose([]) == [] and drafter.propose([]) == [3, 4]
    drafter.record(2, 0)
    assert [drafter.propose([]) for _ in range(4)] == [[], [], [], [3]]
    drafter.record(1, 1)  # an accepted draft resets the pauses
    drafter.record(3, 0)
    assert drafter.propose([]) == [] and drafter.propose([]) != []


# -- scheduler and cache accounting ---------------------------------------------------------------

class VerifyingModel:
    """test_scheduler.FakeModel that also verifies draft tokens: every fed position's "logits" pick the token
    after it (last KV mod VOCAB); drafts are accepted while they equal those picks."""

    def __init__(self) -> None:
        self.memory: dict[int, int] = {}
        self.accepted = self.drafted = 0

    def step(self, out: SchedulerOutput) -> dict[int, int | list[int]]:
        sampled: dict[int, int | list[int]] = {}
        for s in out.scheduled:
            table = s.block_table
            assert len(table) >= -(-(s.start + s.num_tokens) // B)  # lookahead blocks may follow
            kv = _ROOT if s.start == 0 else self.memory[table[(s.start - 1) // B] * B + (s.start - 1) % B]
            picks = []
            for token, p in zip(s.token_ids, s.positions, strict=True):
                kv = mix(kv, token)
                self.memory[table[p // B] * B + p % B] = kv
                picks.append(kv % VOCAB)
            if not s.completes_prompt:
                continue
            drafts = s.draft_token_ids
            chosen = picks[len(picks) - len(drafts) - 1:]
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == chosen[accepted]:
                accepted += 1
            sampled[s.request_id] = chosen[:accepted + 1] if drafts else chosen[0]
            self.drafted += len(drafts)
            self.accepted += accepted
        return sampled


def propose_from_reference(sched, rng: random.Random, k: int, wrong: float) -> None:
    """Drafts for every running request: the next ``k`` true tokens, each wrong with probability ``wrong``."""
    for r in sched.running:
        truth = reference(r.prompt_token_ids, r.params.max_tokens + k)[r.num_output_tokens:][:k]
        r.spec_token_ids = [(t + 1) % VOCAB if rng.random() < wrong else t for t in truth]


def run_speculative(sched, model: VerifyingModel, rng: random.Random, k: int, wrong: float, max_steps: int) -> int:
    steps = 0
    while sched.has_unfinished():
        assert steps < max_steps, "not finished"
        out = sched.schedule()
        assert out.num_batched_tokens == sum(s.num_tokens for s in out.scheduled) <= sched.config.max_num_batched_tokens
        for s in out.scheduled:
            if s.num_draft_tokens:
                request = sched.requests[s.request_id]
                assert not s.is_prefill_chunk and s.token_ids[0] == request.output_token_ids[-1]
                assert request.num_output_tokens + s.num_draft_tokens < request.params.max_tokens
        sched.update(out, model.step(out))
        propose_from_reference(sched, rng, k, wrong)
        steps += 1
    return steps


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_draft_tokens_under_preemption_and_prefix_caching_give_the_reference_tokens(prefix_caching):
    rng = random.Random(3)
    sched = make(num_blocks=24, budget=24, max_seqs=6, chunk=8, prefix_caching=prefix_caching)
    shared = [rng.randrange(VOCAB) for _ in range(9)]  # a common prefix: prefix-cache hits on full blocks
    requests = [Request(i, shared + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))],
                        SamplingParams(max_tokens=rng.randint(1, 20))) for i in range(12)]
    for r in requests:
        sched.add(r)
    model = VerifyingModel()
    run_speculative(sched, model, rng, k=4, wrong=0.25, max_steps=500)
    for r in requests:
        assert r.status is RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == reference(r.prompt_token_ids, r.params.max_tokens)
    assert model.accepted > 0 and model.drafted > model.accepted  # drafts were both accepted and rejected
    assert sched.kv.pool.num_free_blocks == sched.kv.pool.num_blocks  # lookahead blocks were freed too


def test_all_drafts_right_takes_one_step_per_k_plus_one_tokens_and_stops_at_a_stop_token():
    prompt = [3, 1, 4, 1, 5]
    full = reference(prompt, 30)
    sched = make(budget=64)
    r = Request(0, prompt, SamplingParams(max_tokens=30))
    sched.add(r)
    steps = run_speculative(sched, VerifyingModel(), random.Random(0), k=4, wrong=0.0, max_steps=100)
    assert r.output_token_ids == full
    assert steps == 1 + -(-(30 - 1) // 5)  # prefill, then 5 tokens per decode (the last trimmed by max_tokens)

    stop = full[7]
    sched = make(budget=64)
    r = Request(1, prompt, SamplingParams(max_tokens=30, stop_token_ids=(stop,)))
    sched.add(r)
    run_speculative(sched, VerifyingModel(), random.Random(0), k=4, wrong=0.0, max_steps=100)
    assert r.status is RequestStatus.FINISHED_STOPPED and r.output_token_ids == full[:full.index(stop) + 1]
    assert sched.kv.pool.num_free_blocks == sched.kv.pool.num_blocks


def test_drafts_are_trimmed_to_budget_and_max_tokens_and_never_preempt():
    sched = make(num_blocks=64, budget=4)
    r = Request(0, [1, 2, 3], SamplingParams(max_tokens=4))
    sched.add(r)
    sched.update(sched.schedule(), {0: 7})
    r.spec_token_ids = [8, 9, 10, 11, 12]
    out = sched.schedule()
    (item,) = out.scheduled
    assert item.token_ids == [7, 8, 9] and item.num_draft_tokens == 2  # max_tokens 4: 1 out + 1 fed + 2 drafts
    with pytest.raises(ValueError, match="accepted draft tokens"):
        sched.update(out, {0: [9, 5]})  # 9 is not the first draft
    sched.update(out, {0: [8, 5]})  # draft 8 accepted, then 5
    assert r.output_token_ids == [7, 8, 5] and r.num_computed_tokens == 5  # prompt + 7 + 8 (9 rejected)

    # A pool that holds the decode but not its drafts: the drafts go, nobody is preempted.
    sched = make(num_blocks=2, budget=16)  # 8 tokens
    old, new = Request(0, [1] * 3, SamplingParams(max_tokens=5)), Request(1, [2] * 3, SamplingParams(max_tokens=5))
    sched.add(old)
    sched.add(new)
    sched.update(sched.schedule(), {0: 4, 1: 4})
    old.spec_token_ids = [5, 6, 7]
    out = sched.schedule()
    assert [s.num_draft_tokens for s in out.scheduled] == [0, 0] and not out.preempted


def test_lookahead_blocks_are_reused_and_keyed_only_once_their_tokens_are_known():
    kv = KVCacheManager(KVCacheConfig(num_blocks=8, block_size=4))
    kv.allocate(0, [1, 2, 3])
    kv.append(0, 1, [9], num_lookahead_tokens=4)  # room for 4 tokens, blocks for 8
    assert len(kv.block_table(0)) == 2 and kv.num_allocated_tokens(0) == 4
    free = kv.num_free_blocks
    kv.append(0, 3, [5, 6, 7])  # two drafts accepted, plus the next token: covered by the lookahead block
    assert kv.num_free_blocks == free and kv.num_allocated_tokens(0) == 7 and len(kv.block_table(0)) == 2
    # Only full blocks of known tokens are keyed: block 0 (1 2 3 9); block 1 holds 3 tokens so far.
    assert kv.allocate(1, [1, 2, 3, 9, 5, 6, 7, 8, 0]) == 4
    with pytest.raises(ValueError, match="num_lookahead_tokens"):
        kv.append(0, 0, [], num_lookahead_tokens=-1)


# -- the engine on compiled artifacts -------------------------------------------------------------

REPETITIVE = [5, 6, 7, 8, 9] * 6  # its continuation repeats too: drafts get accepted


@pytest.fixture(scope="module", params=[("tiny-llama", "contiguous"), ("tiny-deepseek-v3", "contiguous"),
                                        ("tiny-llama", "paged")], ids=lambda p: "-".join(p))
def artifact(request, tmp_path_factory) -> tuple[str, Path]:
    name, kv_cache = request.param
    out = tmp_path_factory.mktemp(f"{name}-{kv_cache}") / "artifact"
    options = CompileOptions.from_flags(model=name, output_dir=out, max_seq_len=128, progress=False,
                                        kv_cache=kv_cache, **({"kv_block_size": 16} if kv_cache == "paged" else {}))
    return name, compile_model(options).output_dir


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, int(length)).tolist() for length in rng.integers(2, 40, n)]


def _torch_greedy(name: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    model = load_model(name).model
    return [generate(model, p, SamplingParams(max_tokens=max_tokens)).token_ids for p in prompts]


@pytest.mark.parametrize("max_batch", [1, 8, None])
def test_greedy_output_with_drafts_equals_pytorch(artifact, max_batch):
    name, path = artifact
    prompts = [REPETITIVE, *_prompts(5, seed=11)]
    expected = _torch_greedy(name, prompts, 40)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    engine = LLMEngine.from_artifact(path, EngineConfig(
        scheduling=SchedulingOptions(max_num_seqs=max_batch or 8, max_num_batched_tokens=64),
        speculative=SpeculativeOptions(tokens=4, max_batch=max_batch, min_ngram=1)))
    outputs = engine.generate(prompts, params)
    assert [o.token_ids for o in outputs] == expected
    metrics = engine.metrics
    # The default limit: 1 on a contiguous artifact (a row with drafts runs alone there), every slot on a paged one.
    limit = engine.speculative_max_batch
    assert limit == (max_batch or (8 if engine.backend.kv_pool is not None else 1))
    if limit >= engine.scheduler.config.max_num_seqs:  # every step may draft
        assert 0 < metrics.accepted_draft_tokens < metrics.draft_tokens
    if max_batch == 1:  # each request alone: every accepted draft saved one step
        plain = LLMEngine.from_artifact(path, EngineConfig(scheduling=SchedulingOptions(max_num_seqs=1)))
        plain.generate(prompts, params)
        assert metrics.steps == plain.metrics.steps - metrics.accepted_draft_tokens
    assert engine.kv.stats().blocks_in_use == 0 and not engine.requests


def test_stop_tokens_stop_strings_and_other_requests_in_a_speculative_batch(artifact):
    name, path = artifact
    (full,) = _torch_greedy(name, [REPETITIVE], 40)
    engine = LLMEngine.from_artifact(path, EngineConfig(
        scheduling=SchedulingOptions(max_num_seqs=4, max_num_batched_tokens=64),
        speculative=SpeculativeOptions(tokens=4, max_batch=4, min_ngram=1)))
    stop_token = max(set(full), key=full.index)  # the token that shows up last
    stopped = engine.generate([REPETITIVE], SamplingParams(max_tokens=40, ignore_eos=True,
                                                           stop_token_ids=(stop_token,)))[0]
    assert stopped.token_ids == full[:full.index(stop_token) + 1] and stopped.finish_reason == "stop"
    # A stop string completed inside an accepted run ends the output at the token that completed it, as plain
    # decoding does (compared with the engine without speculation: the same tokenizer decides).
    plain = LLMEngine.from_artifact(path, EngineConfig(scheduling=SchedulingOptions(max_num_seqs=4)))
    text = plain.generate([REPETITIVE], SamplingParams(max_tokens=40, ignore_eos=True))[0].text
    assert text
    for stop in {text[i:i + 2].rstrip("\ufffd") for i in (10, 25, 33)} - {""}:
        params = SamplingParams(max_tokens=40, ignore_eos=True, stop_strings=(stop,))
        want = plain.generate([REPETITIVE], params)[0]
        got = engine.generate([REPETITIVE], params)[0]
        assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason)
    # Sampled and logprob requests run beside the drafting ones, unchanged: a seeded request samples what it
    # samples alone, and logprobs come back per token.
    seeded = SamplingParams(temperature=1.0, top_k=20, seed=5, max_tokens=12, ignore_eos=True)
    alone = plain.generate([REPETITIVE], seeded)[0].token_ids
    greedy = SamplingParams(max_tokens=30, ignore_eos=True)
    crowd = engine.generate([REPETITIVE, REPETITIVE[:-3], REPETITIVE],
                            [greedy, SamplingParams(max_tokens=10, ignore_eos=True, logprobs=2), seeded])
    assert crowd[0].token_ids == full[:30] and crowd[2].token_ids == alone
    assert engine.metrics.accepted_draft_tokens > 0
    assert len(crowd[1].logprobs) == len(crowd[1].top_logprobs) == 10


class CyclingBackend:
    """A model whose next token is always (token + 1) % 4, returning one-hot logits for each row's last
    ``num_logits`` tokens: its output cycles, so drafts copied from the sequence are right."""

    num_slots, max_seq_len, vocab_size, kv_pool, multi_logit_rows = 2, 64, 4, None, True

    def execute(self, step: StepInput) -> np.ndarray:
        fed = [t for row in step.rows for t in row.token_ids[len(row.token_ids) - row.num_logits:]]
        return np.eye(self.vocab_size, dtype=np.float32)[[(t + 1) % self.vocab_size for t in fed]]

    def release(self, slot: int) -> None:
        pass

    def op_time_shares(self) -> None:
        return None


def test_a_stop_string_completed_inside_an_accepted_run_ends_the_output_there():
    engine = LLMEngine(CyclingBackend(), tokenizer=letter_tokenizer("abcd", 4),  # type: ignore[arg-type]
                       config=EngineConfig(speculative=SpeculativeOptions(tokens=4)))
    prompt = [0, 1, 2, 3, 0]  # output: b c d a b c d ...; the second step accepts 4 drafts (output 1..5 at once)
    chunks = [c.new_token_ids for c in engine.stream(prompt, SamplingParams(max_tokens=12))]
    assert chunks[:2] == [[1], [2, 3, 0, 1, 2]] and [t for c in chunks for t in c] == [(1 + i) % 4 for i in range(12)]
    stopped = engine.generate([prompt], SamplingParams(max_tokens=12, stop_strings=("dab",)))[0]
    # The output ends at the token that completed "dab" (not the c that came in the same run); its text before it.
    assert stopped.token_ids == [1, 2, 3, 0, 1] and stopped.text == "bc" and stopped.finish_reason == "stop"
    # A stop token inside a run, and max_tokens: the run is cut there too.
    assert engine.generate([prompt], SamplingParams(max_tokens=12, stop_token_ids=(0,)))[0].token_ids == [1, 2, 3, 0]
    assert engine.generate([prompt], SamplingParams(max_tokens=4))[0].token_ids == [1, 2, 3, 0]
    # A stop string completed by the run's token that also reaches max_tokens: "stop", as plain decoding reports it.
    last = engine.generate([prompt], SamplingParams(max_tokens=5, stop_strings=("dab",)))[0]
    assert (last.token_ids, last.text, last.finish_reason) == ([1, 2, 3, 0, 1], "bc", "stop")
    assert engine.metrics.accepted_draft_tokens > 0 and not engine.requests


class OneLogitBackend(CyclingBackend):
    """A backend that returns one row of logits per sequence (no ``multi_logit_rows``)."""

    multi_logit_rows = False


def test_speculation_on_a_backend_that_cannot_verify_is_refused_by_name():
    with pytest.raises(EngineConfigError, match=r"SpeculativeOptions\(tokens=3\).*set tokens=0"):
        LLMEngine(OneLogitBackend(), config=EngineConfig(
            speculative=SpeculativeOptions(tokens=3)))  # type: ignore[arg-type]
    with pytest.raises(EngineConfigError, match=r"SpeculativeOptions\(tokens=-1\)"):
        SpeculativeOptions(tokens=-1)
    LLMEngine(OneLogitBackend(), config=EngineConfig())  # type: ignore[arg-type]
