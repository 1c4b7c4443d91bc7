"""``moeforge serve`` as a process: SIGTERM lets in-flight requests finish or ends them as the API says one ends,
refuses new work with 503 while it drains, and exits 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from moeforge.parallel.net import free_port
from tests.conftest import wait_healthy


def test_sigterm_drains_in_flight_requests_and_exits_0(tiny_artifact: Path, tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # Run from outside the checkout: the installed package, as a user runs it.
    process = subprocess.Popen(
        [sys.executable, "-m", "moeforge.cli", "serve", str(tiny_artifact), "--port", str(port), "--threads", "1",
         "--shutdown-timeout", "20", "--log-level", "warning"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ})
    try:
        wait_healthy(process, url)

        body = {"model": "tiny-llama", "prompt": [1, 2, 3], "max_tokens": 120, "temperature": 0, "stream": True,
                "ignore_eos": True, "return_token_ids": True}
        tokens, reasons, done = 0, [], False
        with httpx.Client(timeout=60) as http, http.stream("POST", url + "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    break
            process.send_signal(signal.SIGTERM)  # mid-stream
            for line in lines:
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    choice = json.loads(line[6:])["choices"][0]
                    tokens += len(choice["token_ids"])
                    reasons.append(choice["finish_reason"])
        assert done and reasons[-1] == "length"  # the in-flight request ran to its end

        try:  # after SIGTERM: no new work (the listener is closed, or a 503 while draining)
            refused = httpx.post(url + "/v1/completions", json={**body, "stream": False}, timeout=5).status_code
        except httpx.TransportError:
            refused = 503
        assert refused == 503
        output = process.communicate(timeout=60)[0]
        assert process.returncode == 0, output
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _requests_in_engine(url: str) -> float:
    """Running plus waiting requests, as /metrics says."""
    families = text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text)
    return sum(sample.value for family in families for sample in family.samples
               if sample.name in ("moeforge:num_requests_running", "moeforge:num_requests_waiting"))


def _serve(artifact: Path, cwd: Path, *flags: str) -> tuple[subprocess.Popen[str], str]:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "moeforge.cli", "serve", str(artifact), "--port", str(port), "--threads", "1",
         "--max-num-seqs", "4", "--max-queued", "32", "--log-level", "warning", *flags],
        cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ})
    return process, f"http://127.0.0.1:{port}"


def test_sigterm_ends_every_in_flight_request_as_the_api_says(tiny_artifact: Path, tmp_path: Path) -> None:
    """--shutdown-timeout 0 with 16 requests in flight (8 streams, 8 not): every stream ends with a final chunk and
    [DONE], every response is OpenAI-shaped (finish_reason "abort" or "length"); a request sent during the drain
    gets 503 (the server still listens); nothing logs a traceback; the exit code is 0."""
    process, url = _serve(tiny_artifact, tmp_path, "--shutdown-timeout", "0")
    body = {"model": "tiny-llama", "prompt": [1, 2, 3], "max_tokens": 120, "temperature": 0.8, "seed": 1,
            "ignore_eos": True}
    results: dict[str, list[object]] = {"stream": [], "plain": []}
    started = threading.Event()

    def stream() -> None:
        reasons, done = [], False
        with httpx.Client(timeout=60) as http, http.stream("POST", url + "/v1/completions",
                                                           json={**body, "stream": True}) as response:
            for line in response.iter_lines():
                started.set()
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    reasons.append(json.loads(line[6:])["choices"][0]["finish_reason"])
        results["stream"].append((response.status_code, done, reasons[-1] if reasons else None))

    def plain() -> None:
        response = httpx.post(url + "/v1/completions", json=body, timeout=60)
        results["plain"].append((response.status_code, response.json()))

    try:
        wait_healthy(process, url)
        threads = [threading.Thread(target=f) for f in [stream] * 8 + [plain] * 8]
        for thread in threads:
            thread.start()
        assert started.wait(30)
        process.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(timeout=60)
        for status, done, reason in results["stream"]:
            # 503: it reached the server after the drain began (the gate refuses it before any stream starts).
            assert status == 503 or (status == 200 and done and reason in ("abort", "length")), results["stream"]
        for status, reply in results["plain"]:
            if status == 503:  # it reached the server after the drain began
                assert reply["error"]["code"] == "shutting_down"
            else:
                assert status == 200 and reply["choices"][0]["finish_reason"] in ("abort", "length"), reply
        assert any(r == "abort" for _, _, r in results["stream"]) or any(
            s == 200 and r["choices"][0]["finish_reason"] == "abort" for s, r in results["plain"])  # some were cut
        output = process.communicate(timeout=60)[0]
        assert process.returncode == 0, output
        assert "Traceback" not in output and "CancelledError" not in output, output
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def long_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-llama with room for 1000-token outputs: a drain that lasts seconds, not a timing guess."""
    from moeforge.compile.driver import CompileOptions, compile_model

    out = tmp_path_factory.mktemp("drain") / "tiny-llama"
    options = CompileOptions(model="tiny-llama", output_dir=out, max_seq_len=1024, progress=False)
    return compile_model(options).output_dir


def test_a_request_during_the_drain_gets_503_not_a_refused_connection(long_artifact: Path, tmp_path: Path) -> None:
    """While in-flight requests drain (16 streams of 1000 tokens, one sequence at a time: 16,000 steps, seconds
    even at tiny-llama's 0.3 ms a step), the server still listens: a new request gets 503 with Retry-After and
    /health says 503; the streams run to their end; the exit code is 0. SIGTERM goes once /metrics counts all 16 as
    running or waiting, so none is still connecting when the drain begins."""
    process, url = _serve(long_artifact, tmp_path, "--shutdown-timeout", "60", "--max-num-seqs", "1")
    body = {"model": "tiny-llama", "prompt": [1, 2, 3], "max_tokens": 1000, "ignore_eos": True, "stream": True}
    ends: list[tuple[bool, str | None]] = []
    started = threading.Event()

    def stream() -> None:
        done, reason = False, None
        with httpx.Client(timeout=120) as http, http.stream("POST", url + "/v1/completions", json=body) as response:
            for line in response.iter_lines():
                started.set()
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    reason = json.loads(line[6:])["choices"][0]["finish_reason"]
        ends.append((done, reason))

    try:
        wait_healthy(process, url)
        threads = [threading.Thread(target=stream) for _ in range(16)]
        for thread in threads:
            thread.start()
        assert started.wait(30)
        deadline = time.monotonic() + 30
        while _requests_in_engine(url) < 16:  # every stream admitted: running or queued
            assert time.monotonic() < deadline, "the 16 streams never all reached the engine"
            time.sleep(0.01)
        process.send_signal(signal.SIGTERM)
        refused = httpx.post(url + "/v1/completions", json={**body, "stream": False}, timeout=10)
        assert refused.status_code == 503 and refused.headers["Retry-After"], refused.text
        assert httpx.get(url + "/health", timeout=10).status_code == 503  # a load balancer takes it out
        for thread in threads:
            thread.join(timeout=120)
        assert ends == [(True, "length")] * 16  # a timeout long enough: every stream ran to its end
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
