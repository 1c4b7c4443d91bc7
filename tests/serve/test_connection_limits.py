"""Connections that never finish a request head are closed at the header timeout, connections beyond the cap are
closed at once, and ``/health`` answers throughout (the audit's flood: half-sent headers exhausted file handles
and stalled the server, without any API key)."""

from __future__ import annotations

import resource
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from moeforge.parallel.net import free_port
from moeforge.serve.connections import FILES_RESERVED, ConnectionLimits, protocol_options, raise_file_limit


@contextmanager
def _serving(limits: ConnectionLimits) -> Iterator[tuple[str, int]]:
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error",
                                           **protocol_options(limits)))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline
        time.sleep(0.02)
    try:
        yield "127.0.0.1", port
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def _closed_by_server(sock: socket.socket) -> bool:
    sock.settimeout(0.05)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_half_sent_heads_are_closed_at_the_header_timeout_and_health_answers():
    with _serving(ConnectionLimits(header_timeout_s=0.5, max_connections=64)) as (host, port):
        silent = [socket.create_connection((host, port)) for _ in range(20)]
        trickling = [socket.create_connection((host, port)) for _ in range(20)]
        for sock in trickling:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # never the blank line
        assert httpx.get(f"http://{host}:{port}/health", timeout=5).status_code == 200
        time.sleep(0.3)
        for sock in trickling:
            sock.sendall(b"X-Slow: 1\r\n")  # more bytes do not buy more time
        deadline = time.monotonic() + 10
        while not all(_closed_by_server(s) for s in silent + trickling):
            assert time.monotonic() < deadline, "half-sent connections were kept past the header timeout"
        assert httpx.get(f"http://{host}:{port}/health", timeout=5).status_code == 200
        for sock in silent + trickling:
            sock.close()


def test_a_kept_alive_connection_keeps_working_within_the_timeout():
    with _serving(ConnectionLimits(header_timeout_s=1.0, max_connections=8)) as (host, port):
        with httpx.Client(base_url=f"http://{host}:{port}", timeout=5) as client:
            for _ in range(3):  # one connection, several requests, each head sent at once
                assert client.get("/health").status_code == 200
                time.sleep(0.2)


def test_at_the_cap_the_oldest_connection_without_a_request_makes_room():
    """A cap full of connections that send nothing cannot lock out a client that sends its request at once: the one
    waiting longest for its head is closed to admit it; the others keep waiting for theirs."""
    with _serving(ConnectionLimits(header_timeout_s=30, max_connections=5)) as (host, port):
        held = []
        for _ in range(5):
            held.append(socket.create_connection((host, port)))
            time.sleep(0.05)  # an order of arrival
        time.sleep(0.2)
        assert httpx.get(f"http://{host}:{port}/health", timeout=5).status_code == 200
        deadline = time.monotonic() + 5
        while not _closed_by_server(held[0]):
            assert time.monotonic() < deadline, "the oldest half-open connection was kept at the cap"
        assert not any(_closed_by_server(s) for s in held[2:])  # the newer ones still wait for their heads
        for sock in held:
            sock.close()


def test_the_file_limit_is_raised_and_leaves_room_for_the_process():
    fits = raise_file_limit()
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert fits == soft - FILES_RESERVED > 0


def test_bad_limits_are_refused():
    with pytest.raises(ValueError, match="header_timeout_s"):
        ConnectionLimits(header_timeout_s=0)
    with pytest.raises(ValueError, match="max_connections"):
        ConnectionLimits(max_connections=0)
