"""EngineLoop: the one thread that drives ``LLMEngine`` for every connection of the server.

The engine is not thread-safe, so only this thread touches it. Request handlers (on the asyncio event loop)
hand it commands through a queue -- add these prompts, abort those requests, stop -- and get back a
``concurrent.futures.Future`` with the new request ids (or the error ``add_request`` raised). Outputs go to
each submission's sink, called on this thread after every step that advanced the request; the server's sink
moves them onto the event loop with ``call_soon_threadsafe``.

A request added while others run joins the running batch at the next step (the engine's continuous
batching); an aborted one frees its KV blocks at once (``engine.abort``) and reports a final "abort" output
at the next step. Idle, the thread sleeps on the command queue. ``stop(timeout)`` refuses new work, lets
the in-flight requests finish until the deadline, aborts what is left, reports it and ends the thread.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from moeforge.core.errors import MoeforgeError
from moeforge.runtime.engine import LLMEngine
from moeforge.runtime.outputs import RequestOutput
from moeforge.runtime.sampler import SamplingParams
from moeforge.serve.metrics import ServerMetrics

EXPERT_LOAD_PERIOD_S = 1.0  # how often a busy server refreshes its expert-load metrics

log = logging.getLogger(__name__)

# Called on the loop thread with (the prompt's index in its submission, the output).
OutputSink = Callable[[int, RequestOutput], None]


class ServerShuttingDown(MoeforgeError):
    """The loop is stopping (or stopped): it takes no new requests."""


@dataclass
class _Add:
    prompts: list[tuple[list[int], SamplingParams]]
    sink: OutputSink
    arrival: float
    future: Future[list[int]]


@dataclass
class _Abort:
    request_ids: list[int]


@dataclass
class _AbortAll:
    """Abort every request held (the backend is gone)."""


@dataclass
class _Stop:
    deadline: float


@dataclass
class _Tracked:
    """A live request as the loop sees it: where its outputs go and its timings (for the latency metrics)."""

    sink: OutputSink
    index: int
    arrival: float
    first_token: float | None = None
    last_token: float | None = None


@dataclass
class LoopState:
    """What the request handlers may read without the engine: counts the loop thread last published."""

    running: int = 0
    waiting: int = 0
    kv_blocks_in_use: int = 0
    alive: bool = False
    ready: bool = False  # the warm-up step ran: the first real request meets initialised kernels and buffers
    error: str | None = None  # why the loop died, if it did
    finished: dict[str, int] = field(default_factory=dict)  # requests by finish reason


class EngineLoop:
    """Owns ``engine`` from ``start()`` on: nothing else may call it until the thread has ended."""

    def __init__(self, engine: LLMEngine, metrics: ServerMetrics | None = None, *, profile_steps: int = 0) -> None:
        self.engine = engine
        self.metrics = metrics
        self.state = LoopState()
        self._commands: queue.SimpleQueue[_Add | _Abort | _AbortAll | _Stop] = queue.SimpleQueue()
        self._tracked: dict[int, _Tracked] = {}
        self._accepting = True
        self._deadline: float | None = None
        self._profile_steps = profile_steps
        self._expert_baseline: np.ndarray | None = None  # expert load routed by the warm-up step
        self._rank_baseline: np.ndarray | None = None  # and its per-rank load (sharded artifacts)
        self._expert_published = float("-inf")
        self._thread = threading.Thread(target=self._run, name="moeforge-engine-loop", daemon=True)

    # ---- any thread
    def start(self) -> None:
        self.state.alive = True
        self._thread.start()

    def submit(self, prompts: Sequence[tuple[list[int], SamplingParams]], sink: OutputSink,
               arrival: float | None = None) -> Future[list[int]]:
        """Queue prompts (token ids, params) as requests that succeed or fail together. The future gets their
        ids in order, or the ``MoeforgeError`` that refused them (``RequestError``, ``SamplingParamsError``,
        ``ServerShuttingDown``); then ``sink`` gets every output of each."""
        future: Future[list[int]] = Future()
        if not self._accepting or not self.state.alive:
            future.set_exception(ServerShuttingDown(self.state.error or "the server is shutting down"))
            return future
        self._commands.put(_Add(list(prompts), sink, time.perf_counter() if arrival is None else arrival, future))
        if not self.state.alive:  # the thread ended after the check above: answer what it left queued
            self._refuse_pending()
        return future

    def abort(self, request_ids: Sequence[int]) -> None:
        """Abort requests (unknown or finished ids are ignored); each reports a final "abort" output."""
        if request_ids:
            self._commands.put(_Abort(list(request_ids)))

    def abort_all(self) -> None:
        """Abort every request the loop holds (each reports a final "abort" output)."""
        self._commands.put(_AbortAll())

    def served_expert_load(self) -> tuple[np.ndarray | None, np.ndarray | None]:
        """The expert load the served requests routed, the warm-up's subtracted: ([L_moe, E] routed tokens per
        logical expert, [L_moe, N] per rank of a sharded artifact), each None where not counted. Call once the loop
        has stopped (the engine is the loop's until then)."""
        if self._thread.is_alive():
            raise RuntimeError("served_expert_load() reads the engine: stop the loop first")
        return self._expert_load_since_warm_up()

    def _expert_load_since_warm_up(self) -> tuple[np.ndarray | None, np.ndarray | None]:
        """(per logical expert, per rank) load read from the engine now, less what the warm-up step routed."""
        load, ranks = self.engine.expert_load(), self.engine.rank_expert_load()  # fresh copies, or None
        if load is not None and self._expert_baseline is not None:
            load = load - self._expert_baseline
        if ranks is not None and self._rank_baseline is not None:
            ranks = ranks - self._rank_baseline
        return load, ranks

    def stop(self, timeout: float) -> None:
        """Refuse new requests, let in-flight ones run for ``timeout`` seconds, abort the rest, end the thread.
        Blocks until the thread has ended (call it off the event loop)."""
        self._accepting = False
        if self._thread.is_alive():
            self._commands.put(_Stop(time.perf_counter() + max(timeout, 0.0)))
            self._thread.join()

    # ---- the loop thread
    def _warm_up(self) -> None:
        """One short prefill and a decode step before the server reports ready (``LoopState.ready``): ONNX Runtime
        allocates and prepacks on a session's first runs, which the first client should not wait for. Sampled (not
        greedy), so no argmax-head run is counted; the metrics start from the engine's state after it, and the expert
        load it routed is subtracted from what is exported."""
        engine = self.engine
        prompt = [min(1, engine.backend.vocab_size - 1)] * 2
        engine.add_request(prompt, SamplingParams(max_tokens=2, temperature=1.0, seed=0, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
        self._expert_baseline = engine.expert_load()
        self._rank_baseline = engine.rank_expert_load()
        if self.metrics is not None:
            self.metrics.set_baseline(engine.stats())

    def _run(self) -> None:
        try:
            self._warm_up()
            self.state.ready = True
            while True:
                self._take_commands(block=self._deadline is None and not self.engine.has_unfinished())
                if self._deadline is not None:
                    if not self.engine.has_unfinished():
                        break
                    if time.perf_counter() >= self._deadline:
                        self._abort(list(self.engine.requests))
                if self.engine.has_unfinished():
                    outputs = self.engine.step()
                    self._publish()  # first: a client that has its final output sees gauges that count it out
                    for out in outputs:
                        self._dispatch(out)
        except BaseException as exc:  # a bug in the loop: every waiting client gets an error, not a hang
            log.exception("the engine loop failed; failing its %d requests", len(self._tracked))
            self._fail_all(f"the engine loop failed ({type(exc).__name__}: {exc})")
        finally:
            self._accepting = False
            self.state.alive = False
            self._refuse_pending()
            self._shutdown_engine()

    def _shutdown_engine(self) -> None:
        """The loop ended (a drain, or a failure): the engine writes its cached KV blocks to the disk tier (when
        there is one) for the next server on this artifact. On this thread: the engine is this thread's alone."""
        try:
            written = self.engine.shutdown()
            if written:
                log.info("wrote %d KV-cache blocks to the disk tier for the next start", written)
        except Exception:  # the blocks are a cache: losing them costs a recompute, the shutdown goes on
            log.exception("could not write the KV cache to the disk tier at shutdown")

    def _take_commands(self, block: bool) -> None:
        """Apply every queued command; wait for one first when ``block`` (nothing to run)."""
        while True:
            try:
                command = self._commands.get(timeout=None) if block else self._commands.get_nowait()
            except queue.Empty:
                return
            block = False
            if isinstance(command, _Add):
                self._add(command)
            elif isinstance(command, _Abort):
                self._abort(command.request_ids)
            elif isinstance(command, _AbortAll):
                self._abort(list(self.engine.requests))
            else:
                self._deadline = command.deadline if self._deadline is None else min(self._deadline, command.deadline)

    def _add(self, command: _Add) -> None:
        if not command.future.set_running_or_notify_cancel():  # the client went away while queued
            return
        if self._deadline is not None:
            command.future.set_exception(ServerShuttingDown("the server is shutting down"))
            return
        added: list[int] = []
        try:
            for prompt, params in command.prompts:
                request_id = self.engine.add_request(prompt, params)
                added.append(request_id)
                # The scheduler fails at once a request that can never run (prompt + max_tokens beyond the whole
                # cache): refuse it here, so the client gets a 400 rather than a stream holding one error.
                request = self.engine.requests.get(request_id)
                if request is not None and request.is_finished:
                    raise MoeforgeError(request.error or "the request can never run")
        except MoeforgeError as exc:
            for request_id in added:
                self.engine.abort(request_id)  # its final output goes nowhere: it is not tracked
            command.future.set_exception(exc)
            return
        for index, (request_id, (prompt, _)) in enumerate(zip(added, command.prompts, strict=True)):
            self._tracked[request_id] = _Tracked(command.sink, index, command.arrival)
            if self.metrics is not None:
                self.metrics.admitted(len(prompt))
        command.future.set_result(added)

    def _abort(self, request_ids: Sequence[int]) -> None:
        for request_id in request_ids:
            self.engine.abort(request_id)

    def _dispatch(self, out: RequestOutput) -> None:
        tracked = self._tracked.get(out.request_id)
        if tracked is None:  # refused at submit: nobody waits for it
            return
        now = time.perf_counter()
        if out.new_token_ids:
            ttft = now - tracked.arrival if tracked.first_token is None else None
            itl = None if tracked.last_token is None else now - tracked.last_token
            if tracked.first_token is None:
                tracked.first_token = now
            tracked.last_token = now
            if self.metrics is not None:
                self.metrics.tokens(len(out.new_token_ids), ttft=ttft, itl=itl)
        if out.finished:
            del self._tracked[out.request_id]
            reason = out.finish_reason or "error"
            self.state.finished[reason] = self.state.finished.get(reason, 0) + 1
            if self.metrics is not None:
                self.metrics.finished(reason, now - tracked.arrival)
        try:
            tracked.sink(tracked.index, out)
        except Exception:  # one broken consumer must not stop the others' outputs
            log.exception("output sink of request %d failed", out.request_id)

    def _publish(self) -> None:
        """Counts for the handlers and the metrics, after a step."""
        engine = self.engine
        stats = engine.stats()
        state = self.state
        state.running, state.waiting = stats.running, stats.waiting
        state.kv_blocks_in_use = stats.kv.blocks_in_use
        if self.metrics is not None:
            self.metrics.update_engine(stats)
            now = time.monotonic()
            # At most once a second while busy, and whenever the engine goes idle: a sharded artifact's counts are
            # gathered from every rank.
            if now - self._expert_published >= EXPERT_LOAD_PERIOD_S or not (stats.running or stats.waiting):
                self._expert_published = now
                load, ranks = self._expert_load_since_warm_up()  # None unless the artifact routes to experts
                if load is not None:
                    self.metrics.set_expert_load(load)
                if ranks is not None:
                    self.metrics.set_rank_expert_load(ranks)
        if self._profile_steps and stats.totals.steps >= self._profile_steps:
            self._profile_steps = 0  # profiling ends with the first read
            share = engine.attention_time_share()
            if share is not None and self.metrics is not None:
                self.metrics.set_attention_share(share)

    def _fail_all(self, message: str) -> None:
        self.state.error = message
        for request_id, tracked in list(self._tracked.items()):
            del self._tracked[request_id]
            try:
                tracked.sink(tracked.index, RequestOutput(request_id, [], [], True, "error", message))
            except Exception:
                log.exception("output sink of request %d failed", request_id)

    def _refuse_pending(self) -> None:
        """Answer the adds that arrived after the loop ended."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add) and command.future.set_running_or_notify_cancel():
                command.future.set_exception(ServerShuttingDown(self.state.error or "the server is shutting down"))
