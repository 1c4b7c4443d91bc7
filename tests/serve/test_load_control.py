"""Backpressure (429), client disconnects (abort: KV blocks back at once) and /metrics, each on a fresh server."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

MODEL = "tiny-llama"


def scrape(url: str) -> dict[str, Any]:
    """The /metrics families by name (a counter's family name has no ``_total``)."""
    text = httpx.get(url + "/metrics").text
    return {family.name: family for family in text_string_to_metric_families(text)}


def value(families: dict[str, Any], sample: str, **labels: str) -> float:
    name = sample.removesuffix("_total").removesuffix("_count").removesuffix("_sum")
    for s in families[name].samples:
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
            return float(s.value)
    raise KeyError(f"{sample} {labels}")


def wait_for(check: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.02)


def test_a_full_queue_answers_429_with_retry_after(start_server: Any) -> None:
    with start_server(max_num_seqs=2, max_queued=1) as (url, app):
        app.state.backend.gate.clear()  # hold every step: the requests stay in flight
        client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=60)
        results: list[Any] = []

        def one() -> None:
            results.append(client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=8, temperature=0,
                                                      extra_body={"ignore_eos": True}))

        threads = [threading.Thread(target=one) for _ in range(3)]  # 2 running + 1 queued: the capacity
        for thread in threads:
            thread.start()
        wait_for(lambda: app.state.server.admission.in_flight == 3)
        with pytest.raises(openai.RateLimitError) as refused:
            client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=8)
        assert refused.value.response.headers["retry-after"] == "1"
        assert refused.value.body["code"] == "rate_limit_exceeded"  # type: ignore[index]
        app.state.backend.gate.set()
        for thread in threads:
            thread.join(timeout=30)
        assert [r.choices[0].finish_reason for r in results] == ["length"] * 3  # nobody lost
        assert value(scrape(url), "moeforge:request_rejected_total", reason="queue_full") == 1


def test_a_client_leaving_mid_stream_aborts_and_frees_its_kv_blocks(start_server: Any) -> None:
    with start_server(delay=0.02) as (url, _):  # 100 tokens would take > 2 s
        body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 100, "temperature": 0, "stream": True,
                "ignore_eos": True}
        with httpx.Client(timeout=30) as http, http.stream("POST", url + "/v1/completions", json=body) as response:
            events = 0
            for line in response.iter_lines():
                events += line.startswith("data: {")
                if events == 3:  # mid-stream: the request holds blocks
                    assert value(scrape(url), "moeforge:kv_cache_blocks_in_use") > 0
                    break  # leaving the iteration closes the connection (httpx)
        # The client is gone: the server aborts the request, its blocks return at once.
        wait_for(lambda: value(scrape(url), "moeforge:request_success_total", finished_reason="abort") == 1)
        families = scrape(url)
        assert value(families, "moeforge:kv_cache_blocks_in_use") == 0
        assert value(families, "moeforge:num_requests_running") == 0
        assert value(families, "moeforge:generation_tokens_total") < 100
        # Not streamed: a client that gives up waiting aborts its request too.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json={**body, "stream": False}, timeout=0.5)
        wait_for(lambda: value(scrape(url), "moeforge:request_success_total", finished_reason="abort") == 2)
        assert value(scrape(url), "moeforge:kv_cache_blocks_in_use") == 0


def test_metrics_parse_with_the_expected_families_and_counts(start_server: Any) -> None:
    with start_server() as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=60)
        prompt_tokens = 0
        for prompt, n in (([1, 2, 3], 5), ([4, 5, 6, 7], 9), ("hi", 3)):
            out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0,
                                            extra_body={"ignore_eos": True})
            assert out.usage is not None
            prompt_tokens += out.usage.prompt_tokens
        families = scrape(url)
    vllm_style = {"num_requests_running", "num_requests_waiting", "request_success", "prompt_tokens",
                  "generation_tokens", "time_to_first_token_seconds", "inter_token_latency_seconds",
                  "e2e_request_latency_seconds", "kv_cache_usage_perc", "prefix_cache_queries", "prefix_cache_hits",
                  "num_preemptions", "kv_cache_blocks_in_use", "kv_cache_blocks_capacity", "prefix_cache_hit_rate"}
    assert {"moeforge:" + name for name in vllm_style} <= set(families)
    assert families["moeforge:time_to_first_token_seconds"].type == "histogram"
    assert value(families, "moeforge:prompt_tokens_total") == prompt_tokens
    assert value(families, "moeforge:generation_tokens_total") == 17
    assert value(families, "moeforge:request_success_total", finished_reason="length") == 3
    assert value(families, "moeforge:request_success_total", finished_reason="abort") == 0
    assert value(families, "moeforge:time_to_first_token_seconds_count") == 3
    assert value(families, "moeforge:e2e_request_latency_seconds_count") == 3
    assert value(families, "moeforge:inter_token_latency_seconds_count") == 17 - 3
    assert value(families, "moeforge:kv_cache_blocks_capacity") == 4 * 128 // 16
    assert value(families, "moeforge:kv_cache_blocks_in_use") == 0
    assert value(families, "moeforge:num_requests_running") == 0
    assert value(families, "moeforge:num_preemptions_total") == 0
