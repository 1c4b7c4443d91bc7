"""Fixtures of the server tests: tiny-llama compiled once, and servers started on free localhost ports.

tiny-llama's tokenizer (byte-level) has no chat template, so the chat tests give the server one
(``CHAT_TEMPLATE``, as ``moeforge serve --chat-template`` would) and build the reference prompt with it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from moeforge.parallel.net import free_port
from moeforge.runtime.backends.base import StepInput
from moeforge.runtime.engine import BackendOptions, EngineConfig, LLMEngine, SchedulingOptions
from moeforge.serve import ServerConfig, create_app

MODEL = "tiny-llama"
API_KEY = "test-key"
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="session")
def tiny_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-llama (GQA, contiguous cache, byte-level tokenizer), max_seq_len 128."""
    from moeforge.compile.driver import CompileOptions, compile_model  # the compile stack: only this fixture needs it

    out = tmp_path_factory.mktemp("serve") / "tiny-llama"
    return compile_model(CompileOptions(model=MODEL, output_dir=out, max_seq_len=128, progress=False)).output_dir


class SlowBackend:
    """Wraps a backend: each step waits for ``gate`` and then ``delay`` seconds, so that a test can hold
    requests in the engine (the queue fills; a stream is still running when its client leaves)."""

    def __init__(self, inner: Any, delay: float = 0.0) -> None:
        self.inner = inner
        self.delay = delay
        self.gate = threading.Event()
        self.gate.set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def execute(self, step: StepInput) -> Any:
        self.gate.wait(timeout=30)
        if self.delay:
            time.sleep(self.delay)
        return self.inner.execute(step)


@contextmanager
def _running(app: Any) -> Iterator[str]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    url = f"http://127.0.0.1:{port}"
    while httpx.get(url + "/health", timeout=5).status_code != 200:  # ready: its warm-up step ran
        if time.monotonic() > deadline:
            raise RuntimeError("the test server did not become ready")
        time.sleep(0.02)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=30)


ServerFactory = Callable[..., AbstractContextManager[tuple[str, Any]]]


@pytest.fixture
def start_server(tiny_artifact: Path) -> ServerFactory:
    """``with start_server(max_num_seqs=2, max_queued=1, delay=0.01) as (url, app):`` a fresh engine and app
    (fresh metrics) on a free port; ``app.state.server`` is the app's state, ``app.state.backend`` the
    ``SlowBackend`` in front of the engine's."""

    @contextmanager
    def start(*, max_num_seqs: int = 4, delay: float = 0.0, **config: Any) -> Iterator[tuple[str, Any]]:
        engine = LLMEngine.from_artifact(
            tiny_artifact, EngineConfig(
                scheduling=SchedulingOptions(max_num_seqs=max_num_seqs),
                backend=BackendOptions(threads=1)))
        backend = SlowBackend(engine.backend, delay)
        engine.backend = backend  # type: ignore[assignment]  # a test double around the real backend
        app = create_app(engine, ServerConfig(model_name=MODEL, chat_template=CHAT_TEMPLATE, **config))
        app.state.backend = backend
        with _running(app) as url:
            yield url, app
        backend.gate.set()

    return start


@pytest.fixture(scope="module")
def shared_server(tiny_artifact: Path) -> Iterator[str]:
    """One server for the API tests (API key ``API_KEY``)."""
    engine = LLMEngine.from_artifact(tiny_artifact, EngineConfig(
        scheduling=SchedulingOptions(max_num_seqs=4),
        backend=BackendOptions(threads=1)))
    app = create_app(engine, ServerConfig(model_name=MODEL, api_key=API_KEY, chat_template=CHAT_TEMPLATE))
    with _running(app) as url:
        yield url


@pytest.fixture(scope="session")
def reference(tiny_artifact: Path) -> LLMEngine:
    """The engine used directly: what the server must reproduce."""
    return LLMEngine.from_artifact(tiny_artifact, EngineConfig(
        scheduling=SchedulingOptions(max_num_seqs=4),
        backend=BackendOptions(threads=1)))
