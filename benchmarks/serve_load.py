"""Load test of ``moeforge serve``: 64 concurrent streaming clients on loopback, a quarter leaving mid-stream.

`python benchmarks/serve_load.py [ARTIFACT] [--clients 64] [--max-num-seqs 16] [--timeout 150]` (no ARTIFACT:
tiny-llama is compiled into a temporary folder, max_seq_len 256) starts ``moeforge serve`` as a process on a
free 127.0.0.1 port and sends every client's request at once: prompts of 4..64 random token ids, greedy,
``ignore_eos``, 8..96 new tokens, streamed (SSE). Every 4th client closes its connection after a few tokens
(with 160+ tokens asked, so that it leaves while its request still runs). Then it checks:

- every other client got ``data: [DONE]``, a finish reason, and exactly the tokens the same request gets run
  alone through ``LLMEngine.generate`` (its solo-run greedy tokens);
- no request is lost: the server's ``moeforge:request_success_total`` over all reasons is the client count;
- the KV blocks in use (``moeforge:kv_cache_blocks_in_use``) and running requests return to 0.

Records p50/p99 time to first token (client side, from sending the request), aggregate tokens/s (tokens
received by all clients / wall time of the run), the server's counters, and writes
benchmarks/results/serve_load.json. Exit 1 if a check fails. Bounded: ``--timeout`` seconds for the run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families
from timer import Stopwatch

from moeforge.cli.bench import write_result
from moeforge.compile.driver import CompileOptions, compile_model
from moeforge.parallel.net import free_port
from moeforge.runtime.engine import EngineConfig, LLMEngine, SchedulingOptions
from moeforge.runtime.sampler import SamplingParams

RESULTS = Path(__file__).parent / "results"
HOST = "127.0.0.1"


@dataclass
class Client:
    index: int
    prompt: list[int]
    max_tokens: int
    leave_after: int | None  # tokens after which it disconnects (None: reads to the end)
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    done: bool = False
    ttft: float | None = None
    error: str | None = None


def workload(clients: int, vocab: int, seed: int) -> list[Client]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(clients):
        prompt = rng.integers(0, min(vocab, 256), int(rng.integers(4, 65))).tolist()
        if i % 4 == 3:  # a quarter leaves mid-stream
            out.append(Client(i, prompt, int(rng.integers(160, 257 - len(prompt) - 1)), int(rng.integers(2, 12))))
        else:
            out.append(Client(i, prompt, int(rng.integers(8, 97)), None))
    return out


async def run_client(http: httpx.AsyncClient, url: str, model: str, client: Client, clock: Stopwatch) -> None:
    body = {"model": model, "prompt": client.prompt, "max_tokens": client.max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True, "return_token_ids": True}
    try:
        async with http.stream("POST", url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                client.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    client.done = True
                elif line.startswith("data: "):
                    choice = json.loads(line[6:])["choices"][0]
                    if choice.get("token_ids") and client.ttft is None:
                        client.ttft = clock.elapsed()
                    client.tokens += choice.get("token_ids") or []
                    client.finish_reason = choice["finish_reason"] or client.finish_reason
                    if client.leave_after is not None and len(client.tokens) >= client.leave_after:
                        return  # leaving the block closes the connection mid-stream
    except httpx.HTTPError as exc:
        client.error = f"{type(exc).__name__}: {exc}"


def metrics(url: str) -> dict[str, float]:
    """Every sample of /metrics, labels folded into the name."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def solo_tokens(artifact: Path, clients: list[Client]) -> dict[int, list[int]]:
    """Each finishing client's request run alone (one request in the engine)."""
    engine = LLMEngine.from_artifact(artifact, EngineConfig(scheduling=SchedulingOptions(max_num_seqs=1)))
    return {c.index: engine.generate([c.prompt], SamplingParams(max_tokens=c.max_tokens, ignore_eos=True))[0]
            .token_ids for c in clients if c.leave_after is None}


def start_server(artifact: Path, port: int, max_num_seqs: int, clients: int, cwd: Path,
                 extra: Sequence[str] = ()) -> subprocess.Popen[str]:
    """``moeforge serve ARTIFACT`` on ``port`` (``extra``: more flags), once ``/health`` answers 200."""
    command = [sys.executable, "-P", "-m", "moeforge.cli", "serve", str(artifact), "--host", HOST, "--port", str(port),
               "--max-num-seqs", str(max_num_seqs), "--max-queued", str(clients), "--log-level", "warning", *extra]
    process = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ})
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"moeforge serve exited: {process.communicate()[0]}")
        try:
            if httpx.get(f"http://{HOST}:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    process.kill()
    raise RuntimeError("moeforge serve did not come up in 120 s")


async def load(url: str, model: str, clients: list[Client], timeout: float) -> float:
    limits = httpx.Limits(max_connections=len(clients), max_keepalive_connections=len(clients))
    async with httpx.AsyncClient(timeout=60, limits=limits) as http:
        clock = Stopwatch()
        await asyncio.wait_for(asyncio.gather(*(run_client(http, url, model, c, clock) for c in clients)), timeout)
        return clock.elapsed()


def run(artifact: Path, num_clients: int, max_num_seqs: int, timeout: float, seed: int) -> tuple[dict[str, object],
                                                                                               list[str]]:
    manifest = json.loads((artifact / "manifest.json").read_text())
    vocab = int(manifest["model_config"]["vocab_size"])
    clients = workload(num_clients, vocab, seed)
    port = free_port()
    url = f"http://{HOST}:{port}"
    with tempfile.TemporaryDirectory() as cwd:
        process = start_server(artifact, port, max_num_seqs, num_clients, Path(cwd))
        try:
            model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
            wall = asyncio.run(load(url, model, clients, timeout))
            deadline = time.monotonic() + 10
            while True:  # aborts land at the engine's next step: give it a moment
                after = metrics(url)
                settled = after["moeforge:kv_cache_blocks_in_use"] == 0 and after["moeforge:num_requests_running"] == 0
                if settled or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        finally:
            process.send_signal(signal.SIGTERM)
            exit_code = process.wait(timeout=60)
    solo = solo_tokens(artifact, clients)

    failures = []
    finishing = [c for c in clients if c.leave_after is None]
    leaving = [c for c in clients if c.leave_after is not None]
    for c in clients:
        if c.error:
            failures.append(f"client {c.index}: {c.error}")
    for c in finishing:
        if not c.done or c.finish_reason is None:
            failures.append(f"client {c.index}: no [DONE] / finish reason")
        elif c.tokens != solo[c.index]:
            failures.append(f"client {c.index}: tokens differ from its solo run")
    finished = {r: after.get(f"moeforge:request_success_total{{finished_reason={r}}}", 0.0)
                for r in ("stop", "length", "abort", "error")}
    if sum(finished.values()) != num_clients:
        failures.append(f"requests lost: the server finished {sum(finished.values())} of {num_clients}: {finished}")
    if after["moeforge:kv_cache_blocks_in_use"] != 0:
        failures.append(f"KV blocks still in use: {after['moeforge:kv_cache_blocks_in_use']}")
    if exit_code != 0:
        failures.append(f"moeforge serve exited {exit_code} on SIGTERM")

    ttft = np.array([c.ttft for c in clients if c.ttft is not None])
    received = sum(len(c.tokens) for c in clients)
    results: dict[str, object] = {
        "model": manifest.get("source"), "max_seq_len": manifest["kv_cache"]["max_seq_len"],
        "clients": num_clients, "leaving_mid_stream": len(leaving), "max_num_seqs": max_num_seqs,
        "prompt_tokens": sum(len(c.prompt) for c in clients),
        "wall_s": round(wall, 3),
        "ttft_ms_p50": round(float(np.percentile(ttft, 50)) * 1e3, 2),
        "ttft_ms_p99": round(float(np.percentile(ttft, 99)) * 1e3, 2),
        "tokens_received": received,
        "aggregate_tokens_per_s": round(received / wall, 1),
        "finishing_clients_matching_solo_run": sum(1 for c in finishing if c.tokens == solo[c.index]),
        "finishing_clients": len(finishing),
        "server_finished_by_reason": finished,
        "server_generation_tokens": after["moeforge:generation_tokens_total"],
        "server_preemptions": after["moeforge:num_preemptions_total"],
        "server_steps": after["moeforge:engine_steps_total"],
        "kv_blocks_in_use_after": after["moeforge:kv_cache_blocks_in_use"],
        "server_exit_code_on_sigterm": exit_code,
        "failures": failures,
    }
    return results, failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("artifact", nargs="?", type=Path, help="artifact directory (default: tiny-llama, compiled)")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=150.0, help="seconds the load may take at most")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "serve_load.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        artifact = args.artifact
        if artifact is None:
            artifact = compile_model(CompileOptions(model="tiny-llama", output_dir=Path(tmp) / "tiny-llama",
                                                    max_seq_len=256, progress=False)).output_dir
        results, failures = run(artifact, args.clients, args.max_num_seqs, args.timeout, args.seed)
    return report(args.out, "serve_load", results, failures)


def report(out: Path, name: str, results: dict[str, Any], failures: list[str]) -> int:
    """Write ``results`` (machine described) to ``out``, print them and each failure; the exit code (1: a failure)."""
    write_result(out, name, results)
    print(json.dumps(results, indent=2))
    for failure in failures:
        print("FAIL", failure, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
