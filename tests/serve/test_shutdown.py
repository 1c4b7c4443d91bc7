"""``moeforge serve`` as a process: SIGTERM lets the in-flight stream finish, refuses new work, exits 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx

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
