"""Abuse of a live ``moeforge serve`` on loopback: slow headers, huge bodies, clients that never read.

`python benchmarks/serve_abuse.py [ARTIFACT] [--slow-connections 3000] [--seconds 15]` (no ARTIFACT: tiny-llama
is compiled into a temporary folder) starts ``moeforge serve`` as a process on a free 127.0.0.1 port with its
default limits (``--stall-timeout`` shortened to ``--stall-timeout`` seconds so the run stays short) and runs three
attacks one after the other, each while a prober asks ``/health`` every 0.2 s on a fresh connection and a sampler
reads the server's resident memory and open file descriptors:

- **slow headers** (slowloris): ``--slow-connections`` sockets each send a request line and then one header line
  every second, never finishing; the server must keep answering ``/health`` and close them after its header
  timeout, without exhausting file handles;
- **large bodies**: 8 clients declare a 150 MB JSON body and start sending it; each must get 413 before the body
  is read, and the server's memory must not grow by the bodies' size;
- **non-reading clients**: 8 clients ask for 1000 streamed tokens with logprobs and never read (a small receive
  buffer); the server must abort them after its stall timeout and free their KV blocks, its memory bounded.

Writes benchmarks/results/serve_abuse.json (machine described): per attack the ``/health`` latency (p50, p99,
max, failures), the server's peak RSS and file descriptors, and the attack's outcome. Exit 1 if ``/health`` failed
or took over a second during an attack, or an attack's outcome is wrong.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil
from serve_load import HOST, metrics, report, start_server

from moeforge.compile.driver import CompileOptions, compile_model
from moeforge.parallel.net import free_port

RESULTS = Path(__file__).parent / "results"
HEALTH_LIMIT_S = 1.0  # /health slower than this during an attack fails the run
BODY_BYTES = 150 * 2**20


@dataclass
class Watch:
    """``/health`` latencies and the server's memory and descriptors, sampled while an attack runs."""

    url: str
    server: psutil.Process
    latencies: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    rss: list[int] = field(default_factory=list)
    fds: list[int] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self.stop.is_set():
            start = time.perf_counter()
            try:
                status = httpx.get(self.url + "/health", timeout=5).status_code
                if status != 200:
                    self.failures.append(f"/health answered {status}")
            except httpx.HTTPError as exc:
                self.failures.append(f"/health: {type(exc).__name__}")
            self.latencies.append(time.perf_counter() - start)
            processes = [self.server, *self.server.children(recursive=True)]
            self.rss.append(sum(p.memory_info().rss for p in processes if p.is_running()))
            self.fds.append(self.server.num_fds())
            self.stop.wait(0.2)

    def summary(self) -> dict[str, Any]:
        lat = np.array(self.latencies) * 1e3
        return {"health_probes": len(lat), "health_failures": len(self.failures),
                "health_failure_examples": self.failures[:3],
                "health_ms_p50": round(float(np.percentile(lat, 50)), 1) if len(lat) else None,
                "health_ms_p99": round(float(np.percentile(lat, 99)), 1) if len(lat) else None,
                "health_ms_max": round(float(lat.max()), 1) if len(lat) else None,
                "server_rss_mib_max": round(max(self.rss) / 2**20, 1) if self.rss else None,
                "server_rss_mib_start": round(self.rss[0] / 2**20, 1) if self.rss else None,
                "server_fds_max": max(self.fds) if self.fds else None}


def watched(url: str, server: psutil.Process, attack: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run ``attack`` while ``/health`` and the server's memory are watched; both summaries merged."""
    watch = Watch(url, server)
    thread = threading.Thread(target=watch.run, daemon=True)
    thread.start()
    time.sleep(0.5)  # a baseline first
    try:
        outcome = attack()
    finally:
        watch.stop.set()
        thread.join()
    return {**watch.summary(), **outcome}


def slow_headers(port: int, connections: int, seconds: float) -> dict[str, Any]:
    """Slowloris: request line + one header line a second, never the blank line."""
    sockets: list[socket.socket] = []
    refused = 0
    for _ in range(connections):
        try:
            s = socket.create_connection((HOST, port), timeout=2)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            sockets.append(s)
        except OSError:
            refused += 1
    deadline, closed = time.monotonic() + seconds, 0
    while time.monotonic() < deadline and sockets:
        alive = []
        for s in sockets:
            try:
                s.sendall(b"X-Slow: 1\r\n")
                alive.append(s)
            except OSError:  # the server closed it
                closed += 1
                s.close()
        sockets = alive
        time.sleep(1.0)
    for s in sockets:
        s.close()
    return {"attack": "slow headers", "connections": connections, "seconds": seconds, "refused_at_connect": refused,
            "closed_by_server": closed, "still_open_at_end": len(sockets)}


def large_bodies(port: int, clients: int = 8) -> dict[str, Any]:
    """Each client declares a 150 MB body and starts sending it; the server should answer 413 without reading it."""
    statuses: list[str] = []
    sent: list[int] = []

    def one() -> None:
        s = socket.create_connection((HOST, port), timeout=30)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {BODY_BYTES}\r\n\r\n".encode() + b'{"prompt": "')
        total, chunk = 0, b"a" * 2**20
        try:
            while total < BODY_BYTES:  # the server may answer and close long before
                s.sendall(chunk)
                total += len(chunk)
        except OSError:
            pass
        try:
            statuses.append(s.recv(4096).split(b"\r\n", 1)[0].decode(errors="replace"))
        except OSError as exc:
            statuses.append(f"no answer ({type(exc).__name__})")
        sent.append(total)
        s.close()

    threads = [threading.Thread(target=one) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return {"attack": "large bodies", "clients": clients, "declared_bytes": BODY_BYTES, "statuses": statuses,
            "all_413": bool(statuses) and all(" 413 " in f"{s} " for s in statuses),
            "mib_sent_per_client_max": round(max(sent, default=0) / 2**20, 1)}


def non_reading(url: str, port: int, model: str, clients: int, stall_timeout: float) -> dict[str, Any]:
    """Clients that ask for long streams and never read them; the server must abort them and free their blocks."""
    body = json.dumps({"model": model, "prompt": [1, 2, 3, 4], "max_tokens": 1000, "n": 8, "stream": True,
                       "logprobs": 5, "ignore_eos": True}).encode()  # ~4 MB of events per request
    sockets = []
    for _ in range(clients):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills at once: the server's writes back up
        s.connect((HOST, port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        sockets.append(s)
    deadline = time.monotonic() + stall_timeout + 60
    after: dict[str, float] = {}
    while time.monotonic() < deadline:
        time.sleep(1.0)
        after = metrics(url)
        if after.get("moeforge:request_success_total{finished_reason=abort}", 0.0) >= clients and \
                after["moeforge:kv_cache_blocks_in_use"] == 0 and after["moeforge:num_requests_running"] == 0:
            break
    for s in sockets:
        s.close()
    finished = {r: after.get(f"moeforge:request_success_total{{finished_reason={r}}}", 0.0)
                for r in ("stop", "length", "abort", "error")}
    blocks = after.get("moeforge:kv_cache_blocks_in_use", -1.0)
    return {"attack": "non-reading clients", "clients": clients, "stall_timeout_s": stall_timeout,
            "server_finished_by_reason": finished, "kv_blocks_in_use_after": blocks,
            "all_aborted_and_freed": finished["abort"] >= clients and blocks == 0}


def run(artifact: Path, connections: int, seconds: float, stall_timeout: float) -> tuple[dict[str, Any], list[str]]:
    port = free_port()
    url = f"http://{HOST}:{port}"
    with tempfile.TemporaryDirectory() as cwd:
        process = start_server(artifact, port, 8, 64, Path(cwd), extra=["--stall-timeout", str(stall_timeout)])
        server = psutil.Process(process.pid)
        log_tail: deque[str] = deque(maxlen=50)  # drained, or the server would block on a full pipe
        threading.Thread(target=log_tail.extend, args=(process.stdout or (),), daemon=True).start()
        try:
            model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
            attacks = [watched(url, server, lambda: slow_headers(port, connections, seconds)),
                       watched(url, server, lambda: large_bodies(port)),
                       watched(url, server, lambda: non_reading(url, port, model, 8, stall_timeout))]
        finally:
            process.terminate()
            exit_code = process.wait(timeout=60)
    failures = []
    for attack in attacks:
        name = attack["attack"]
        if attack["health_failures"]:
            failures.append(f"{name}: /health failed {attack['health_failures']} times")
        if (attack["health_ms_max"] or 0) > HEALTH_LIMIT_S * 1e3:
            failures.append(f"{name}: /health took {attack['health_ms_max']} ms")
    if attacks[0]["still_open_at_end"] and seconds > 12:  # the default header timeout is 10 s
        failures.append(f"slow headers: {attacks[0]['still_open_at_end']} connections still open after {seconds} s")
    if not attacks[1]["all_413"]:
        failures.append(f"large bodies: {attacks[1]['statuses']}")
    if not attacks[2]["all_aborted_and_freed"]:
        failures.append(f"non-reading clients: {attacks[2]['server_finished_by_reason']}, "
                        f"{attacks[2]['kv_blocks_in_use_after']} KV blocks in use")
    return {"artifact": str(artifact), "attacks": attacks, "server_exit_code": exit_code,
            "server_log_lines_last": list(log_tail)[-10:],
            "health_limit_ms": HEALTH_LIMIT_S * 1e3, "failures": failures}, failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("artifact", nargs="?", type=Path, help="artifact directory (default: tiny-llama, compiled)")
    parser.add_argument("--slow-connections", type=int, default=3000, help="slow-header connections (default 3000)")
    parser.add_argument("--seconds", type=float, default=15.0, help="how long the slow headers trickle")
    parser.add_argument("--stall-timeout", type=float, default=5.0, help="the server's --stall-timeout here")
    parser.add_argument("--out", type=Path, default=RESULTS / "serve_abuse.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        artifact = args.artifact or compile_model(CompileOptions(
            model="tiny-llama", output_dir=Path(tmp) / "tiny-llama", max_seq_len=1024, progress=False)).output_dir
        results, failures = run(artifact, args.slow_connections, args.seconds, args.stall_timeout)
    return report(args.out, "serve_abuse", results, failures)


if __name__ == "__main__":
    sys.exit(main())
