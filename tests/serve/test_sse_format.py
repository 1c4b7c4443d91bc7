"""Server-sent events stay one line each whatever the generated text holds: characters that JSON leaves raw but
``str.splitlines`` breaks on (httpx's ``iter_lines`` uses it) are escaped, and the JSON still reads back the same."""

from __future__ import annotations

import json

import pytest

from moeforge.serve.protocol import CompletionChoice, CompletionResponse
from moeforge.serve.serving import _sse

# U+0085 NEL, U+2028 LINE SEPARATOR, U+2029 PARAGRAPH SEPARATOR, and the ones JSON escapes anyway.
TEXTS = ["a\x85b", "a\u2028b", "a\u2029b", "a\nb\rc\x0bd\x0ce\x1cf\x1dg\x1eh", "plain é 漢字 🙂"]


@pytest.mark.parametrize("text", TEXTS)
def test_an_event_is_one_line_and_reads_back_the_same_text(text: str) -> None:
    for body in ({"text": text},
                 CompletionResponse(id="x", created=0, model="m",
                                    choices=[CompletionChoice(index=0, text=text, finish_reason=None)])):
        event = _sse(body)
        assert event.endswith("\n\n")
        (line,) = event[:-2].splitlines()  # one line, as httpx's iter_lines reads it
        assert line.startswith("data: ")
        data = json.loads(line[6:])
        assert (data["text"] if isinstance(body, dict) else data["choices"][0]["text"]) == text
