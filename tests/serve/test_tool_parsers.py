"""Tool-call and reasoning parsers on each format's published examples, whole and streamed piece by piece."""

import json

import numpy as np
import pytest

from moeforge.serve.chat_output import ChatOutputOptions, ChatOutputStream, split_chat_output
from moeforge.serve.reasoning import ReasoningStream, split_reasoning
from moeforge.serve.tool_calls import FORMATS, ToolCallStream, detect_format, parse_tool_calls

WEATHER = ("get_weather", {"location": "San Francisco, CA", "unit": "celsius"})
# (format, output text, expected content, expected calls): the examples of each family's docs / chat template.
EXAMPLES = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"location": "San Francisco, CA", '
               '"unit": "celsius"}}\n</tool_call>', "Let me check.", [WEATHER]),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"location": "San Francisco, CA", "unit": '
               '"celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "PST"}}\n'
               "</tool_call>", "", [WEATHER, ("get_time", {"tz": "PST"})]),
    ("llama3", '{"name": "get_weather", "parameters": {"location": "San Francisco, CA", "unit": "celsius"}}', "",
     [WEATHER]),
    ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"location": "San Francisco, CA", "unit": '
               '"celsius"}}; {"name": "get_time", "parameters": {}}', "", [WEATHER, ("get_time", {})]),
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                    '{"location": "San Francisco, CA", "unit": "celsius"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
     "", [WEATHER]),
    ("deepseek_v3", "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"location\": "
                    '"San Francisco, CA", "unit": "celsius"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time'
                    '<｜tool▁sep｜>{"tz": "PST"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
     "Sure.", [WEATHER, ("get_time", {"tz": "PST"})]),
    ("deepseek_v4", '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="location" '
                    'string="true">San Francisco, CA</｜DSML｜parameter>\n<｜DSML｜parameter name="unit" string="true">'
                    'celsius</｜DSML｜parameter>\n</｜DSML｜invoke>\n<｜DSML｜invoke name="count">\n<｜DSML｜parameter '
                    'name="n" string="false">5</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>',
     "", [WEATHER, ("count", {"n": 5})]),
    ("deepseek_v4", 'I will look.\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter '
                    'name="location" string="true">San Francisco, CA</｜DSML｜parameter>\n<｜DSML｜parameter '
                    'name="unit" string="true">celsius</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
                    "</｜DSML｜function_calls>",
     "I will look.", [WEATHER]),
]


def _pieces(text: str, seed: int) -> list[str]:
    """``text`` cut at random places (seed 0: one character at a time, as a byte-level model streams it)."""
    if seed == 0:
        return list(text)
    cuts = sorted(set(np.random.default_rng(seed).integers(1, len(text), size=len(text) // 4).tolist()))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def _stream(fmt: str, pieces: list[str]) -> tuple[str, list[tuple[str, dict]]]:
    stream = ToolCallStream(FORMATS[fmt])
    content, calls = "", []
    for i, piece in enumerate(pieces):
        text, deltas = stream.feed(piece, final=i == len(pieces) - 1)
        content += text
        for d in deltas:
            assert d.index == len(calls) and d.id.startswith("call_")
            calls.append((d.name, json.loads(d.arguments)))
    return content, calls


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), EXAMPLES)
def test_published_examples_parse_whole_and_streamed(fmt, text, content, calls):
    got_content, got = parse_tool_calls(FORMATS[fmt], text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    for seed in (0, 1, 2):
        streamed_content, streamed = _stream(fmt, _pieces(text, seed))
        assert streamed == calls
        assert streamed_content.rstrip() == content


def test_each_call_streams_as_soon_as_it_is_complete():
    stream = ToolCallStream(FORMATS["hermes"])
    assert stream.feed("Hi <tool_") == ("Hi", [])  # "<tool_" may start a call: held back, and the space before it
    assert stream.feed('call>\n{"name": "get_weather", "argum') == ("", [])
    _, deltas = stream.feed('ents": {"location": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "f", ')
    assert [(d.index, d.name, d.arguments) for d in deltas] == [(0, "get_weather", '{"location": "Paris"}')]
    _, deltas = stream.feed('"arguments": {}}\n</tool_call>', final=True)
    assert [(d.index, d.name, d.arguments) for d in deltas] == [(1, "f", "{}")]


@pytest.mark.parametrize(("fmt", "text"), [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"location": </tool_call>'),
    ("hermes", "<tool_call>\n{\"name\": \"get_weather\""),  # cut off (max_tokens)
    ("hermes", '<tool_call>\n{"arguments": {}}\n</tool_call>'),  # no name
    ("llama3", '{"answer": 42}'),  # JSON, not a call
    ("llama3", '{"name": "f", "parameters": [1, 2]}'),
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{oops}<｜tool▁call▁end｜>"
                    "<｜tool▁calls▁end｜>"),
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{}"),
    ("deepseek_v4", '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="n" string="false">'
                    "five</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>"),
])
def test_a_malformed_call_comes_back_as_text(fmt, text):
    assert parse_tool_calls(FORMATS[fmt], text) == (text, [])
    content, _ = _stream(fmt, _pieces(text, 0))
    assert content == text


def test_plain_text_streams_through_at_once():
    stream = ToolCallStream(FORMATS["deepseek_v3"])
    assert stream.feed("Paris is the capital") == ("Paris is the capital", [])
    assert stream.feed(" <") == ("", [])  # may be a marker (and the space then is not content)
    assert stream.feed("b> ok", final=True) == (" <b> ok", [])


def test_formats_are_detected_from_the_chat_template():
    assert detect_format("{{'<｜tool▁calls▁begin｜>'}}").name == "deepseek_v3"
    assert detect_format("{{'<｜DSML｜tool_calls>'}}").name == "deepseek_v4"
    assert detect_format("<|start_header_id|>ipython<|end_header_id|>").name == "llama3"
    assert detect_format("{% if tools %}<tool_call>{% endif %}").name == "hermes"
    assert detect_format(None).name == "hermes"


@pytest.mark.parametrize("in_prompt", [False, True])
def test_reasoning_is_split_from_the_answer_whole_and_streamed(in_prompt):
    thinking = "The user asks 2 + 2. <b>Four</b> < five."
    text = ("" if in_prompt else "<think>\n") + thinking + "\n</think>\n\nIt is 4."
    assert split_reasoning(text, in_prompt) == ("\n" + thinking + "\n" if not in_prompt else thinking + "\n",
                                                "It is 4.")
    for seed in (0, 1, 3):
        stream = ReasoningStream(in_reasoning=in_prompt)
        pieces = _pieces(text, seed)
        parts = [stream.feed(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]
        assert "".join(r for r, _ in parts).strip() == thinking
        assert "".join(c for _, c in parts) == "It is 4."
    assert split_reasoning("No thinking here.", False) == (None, "No thinking here.")


def test_reasoning_then_a_tool_call_streamed():
    options = ChatOutputOptions(tool_format=FORMATS["deepseek_v3"], reasoning=True, in_reasoning=True)
    text = ("I need the weather.</think>Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
            '{"location": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
    reasoning, content, calls = split_chat_output(text, options)
    assert (reasoning, content, [c.name for c in calls]) == ("I need the weather.", "Checking.", ["get_weather"])
    stream = ChatOutputStream(options)
    pieces = _pieces(text, 0)
    deltas = [stream.feed(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]
    assert "".join(d.reasoning for d in deltas) == "I need the weather."
    assert "".join(d.content for d in deltas) == "Checking."
    assert [(c.name, c.arguments) for d in deltas for c in d.calls] == [("get_weather", '{"location": "Paris"}')]
    assert stream.called
