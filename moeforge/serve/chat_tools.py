"""Tools on the prompt side: checking a request's ``tools`` / ``tool_choice``, giving the tools to the chat template,
and the grammar that makes ``tool_choice`` "required" or a named function always produce a call that parses.

A template that reads ``tools`` (Qwen, Llama 3.1, DeepSeek V3.1/V4) gets them as its ``tools`` variable, as
transformers' ``apply_chat_template(..., tools=...)`` gives them. A template that knows no tools (SmolLM2's) gets
them described in a system message, with the Hermes format to answer in; assistant ``tool_calls`` in the history are
then written as that format's text, so the model sees its own calls as it would have written them.

The grammar (``tool_call_grammar``): the format's call block, each call one of the tools with arguments matching its
``parameters`` schema (llguidance Lark, ``%json``), one call or, for "required" with ``parallel_tool_calls``, up to
``MAX_PARALLEL_CALLS``; free strings and arrays are bounded (``bounded``) so that the call ends within
``max_tokens``. Markers that are single tokens of the vocabulary are matched as those tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from moeforge.model.tokenizer import Tokenizer
from moeforge.runtime.structured_output import StructuredOutput, closed_objects, map_schemas
from moeforge.serve.tool_calls import (
    DeepSeekV3Format,
    DeepSeekV4Format,
    HermesFormat,
    Llama3Format,
    ToolCallFormat,
)

MAX_TOOLS = 128  # as the OpenAI API
MAX_PARALLEL_CALLS = 8
# Bounds on a forced call's arguments where their schema gives none: the call must end within max_tokens whatever
# the model (a small one sampling at temperature 1 can write a string or a list forever).
MAX_ARGUMENT_CHARS = 64
MAX_ARGUMENT_ITEMS = 4
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}  # as response_format JSON
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")


class ToolsError(ValueError):
    """A bad ``tools`` / ``tool_choice``; ``param`` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]

    def openai(self) -> dict[str, Any]:
        """As the API gives it (and chat templates expect it)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


def check_tools(tools: list[Any] | None, tool_choice: Any, max_tools: int = MAX_TOOLS,
                max_schema_chars: int | None = None) -> tuple[list[Tool], str | None]:
    """The request's tools and the function it forces: (tools, None) for "auto"/"none" and no choice, (tools,
    "*") for "required", (tools, name) for a named function; ``ToolsError`` naming the problem."""
    tools = tools or []
    if len(tools) > max_tools:
        raise ToolsError("tools", f"{len(tools)} tools, more than the limit of {max_tools}")
    out: list[Tool] = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise ToolsError("tools", f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}")
        name = function.get("name")
        if not isinstance(name, str) or not name or len(name) > 64 or not set(name) <= _NAME_CHARS:
            raise ToolsError("tools", f"tools[{i}].function.name must be 1-64 characters of a-z, A-Z, 0-9, _, - "
                                      f"or ., got {name!r}")
        if any(t.name == name for t in out):
            raise ToolsError("tools", f"tools[{i}]: the name {name!r} is given twice")
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(parameters, dict):
            raise ToolsError("tools", f"tools[{i}].function.parameters must be a JSON schema object")
        description = function.get("description") or ""
        if not isinstance(description, str):
            raise ToolsError("tools", f"tools[{i}].function.description must be a string")
        out.append(Tool(name, description, parameters))
    if max_schema_chars is not None:
        size = len(json.dumps([t.parameters for t in out]))
        if size > max_schema_chars:
            raise ToolsError("tools", f"the tools' parameter schemas are {size} characters, more than the limit of "
                                      f"{max_schema_chars}")
    forced: str | None = None
    if tool_choice in (None, "auto", "none"):
        forced = None
    elif tool_choice == "required":
        forced = "*"
    elif isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict):
        forced = tool_choice["function"].get("name")
        if not any(t.name == forced for t in out):
            raise ToolsError("tool_choice", f"tool_choice names the function {forced!r}, which is not in tools")
    else:
        raise ToolsError("tool_choice", f"tool_choice must be 'none', 'auto', 'required' or {{'type': 'function', "
                                        f"'function': {{'name': ...}}}}, got {tool_choice!r}")
    if forced is not None and not out:
        raise ToolsError("tool_choice", "tool_choice forces a call but no tools are given")
    return out, forced


def template_knows_tools(template: str | None) -> bool:
    return bool(template) and "tools" in (template or "")


def render_chat(tokenizer: Tokenizer, messages: list[dict[str, Any]], tools: list[Tool], fmt: ToolCallFormat,
                add_generation_prompt: bool) -> str:
    """The prompt text of a chat with tools (see the module docstring)."""
    template = tokenizer.chat_template
    if template_knows_tools(template):
        json_args = "arguments|tojson" in (template or "").replace(" ", "")
        messages = [_native_message(m, json_args) for m in messages]
        kwargs: dict[str, Any] = {"tools": [t.openai() for t in tools]} if tools else {}
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)
    messages = [_text_message(m, fmt) for m in messages]
    if tools:
        system = _tools_system_prompt(tools, fmt)
        if messages and messages[0].get("role") == "system":
            messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{system}"}
        else:
            messages.insert(0, {"role": "system", "content": system})
    return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)


def _calls_of(message: dict[str, Any]) -> list[tuple[str, str]]:
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function", {}) if isinstance(call, dict) else {}
        args = function.get("arguments", "{}")
        calls.append((str(function.get("name", "")), args if isinstance(args, str) else json.dumps(args)))
    return calls


def _native_message(message: dict[str, Any], json_args: bool) -> dict[str, Any]:
    """A message for a template that knows tools: arguments as a dict where the template writes them with
    ``tojson`` (Qwen, Llama), as the API's JSON text otherwise (DeepSeek concatenates them)."""
    if not json_args or not message.get("tool_calls"):
        return message
    calls = []
    for call in message["tool_calls"]:
        function = dict(call.get("function", {}))
        if isinstance(function.get("arguments"), str):
            try:
                function["arguments"] = json.loads(function["arguments"])
            except json.JSONDecodeError:
                pass
        calls.append({**call, "function": function})
    return {**message, "tool_calls": calls}


def _text_message(message: dict[str, Any], fmt: ToolCallFormat) -> dict[str, Any]:
    """A message for a template that knows no tools: calls as the format's text, tool results as plain text."""
    calls = _calls_of(message)
    if calls:
        text = fmt.format_calls(calls)
        content = message.get("content") or ""
        return {"role": message["role"], "content": f"{content}\n{text}" if content else text}
    if message.get("role") == "tool":
        return {"role": "tool", "content": message.get("content") or ""}
    return message


def _tools_system_prompt(tools: list[Tool], fmt: ToolCallFormat) -> str:
    listed = "\n".join(json.dumps(t.openai(), ensure_ascii=False) for t in tools)
    example = fmt.format_calls([("<function-name>", '{"<argument>": "<value>"}')])
    return (f"You may call one or more functions to answer. The functions:\n<tools>\n{listed}\n</tools>\n"
            f"To call a function, answer with:\n{example}")


def tool_call_grammar(tools: list[Tool], forced: str, fmt: ToolCallFormat, tokenizer: Tokenizer,
                      parallel: bool) -> StructuredOutput:
    """The grammar of a forced call (``forced``: "*" any of ``tools``, else that function's name) in ``fmt``: one
    call of the named function (OpenAI's meaning of naming one), and with "required" up to ``MAX_PARALLEL_CALLS``
    when ``parallel``."""
    chosen = [Tool(t.name, t.description, bounded(closed_objects(t.parameters)))
              for t in tools if forced in ("*", t.name)]
    parallel = parallel and forced == "*"

    def lit(text: str) -> str:
        token = tokenizer.token_to_id(text)
        return f"<[{token}]>" if token is not None and text.startswith("<") else json.dumps(text)

    def schema(keys: tuple[str, str], tool: Tool) -> str:
        return json.dumps({"type": "object", "properties": {keys[0]: {"const": tool.name}, keys[1]: tool.parameters},
                           "required": list(keys), "additionalProperties": False, "x-guidance": _COMPACT,
                           **_definitions(tool.parameters)})

    repeat = f"{{1,{MAX_PARALLEL_CALLS}}}" if parallel else ""
    rules: list[str] = []
    if isinstance(fmt, DeepSeekV3Format):
        rules.append(f"start: {lit(fmt.BEGIN)} call{repeat} {lit(fmt.END)}")
        rules.append("call: " + " | ".join(f"c{i}" for i in range(len(chosen))))
        for i, t in enumerate(chosen):
            args = json.dumps({**t.parameters, "x-guidance": _COMPACT})
            rules.append(f"c{i}: {lit(fmt.CALL)} {json.dumps(t.name)} {lit(fmt.SEP)} %json{args} {lit(fmt.CALL_END)}")
    elif isinstance(fmt, DeepSeekV4Format):
        # Every value as JSON (string="false"): the grammar then checks it against its schema.
        rules.append(f'start: "<｜DSML｜tool_calls>\\n" call{repeat} "</｜DSML｜tool_calls>"')
        rules.append("call: " + " | ".join(f"c{i}" for i in range(len(chosen))))
        for i, t in enumerate(chosen):
            props = t.parameters.get("properties") or {}
            params = " ".join(f'"<｜DSML｜parameter name=\\"{key}\\" string=\\"false\\">" '
                              f'%json{json.dumps(_param_schema(value, t.parameters))} "</｜DSML｜parameter>\\n"'
                              for key, value in props.items() if key in (t.parameters.get("required") or []))
            rules.append(f'c{i}: "<｜DSML｜invoke name=\\"{t.name}\\">\\n" {params} "</｜DSML｜invoke>\\n"')
    elif isinstance(fmt, Llama3Format):
        sep = '"; "' if parallel else ""
        body = "call" if not parallel else f'call ({sep} call){{0,{MAX_PARALLEL_CALLS - 1}}}'
        rules.append(f"start: {body}")
        rules.append("call: " + " | ".join(f"%json{schema(('name', 'parameters'), t)}" for t in chosen))
    else:
        assert isinstance(fmt, HermesFormat)
        open_, close = lit(fmt.OPEN), lit(fmt.CLOSE)
        body = "call" if not parallel else f'call ("\\n" call){{0,{MAX_PARALLEL_CALLS - 1}}}'
        rules.append(f"start: {body}")
        rules.append(f'call: {open_} "\\n" args "\\n" {close}')
        rules.append("args: " + " | ".join(f"%json{schema(('name', 'arguments'), t)}" for t in chosen))
    return StructuredOutput.grammar("\n".join(rules))


def _definitions(parameters: dict[str, Any]) -> dict[str, Any]:
    """The ``$defs`` / ``definitions`` of a parameters schema, for a schema that embeds it: its ``$ref``s point at
    the root ("#/$defs/X"), which is then the embedding schema."""
    return {key: parameters[key] for key in ("$defs", "definitions") if key in parameters}


def _param_schema(value: Any, parameters: dict[str, Any]) -> dict[str, Any]:
    return {**value, **_definitions(parameters)} if isinstance(value, dict) else {}


def bounded(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with a ``maxLength`` on free strings and a ``maxItems`` on arrays that have none
    (``MAX_ARGUMENT_CHARS``, ``MAX_ARGUMENT_ITEMS``): an answer valid for the result is valid for ``schema``."""

    def bound(node: dict[str, Any]) -> dict[str, Any]:
        types = node.get("type")
        types = types if isinstance(types, list) else [types]
        free = not any(k in node for k in ("enum", "const", "pattern", "format", "maxLength"))
        if "string" in types and free:
            node["maxLength"] = max(MAX_ARGUMENT_CHARS, node.get("minLength", 0))
        if "array" in types and "maxItems" not in node:
            node["maxItems"] = max(MAX_ARGUMENT_ITEMS, node.get("minItems", 0))
        return node

    result: dict[str, Any] = map_schemas(schema, bound)
    return result
