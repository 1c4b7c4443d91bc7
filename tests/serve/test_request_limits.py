"""What surrounds a request: a body over the limit is refused with 413 before it is parsed (declared or streamed),
two Authorization headers are refused rather than one silently winning, and the API's schema is behind the key."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx

from .conftest import API_KEY, MODEL

LIMIT = 4096


def _body(prompt_chars: int) -> bytes:
    return json.dumps({"model": MODEL, "prompt": "x" * prompt_chars, "max_tokens": 2}).encode()


def _chunks(data: bytes, size: int = 1000) -> Iterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i:i + size]


def test_a_body_over_the_limit_gets_413_unparsed(start_server):
    with start_server(max_body_bytes=LIMIT, api_key=API_KEY) as (url, _):
        auth = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
        ok = httpx.post(f"{url}/v1/completions", content=_body(100), headers=auth, timeout=60)
        assert ok.status_code == 200, ok.text
        declared = httpx.post(f"{url}/v1/completions", content=_body(10 * LIMIT), headers=auth, timeout=60)
        assert declared.status_code == 413 and "--max-body-bytes" in declared.json()["error"]["message"]
        # Chunked, with no Content-Length: counted as it arrives, refused once past the limit.
        streamed = httpx.post(f"{url}/v1/completions", content=_chunks(_body(10 * LIMIT)), headers=auth, timeout=60)
        assert streamed.status_code == 413 and streamed.json()["error"]["code"] == "request_too_large"
        small_chunked = httpx.post(f"{url}/v1/completions", content=_chunks(_body(100), 7), headers=auth, timeout=60)
        assert small_chunked.status_code == 200, small_chunked.text  # replayed to the app intact
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
        assert 'moeforge:request_rejected_total{model_name="' + MODEL + '",reason="body_too_large"} 2.0' in metrics


def test_two_authorization_headers_are_refused(shared_server):
    headers = [("Authorization", f"Bearer {API_KEY}"), ("Authorization", "Bearer other"),
               ("Content-Type", "application/json")]
    response = httpx.post(f"{shared_server}/v1/completions", content=_body(10), headers=headers, timeout=60)
    assert response.status_code == 400 and "exactly one" in response.json()["error"]["message"]


def test_the_schema_is_behind_the_key(shared_server):
    assert httpx.get(f"{shared_server}/openapi.json", timeout=30).status_code == 401
    schema = httpx.get(f"{shared_server}/openapi.json", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
    assert schema.status_code == 200 and "/v1/completions" in schema.json()["paths"]
    assert httpx.get(f"{shared_server}/health", timeout=30).status_code == 200  # health stays open


def test_strings_and_booleans_are_not_numbers_and_unsupported_fields_are_named(shared_server):
    headers = {"Authorization": f"Bearer {API_KEY}"}

    def post(path: str, **fields: object) -> httpx.Response:
        body: dict[str, object] = {"model": MODEL, "max_tokens": 2}
        body.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": [1, 2]})
        body.update(fields)
        return httpx.post(f"{shared_server}{path}", json=body, headers=headers, timeout=60)

    for field, value in (("max_tokens", "5"), ("max_tokens", True), ("n", 2.0), ("seed", "1"), ("stream", "yes")):
        response = post("/v1/completions", **{field: value})
        assert response.status_code == 400 and response.json()["error"]["param"] == field, (field, response.text)
    for path, field, value in (("/v1/completions", "best_of", 3), ("/v1/completions", "tools", [{"type": "f"}]),
                               ("/v1/chat/completions", "function_call", "auto"),
                               ("/v1/chat/completions", "response_format", {"type": "xml"}),
                               ("/v1/chat/completions", "functions", [{"name": "f"}])):
        response = post(path, **{field: value})
        assert response.status_code == 400 and response.json()["error"]["param"] == field, (field, response.text)
        assert "not supported" in response.json()["error"]["message"]
    # What is honoured as OpenAI means it passes: a float temperature given as an int, text format, best_of = n.
    assert post("/v1/completions", temperature=0, best_of=1).status_code == 200
    assert post("/v1/chat/completions", response_format={"type": "text"}, tool_choice="none").status_code == 200
    assert post("/v1/chat/completions", response_format={"type": "json_object"}, tool_choice="auto").status_code == 200


def test_errors_name_the_api_field_not_a_cli_flag(shared_server):
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    too_long = httpx.post(f"{shared_server}/v1/completions", headers=headers, timeout=60,
                          json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 10_000})
    error = too_long.json()["error"]
    assert too_long.status_code == 400 and error["param"] == "max_tokens" and "--max-new-tokens" not in error["message"]
    nan = httpx.post(f"{shared_server}/v1/completions", headers=headers, timeout=60,
                     content=f'{{"model": "{MODEL}", "prompt": [1], "temperature": NaN}}')
    assert nan.status_code == 400 and nan.json()["error"]["param"] == "temperature"
    assert "finite" in nan.json()["error"]["message"]


def test_ready_only_after_the_warm_up_and_live_throughout(tiny_artifact):
    """/health (readiness) says "starting" until the engine loop's warm-up step has run; /health/live is 200 from
    the start; the warm-up is not counted in the metrics (no step, no argmax-head run)."""
    import threading

    import uvicorn

    from moeforge.parallel.net import free_port
    from moeforge.runtime.engine import BackendOptions, EngineConfig, LLMEngine, SchedulingOptions
    from moeforge.serve.app import ServerConfig, create_app

    engine = LLMEngine.from_artifact(tiny_artifact, EngineConfig(scheduling=SchedulingOptions(max_num_seqs=2),
                                                                 backend=BackendOptions(threads=1)))
    gate = threading.Event()
    real_step = engine.step

    def held_step():  # the warm-up waits until the test has seen "starting"
        gate.wait(timeout=30)
        return real_step()

    engine.step = held_step  # type: ignore[method-assign]
    app = create_app(engine, ServerConfig(model_name=MODEL))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        starting = httpx.get(url + "/health", timeout=5)
        assert starting.status_code == 503 and starting.json() == {"status": "starting", "reason": "warming up"}
        assert httpx.get(url + "/health/live", timeout=5).json() == {"status": "alive"}
        gate.set()
        while httpx.get(url + "/health", timeout=5).status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        metrics = httpx.get(url + "/metrics", timeout=5).text
        assert 'moeforge:engine_steps_total{model_name="' + MODEL + '"} 0.0' in metrics
        assert engine.backend.argmax_head_stats().runs == 0  # sampled, not greedy: no head run counted
    finally:
        gate.set()
        server.should_exit = True
        thread.join(timeout=30)


def test_bad_serve_settings_are_refused_by_flag_before_the_model_loads(tmp_path):
    """Each setting is checked once, by the dataclass that owns it, and the error names the flag; the artifact
    (which does not exist here) is never opened."""
    import pytest

    from moeforge.core.errors import MoeforgeError
    from moeforge.serve.runner import ServeOptions, build_app

    for field, value, message in (("max_queued", -1, "--max-queued must be >= 0"),
                                  ("max_body_bytes", 0, "--max-body-bytes must be >= 1"),
                                  ("stall_timeout", 0.0, "--stall-timeout must be > 0"),
                                  ("header_timeout", -1.0, "--header-timeout must be > 0"),
                                  ("max_connections", 0, "--max-connections must be >= 1"),
                                  ("api_key", "", "--api-key is empty")):
        with pytest.raises(MoeforgeError, match=message):
            build_app(ServeOptions(artifact=tmp_path / "never-read", **{field: value}))
