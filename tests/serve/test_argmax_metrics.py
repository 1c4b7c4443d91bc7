"""The certified argmax head on /metrics: ``moeforge:argmax_head_runs_total`` / ``argmax_head_reruns_total`` follow
the backend's own counters, grow on plain greedy requests only, and are absent for an artifact without the head."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from moeforge.compile.driver import CompileOptions, compile_model
from moeforge.runtime.engine import BackendOptions, EngineConfig, LLMEngine, SchedulingOptions
from moeforge.serve import ServerConfig, create_app

from .conftest import MODEL, _running


def _argmax_counters(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {sample.name: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name.startswith("moeforge:argmax_head_")}


def _complete(url: str, **params: object) -> None:
    body = {"model": MODEL, "prompt": [5, 17, 200, 3, 99], "max_tokens": 8, "ignore_eos": True, **params}
    assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200


def test_argmax_head_runs_are_exported(start_server):
    with start_server() as (url, app):
        stats = app.state.backend.argmax_head_stats  # the real backend's counters, through the test double
        assert stats() is not None and stats().runs == 0  # tiny-llama's float head gets the argmax head
        _complete(url, temperature=0)
        greedy = stats()
        assert greedy.runs >= 7  # the decode steps after the prompt's
        counters = _argmax_counters(url)
        assert counters == {"moeforge:argmax_head_runs_total": greedy.runs,
                            "moeforge:argmax_head_reruns_total": greedy.reruns}
        _complete(url, temperature=0.8, seed=3)  # sampling reads the whole float head: no argmax run
        _complete(url, temperature=0, logprobs=2)  # nor do logprobs
        assert stats() == greedy
        assert _argmax_counters(url)["moeforge:argmax_head_runs_total"] == greedy.runs


def test_no_series_without_the_head(tmp_path):
    out = compile_model(CompileOptions.from_flags(model=MODEL, output_dir=tmp_path / "plain", max_seq_len=64,
                                                  argmax_head=False, progress=False)).output_dir
    engine = LLMEngine.from_artifact(out, EngineConfig(
        scheduling=SchedulingOptions(max_num_seqs=2),
        backend=BackendOptions(threads=1)))
    assert engine.argmax_head_stats() is None
    with _running(create_app(engine, ServerConfig(model_name=MODEL))) as url:
        _complete(url, temperature=0)
        assert _argmax_counters(url) == {}
