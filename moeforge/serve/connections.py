"""Connection limits that hold before any request exists: a deadline for the request head and a cap on open
connections, both below what the process can hold, so that a flood of half-sent requests (no API key needed to
open a socket) cannot exhaust file handles, spin the event loop on accept errors or starve ``/health``.

uvicorn's HTTP/1.1 protocol arms no timer while it waits for a request head: a connection that sends nothing,
or a byte at a time, is kept forever. ``guarded_h11(limits)`` is that protocol with a deadline for each head
(from the connection's opening and after every response) and a cap: a connection beyond ``max_connections``
closes the connection that has waited longest without sending a request head (or, when every other one has a
request in flight, is closed itself), so that a flood of half-sent heads cannot lock out a client that sends its
request at once. Once a head has arrived, its body must keep arriving: ``body_timeout_s`` without a byte of it (a
client that declared ``Content-Length: 100`` and sent 10) ends the request with a 408 and the close, so that a
stalled body cannot hold a connection, and the handler reading it, forever. ``raise_file_limit`` lifts the soft
limit on open files to the hard one and returns what the cap must stay under.

The same protocol closes a connection answered while its request body is still arriving with a lingering close
(``lingering_close.py``: the answer, then the rest of the body read and discarded for a bounded time, then the
close), so that a client still sending reads the answer instead of a reset. A lingering connection has had its
answer: at the cap it is the first to make room.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from dataclasses import dataclass, field
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from moeforge.serve.api_errors import error_response
from moeforge.serve.lingering_close import LingeringTransport, LingerLimits

log = logging.getLogger(__name__)

DEFAULT_HEADER_TIMEOUT_S = 10.0  # a client has this long to send a request line and headers
DEFAULT_BODY_TIMEOUT_S = 10.0  # a request body may pause this long between two of its bytes
DEFAULT_MAX_CONNECTIONS = 1024
FILES_RESERVED = 64  # open files kept for the process itself (model files, logs, the engine's threads)
LOG_EVERY_S = 10.0  # refusals are logged at most this often, with the count since the last line


@dataclass(frozen=True)
class ConnectionLimits:
    """``header_timeout_s``: seconds a connection may take to send a request head; ``max_connections``: open
    connections at most (beyond it, a lingering one or the one waiting longest for its request head is closed);
    ``linger``: how long a connection answered before its body ended reads and discards the rest;
    ``body_timeout_s``: seconds a request body may go without a byte arriving before the request gets a 408."""

    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    linger: LingerLimits = field(default_factory=LingerLimits)
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S

    def __post_init__(self) -> None:
        if not self.header_timeout_s > 0:
            raise ValueError(f"header_timeout_s must be > 0, got {self.header_timeout_s}")
        if not self.body_timeout_s > 0:
            raise ValueError(f"body_timeout_s must be > 0, got {self.body_timeout_s}")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")


def raise_file_limit() -> int:
    """Lift this process's soft limit on open files to its hard limit; returns the connections that then fit
    (the limit less ``FILES_RESERVED``)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):  # a container may forbid it: keep the soft limit
            pass
    return max(soft - FILES_RESERVED, 1)


class _RateLimitedLog:
    """One warning per ``LOG_EVERY_S`` with the count since the last: a flood must not flood the log too."""

    def __init__(self, message: str) -> None:
        self.message, self.count, self.last = message, 0, 0.0

    def __call__(self) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self.last >= LOG_EVERY_S:
            log.warning(self.message, self.count)
            self.count, self.last = 0, now


def guarded_h11(limits: ConnectionLimits) -> type[H11Protocol]:
    """uvicorn's H11 protocol class with ``limits`` (pass it as ``uvicorn.Config(http=...)``)."""
    over_cap = _RateLimitedLog("%d connection(s) over --max-connections: the oldest without a request head closed")
    too_slow = _RateLimitedLog("%d connection(s) closed: no complete request head within --header-timeout")
    body_stalled = _RateLimitedLog("%d request(s) answered 408: their body stopped arriving")

    class GuardedH11Protocol(H11Protocol):
        _head_deadline: asyncio.TimerHandle | None = None
        _body_idle: asyncio.TimerHandle | None = None  # armed while a request body is arriving, reset by each byte
        _waiting_since = 0.0  # loop time since which it waits for a request head (opened, or last response sent)
        _closing: LingeringTransport | None = None  # the transport uvicorn writes to and closes

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._closing = LingeringTransport(transport, self._body_arriving, limits.linger, self.loop)
            self.transport = self._closing  # every close, uvicorn's own included, goes through it
            self._waiting_since = self.loop.time()
            if len(self.connections) > limits.max_connections:
                # Make room by closing a lingering connection (answered already), else the one that has waited
                # longest without a request head (half-sent heads, idle keep-alives): a flood of them cannot lock
                # out a client that sends its request at once (a /health probe). Only when every other connection
                # has a request in flight is the new one closed.
                oldest = min((c for c in self.connections if c is not self and isinstance(c, GuardedH11Protocol)
                              and (c._lingering() or (c.conn.their_state is h11.IDLE
                                                      and not c.transport.is_closing()))),
                             key=lambda c: (not c._lingering(), c._waiting_since), default=None)
                over_cap()
                if oldest is None:
                    self.connections.discard(self)
                    transport.close()
                    return
                oldest.connections.discard(oldest)
                oldest.transport.close()
            self._arm_head_deadline()

        def _body_arriving(self) -> bool:
            return self.conn.their_state is h11.SEND_BODY

        def _lingering(self) -> bool:
            return self._closing is not None and self._closing.lingering

        def data_received(self, data: bytes) -> None:
            if self._closing is not None and self._closing.lingering:
                self._closing.discard(len(data))  # the rest of a body already answered: never parsed, never kept
                return
            super().data_received(data)

        def handle_events(self) -> None:
            super().handle_events()
            # Called after bytes arrive (or a response ends): a body still arriving starts its idle wait again.
            self._disarm_body_idle()
            if self._body_arriving() and not self.transport.is_closing():
                self._body_idle = self.loop.call_later(limits.body_timeout_s, self._body_timed_out)

        def on_response_complete(self) -> None:
            if self._body_arriving() and not self.transport.is_closing():
                # Answered before the body ended (an early refusal) on a kept-alive connection: the rest of the body
                # is discarded within the linger limits and the connection closed, never parsed as a next request.
                self.transport.close()
            super().on_response_complete()
            self._waiting_since = self.loop.time()
            self._arm_head_deadline()  # a kept-alive connection owes its next head in time too

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_head_deadline()
            self._disarm_body_idle()
            if self._closing is not None:
                self._closing.stop_timers()
            super().connection_lost(exc)

        def _arm_head_deadline(self) -> None:
            self._disarm_head_deadline()
            self._head_deadline = self.loop.call_later(limits.header_timeout_s, self._head_timed_out)

        def _disarm_head_deadline(self) -> None:
            if self._head_deadline is not None:
                self._head_deadline.cancel()
                self._head_deadline = None

        def _head_timed_out(self) -> None:
            self._head_deadline = None
            # IDLE: h11 still waits for a request line and headers (partial bytes included).
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                too_slow()
                self.transport.close()

        def _disarm_body_idle(self) -> None:
            if self._body_idle is not None:
                self._body_idle.cancel()
                self._body_idle = None

        def _body_timed_out(self) -> None:
            self._body_idle = None
            if not self._body_arriving() or self.transport.is_closing():
                return
            cycle = self.cycle
            if self.flow.read_paused or (cycle is not None and cycle.waiting_for_100_continue):
                # The server holds the body back (its buffer is full, or 100 Continue is not sent yet): the client
                # is not the one that stopped.
                self._body_idle = self.loop.call_later(limits.body_timeout_s, self._body_timed_out)
                return
            body_stalled()
            if cycle is not None and not cycle.response_started:
                cycle.disconnected = True  # the handler reading the body sees the client gone; its answer is dropped
                cycle.message_event.set()
                self._send_408()
            assert self._closing is not None
            self._closing.finish()  # at once: the client sends nothing a lingering close would wait for

        def _send_408(self) -> None:
            answer = error_response(408, f"the request body stopped arriving: nothing of it for "
                                    f"{limits.body_timeout_s:g} s; send the whole body without pausing",
                                    code="request_timeout", headers={"Connection": "close"})
            try:
                head = self.conn.send(h11.Response(status_code=408, reason=b"Request Timeout",
                                                   headers=list(answer.raw_headers)))
                self.transport.write(head + self.conn.send(h11.Data(data=bytes(answer.body))) +
                                     self.conn.send(h11.EndOfMessage()))
            except h11.LocalProtocolError:  # h11 takes no answer now: the close alone ends the request
                pass

    return GuardedH11Protocol


def protocol_options(limits: ConnectionLimits) -> dict[str, Any]:
    """The ``uvicorn.Config`` keywords that apply ``limits``."""
    return {"http": guarded_h11(limits)}
