"""``serve(options)``: open an artifact and serve it with uvicorn until SIGTERM / SIGINT.

Shutdown (SIGTERM or SIGINT): the server keeps listening, and new generation requests get a 503 with Retry-After
at once; in-flight requests run on for up to ``shutdown_timeout`` seconds, then the engine aborts the ones left, so
that every request ends as the API says one ends (a non-streaming response with ``finish_reason: "abort"``, a stream
with its final chunk and ``[DONE]``); once their responses are sent (``RESPONSE_GRACE_S`` at most), uvicorn closes
the listener and the process exits 0. A second signal skips the drain.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import uvicorn
from fastapi import FastAPI

from moeforge.core.errors import MoeforgeError, TokenizerError
from moeforge.core.strict_json import JsonFileError, read_regular_file
from moeforge.model.chat_template import CHAT_TEMPLATE_MAX_CHARS, check_chat_template
from moeforge.runtime.backends.base import Backend
from moeforge.runtime.engine import (
    BackendOptions,
    CacheOptions,
    EngineConfig,
    LLMEngine,
    SchedulingOptions,
    SpeculativeOptions,
)
from moeforge.runtime.engine_config import DEFAULT_DISK_BYTES
from moeforge.runtime.expert_stats import check_expert_load_out, save_expert_load
from moeforge.serve.app import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_QUEUED, ServerConfig, ServerState, create_app
from moeforge.serve.connections import (
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
    ConnectionLimits,
    protocol_options,
    raise_file_limit,
)
from moeforge.serve.listener import bind_listeners
from moeforge.serve.streams import DEFAULT_STALL_TIMEOUT_S

log = logging.getLogger(__name__)
# After the engine has ended every request: how long their responses may take to go out before uvicorn stops.
RESPONSE_GRACE_S = 5
LIVENESS_POLL_S = 0.5  # how often a sharded server checks that its ranks run
LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class ServeOptions:
    artifact: Path
    host: str = "127.0.0.1"
    port: int = 8000
    # Bound already (``bind_listeners``: the command line binds before a sharded artifact's ranks start); empty:
    # ``serve`` binds host:port itself, before the model loads.
    sockets: tuple[socket.socket, ...] = ()
    max_queued: int = DEFAULT_MAX_QUEUED
    api_key: str | None = None
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 512
    kv_blocks: int | None = None
    # KV tiers below the pool (CacheOptions.host_bytes / disk_dir / disk_bytes / offload_dtype)
    kv_host_bytes: int = 0
    kv_disk_dir: Path | None = None
    kv_disk_bytes: int = DEFAULT_DISK_BYTES
    kv_offload_dtype: str = "native"
    threads: int | None = None
    micro_batches: int = 0  # a pipeline artifact's micro-batches per step (0: one per stage)
    huge_pages: bool = True  # BackendOptions.huge_pages
    speculative_tokens: int = 0  # SpeculativeOptions.tokens
    chat_template: Path | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # a larger request body gets 413, unparsed
    stall_timeout: float = DEFAULT_STALL_TIMEOUT_S  # a client reading nothing this long is aborted
    header_timeout: float = DEFAULT_HEADER_TIMEOUT_S  # a connection sends its request head within this
    max_connections: int = DEFAULT_MAX_CONNECTIONS  # open connections at most (also kept under the file limit)
    served_model_name: str | None = None
    shutdown_timeout: int = 30  # seconds
    profile_steps: int = 0
    log_level: str = "info"
    backend: Backend | None = None  # opened already (a sharded artifact's ShardedBackend); artifact is its rank 0
    # Polled while serving: why the backend's processes are broken (a sharded artifact's rank died), else None.
    # On a reason /health says so at once and the server stops with exit code 1, for a supervisor to restart it.
    liveness: Callable[[], str | None] | None = None
    # Written at exit: the expert load the served requests routed (``moeforge eplb`` reads it); MoE artifacts only.
    expert_load_out: Path | None = None
    expert_load_force: bool = False  # --force: replace an existing expert_load_out file


class _Server(uvicorn.Server):
    """uvicorn's server with moeforge's drain: at the first shutdown signal the app refuses new work and the engine
    loop finishes or aborts what runs (``EngineLoop.stop``), and only once every response has been sent does uvicorn
    stop; a second signal stops it at once."""

    def __init__(self, config: uvicorn.Config, state: ServerState, shutdown_timeout: float) -> None:
        super().__init__(config)
        self._state = state
        self._shutdown_timeout = shutdown_timeout
        self._drain: threading.Thread | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain is not None or not self.started:  # a second signal, or nothing to drain yet
            super().handle_exit(sig, frame)
            return
        self._state.start_draining()
        # Off the signal handler: the drain waits for the engine and the responses.
        self._drain = threading.Thread(target=self._drain_then_exit, args=(sig,), name="moeforge-drain", daemon=True)
        self._drain.start()

    def _drain_then_exit(self, sig: int) -> None:
        self._state.engine.stop(self._shutdown_timeout)  # in-flight requests finish or end with "abort"
        deadline = time.monotonic() + RESPONSE_GRACE_S
        while self._state.admission.in_flight and time.monotonic() < deadline:  # their last bytes go out
            time.sleep(0.02)
        super().handle_exit(sig, None)


def model_name(artifact: Path) -> str:
    """The name clients pass as ``model`` by default: the artifact directory's name (``artifacts/smollm2`` ->
    ``smollm2``), predictable from the command line, where the manifest's source may be a long file path."""
    return artifact.resolve().name


def engine_config(options: ServeOptions) -> EngineConfig:
    """The engine settings ``options`` ask for (expert-load tracking is a no-op on artifacts without MoE)."""
    return EngineConfig(
        scheduling=SchedulingOptions(max_num_seqs=options.max_num_seqs,
                                     max_num_batched_tokens=options.max_num_batched_tokens),
        cache=CacheOptions(kv_blocks=options.kv_blocks, host_bytes=options.kv_host_bytes, disk_dir=options.kv_disk_dir,
                           disk_bytes=options.kv_disk_bytes, offload_dtype=options.kv_offload_dtype),
        backend=BackendOptions(threads=options.threads, profile=options.profile_steps > 0,
                               track_expert_load=True, huge_pages=options.huge_pages,
                               micro_batches=options.micro_batches),
        speculative=SpeculativeOptions(tokens=options.speculative_tokens))


def build_app(options: ServeOptions) -> tuple[FastAPI, ServerState]:
    """The app and its state for ``options`` (engine built, not started). Every setting is checked, by the
    dataclass that owns it (``ServerConfig``, ``ConnectionLimits``), before the model loads."""
    config = server_config(options)
    check_expert_load_out(options.expert_load_out, options.artifact, force=options.expert_load_force)
    engine = LLMEngine.from_artifact(options.artifact, engine_config(options), backend=options.backend)
    if options.expert_load_out is not None and engine.expert_load() is None:
        raise MoeforgeError(f"--expert-load-out {options.expert_load_out}: {options.artifact} routes no experts "
                            "(not a MoE model); leave the flag out")
    app = create_app(engine, config)
    state: ServerState = app.state.server
    return app, state


def server_config(options: ServeOptions) -> ServerConfig:
    """The server's settings of ``options``, each checked by the dataclass that owns it (``ServerConfig``,
    ``ConnectionLimits``) and named as its flag; the chat template read and checked. Reads no model: the CLI asks
    it before a sharded artifact's ranks start."""
    if options.shutdown_timeout < 0:
        raise MoeforgeError(f"--shutdown-timeout must be >= 0, got {options.shutdown_timeout}")
    template = None
    if options.chat_template is not None:
        # A regular file of bounded size: a FIFO or device would block the start (or never end), a huge file fill
        # memory; a template is far smaller than what it may render (CHAT_TEMPLATE_MAX_CHARS).
        fix = f"name a regular UTF-8 file of at most {CHAT_TEMPLATE_MAX_CHARS:,} bytes holding a Jinja chat template"
        try:
            template = read_regular_file(options.chat_template, what="chat template file", fix=fix,
                                         max_bytes=CHAT_TEMPLATE_MAX_CHARS).decode("utf-8")
        except JsonFileError as exc:
            raise MoeforgeError(f"cannot read --chat-template: {exc}") from None
        except UnicodeDecodeError as exc:
            raise MoeforgeError(f"cannot read --chat-template {options.chat_template}: not UTF-8 text ({exc.reason} "
                                f"at byte {exc.start}); {fix}") from None
        try:
            check_chat_template(template)  # before the model loads: a broken template is the operator's to fix
        except TokenizerError as exc:
            raise MoeforgeError(f"--chat-template {options.chat_template}: {exc}") from None
    try:
        config = ServerConfig(model_name=options.served_model_name or model_name(options.artifact),
                              max_queued=options.max_queued, api_key=options.api_key, chat_template=template,
                              profile_steps=options.profile_steps, max_body_bytes=options.max_body_bytes,
                              stall_timeout_s=options.stall_timeout)
        connection_limits(options)
    except ValueError as exc:  # the field's name becomes the flag's
        raise MoeforgeError(_as_flags(str(exc))) from None
    return config


# ServerConfig / ConnectionLimits field -> the serve flag that sets it (their errors name the field).
_FLAGS = {"max_queued": "--max-queued", "max_body_bytes": "--max-body-bytes", "stall_timeout_s": "--stall-timeout",
          "header_timeout_s": "--header-timeout", "max_connections": "--max-connections",
          "api_key": "--api-key", "profile_steps": "--profile-steps"}


def _as_flags(message: str) -> str:
    field = message.split(" ", 1)[0]
    return _FLAGS[field] + message[len(field):] if field in _FLAGS else message


def connection_limits(options: ServeOptions, open_file_room: int | None = None) -> ConnectionLimits:
    """The connection limits of ``options``; the cap lowered (with a warning) to what ``open_file_room`` leaves."""
    cap = options.max_connections
    if open_file_room is not None and cap > open_file_room:
        log.warning("--max-connections %d lowered to %d: what this process's open-file limit leaves",
                    cap, open_file_room)
        cap = open_file_room
    return ConnectionLimits(header_timeout_s=options.header_timeout, max_connections=cap)


def serve(options: ServeOptions) -> int:
    """Serve until a shutdown signal; returns the exit code (0 after a graceful shutdown)."""
    sockets = list(options.sockets) or bind_listeners(options.host, options.port)  # before the model loads
    try:
        app, state = build_app(options)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    if options.host not in LOOPBACK and options.api_key is None:
        log.warning("serving on %s without --api-key: anyone who can reach this host can use it", options.host)
    limits = connection_limits(options, raise_file_limit())
    # The drain (``_Server``) has ended every request before uvicorn shuts down: its own grace is for stragglers.
    config = uvicorn.Config(app, host=options.host, port=options.port, log_level=options.log_level,
                            access_log=False, timeout_graceful_shutdown=RESPONSE_GRACE_S, lifespan="on",
                            **protocol_options(limits))
    server = _Server(config, state, options.shutdown_timeout)
    failure: list[str] = []
    if options.liveness is not None:
        threading.Thread(target=_watch, args=(options.liveness, server, state, failure), name="moeforge-liveness",
                         daemon=True).start()
    # uvicorn re-raises the signal it shut down for once it has restored the previous handler; a handler that
    # does nothing makes that a no-op, so SIGTERM ends in a clean exit 0 rather than death by the signal.
    previous = signal.signal(signal.SIGTERM, _ignore)
    try:
        server.run(sockets=sockets)  # uvicorn closes them at shutdown
    finally:
        signal.signal(signal.SIGTERM, previous)
    if options.expert_load_out is not None and server.started and not failure:
        _save_expert_load(options, state)
    return 0 if server.started and not failure else 1


def _save_expert_load(options: ServeOptions, state: ServerState) -> None:
    """Write what the served requests routed (the loop has stopped: lifespan's end). A sharded artifact's ranks are
    still up (they stop once ``serve`` returns), so its counts are gathered from them; ``options.artifact`` is then
    rank 0's directory and the statistics are named by the top directory's digest. A write that fails now (the
    folder went read-only, a file appeared without --force) is a ``MoeforgeError``: exit code 2 with its message."""
    load, ranks = state.engine.served_expert_load()
    top = options.artifact.parent if options.backend is not None else options.artifact
    path = save_expert_load(options.expert_load_out or Path(), load, ranks, top,
                            options.served_model_name or model_name(options.artifact), force=options.expert_load_force)
    log.info("expert-load statistics of the served requests written to %s", path)


def _watch(liveness: Callable[[], str | None], server: uvicorn.Server, state: ServerState, failure: list[str]) -> None:
    """Poll ``liveness`` while the server runs; on a reason: unhealthy at once, then stop (exit code 1)."""
    while not server.should_exit:
        reason = liveness()
        if reason is not None:
            log.error("the server cannot serve any more: %s; stopping (exit code 1)", reason)
            failure.append(reason)
            state.fail(reason)  # unhealthy; every request aborted, so each response ends as the API says
            deadline = time.monotonic() + RESPONSE_GRACE_S
            while state.admission.in_flight and time.monotonic() < deadline:  # their last bytes go out
                time.sleep(0.02)
            server.should_exit = True
            return
        time.sleep(LIVENESS_POLL_S)


def _ignore(sig: int, frame: FrameType | None) -> None:
    """SIGTERM after the server has shut down: nothing left to do."""
