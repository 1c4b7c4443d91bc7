"""Tool-call formats: how each model family writes its calls, parsed back into OpenAI ``tool_calls``, streamed.

Formats (the model's published chat-template format, detected from its chat template by ``detect_format``):

- ``hermes`` (Qwen 2.5/3, Hermes, and the default for templates that know no tools)::

      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>

- ``llama3`` (Llama 3.1-3.3 JSON tool calling; ``<|python_tag|>`` optional)::

      {"name": "get_weather", "parameters": {"city": "Paris"}}

- ``deepseek_v3`` (DeepSeek V3 and V3.1: V3 writes ``function<｜tool▁sep｜>name\\n```json\\n{...}\\n```, V3.1
  ``name<｜tool▁sep｜>{...}``; both parse)::

      <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>
      <｜tool▁calls▁end｜>        (one line in the output)

- ``deepseek_v4`` (DeepSeek V4's DSML; V3.2's ``function_calls`` block name parses too; ``string="false"``
  values are JSON)::

      <｜DSML｜tool_calls>
      <｜DSML｜invoke name="get_weather">
      <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
      </｜DSML｜invoke>
      </｜DSML｜tool_calls>

Text before the calls is content. Streaming (``ToolCallStream``) re-parses the text so far after each delta: content
goes out as soon as it cannot be the start of a call block, each call as soon as it is complete. A block that does
not parse by the end of the output is returned as content, never an error.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any


class MalformedToolCall(ValueError):
    """The text after a call block's start is not a well-formed call of the format."""


@dataclass(frozen=True)
class ParsedCall:
    """A call found in the output: its name, and its arguments as JSON text once the call is complete."""

    name: str
    arguments: str | None = None


@dataclass(frozen=True)
class ToolCallFormat:
    """One family's format: where a call block starts, and how its calls parse (``calls``)."""

    name: str
    starts: tuple[str, ...]

    def find_start(self, text: str) -> int:
        """Where the call block starts in ``text``, or -1."""
        found = [i for i in (text.find(s) for s in self.starts) if i >= 0]
        return min(found) if found else -1

    def calls(self, block: str, final: bool) -> list[ParsedCall]:
        """The calls of a block (from its start marker on). ``final``: the output has ended, so an unfinished
        call is malformed. Raises ``MalformedToolCall``."""
        raise NotImplementedError

    def format_calls(self, calls: list[tuple[str, str]]) -> str:
        """(name, arguments JSON) calls written as the model writes them (for templates that know no tools)."""
        raise NotImplementedError


def _json_object(text: str, what: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise MalformedToolCall(f"{what} is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise MalformedToolCall(f"{what} is not a JSON object")
    return value


def _arguments(value: Any) -> str:
    if isinstance(value, str):  # some models write the arguments as a JSON string
        value = _json_object(value, "the arguments")
    if not isinstance(value, dict):
        raise MalformedToolCall("the arguments are not a JSON object")
    return json.dumps(value, ensure_ascii=False)


def _name_and_arguments(value: dict[str, Any], keys: tuple[str, ...]) -> ParsedCall:
    name = value.get("name")
    if not isinstance(name, str) or not name:
        raise MalformedToolCall("a call has no name")
    args: Any = next((value[k] for k in keys if k in value), {})
    return ParsedCall(name, _arguments(args))


_NAME_SO_FAR = re.compile(r'^\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')


class HermesFormat(ToolCallFormat):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def calls(self, block: str, final: bool) -> list[ParsedCall]:
        out: list[ParsedCall] = []
        rest = block
        while rest.strip():
            rest = rest.lstrip()
            if not rest.startswith(self.OPEN):
                if self.OPEN.startswith(rest) and not final:
                    break
                raise MalformedToolCall(f"expected {self.OPEN} between calls")
            body, sep, after = rest[len(self.OPEN):].partition(self.CLOSE)
            if not sep:
                if final:
                    raise MalformedToolCall(f"a call has no {self.CLOSE}")
                name = _NAME_SO_FAR.match(body)
                if name and body[name.end():].lstrip()[:1] in (",", "}"):
                    out.append(ParsedCall(json.loads(f'"{name.group(1)}"')))
                break
            value = _json_object(body.strip(), "a call")
            out.extend(_json_calls(value, ("arguments", "parameters")))
            rest = after
        return out

    def format_calls(self, calls: list[tuple[str, str]]) -> str:
        return "\n".join(f'{self.OPEN}\n{{"name": {json.dumps(name)}, "arguments": {args}}}\n{self.CLOSE}'
                         for name, args in calls)


def _json_calls(value: Any, keys: tuple[str, ...]) -> list[ParsedCall]:
    """One call object, or a list of them (some models write ``[{...}, {...}]`` in one block)."""
    items = value if isinstance(value, list) else [value]
    if not items or not all(isinstance(item, dict) for item in items):
        raise MalformedToolCall("a call is not a JSON object")
    return [_name_and_arguments(item, keys) for item in items]


class Llama3Format(ToolCallFormat):
    TAG = "<|python_tag|>"

    def find_start(self, text: str) -> int:
        tag = text.find(self.TAG)
        if tag >= 0:
            return tag
        stripped = text.lstrip()
        return len(text) - len(stripped) if stripped.startswith("{") else -1  # a call is the whole answer

    def calls(self, block: str, final: bool) -> list[ParsedCall]:
        body = block.removeprefix(self.TAG) if block.startswith(self.TAG) else block
        decoder = json.JSONDecoder()
        out: list[ParsedCall] = []
        pos, body = 0, body.strip()
        while pos < len(body):
            try:
                value, end = decoder.raw_decode(body, pos)
            except json.JSONDecodeError:
                if final:
                    raise MalformedToolCall("a call is not complete JSON") from None
                name = _NAME_SO_FAR.match(body[pos:])
                if name and body[pos + name.end():].lstrip()[:1] in (",", "}"):
                    out.append(ParsedCall(json.loads(f'"{name.group(1)}"')))
                break
            out.extend(_json_calls(value, ("parameters", "arguments")))
            pos = end
            while pos < len(body) and body[pos] in " \t\n;":  # calls separated by ";" (Llama 3.2)
                pos += 1
        return out

    def format_calls(self, calls: list[tuple[str, str]]) -> str:
        return "; ".join(f'{{"name": {json.dumps(name)}, "parameters": {args}}}' for name, args in calls)


class DeepSeekV3Format(ToolCallFormat):
    BEGIN, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    CALL, SEP, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
    _FENCED = re.compile(r"^(?P<name>[^\n]+)\n```(?:json)?\n(?P<args>.*)\n```\s*$", re.S)

    def calls(self, block: str, final: bool) -> list[ParsedCall]:
        body = block[len(self.BEGIN):]
        out: list[ParsedCall] = []
        for piece in body.split(self.CALL)[1:]:
            head, sep, rest = piece.partition(self.SEP)
            if not sep:
                break
            args_text, done, _ = rest.partition(self.CALL_END)
            if head.strip() == "function" and "\n" in args_text:  # V3: function<sep>name\n```json\n{...}\n```
                name = args_text.partition("\n")[0]
                if not done:
                    out.append(ParsedCall(name.strip()))
                    break
                match = self._FENCED.match(args_text)
                if match is None:
                    raise MalformedToolCall("a DeepSeek V3 call's arguments are not a ```json block")
                out.append(ParsedCall(match["name"].strip(), _arguments(_json_object(match["args"], "arguments"))))
                continue
            if not done:
                if head.strip() != "function":  # "function" may still be V3's type before the name
                    out.append(ParsedCall(head.strip()))
                break
            out.append(ParsedCall(head.strip(), _arguments(_json_object(args_text.strip(), "arguments"))))
        if final and (self.END not in body or any(c.arguments is None for c in out) or not out):
            raise MalformedToolCall(f"the call block does not end with {self.END}")
        return out

    def format_calls(self, calls: list[tuple[str, str]]) -> str:
        inner = "".join(f"{self.CALL}{name}{self.SEP}{args}{self.CALL_END}" for name, args in calls)
        return f"{self.BEGIN}{inner}{self.END}"


class DeepSeekV4Format(ToolCallFormat):
    D = "｜DSML｜"
    _INVOKE = re.compile(r'<｜DSML｜invoke name="(?P<name>[^"]*)">(?P<body>.*?)(?P<end></｜DSML｜invoke>|$)', re.S)
    _PARAM = re.compile(r'<｜DSML｜parameter name="(?P<name>[^"]*)"(?: string="(?P<string>true|false)")?>'
                        r"(?P<value>.*?)</｜DSML｜parameter>", re.S)

    def calls(self, block: str, final: bool) -> list[ParsedCall]:
        name = "tool_calls" if block.startswith(f"<{self.D}tool_calls>") else "function_calls"
        close = f"</{self.D}{name}>"
        body, closed, _ = block.partition(close)
        out: list[ParsedCall] = []
        for match in self._INVOKE.finditer(body):
            if not match["end"]:
                out.append(ParsedCall(match["name"]))
                break
            args: dict[str, Any] = {}
            for param in self._PARAM.finditer(match["body"]):
                value = param["value"]
                if param["string"] == "false":
                    try:
                        args[param["name"]] = json.loads(value)
                    except json.JSONDecodeError:
                        raise MalformedToolCall(f"parameter {param['name']!r} is not JSON") from None
                else:
                    args[param["name"]] = value
            out.append(ParsedCall(match["name"], json.dumps(args, ensure_ascii=False)))
        if final and (not closed or not out or any(c.arguments is None for c in out)):
            raise MalformedToolCall(f"the call block does not end with {close}")
        return out

    def format_calls(self, calls: list[tuple[str, str]]) -> str:
        parts = []
        for name, args in calls:
            params = "".join(
                f'<{self.D}parameter name="{key}" string="{str(isinstance(value, str)).lower()}">'
                f"{value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)}</{self.D}parameter>\n"
                for key, value in json.loads(args).items())
            parts.append(f'<{self.D}invoke name="{name}">\n{params}</{self.D}invoke>\n')
        return f"<{self.D}tool_calls>\n{''.join(parts)}</{self.D}tool_calls>"


FORMATS: dict[str, ToolCallFormat] = {
    "hermes": HermesFormat("hermes", (HermesFormat.OPEN,)),
    "llama3": Llama3Format("llama3", (Llama3Format.TAG,)),
    "deepseek_v3": DeepSeekV3Format("deepseek_v3", (DeepSeekV3Format.BEGIN,)),
    "deepseek_v4": DeepSeekV4Format("deepseek_v4", ("<｜DSML｜tool_calls>", "<｜DSML｜function_calls>")),
}


def detect_format(template: str | None) -> ToolCallFormat:
    """The format a chat template writes tool calls in; Hermes for one that knows no tools (the server then
    describes the tools in a system message, ``chat_tools.py``)."""
    text = template or ""
    if "DSML" in text:
        return FORMATS["deepseek_v4"]
    if "tool▁calls▁begin" in text:
        return FORMATS["deepseek_v3"]
    if "<|python_tag|>" in text or "ipython" in text:
        return FORMATS["llama3"]
    return FORMATS["hermes"]


def parse_tool_calls(fmt: ToolCallFormat, text: str) -> tuple[str, list[ParsedCall]]:
    """(content, calls) of a finished output; a malformed call block stays in the content."""
    start = fmt.find_start(text)
    if start < 0:
        return text, []
    try:
        calls = fmt.calls(text[start:], final=True)
    except MalformedToolCall:
        return text, []
    return (text[:start].rstrip(), calls) if calls else (text, [])


@dataclass
class CallDelta:
    """One streamed call: its index among the output's calls, id, name and arguments (JSON text)."""

    index: int
    id: str
    name: str
    arguments: str


@dataclass
class ToolCallStream:
    """Splits an output streamed in deltas into content and calls (see the module docstring). A call goes out whole
    once it is complete, so that one that never completes (malformed, cut off) can still go out as content."""

    fmt: ToolCallFormat
    text: str = ""
    sent_content: int = 0  # characters of ``text`` sent as content
    calls_sent: int = 0

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[CallDelta]]:
        """The content and calls that ``delta`` (the next piece of the output) releases; ``final``: the output
        has ended (a block still malformed then is released as content)."""
        self.text += delta
        start = self.fmt.find_start(self.text)
        if start < 0:
            return self._content(len(self.text) if final else _safe_end(self.text, self.fmt)), []
        try:
            calls = [c for c in self.fmt.calls(self.text[start:], final) if c.arguments is not None]
        except MalformedToolCall:
            calls = None
        if calls is None or (final and not calls):
            # Malformed: at the end, what was not sent as calls is content (until then, wait: it may still parse).
            return self._content(len(self.text) if final else start), []
        content = self._content(len(self.text[:start].rstrip())) if self.calls_sent == 0 else ""
        deltas = [CallDelta(i, f"call_{uuid.uuid4().hex[:24]}", call.name, call.arguments or "")
                  for i, call in enumerate(calls) if i >= self.calls_sent]
        self.calls_sent = max(self.calls_sent, len(calls))
        return content, deltas

    def _content(self, end: int) -> str:
        end = max(end, self.sent_content)
        out, self.sent_content = self.text[self.sent_content:end], end
        return out


def _safe_end(text: str, fmt: ToolCallFormat) -> int:
    """How much of ``text`` (no call block found in it) can go out as content: all but a suffix that may still
    become a start marker, and the whitespace before it."""
    if isinstance(fmt, Llama3Format) and not text.strip():
        return 0
    end = len(text)
    for n in range(min(len(text), max(len(s) for s in fmt.starts)), 0, -1):
        if any(s.startswith(text[-n:]) for s in fmt.starts):
            end = len(text) - n
            break
    return len(text[:end].rstrip())  # whitespace before a call is not content: wait for what follows it
