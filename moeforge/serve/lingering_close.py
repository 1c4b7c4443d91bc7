"""Lingering close: a connection answered while its request body is still arriving is not closed at once.

The server may answer before it has read a body: a 413 for a body over ``--max-body-bytes``, a 401 or 503 refused
before the body is read. Closing the socket then, with the client's bytes unread in it, makes the kernel send a
reset (RST), and a client still sending (Python's urllib, which sends the whole body before it reads) gets
"connection reset by peer" instead of the answer. As nginx does (``lingering_close``, ``lingering_time``,
``lingering_timeout``), the server sends the answer, shuts its sending side (the client sees the answer end), then
reads and discards what the client still sends, without keeping any of it, until the client closes, or
``idle_s`` pass with nothing received, or ``time_s`` pass in all, or more than ``max_bytes`` have arrived; then it
closes.

``LingeringTransport`` wraps a connection's transport: uvicorn closes the connection through it (it closes at once
unless the request's body is still arriving) and the protocol hands it what arrives while it lingers
(``discard``). ``connections.guarded_h11`` installs it on every connection.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

LINGER_TIME_S = 30.0  # nginx's lingering_time
LINGER_IDLE_S = 5.0  # nginx's lingering_timeout: nothing received this long ends the wait
LINGER_MAX_BYTES = 2**30  # discarded at most; a client still sending after that is cut off


@dataclass(frozen=True)
class LingerLimits:
    """How long and how much a lingering close reads and discards: ``time_s`` in all, ``idle_s`` without a byte,
    ``max_bytes`` in all."""

    time_s: float = LINGER_TIME_S
    idle_s: float = LINGER_IDLE_S
    max_bytes: int = LINGER_MAX_BYTES

    def __post_init__(self) -> None:
        for name in ("time_s", "idle_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {self.max_bytes}")


class LingeringTransport(asyncio.Transport):
    """``inner`` (a connection's transport) whose ``close()``, while ``body_arriving()`` says the client is still
    sending its request body, lingers instead: the answer already written goes out, the sending side is shut, and
    what arrives is passed to ``discard`` until the client closes or ``limits`` end the wait. While it lingers the
    transport reports ``is_closing()``, so that uvicorn starts no further request on the connection."""

    def __init__(self, inner: asyncio.Transport, body_arriving: Callable[[], bool], limits: LingerLimits,
                 loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self._inner, self._body_arriving, self._limits, self._loop = inner, body_arriving, limits, loop
        self.lingering = False
        self.discarded = 0  # bytes received and dropped while lingering
        self._deadline: asyncio.TimerHandle | None = None
        self._idle: asyncio.TimerHandle | None = None

    def close(self) -> None:
        if self.lingering or self._inner.is_closing() or not self._body_arriving():
            self.finish()
            return
        self.lingering = True
        if self._inner.can_write_eof():
            self._inner.write_eof()  # after the buffered answer: the client reads it to its end
        self._inner.resume_reading()  # uvicorn may have paused reading while its buffer was full
        self._deadline = self._loop.call_later(self._limits.time_s, self.finish)
        self._idle = self._loop.call_later(self._limits.idle_s, self.finish)

    def discard(self, size: int) -> None:
        """``size`` bytes arrived while lingering: counted and dropped; the idle wait starts again."""
        self.discarded += size
        if self.discarded > self._limits.max_bytes:
            self.finish()
            return
        if self._idle is not None:
            self._idle.cancel()
            self._idle = self._loop.call_later(self._limits.idle_s, self.finish)

    def finish(self) -> None:
        """Stop lingering (or never start) and close the connection now."""
        self.stop_timers()
        self._inner.close()

    def stop_timers(self) -> None:
        for timer in (self._deadline, self._idle):
            if timer is not None:
                timer.cancel()
        self._deadline = self._idle = None

    def is_closing(self) -> bool:
        return self.lingering or self._inner.is_closing()

    def abort(self) -> None:
        self.stop_timers()
        self._inner.abort()

    # Everything else is the connection's transport's.
    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._inner.write(data)

    def writelines(self, list_of_data: Any) -> None:
        self._inner.writelines(list_of_data)

    def write_eof(self) -> None:
        self._inner.write_eof()

    def can_write_eof(self) -> bool:
        return self._inner.can_write_eof()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._inner.get_extra_info(name, default)

    def pause_reading(self) -> None:
        self._inner.pause_reading()

    def resume_reading(self) -> None:
        self._inner.resume_reading()

    def is_reading(self) -> bool:
        return self._inner.is_reading()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._inner.set_write_buffer_limits(high, low)

    def get_write_buffer_size(self) -> int:
        return self._inner.get_write_buffer_size()

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._inner.get_write_buffer_limits()

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._inner.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._inner.get_protocol()
