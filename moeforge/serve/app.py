"""``create_app(engine, config)``: the FastAPI application of ``moeforge serve``.

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (serving.py),
``GET /health``, ``GET /metrics`` (Prometheus text). The app's lifespan starts the engine loop thread and,
at shutdown, stops it (whatever is still running then is aborted). A pure ASGI gate in front of the routes
checks the bearer token of ``/v1/*`` requests (``--api-key``; /health and /metrics stay open, as vLLM's do)
and refuses new ``/v1/*`` requests with a 503 once draining has begun (``start_draining``, on SIGTERM).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from moeforge.core.errors import MoeforgeError, TokenizerError
from moeforge.model.chat_template import check_chat_template
from moeforge.model.tokenizer import Tokenizer
from moeforge.runtime.engine import LLMEngine
from moeforge.runtime.structured_output import MAX_GRAMMAR_CHARS
from moeforge.serve.api_errors import error_response, install_error_handlers
from moeforge.serve.chat_tools import MAX_TOOLS
from moeforge.serve.engine_loop import EngineLoop
from moeforge.serve.metrics import CONTENT_TYPE, ServerMetrics
from moeforge.serve.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from moeforge.serve.serving import RETRY_AFTER_S, OpenAIServing
from moeforge.serve.streams import DEFAULT_STALL_TIMEOUT_S, Admission

log = logging.getLogger(__name__)

DEFAULT_MAX_QUEUED = 256
# A generation request's JSON body at most: a full 128k-token prompt as ids is ~1 MB; more is refused (413) unread.
DEFAULT_MAX_BODY_BYTES = 16 * 2**20
# Paths behind the API key: the API and its schema (which names every endpoint and field).
GATED_PATHS = ("/v1/", "/openapi.json")


@dataclass(frozen=True)
class ServerConfig:
    """What the server adds to the engine. ``max_queued``: requests that may wait beyond the ``max_num_seqs``
    running ones before new ones get a 429. ``chat_template`` (Jinja source) replaces the tokenizer's.
    ``profile_steps`` > 0 profiles the first that many engine steps for ``moeforge:attention_time_share``.
    ``max_body_bytes``: a request body larger than this is refused with 413 before it is parsed.
    ``stall_timeout_s``: a client that reads nothing this long while its requests produce is aborted.
    ``max_schema_chars``: the largest ``response_format`` schema or grammar, and the most characters all of a
    request's tool parameter schemas may have; ``max_tools``: the most tools a request may give (400 beyond)."""

    model_name: str
    max_queued: int = DEFAULT_MAX_QUEUED
    api_key: str | None = None
    chat_template: str | None = None
    profile_steps: int = 0
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S
    max_schema_chars: int = MAX_GRAMMAR_CHARS
    max_tools: int = MAX_TOOLS

    def __post_init__(self) -> None:
        if self.max_schema_chars < 1 or self.max_tools < 0:
            raise ValueError(f"max_schema_chars must be >= 1 and max_tools >= 0, got {self.max_schema_chars}, "
                             f"{self.max_tools}")
        if self.max_queued < 0:
            raise ValueError(f"max_queued must be >= 0, got {self.max_queued}")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if not self.stall_timeout_s > 0:
            raise ValueError(f"stall_timeout_s must be > 0, got {self.stall_timeout_s}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key is empty: give a key, or leave it out for no authentication")
        if self.profile_steps < 0:
            raise ValueError(f"profile_steps must be >= 0, got {self.profile_steps}")


class _Gate:
    """Before any body is parsed: the bearer-token check for the API and its schema, drain refusal, and the body
    size limit (a body declared or sent larger than ``max_body_bytes`` gets 413; a smaller one is read here and
    replayed to the app). A refused POST is answered with ``Connection: close``: its body is not read."""

    def __init__(self, app: ASGIApp, *, api_key: str | None, server: ServerState, max_body_bytes: int) -> None:
        self.app = app
        self.expected = None if api_key is None else api_key.encode()
        self.server = server
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(GATED_PATHS):
            response = self._refusal(scope)
            if response is None and scope["method"] == "POST":
                response, receive = await self._limited_body(scope, receive)
            if response is not None:
                if scope["method"] == "POST":
                    # Its body is left unread: the client is told the connection ends with this answer, and the
                    # server discards the rest of the body before it closes (connections.py, a lingering close).
                    response.headers["Connection"] = "close"
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, scope: Scope) -> JSONResponse | None:
        if self.expected is not None:
            given_headers = [v for k, v in scope["headers"] if k == b"authorization"]
            if len(given_headers) > 1:  # which one would count is up to each proxy: refuse the ambiguity
                self.server.metrics.reject("unauthorized")
                return error_response(400, "several Authorization headers: send exactly one", code="invalid_api_key")
            scheme, _, given = (given_headers[0] if given_headers else b"").strip().partition(b" ")
            # The scheme is case-insensitive (RFC 9110 11.1); the key is compared in constant time: it is a secret.
            if scheme.lower() != b"bearer" or not hmac.compare_digest(given.strip(), self.expected):
                self.server.metrics.reject("unauthorized")
                return error_response(401, "missing or invalid API key: send 'Authorization: Bearer KEY'",
                                      code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        if self.server.draining and scope["method"] == "POST":
            self.server.metrics.reject("shutting_down")
            return error_response(503, "the server is shutting down", type="server_error", code="shutting_down",
                                  headers={"Retry-After": str(RETRY_AFTER_S)})
        return None

    def _too_large(self, size: str) -> JSONResponse:
        self.server.metrics.reject("body_too_large")
        return error_response(413, f"the request body is {size}, more than the server's limit of "
                              f"{self.max_body_bytes:,} bytes (--max-body-bytes)", code="request_too_large")

    async def _limited_body(self, scope: Scope, receive: Receive) -> tuple[JSONResponse | None, Receive]:
        """The body read up to the limit: (413, _) past it, else (None, a receive that replays it)."""
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            return self._too_large(f"{int(declared):,} bytes"), receive
        chunks: list[Message] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left: let the app see it
                chunks.append(message)
                break
            size += len(message.get("body", b""))
            if size > self.max_body_bytes:
                return self._too_large("larger"), receive
            chunks.append(message)
            if not message.get("more_body", False):
                break
        replay = iter(chunks)

        async def replayed() -> Message:
            return next(replay, None) or await receive()

        return None, replayed


@dataclass
class ServerState:
    """The app's live objects (``app.state.server``)."""

    engine: EngineLoop
    metrics: ServerMetrics
    admission: Admission
    draining: bool = False
    failed: str | None = None  # why the server cannot serve any more (a rank died): /health says so

    def start_draining(self) -> None:
        """Refuse new generation requests from now on; in-flight ones go on (the SIGTERM path)."""
        self.draining = True

    def fail(self, reason: str) -> None:
        """The backend is gone: unhealthy from now on, new requests refused, in-flight ones aborted."""
        self.failed = reason
        self.draining = True
        self.engine.abort_all()


def _chat_tokenizer(tokenizer: Tokenizer | None, template: str | None) -> Tokenizer | None:
    """The tokenizer the chat endpoint renders with: the artifact's, or a copy with ``template`` as its template."""
    if template is None and tokenizer is not None and tokenizer.chat_template:
        try:
            check_chat_template(tokenizer.chat_template)
        except TokenizerError as exc:
            raise MoeforgeError(f"the artifact's chat template: {exc}; start the server with --chat-template FILE "
                                "to replace it") from None
    if template is None or tokenizer is None:
        return tokenizer
    return Tokenizer(tokenizer.backend, bos_token_id=tokenizer.bos_token_id, eos_token_ids=tokenizer.eos_token_ids,
                     chat_template=template, add_bos=tokenizer.add_bos)


def create_app(engine: LLMEngine, config: ServerConfig) -> FastAPI:
    """The server over ``engine``, which the app's engine loop owns from startup on (touch it no more)."""
    metrics = ServerMetrics(config.model_name)
    loop = EngineLoop(engine, metrics, profile_steps=config.profile_steps)
    # Read now, before the loop thread owns the engine.
    max_seq_len = engine.max_model_len  # prompt + max_tokens: the artifact's context, or what the KV cache holds
    if max_seq_len < engine.backend.max_seq_len:
        log.warning("the KV cache holds %d tokens (--kv-blocks), fewer than the artifact's context (%d): requests "
                    "are limited to prompt + max_tokens <= %d", max_seq_len - 1, engine.backend.max_seq_len,
                    max_seq_len)
    capacity = engine.stats().max_num_seqs + config.max_queued
    state = ServerState(loop, metrics, Admission(capacity))
    serving = OpenAIServing(loop, model_name=config.model_name, tokenizer=engine.tokenizer,
                            tokenize=engine.tokenize,
                            chat_tokenizer=_chat_tokenizer(engine.tokenizer, config.chat_template),
                            max_seq_len=max_seq_len, admission=state.admission, metrics=metrics,
                            stall_timeout_s=config.stall_timeout_s, grammars=engine.grammars,
                            max_schema_chars=config.max_schema_chars, max_tools=config.max_tools)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loop.start()
        yield
        # The HTTP server has stopped taking requests and waited for (or cancelled) the ones in flight:
        # anything still in the engine now has nobody to answer, so it is aborted at once.
        state.start_draining()
        await asyncio.to_thread(loop.stop, 0.0)

    app = FastAPI(title="moeforge", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = state
    install_error_handlers(app)
    app.add_middleware(_Gate, api_key=config.api_key, server=state, max_body_bytes=config.max_body_bytes)

    @app.get("/health")
    async def health() -> JSONResponse:
        """Readiness: 200 once the engine has warmed up and while it serves (a load balancer's probe)."""
        if not loop.state.alive or state.draining:
            why = state.failed or loop.state.error or ("shutting down" if state.draining
                                                       else "the engine loop is not running")
            return JSONResponse({"status": "unavailable", "reason": why}, status_code=503)
        if not loop.state.ready:
            return JSONResponse({"status": "starting", "reason": "warming up"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/health/live")
    async def live() -> JSONResponse:
        """Liveness: 200 while the process and its engine loop run, warming up or draining included (a restart
        helps only when this fails)."""
        if loop.state.error is not None or state.failed is not None:
            return JSONResponse({"status": "dead", "reason": state.failed or loop.state.error}, status_code=503)
        return JSONResponse({"status": "alive"})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=config.model_name, created=created, max_model_len=max_seq_len)])

    @app.post("/v1/completions", response_model=None)
    async def completions(request: CompletionRequest, raw: Request) -> JSONResponse | StreamingResponse:
        return await serving.completions(request, raw)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: ChatCompletionRequest, raw: Request) -> JSONResponse | StreamingResponse:
        return await serving.chat(request, raw)

    return app
