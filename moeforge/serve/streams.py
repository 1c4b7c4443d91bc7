"""The bridge between the engine loop thread and one HTTP request, and the admission limit.

``Admission`` counts requests accepted and not yet finished by the engine, and refuses new ones beyond
``max_num_seqs + max_queued`` (a 429): the queue never grows without bound. The loop thread releases a
request when it reports the request's final output, so the count is right however the HTTP side ends.

``ChoiceStream`` is one HTTP request's view of its engine requests (one per choice): the loop thread's sink
hands each output to the event loop with ``call_soon_threadsafe`` (asyncio objects are not thread-safe), the
handler awaits them, and ``close()`` aborts whatever has not finished -- the one way a request leaves early
(client disconnect, cancelled handler, error). What waits for the handler is bounded: an output not read yet is
merged with the next one of its choice (the newer carries every token so far; the new ids and text deltas are
joined), so a client that reads slowly costs one output per choice, not one per token. A client that reads
nothing for ``stall_timeout_s`` while its requests keep producing is a stalled client: its requests are aborted,
freeing their KV blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future

from moeforge.runtime.outputs import RequestOutput
from moeforge.runtime.sampler import SamplingParams
from moeforge.serve.engine_loop import EngineLoop

log = logging.getLogger(__name__)
# A client that reads nothing this long while its requests produce is aborted (``--stall-timeout``).
DEFAULT_STALL_TIMEOUT_S = 60.0


class Admission:
    """At most ``capacity`` requests in the engine (running or waiting) at once."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.in_flight = 0
        self._lock = threading.Lock()  # taken by the event loop (acquire) and the loop thread (release)

    def try_acquire(self, count: int) -> bool:
        with self._lock:
            if self.in_flight + count > self.capacity:
                return False
            self.in_flight += count
            return True

    def release(self, count: int = 1) -> None:
        with self._lock:
            self.in_flight = max(self.in_flight - count, 0)


class ChoiceStream:
    """The outputs of one HTTP request's engine requests, in the order the engine produced them (merged per choice
    while unread)."""

    def __init__(self, loop: EngineLoop, admission: Admission, num_choices: int,
                 stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S) -> None:
        self.loop = loop
        self.admission = admission
        self.request_ids: list[int] = []
        self.finished = [False] * num_choices
        self.stall_timeout_s = stall_timeout_s
        self._pending: dict[int, RequestOutput] = {}  # choice -> its unread output (dicts keep arrival order)
        self._ready = asyncio.Event()
        self._last_read = time.monotonic()
        self._event_loop = asyncio.get_running_loop()
        self._closed = False
        self.stalled = False  # the client stopped reading and its requests were aborted

    async def submit(self, prompts: Sequence[tuple[list[int], SamplingParams]], arrival: float) -> list[int]:
        """Queue the choices (admission already granted for them); raises what the engine refused them with."""
        future = self.loop.submit(prompts, self._sink, arrival)
        try:
            self.request_ids = await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            # The client left while the loop was adding them: abort them once they exist.
            def settle(done: Future[list[int]]) -> None:
                if done.cancelled() or done.exception() is not None:
                    self.admission.release(len(prompts))  # they never reached the engine
                else:
                    self.loop.abort(done.result())

            future.add_done_callback(settle)
            raise
        except BaseException:
            self.admission.release(len(prompts))  # refused: they never reached the engine
            raise
        return self.request_ids

    def _sink(self, index: int, out: RequestOutput) -> None:
        """On the loop thread: count the request out when it finishes, and hand the output to the event loop."""
        if out.finished:
            self.admission.release()
        try:
            self._event_loop.call_soon_threadsafe(self._offer, index, out)
        except RuntimeError:  # the event loop is closed (the server is gone): nobody reads this any more
            pass

    def _offer(self, index: int, out: RequestOutput) -> None:
        """On the event loop: keep ``out`` for the handler, merged with its choice's unread output."""
        unread = self._pending.pop(index, None)
        if unread is not None:  # ``out`` holds every token so far; what was new since the last read is joined
            out = dataclasses.replace(out, new_token_ids=unread.new_token_ids + out.new_token_ids,
                                      text_delta=unread.text_delta + out.text_delta)
            if not out.finished and not self.stalled and time.monotonic() - self._last_read > self.stall_timeout_s:
                self.stalled = True
                log.warning("a client read nothing for %.0f s while its requests ran: aborting %s",
                            self.stall_timeout_s, self.request_ids)
                self.loop.abort([rid for i, rid in enumerate(self.request_ids) if not self.finished[i]])
        self._pending[index] = out
        self._ready.set()

    async def next(self) -> tuple[int, RequestOutput]:
        while not self._pending:
            self._ready.clear()
            await self._ready.wait()
        index = next(iter(self._pending))
        out = self._pending.pop(index)
        self._last_read = time.monotonic()
        if out.finished:
            self.finished[index] = True
        return index, out

    @property
    def done(self) -> bool:
        return all(self.finished)

    def close(self) -> None:
        """Abort the choices that have not finished (idempotent; safe in ``finally`` under cancellation)."""
        if self._closed:
            return
        self._closed = True
        unfinished = [rid for i, rid in enumerate(self.request_ids) if not self.finished[i]]
        if unfinished:
            log.debug("aborting %d unfinished request(s): %s", len(unfinished), unfinished)
            self.loop.abort(unfinished)
