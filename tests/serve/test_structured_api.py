"""response_format, tools and tool_choice through the server: answers that parse, and bad input refused with a 400.

tiny-llama (random weights) shows the constraint alone makes the answer valid; SmolLM2 (a real model) runs the openai
client's tool-calling loop end to end.
"""

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from moeforge.runtime.engine import BackendOptions, EngineConfig, LLMEngine, SchedulingOptions
from moeforge.serve import ServerConfig, create_app
from tests.serve.conftest import API_KEY, MODEL, _running

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                           "population": {"type": "integer", "minimum": 0, "maximum": 10**9}},
          "required": ["city", "population"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"], "additionalProperties": False}}}


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json={"model": MODEL, **body}, headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=60)


def _json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def test_json_schema_answers_validate_on_both_endpoints_and_streamed(shared_server):
    chat = _post(shared_server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "A city as JSON"}], "max_tokens": 85, "n": 4, "seed": 1,
        "response_format": _json_schema(SCHEMA)}).json()
    for choice in chat["choices"]:
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    completion = _post(shared_server, "/v1/completions", {
        "prompt": "JSON: ", "max_tokens": 40, "temperature": 0, "response_format": {"type": "json_object"}}).json()
    assert isinstance(json.loads(completion["choices"][0]["text"]), dict)
    with httpx.stream("POST", shared_server + "/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                      json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 85,
                            "seed": 2, "stream": True, "response_format": _json_schema(SCHEMA)}, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize(("body", "param", "reason"), [
    ({"response_format": _json_schema({"type": "objec"})}, "response_format", "objec"),
    ({"response_format": _json_schema({"type": "string", "pattern": "a" * 70_000})}, "response_format", "limit"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    ({"response_format": {"type": "grammar", "grammar": "start: nowhere"}}, "response_format", "nowhere"),
    ({"response_format": {"type": "xml"}}, "response_format", "xml"),
    ({"tools": [WEATHER] * 2}, "tools", "twice"),
    ({"tools": [ADD] * 129}, "tools", "129 tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", "name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "add"}}}, "tool_choice", "add"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "sometimes"),
    ({"tool_choice": "required"}, "tool_choice", "no tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objec"}}}],
      "tool_choice": "required"}, "tools", "objec"),
])
def test_bad_schemas_and_tool_lists_are_refused_with_400(shared_server, body, param, reason):
    response = _post(shared_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and reason in error["message"], error
    ok = _post(shared_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                       "max_tokens": 2})
    assert ok.status_code == 200  # the server still serves


def test_the_server_limits_apply_to_schemas_and_tools(start_server):
    with start_server(max_schema_chars=200, max_tools=1) as (url, _):
        big = {"type": "object", "properties": {f"field{i}": {"type": "string"} for i in range(20)}}
        for body, param in (({"response_format": _json_schema(big)}, "response_format"),
                            ({"tools": [WEATHER, ADD]}, "tools"),
                            ({"tools": [{"type": "function", "function": {"name": "f", "parameters": big}}]}, "tools")):
            response = httpx.post(url + "/v1/chat/completions", timeout=60, json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}], **body})
            assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
            assert "limit" in response.json()["error"]["message"]


@pytest.fixture(scope="module")
def smollm2_server(smollm2_artifact: Path) -> Iterator[str]:
    engine = LLMEngine.from_artifact(smollm2_artifact, EngineConfig(
        scheduling=SchedulingOptions(max_num_seqs=4), backend=BackendOptions(threads=2)))
    with _running(create_app(engine, ServerConfig(model_name="smollm2"))) as url:
        yield url


def _add(a: int, b: int) -> str:
    return str(a + b)


def _weather(city: str, unit: str) -> str:
    return json.dumps({"city": city, "temperature": 21, "unit": unit})


@pytest.mark.smollm2
def test_the_openai_tool_calling_loop_end_to_end(smollm2_server):
    client = openai.OpenAI(base_url=smollm2_server + "/v1", api_key="-", max_retries=0, timeout=120)
    messages: list = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
    first = client.chat.completions.create(model="smollm2", messages=messages, tools=[WEATHER, ADD],
                                           tool_choice="required", max_tokens=200)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    messages.append(choice.message.model_dump(exclude_none=True))
    for call in choice.message.tool_calls:
        args = json.loads(call.function.arguments)
        schema = {"get_weather": WEATHER, "add": ADD}[call.function.name]["function"]["parameters"]
        jsonschema.validate(args, schema)
        result = _weather(**args) if call.function.name == "get_weather" else _add(**args)
        messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    final = client.chat.completions.create(model="smollm2", messages=messages, tools=[WEATHER, ADD],
                                           tool_choice="none", max_tokens=30, temperature=0)
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls

    # Named function, streamed: the deltas add up to a call of that function.
    stream = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Add 2 and 40."}], tools=[WEATHER, ADD],
        tool_choice={"type": "function", "function": {"name": "add"}}, max_tokens=60, stream=True)
    calls: dict[int, dict] = {}
    reasons = []
    for chunk in stream:
        for c in chunk.choices:
            reasons.append(c.finish_reason)
            for d in c.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
    assert reasons[-1] == "tool_calls" and calls and all(c["name"] == "add" for c in calls.values())
    for c in calls.values():
        jsonschema.validate(json.loads(c["arguments"]), ADD["function"]["parameters"])


@pytest.mark.smollm2
def test_json_schema_on_a_real_model_through_the_openai_client(smollm2_server):
    client = openai.OpenAI(base_url=smollm2_server + "/v1", api_key="-", max_retries=0, timeout=120)
    response = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Name a big city and its population as JSON."}],
        response_format=_json_schema(SCHEMA), max_tokens=60, n=3, seed=0, temperature=0.7)
    for choice in response.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


THINKING_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
                     "{% if add_generation_prompt %}<|assistant|><think>{% endif %}")


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """tiny-llama behind a template that opens the thinking and knows no tools (they go into a system message: ~500
    tokens with its byte-level tokenizer, hence a longer context)."""
    from moeforge.compile.driver import CompileOptions, compile_model

    out = tmp_path_factory.mktemp("thinking") / "tiny-llama"
    artifact = compile_model(CompileOptions(model="tiny-llama", output_dir=out, max_seq_len=1024, progress=False))
    engine = LLMEngine.from_artifact(artifact.output_dir, EngineConfig(scheduling=SchedulingOptions(max_num_seqs=4)))
    with _running(create_app(engine, ServerConfig(model_name=MODEL, chat_template=THINKING_TEMPLATE))) as url:
        yield url


def _forced_text(text: str) -> dict:
    """A response_format that makes the model write exactly ``text``."""
    return {"type": "grammar", "grammar": f"start: {json.dumps(text)}"}


def _events(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + "/v1/chat/completions", json={"model": MODEL, "stream": True, **body},
                      timeout=60) as response:
        return [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]


def test_reasoning_content_and_an_auto_tool_call_whole_and_streamed(thinking_server):
    text = ('Two numbers.</think>Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')
    body = {"messages": [{"role": "user", "content": "1 + 2?"}], "tools": [ADD], "max_tokens": 100,
            "response_format": _forced_text(text)}
    choice = httpx.post(thinking_server + "/v1/chat/completions", json={"model": MODEL, **body}, timeout=60
                        ).json()["choices"][0]
    message = choice["message"]
    assert message["reasoning_content"] == "Two numbers." and message["content"] == "Sure."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("add", {"a": 1, "b": 2})]
    assert choice["finish_reason"] == "tool_calls" and message["tool_calls"][0]["id"].startswith("call_")
    events = _events(thinking_server, body)
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Two numbers."
    assert "".join(d.get("content", "") for d in deltas) == "Sure."
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [(c["index"], c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        (0, "add", '{"a": 1, "b": 2}')]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_malformed_call_comes_back_as_content_and_tool_results_go_through_the_template(thinking_server):
    text = 'Hmm.</think><tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n</tool_call>'
    history = [{"role": "user", "content": "1 + 2?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    response = httpx.post(thinking_server + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": history, "tools": [ADD], "max_tokens": 100, "return_token_ids": True,
        "response_format": _forced_text(text)}).json()
    choice = response["choices"][0]
    assert choice["message"]["content"] == text.split("</think>")[1] and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "stop"
    prompt = bytes(t for t in response["prompt_token_ids"] if t < 256).decode()
    assert '<|tool|>3\n' in prompt and '"name": "add", "arguments": {"a": 1, "b": 2}' in prompt
    assert '"name": "add", "description": "Add two integers"' in prompt  # the tools, described in a system message
