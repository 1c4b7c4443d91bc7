"""LLMEngine over compiled artifacts: equal to PyTorch, concurrency-safe, preemption, bad input."""

from pathlib import Path

import numpy as np
import pytest

from moeforge.compile.driver import CompileOptions, compile_model
from moeforge.model.loader import load_model
from moeforge.runtime.engine import (
    BackendOptions,
    CacheOptions,
    EngineConfig,
    LLMEngine,
    RequestError,
    SchedulingOptions,
)
from moeforge.runtime.sampler import SamplingParams, SamplingParamsError
from moeforge.verify.generate import generate

GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-deepseek-v3"])
def artifact(request, tmp_path_factory) -> tuple[str, Path]:
    out = tmp_path_factory.mktemp(request.param) / "artifact"
    compile_model(CompileOptions(model=request.param, output_dir=out, max_seq_len=128, progress=False))
    return request.param, out


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, int(length)).tolist() for length in rng.integers(2, 40, n)]


def _torch_greedy(name: str, prompts, max_tokens: int = 10) -> list[list[int]]:
    model = load_model(name).model
    return [generate(model, p, SamplingParams(max_tokens=max_tokens)).token_ids for p in prompts]


def test_batch_1_and_8_concurrent_equal_pytorch(artifact):
    name, path = artifact
    prompts = _prompts(8)
    expected = _torch_greedy(name, prompts)
    one_seq = EngineConfig(scheduling=SchedulingOptions(max_num_seqs=1))
    solo = [LLMEngine.from_artifact(path, one_seq).generate([p], GREEDY)[0].token_ids
            for p in prompts[:2]]
    assert solo == expected[:2]
    engine = LLMEngine.from_artifact(path, EngineConfig(
        scheduling=SchedulingOptions(max_num_seqs=8, max_num_batched_tokens=48)))
    outputs = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == expected
    assert all(o.finished and o.finish_reason == "length" for o in outputs)
    assert engine.metrics.steps > 0 and engine.kv.stats().blocks_in_use == 0  # everything freed
    assert not engine.requests and not engine.scheduler.requests  # finished requests are forgotten


def test_preemption_with_a_third_of_the_pool(artifact):
    name, path = artifact
    prompts = _prompts(16, seed=1)
    expected = _torch_greedy(name, prompts)
    need = sum(-(-(len(p) + 10) // 16) for p in prompts)  # blocks of 16 tokens for all 16 at once
    engine = LLMEngine.from_artifact(path, EngineConfig(
        scheduling=SchedulingOptions(max_num_seqs=16, max_num_batched_tokens=64),
        cache=CacheOptions(kv_blocks=max(need // 3, 4))))
    outputs = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == expected
    assert engine.metrics.preemptions > 0
    assert engine.kv.stats().blocks_in_use == 0
    assert not engine.requests and not engine.scheduler.requests


def test_bad_requests_fail_alone(artifact):
    name, path = artifact
    engine = LLMEngine.from_artifact(path, EngineConfig(scheduling=SchedulingOptions(max_num_seqs=4)))
    good = _prompts(2, seed=2)
    prompts = [good[0], [], list(range(200)), [5, 99999], good[1]]
    outputs = engine.generate(prompts, GREEDY)
    assert [o.error is None for o in outputs] == [True, False, False, False, True]
    assert "empty" in outputs[1].error and "max_seq_len" in outputs[2].error and "vocabulary" in outputs[3].error
    assert [outputs[0].token_ids, outputs[4].token_ids] == _torch_greedy(name, good)
    with pytest.raises(SamplingParamsError, match="top_p"):
        engine.add_request(good[0], SamplingParams(top_p=0.0))
    with pytest.raises(RequestError, match="outside the vocabulary"):
        engine.add_request([-1])
    assert engine.generate([good[0]], GREEDY)[0].token_ids == _torch_greedy(name, good[:1])[0]  # still serving


def test_seeded_sampling_is_independent_of_the_batch(artifact):
    _, path = artifact
    params = SamplingParams(temperature=1.0, top_k=50, seed=123, max_tokens=8, ignore_eos=True)
    prompt = _prompts(1, seed=3)[0]
    alone = LLMEngine.from_artifact(path).generate([prompt], params)[0].token_ids
    crowd = LLMEngine.from_artifact(path).generate(
        [*_prompts(3, seed=4), prompt], [GREEDY, GREEDY, SamplingParams(temperature=0.7, max_tokens=5), params])
    assert crowd[-1].token_ids == alone


def test_stream_deltas_and_stop_strings(artifact):
    _, path = artifact
    engine = LLMEngine.from_artifact(path)
    prompt = _prompts(1, seed=5)[0]
    chunks = list(engine.stream(prompt, GREEDY))
    assert chunks[-1].finished and [t for c in chunks for t in c.new_token_ids] == chunks[-1].token_ids
    assert chunks[-1].metrics.ttft is not None and chunks[-1].metrics.ttft >= 0
    full_text = chunks[-1].text
    # A trailing U+FFFD may be half a character, matched only once whole: the stop string ends before one.
    stop = full_text[3:6].rstrip("\ufffd")
    if stop:  # the byte-level tokenizer decodes every token to text
        stopped = engine.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True, stop_strings=(stop,)))[0]
        assert stopped.finish_reason == "stop" and len(stopped.token_ids) < 10
    assert not engine.requests  # streamed and stopped requests are forgotten too


def test_attention_time_share_when_profiled(artifact):
    _, path = artifact
    plain = LLMEngine.from_artifact(path)
    plain.generate(_prompts(1), GREEDY)
    assert plain.attention_time_share() is None  # not profiled: the backend cannot tell
    profiled = LLMEngine.from_artifact(path, EngineConfig(backend=BackendOptions(profile=True)))
    profiled.generate(_prompts(2), GREEDY)
    share = profiled.attention_time_share()
    assert share is not None and 0.0 < share < 1.0
