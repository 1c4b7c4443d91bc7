"""Speculative decoding behind the server: completions equal plain greedy decoding's, and /metrics exports the
engine's draft and accepted token totals under vLLM's names."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from moeforge.compile.driver import CompileOptions, compile_model
from moeforge.runtime.engine import BackendOptions, EngineConfig, LLMEngine, SchedulingOptions, SpeculativeOptions
from moeforge.runtime.sampler import SamplingParams
from moeforge.serve import ServerConfig, create_app

from .conftest import MODEL, _running

PROMPT = [5, 6, 7, 8, 9] * 6  # a repetitive prompt: its continuation repeats too, drafts get accepted


def test_speculative_completions_and_metrics(tmp_path):
    out = compile_model(CompileOptions.from_flags(model=MODEL, output_dir=tmp_path / "a", max_seq_len=128,
                                                  progress=False)).output_dir
    plain = LLMEngine.from_artifact(out, EngineConfig(
        scheduling=SchedulingOptions(max_num_seqs=1),
        backend=BackendOptions(threads=1)))
    expected = plain.generate([PROMPT], SamplingParams(max_tokens=40, ignore_eos=True))[0].token_ids
    engine = LLMEngine.from_artifact(out, EngineConfig(
        scheduling=SchedulingOptions(max_num_seqs=2),
        backend=BackendOptions(threads=1),
        speculative=SpeculativeOptions(tokens=4)))
    with _running(create_app(engine, ServerConfig(model_name=MODEL))) as url:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 40, "ignore_eos": True, "temperature": 0}
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200
        text = httpx.get(f"{url}/metrics", timeout=30).text
    samples = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name.startswith("moeforge:spec_decode_")}
    assert samples == {"moeforge:spec_decode_num_draft_tokens_total": engine.metrics.draft_tokens,
                       "moeforge:spec_decode_num_accepted_tokens_total": engine.metrics.accepted_draft_tokens}
    # Drafts are proposed (the prompt repeats); how many a random tiny model accepts depends on near-tied logits,
    # which differ with the machine's kernels: acceptance itself is tested in tests/runtime/test_speculative.py.
    assert engine.metrics.draft_tokens > 0
    assert 0 <= engine.metrics.accepted_draft_tokens <= engine.metrics.draft_tokens
    choice = reply.json()["choices"][0]
    assert choice["text"] == plain.tokenizer.decode(expected, skip_special_tokens=True)
