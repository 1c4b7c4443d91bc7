"""Forced tool calls (tool_choice "required" / named): whatever the model, the output is a call of the format that
its parser reads back, with arguments valid against the tool's schema. tiny-llama's random weights make that the
grammar's doing alone."""

import json

import jsonschema
import pytest

from moeforge.runtime.engine import EngineConfig, LLMEngine, SchedulingOptions
from moeforge.runtime.sampler import SamplingParams
from moeforge.serve.chat_tools import MAX_ARGUMENT_CHARS, bounded, check_tools, render_chat, tool_call_grammar
from moeforge.serve.tool_calls import FORMATS, parse_tool_calls

LOCATION = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"],
            "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "where", "parameters": {
        "type": "object", "properties": {"loc": {"$ref": "#/$defs/Loc"}}, "required": ["loc"],
        "additionalProperties": False, "$defs": {"Loc": LOCATION}}}},
    {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                         "ok": {"type": "boolean"}},
        "required": ["n", "ok"], "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> LLMEngine:
    """tiny-llama with room for DeepSeek's markers, ~10 tokens a character with its byte-level tokenizer."""
    from moeforge.compile.driver import CompileOptions, compile_model

    out = tmp_path_factory.mktemp("tool-grammar") / "tiny-llama"
    artifact = compile_model(CompileOptions(model="tiny-llama", output_dir=out, max_seq_len=320, progress=False))
    return LLMEngine.from_artifact(artifact.output_dir, EngineConfig(scheduling=SchedulingOptions(max_num_seqs=4)))


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "pick"}}])
def test_a_forced_call_always_parses_and_validates(engine, fmt, choice):
    tools, forced = check_tools(TOOLS, choice)
    spec = tool_call_grammar(tools, forced, FORMATS[fmt], engine.tokenizer, parallel=False)
    prompt = engine.tokenizer.encode("call a tool: ")
    outs = engine.generate([prompt] * 4, [SamplingParams(temperature=1.0, seed=s, max_tokens=280,
                                                         structured_output=spec) for s in range(4)])
    for out in outs:
        assert out.finish_reason == "stop", out
        content, calls = parse_tool_calls(FORMATS[fmt], out.text)
        assert content == "" and len(calls) == 1, out.text
        assert forced in ("*", calls[0].name)
        jsonschema.validate(json.loads(calls[0].arguments), SCHEMAS[calls[0].name])


def test_templates_without_tools_get_them_in_a_system_message(engine):
    from moeforge.model.tokenizer import Tokenizer

    tok = Tokenizer(engine.tokenizer.backend, bos_token_id=None, eos_token_ids=engine.tokenizer.eos_token_ids,
                    chat_template="{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}")
    tools, _ = check_tools(TOOLS, "auto")
    text = render_chat(tok, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}], tools,
                       FORMATS["hermes"], add_generation_prompt=True)
    assert text.startswith("[system] Be brief.\n\nYou may call one or more functions")
    assert '"name": "pick"' in text and "<tool_call>" in text and text.endswith("[user] hi\n")
    native = Tokenizer(tok.backend, bos_token_id=None, eos_token_ids=(),
                       chat_template="{% for t in tools %}{{ t.function.name }};{% endfor %}"
                                     "{% for m in messages %}{{ m.content }}{% endfor %}")
    assert render_chat(native, [{"role": "user", "content": "hi"}], tools, FORMATS["hermes"], True) == "where;pick;hi"


def test_a_forced_calls_free_strings_and_arrays_are_bounded():
    schema = {"type": "object", "properties": {
        "q": {"type": "string"}, "day": {"type": "string", "format": "date"}, "tags": {"type": "array", "minItems": 6,
                                                                                      "items": {"type": "string"}},
        "mode": {"enum": ["a", "b"]}, "long": {"type": ["string", "null"], "minLength": 100}}}
    out = bounded(schema)
    props = out["properties"]
    assert props["q"]["maxLength"] == MAX_ARGUMENT_CHARS and "maxLength" not in props["day"]
    assert props["tags"]["maxItems"] == 6 and props["tags"]["items"]["maxLength"] == MAX_ARGUMENT_CHARS
    assert "maxLength" not in props["mode"] and props["long"]["maxLength"] == 100
    assert "maxLength" not in schema["properties"]["q"]  # a copy


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_one_call_unless_parallel_calls_are_asked_for_with_required(engine, fmt):
    tools, _ = check_tools(TOOLS, "auto")
    one = tool_call_grammar(tools, "*", FORMATS[fmt], engine.tokenizer, parallel=False).source
    many = tool_call_grammar(tools, "*", FORMATS[fmt], engine.tokenizer, parallel=True).source
    named = tool_call_grammar(tools, "pick", FORMATS[fmt], engine.tokenizer, parallel=True).source
    assert "{1,8}" in many or "{0,7}" in many
    assert not any(r in text for text in (one, named) for r in ("{1,8}", "{0,7}"))
    assert "where" not in named
