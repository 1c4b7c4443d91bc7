"""A body over the limit is answered 413 and the client reads that answer, whatever it is: the server discards the
rest of the body before it closes (a lingering close), within a time and size bound. Before, it closed at once with
the body unread, and Python's urllib, which sends the whole body before it reads, got "connection reset by peer".

The server here is the real gate (``app._Gate``) and the real connection protocol (``connections.guarded_h11``) in
front of a route that echoes: the body limit needs no model.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request

from moeforge.serve.app import ServerState, _Gate
from moeforge.serve.connections import ConnectionLimits, protocol_options
from moeforge.serve.engine_loop import EngineLoop
from moeforge.serve.lingering_close import LingerLimits
from moeforge.serve.listener import bind_listeners
from moeforge.serve.metrics import ServerMetrics
from moeforge.serve.streams import Admission

LIMIT = 4096
BIG = 64 * 2**20  # the size that got "connection reset by peer"
PATH = "/v1/completions"


def _echo_app() -> FastAPI:
    app = FastAPI()

    @app.post(PATH)
    async def echo(request: Request) -> dict[str, int]:
        return {"received": len(await request.body())}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    state = ServerState(engine=cast(EngineLoop, None), metrics=ServerMetrics("m"), admission=Admission(1))
    app.add_middleware(_Gate, api_key=None, server=state, max_body_bytes=LIMIT)
    return app


@contextmanager
def _serving(linger: LingerLimits, body_timeout_s: float = 10.0) -> Iterator[tuple[str, uvicorn.Server]]:
    sockets = bind_listeners("127.0.0.1", 0)
    port = sockets[0].getsockname()[1]
    limits = ConnectionLimits(linger=linger, body_timeout_s=body_timeout_s)
    config = uvicorn.Config(_echo_app(), host="127.0.0.1", port=port, log_level="error", **protocol_options(limits))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": sockets}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the test server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", server
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with _serving(LingerLimits()) as (base, _):
        yield base


def _chunks(size: int, piece: int = 2**20) -> Iterator[bytes]:
    block = b"x" * piece
    for start in range(0, size, piece):
        yield block[: min(piece, size - start)]


def _refused(status: int, text: str, size: str) -> None:
    assert status == 413, text
    assert f"the request body is {size}" in text and "--max-body-bytes" in text, text


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_urllib_reads_the_413_of_a_64_mb_body(url: str, chunked: bool) -> None:
    data: Any = _chunks(BIG) if chunked else b"x" * BIG
    headers = {"Content-Type": "application/json"}
    if chunked:
        headers["Transfer-Encoding"] = "chunked"
    request = urllib.request.Request(url + PATH, data=data, headers=headers, method="POST")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=60)
    _refused(refused.value.code, refused.value.read().decode(), "larger" if chunked else f"{BIG:,} bytes")
    assert refused.value.headers["Connection"] == "close"


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_httpx_reads_the_413_of_a_64_mb_body_and_the_server_goes_on(url: str, chunked: bool) -> None:
    with httpx.Client(timeout=60) as client:
        assert client.post(url + PATH, content=b"{}").json() == {"received": 2}
        content: Any = _chunks(BIG) if chunked else b"x" * BIG
        response = client.post(url + PATH, content=content)
        _refused(response.status_code, response.text, "larger" if chunked else f"{BIG:,} bytes")
        assert client.post(url + PATH, content=b"[1]").json() == {"received": 3}  # on a new connection
        assert client.get(url + "/health").status_code == 200


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")
@pytest.mark.parametrize("expect", ["100-continue", ""], ids=["expect-100", "no-expect"])
def test_curl_reads_the_413_of_a_64_mb_body(url: str, tmp_path: Path, expect: str) -> None:
    body = tmp_path / "body.json"
    body.write_bytes(b"x" * BIG)
    done = subprocess.run(["curl", "-sS", "--max-time", "60", "-H", "Content-Type: application/json",
                           "-H", f"Expect: {expect}", "--data-binary", f"@{body}", "-w", "\n%{http_code}",
                           url + PATH], capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr
    text, _, status = done.stdout.rpartition("\n")
    _refused(int(status), text, f"{BIG:,} bytes")


def _head(size: int) -> bytes:
    return (f"POST {PATH} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {size}\r\n\r\n"
            ).encode()


@contextmanager
def _answered(linger: LingerLimits) -> Iterator[tuple[socket.socket, Any, float]]:
    """A raw connection that declared a 64 MB body and read its 413 (to the server's end of sending), the server's
    connection object, lingering now, and the time the answer ended."""
    with _serving(linger) as (base, server), socket.create_connection(("127.0.0.1", int(base.rsplit(":", 1)[1]))) \
            as sock:
        sock.sendall(_head(BIG) + b"x" * 1000)
        sock.settimeout(10)
        answer = b""
        while chunk := sock.recv(65536):  # the server shuts its sending side after the answer
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 413") and b"connection: close" in answer.lower(), answer
        assert len(server.server_state.connections) == 1
        connection: Any = next(iter(server.server_state.connections))  # connections.guarded_h11's protocol
        assert connection._lingering()
        yield sock, connection, time.monotonic()


def _closed(connection: Any) -> bool:
    return bool(connection.transport.get_extra_info("socket").fileno() == -1)


def test_a_client_that_stops_sending_is_closed_after_the_idle_time() -> None:
    with _answered(LingerLimits(time_s=30, idle_s=0.5)) as (_, connection, answered):
        while not _closed(connection) and time.monotonic() - answered < 10:
            time.sleep(0.02)
        assert _closed(connection) and 0.3 < time.monotonic() - answered < 3.0


def test_lingering_ends_at_the_time_limit_for_a_trickling_client() -> None:
    with _answered(LingerLimits(time_s=1.0, idle_s=0.5)) as (sock, connection, answered):
        while not _closed(connection) and time.monotonic() - answered < 10:
            try:
                sock.sendall(b"x")  # a byte every 0.1 s: the idle wait never ends it
            except (BrokenPipeError, ConnectionResetError):
                break
            time.sleep(0.1)
        assert _closed(connection) and 0.7 < time.monotonic() - answered < 4.0
        assert 0 < connection._closing.discarded < 100


def test_lingering_discards_at_most_its_byte_limit() -> None:
    with _answered(LingerLimits(time_s=30, idle_s=5, max_bytes=2**20)) as (sock, connection, _):
        sent, block = 0, b"x" * 65536
        with pytest.raises((BrokenPipeError, ConnectionResetError)):
            while sent < BIG:
                sent += sock.send(block)
        assert _closed(connection)
        # Past 1 MiB (one read beyond it at most), then the close; the rest sat in the kernels' socket buffers.
        assert 2**20 < connection._closing.discarded <= 2**20 + 2**18 and sent < BIG // 2


def test_linger_limits_are_checked() -> None:
    for bad in ({"time_s": 0.0}, {"idle_s": -1.0}, {"max_bytes": -1}):
        with pytest.raises(ValueError, match="must be"):
            LingerLimits(**bad)


def test_a_body_that_stops_arriving_gets_a_408_and_the_close_and_a_pausing_body_is_read() -> None:
    """Slowloris on the body: the head declares 100 bytes, 10 come, then nothing. Before, the connection (and the
    handler awaiting the body) was held forever; now the body idle timeout answers 408 and closes."""
    with _serving(LingerLimits(), body_timeout_s=0.5) as (base, server):
        address = ("127.0.0.1", int(base.rsplit(":", 1)[1]))
        with socket.create_connection(address) as sock:
            sock.sendall(_head(100) + b"x" * 10)
            sent = time.monotonic()
            sock.settimeout(10)
            answer = b""
            while chunk := sock.recv(65536):  # ends when the server closes
                answer += chunk
            waited = time.monotonic() - sent
        assert answer.startswith(b"HTTP/1.1 408") and b"connection: close" in answer.lower(), answer
        assert b"the request body stopped arriving" in answer and b"request_timeout" in answer, answer
        assert 0.3 < waited < 5.0, waited
        with socket.create_connection(address) as sock:  # pauses shorter than the timeout: the body is read whole
            sock.sendall(_head(4))
            for byte in b"[12]":
                time.sleep(0.2)
                sock.sendall(bytes([byte]))
            sock.settimeout(10)
            answer = b""
            while b"}" not in answer and (chunk := sock.recv(65536)):
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b'{"received":4}'), answer
        with httpx.Client(timeout=10) as client:
            assert client.get(base + "/health").status_code == 200
        deadline = time.monotonic() + 5
        while server.server_state.connections and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not server.server_state.connections
    with pytest.raises(ValueError, match="body_timeout_s must be > 0"):
        ConnectionLimits(body_timeout_s=0)
