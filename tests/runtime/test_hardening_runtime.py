"""Runtime input hardening (issue 13): one set of sampling rules for both backends (ONNX Runtime engine and the
PyTorch reference), whole-batch prompt checks in ``generate``, and engine sizing refused before it allocates."""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from moeforge.compile.driver import CompileOptions, compile_model
from moeforge.core import host_memory
from moeforge.core.errors import TokenizerError
from moeforge.core.kv_layout import paged_spec
from moeforge.model.loader import load_model
from moeforge.model.model import CausalLM
from moeforge.model.tokenizer import Tokenizer
from moeforge.runtime import engine_config as engine_config_module
from moeforge.runtime.backends import registry as registry_module
from moeforge.runtime.engine import (
    BackendOptions,
    CacheOptions,
    EngineConfig,
    EngineConfigError,
    LLMEngine,
    RequestError,
    SchedulingOptions,
    SpeculativeOptions,
    check_host_memory,
)
from moeforge.runtime.sampler import SamplingParams, SamplingParamsError
from moeforge.verify.generate import generate, generate_stream

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
# What `moeforge run` would pass (flag names for SamplingParams fields), so both paths speak of its flags.
RUN_FLAGS = {"max_tokens": "--max-new-tokens", "temperature": "--temperature", "top_k": "--top-k",
             "top_p": "--top-p", "seed": "--seed"}


@pytest.fixture(scope="module")
def tiny_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-llama") / "artifact"
    return compile_model(CompileOptions(model="tiny-llama", output_dir=out, max_seq_len=64, progress=False)).output_dir


@pytest.fixture(scope="module")
def engine(tiny_artifact: Path) -> LLMEngine:
    return LLMEngine.from_artifact(tiny_artifact, EngineConfig(scheduling=SchedulingOptions(max_num_seqs=4)))


@pytest.fixture(scope="module")
def torch_model() -> CausalLM:
    return load_model("tiny-llama").model


def _assert_idle(engine: LLMEngine) -> None:
    assert not engine.requests and not engine.scheduler.requests and engine.kv_blocks_in_use == 0


# ---- item 9: one validation for both backends -----------------------------------------------------------

BAD_SAMPLING = [
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"),
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": "0.7"}, "temperature"),
    ({"seed": -1}, "seed"),
    ({"seed": 2**64}, "seed"),
    ({"seed": 1.5}, "seed"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": math.nan}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
    ({"top_k": 2**70}, "top_k"),  # overflowed int64 in the sampler and failed the whole step
]


@pytest.mark.parametrize(("kwargs", "param"), BAD_SAMPLING)
def test_both_backends_refuse_the_same_sampling_params(kwargs, param, engine, torch_model):
    """One sampling type (``SamplingParams``) and one set of rules: the engine and the PyTorch reference refuse the
    same parameter with the same words."""
    with pytest.raises(SamplingParamsError) as ort:
        engine.add_request([1, 2, 3], SamplingParams(**kwargs))
    assert ort.value.param == param
    _assert_idle(engine)
    with pytest.raises(SamplingParamsError) as ref:
        next(generate_stream(torch_model, [1, 2, 3], SamplingParams(**kwargs)))
    assert ref.value.param == param and str(ref.value) == str(ort.value)


def test_the_reference_refuses_what_it_does_not_apply(torch_model):
    for kwargs in ({"min_p": 0.1}, {"repetition_penalty": 1.2}, {"stop_strings": ["x"]}, {"logprobs": 2}):
        name = next(iter(kwargs))
        with pytest.raises(SamplingParamsError, match=rf"^{name} is not applied by the PyTorch reference"):
            next(generate_stream(torch_model, [1, 2, 3], SamplingParams(**kwargs)))


def test_the_widest_valid_values_pass_both_backends(engine, torch_model):
    for seed in (0, 2**64 - 1):
        params = SamplingParams(temperature=0.8, top_k=5, top_p=0.9, seed=seed, max_tokens=1, ignore_eos=True)
        assert len(engine.generate([[1, 2, 3]], params)[0].token_ids) == 1
        assert len(generate(torch_model, [1, 2, 3], params).token_ids) == 1
    _assert_idle(engine)


def test_names_map_fields_to_cli_flags():
    with pytest.raises(SamplingParamsError) as named:
        SamplingParams(max_tokens=0).validate(100, names=RUN_FLAGS)
    assert named.value.param == "--max-new-tokens"
    assert str(named.value) == "--max-new-tokens must be an integer >= 1, got 0"
    with pytest.raises(SamplingParamsError, match=r"^--temperature must be a finite number"):
        SamplingParams(temperature=math.nan).validate(100, names=RUN_FLAGS)
    with pytest.raises(SamplingParamsError, match=r"^max_tokens "):  # without names: its own field name
        SamplingParams(max_tokens=0).validate(100)


def test_one_stop_string_is_not_split_into_characters():
    assert SamplingParams(stop_strings="\n\n").stop_strings == ("\n\n",)
    assert SamplingParams(stop_strings=["ab", "c"]).stop_strings == ("ab", "c")


def test_a_tiny_temperature_samples_the_argmax_on_both_backends(engine, torch_model):
    """1e-46 is a valid temperature (> 0) that rounds to 0 in float32: it must act as greedy, not give NaN."""
    prompt = [5, 17, 42, 8]
    want = engine.generate([prompt], GREEDY)[0].token_ids
    tiny = SamplingParams(temperature=1e-46, seed=3, max_tokens=6, ignore_eos=True)
    assert engine.generate([prompt], tiny)[0].token_ids == want
    want_ref = generate(torch_model, prompt, SamplingParams(max_tokens=6)).token_ids
    assert generate(torch_model, prompt, SamplingParams(max_tokens=6, temperature=1e-46, seed=3)).token_ids \
        == want_ref


# ---- item 10: prompts checked whole, nothing half-queued -------------------------------------------------

def test_generate_checks_every_prompt_before_queueing_and_keeps_serving(engine):
    prompts = [[1, 2, 3], None, [4, 2.7, 5], [True, 2], [], (6, 7, 8), np.array([9, 10], np.int64)]
    outputs = engine.generate(prompts, GREEDY)
    assert [o.error is None for o in outputs] == [True, False, False, False, False, True, True]
    assert outputs[1].error.startswith("prompt 1: a prompt must be text or a sequence")
    assert outputs[2].error.startswith("prompt 2: prompt token 1 is 2.7 (float)")
    assert outputs[3].error.startswith("prompt 3: prompt token 0 is True (bool)")
    assert "empty" in outputs[4].error
    assert all(len(outputs[i].token_ids) == 6 for i in (0, 5, 6))
    _assert_idle(engine)
    alone = engine.generate([[1, 2, 3]], GREEDY)[0]  # still serving, and a batch did not change the tokens
    assert alone.token_ids == outputs[0].token_ids
    _assert_idle(engine)


def test_a_malformed_batch_raises_and_queues_nothing(engine):
    with pytest.raises(RequestError, match="2 prompts"):
        engine.generate([[1, 2, 3], [4, 5]], [GREEDY])
    _assert_idle(engine)
    with pytest.raises(RequestError, match="list of prompts"):
        engine.generate("hello", GREEDY)
    _assert_idle(engine)
    assert engine.generate([[1, 2, 3]], GREEDY)[0].error is None


@pytest.mark.parametrize("bad", [2.7, np.float32(3.0), True, "5", None])
def test_add_request_refuses_non_integer_ids_naming_the_position(engine, bad):
    with pytest.raises(RequestError, match=r"prompt token 2 is .*: token ids must be integers"):
        engine.add_request([1, 2, bad])
    _assert_idle(engine)


def test_add_request_refuses_bad_params_type_and_accepts_numpy_ids(engine):
    with pytest.raises(RequestError, match="SamplingParams"):
        engine.add_request([1, 2], {"temperature": 0.0})
    with pytest.raises(RequestError, match=r"positions \[1\]"):
        engine.add_request([1, 512])
    _assert_idle(engine)
    request_id = engine.add_request(np.array([1, 2, 3], np.int32), GREEDY)
    assert engine.requests[request_id].prompt_token_ids == [1, 2, 3]
    assert all(type(t) is int for t in engine.requests[request_id].prompt_token_ids)
    while engine.has_unfinished():
        engine.step()


def test_torch_path_refuses_the_same_prompts(torch_model):
    for bad, message in (([1, 2.7], "prompt token 1 is 2.7"), ([], "empty"), ([1, 512], "outside the vocabulary")):
        with pytest.raises(RequestError, match=message):
            next(generate_stream(torch_model, bad, SamplingParams(max_tokens=2)))


def test_an_interrupted_generate_leaves_no_request_behind(tiny_artifact, monkeypatch):
    engine = LLMEngine.from_artifact(tiny_artifact, EngineConfig(scheduling=SchedulingOptions(max_num_seqs=2)))
    real_step, calls = engine.step, []

    def step_then_interrupt():
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(engine, "step", step_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        engine.generate([[1, 2, 3], [4, 5, 6], [7, 8]], GREEDY)
    _assert_idle(engine)
    monkeypatch.setattr(engine, "step", real_step)
    assert [len(o.token_ids) for o in engine.generate([[1, 2, 3], [9]], GREEDY)] == [6, 6]
    _assert_idle(engine)


# ---- item 7: sizing refused before anything is allocated ---------------------------------------------------

def _no_backend(*args: object, **kwargs: object) -> None:
    raise AssertionError("a backend (and its caches) was built for a refused configuration")


def test_a_huge_max_num_seqs_is_refused_before_allocating(tiny_artifact, monkeypatch):
    monkeypatch.setattr(registry_module, "OrtBackend", _no_backend)
    monkeypatch.setattr(registry_module, "PagedOrtBackend", _no_backend)
    start = time.perf_counter()
    with pytest.raises(EngineConfigError) as refused:
        LLMEngine.from_artifact(tiny_artifact, EngineConfig(scheduling=SchedulingOptions(max_num_seqs=10**9)))
    assert time.perf_counter() - start < 30
    message = str(refused.value)
    assert "EngineConfig(max_num_seqs=1000000000" in message and "1,000,000,000 sequences x 64 tokens x 512 bytes" \
        in message and "GiB is available: lower max_num_seqs" in message


def test_the_memory_limit_is_the_available_memory(tiny_artifact, monkeypatch):
    monkeypatch.setattr(engine_config_module, "available_memory", lambda: 2**30)
    # 100,000 x 64 tokens x 512 bytes = 3.05 GiB of contiguous cache > 1 GiB.
    with pytest.raises(EngineConfigError, match=r"needs at least 3\.05 GiB .* and 1\.00 GiB is available"):
        LLMEngine.from_artifact(tiny_artifact, EngineConfig(scheduling=SchedulingOptions(max_num_seqs=100_000)))
    # A huge token budget is bounded by what the slots can hold (4 x 64 tokens): not refused.
    fits = LLMEngine.from_artifact(
        tiny_artifact, EngineConfig(scheduling=SchedulingOptions(max_num_seqs=4, max_num_batched_tokens=10**9)))
    assert fits.generate([[1, 2, 3]], GREEDY)[0].error is None


def test_paged_pools_are_sized_from_kv_blocks(monkeypatch, torch_model):
    kv = paged_spec(torch_model.config, max_seq_len=64, block_size=16)
    monkeypatch.setattr(engine_config_module, "available_memory", lambda: 2**30)
    check_host_memory(EngineConfig(scheduling=SchedulingOptions(max_num_seqs=4)), kv, 512, num_blocks=16)
    with pytest.raises(EngineConfigError, match=r"1,000,000,000 blocks x 8,192 bytes .* lower kv_blocks"):
        check_host_memory(EngineConfig(cache=CacheOptions(kv_blocks=10**9)), kv, 512, num_blocks=10**9)
    monkeypatch.setattr(engine_config_module, "available_memory", lambda: None)  # unknown: nothing refused
    check_host_memory(EngineConfig(cache=CacheOptions(kv_blocks=10**9)), kv, 512, num_blocks=10**9)


def test_kv_blocks_beyond_the_contiguous_slots_are_capped(tiny_artifact):
    engine = LLMEngine.from_artifact(tiny_artifact, EngineConfig(
        scheduling=SchedulingOptions(max_num_seqs=2),
        cache=CacheOptions(kv_blocks=100_000)))
    assert engine.kv.config.num_blocks == 2 * (64 // 16)  # what two slots of 64 tokens can hold
    assert engine.generate([[1, 2, 3]], GREEDY)[0].error is None


@pytest.mark.parametrize(("part", "kwargs"), [
    (SchedulingOptions, {"max_num_seqs": 0}), (SchedulingOptions, {"max_num_seqs": 2.5}),
    (SchedulingOptions, {"max_num_batched_tokens": 0}), (SchedulingOptions, {"long_prefill_chunk": 0}),
    (BackendOptions, {"threads": -1}), (CacheOptions, {"kv_blocks": True}), (CacheOptions, {"block_size": 1.5}),
    (SpeculativeOptions, {"tokens": -1}), (SpeculativeOptions, {"max_batch": 0})])
def test_engine_config_refuses_non_positive_or_non_integer_sizes(part, kwargs):
    """Each part names itself and the field; backend options are checked when the EngineConfig holding them is made
    (the backend reads them as given)."""
    name = next(iter(kwargs))
    with pytest.raises(EngineConfigError, match=rf"{part.__name__}\({name}="):
        EngineConfig(backend=part(**kwargs)) if part is BackendOptions else part(**kwargs)


def test_engine_config_refuses_a_part_of_the_wrong_type():
    with pytest.raises(EngineConfigError, match=r"EngineConfig\(scheduling=...\) must be a SchedulingOptions"):
        EngineConfig(scheduling=CacheOptions())  # type: ignore[arg-type]


def test_a_container_memory_limit_lowers_the_available_memory(tmp_path, monkeypatch):
    """cgroup v2 ("max" = none) and v1 (a huge number = none) limits: the tightest of them and the host's wins."""
    monkeypatch.setattr(host_memory, "CGROUP_MEMORY_FILES", ((tmp_path / "missing", tmp_path / "missing"),))
    host = host_memory.available_memory()  # /proc/meminfo alone
    assert host is not None and host > 0
    files = []
    for name, limit, usage in (("v2", "max", "0"), ("v1", str(3 * 2**30), str(2**30))):
        limit_file, usage_file = tmp_path / f"{name}.limit", tmp_path / f"{name}.usage"
        limit_file.write_text(limit + "\n")
        usage_file.write_text(usage + "\n")
        files.append((limit_file, usage_file))
    monkeypatch.setattr(host_memory, "CGROUP_MEMORY_FILES", tuple(files))
    limited = host_memory.available_memory()
    assert limited is not None and limited <= 2 * 2**30  # v1: 3 GiB limit - 1 GiB used
    assert limited == 2 * 2**30 or host < 2.5 * 2**30  # (MemAvailable moves between reads: compare loosely)
    files[1][0].write_text(str(2**63 - 4096))  # v1's "no limit"
    unlimited = host_memory.available_memory()
    assert unlimited is not None and (unlimited > 2 * 2**30 or host < 2.5 * 2**30)


def test_session_option_entries_set_attributes_and_bad_ones_are_refused(tiny_artifact):
    """``options.<attribute>`` session_config entries reach ONNX Runtime's SessionOptions; an unknown attribute or
    value is refused at EngineConfig, naming what is accepted."""
    config = EngineConfig(
        scheduling=SchedulingOptions(max_num_seqs=1),
        backend=BackendOptions(session_config=(("options.enable_mem_pattern", "0"),
                                               ("options.graph_optimization_level", "extended"),
                                               ("session.intra_op.allow_spinning", "0"))))
    engine = LLMEngine.from_artifact(tiny_artifact, config)
    options = engine.backend._session.session.get_session_options()
    assert options.enable_mem_pattern is False
    assert options.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    assert engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True))[0].token_ids
    with pytest.raises(EngineConfigError, match=r"options\.enable_mem_pattern, options\.enable_mem_reuse"):
        EngineConfig(backend=BackendOptions(session_config=(("options.intra_op_num_threads", "4"),)))
    with pytest.raises(EngineConfigError, match=r"options\.enable_cpu_mem_arena='off'.*'0', '1'"):
        EngineConfig(backend=BackendOptions(session_config=(("options.enable_cpu_mem_arena", "off"),)))


# ---- found by an audit of hostile input (engine API) --------------------------------------------------------
class _CountingBackend:
    """A tokenizers backend that records the length of every text it encodes."""

    def __init__(self, inner: object) -> None:
        self.inner, self.lengths = inner, []

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def encode(self, text: str, **kwargs: object) -> object:
        self.lengths.append(len(text))
        return self.inner.encode(text, **kwargs)  # type: ignore[attr-defined]


def test_text_that_cannot_fit_is_refused_after_tokenising_a_prefix(engine):
    tokenizer = engine.tokenizer
    counting = _CountingBackend(tokenizer.backend)
    probe = Tokenizer(counting, bos_token_id=tokenizer.bos_token_id,  # type: ignore[arg-type]
                      eos_token_ids=tokenizer.eos_token_ids, add_bos=tokenizer.add_bos)
    text = "the quick brown fox " * 200_000  # 4 MB
    with pytest.raises(TokenizerError, match="more than 64 tokens"):
        probe.encode(text, max_tokens=64)
    assert counting.lengths == [65 * probe.max_token_chars] and counting.lengths[0] < len(text) // 1000
    short = "the quick brown fox"
    assert probe.encode(short, max_tokens=64) == tokenizer.encode(short)
    with pytest.raises(RequestError, match="more than"):
        engine.add_request(text, GREEDY)
    _assert_idle(engine)


def test_a_repetition_penalty_beyond_float32_is_refused(engine):
    with pytest.raises(SamplingParamsError, match="repetition_penalty must be a number in"):
        engine.add_request([1, 2, 3], SamplingParams(repetition_penalty=1e39))
    _assert_idle(engine)


def test_a_lone_surrogate_is_a_request_error(engine):
    with pytest.raises(RequestError, match=r"not valid Unicode.*U\+D800"):
        engine.add_request("hi \ud800", GREEDY)
    _assert_idle(engine)


def _stop_on_last_token(engine: LLMEngine, max_tokens: int) -> tuple[list[int], str]:
    """A greedy prompt and a stop string that its ``max_tokens``-th generated token completes."""
    tokenizer = engine.tokenizer
    for first in range(3, 60):
        prompt = [first, 7, 11]
        ids = engine.generate([prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True))[0].token_ids
        before = tokenizer.decode(ids[:-1], skip_special_tokens=True)
        full = tokenizer.decode(ids, skip_special_tokens=True)
        for k in range(1, len(full) + 1):
            stop = full[-k:]
            if stop not in before and "\ufffd" not in stop:
                return prompt, stop
    raise AssertionError("no prompt whose last token completes a stop string")


def test_a_stop_string_completed_by_the_last_allowed_token_reports_stop(engine):
    prompt, stop = _stop_on_last_token(engine, 6)
    for max_tokens in (6, 7):  # at max_tokens and one before it: "stop" both times, 6 tokens
        out = engine.generate([prompt], SamplingParams(max_tokens=max_tokens, stop_strings=[stop],
                                                       ignore_eos=True))[0]
        assert out.finish_reason == "stop" and len(out.token_ids) == 6
    _assert_idle(engine)


def test_generate_and_stream_keep_other_callers_outputs(engine):
    # Both finish inside the generate(): their outputs, every delta of them, must still reach the caller's step().
    first = engine.add_request([1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
    second = engine.add_request([9, 8], SamplingParams(max_tokens=1, ignore_eos=True))
    assert len(engine.generate([[4, 5, 6]], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids) == 4
    assert not engine.requests and engine.has_unfinished()  # held for their caller
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    for request_id, count in ((first, 2), (second, 1)):
        mine = [out for out in outputs if out.request_id == request_id]
        assert mine[-1].finished and len(mine[-1].token_ids) == count
        assert [t for out in mine for t in out.new_token_ids] == mine[-1].token_ids  # no delta lost
    third = engine.add_request([7, 7], SamplingParams(max_tokens=1, ignore_eos=True))
    assert len(list(engine.stream([7, 8], SamplingParams(max_tokens=3, ignore_eos=True)))) == 3
    held = engine.step()
    assert [out.request_id for out in held] == [third] and held[0].finished
    _assert_idle(engine)


def test_a_closed_stream_leaves_no_held_output(engine):
    one = engine.stream([1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True))
    two = engine.stream([4, 5], SamplingParams(max_tokens=20, ignore_eos=True))
    next(one)
    next(two)  # steps both requests: one's output is held for its stream
    one.close()
    two.close()
    assert not engine.has_unfinished()
    _assert_idle(engine)


def test_an_abandoned_stream_stops_its_request(engine):
    stream = engine.stream([1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True))
    assert next(stream).token_ids
    stream.close()
    assert not engine.has_unfinished()
    _assert_idle(engine)


def test_a_request_the_kv_cache_cannot_hold_is_refused_naming_the_flag(tiny_artifact):
    small = LLMEngine.from_artifact(tiny_artifact, EngineConfig(
        scheduling=SchedulingOptions(max_num_seqs=1),
        cache=CacheOptions(kv_blocks=2, block_size=16)))
    assert small.backend.max_seq_len == 64 and small.max_model_len == 33  # 32 cached tokens + the last one
    fits, too_long = small.generate([[1] * 20, [1] * 20], [SamplingParams(max_tokens=13, ignore_eos=True),
                                                           SamplingParams(max_tokens=14, ignore_eos=True)])
    assert fits.error is None and len(fits.token_ids) == 13
    assert too_long.error is not None and "--kv-blocks" in too_long.error and not too_long.token_ids
    _assert_idle(small)
