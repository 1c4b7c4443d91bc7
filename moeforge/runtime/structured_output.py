"""StructuredOutput: what a request's output must match (a JSON schema, any JSON object, a regex or a grammar).

The engine enforces it by constrained decoding (``runtime/grammar.py``, llguidance): before each sample the
request's grammar gives the set of tokens that keep the output a prefix of a match, and every other token is
masked out. JSON is compiled compact (no free whitespace between items), so a model cannot loop on spaces or
newlines and the answer is what ``json.dumps(..., separators=(", ", ": "))`` would write. An object schema that
lists its properties takes no others unless it says so (``closed_objects``: OpenAI's strict mode, xgrammar's default).

Size limits (``MAX_GRAMMAR_CHARS``) and the library's own parser limits bound what one request may cost; a spec
beyond them, or one the library cannot compile, is refused with ``StructuredOutputError`` naming the reason.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from llguidance import LLMatcher, grammar_from

from moeforge.core.errors import MoeforgeError

MAX_GRAMMAR_CHARS = 64 * 1024  # a schema, pattern or grammar larger than this is refused (the server's default)
MAX_SCHEMA_DEPTH = 32  # nesting of a JSON schema's objects and arrays

Kind = Literal["json_schema", "json_object", "regex", "lark", "gbnf"]
KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "lark", "gbnf")
# The JSON layout of constrained output: compact separators, no free whitespace (see the module docstring).
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class StructuredOutputError(MoeforgeError, ValueError):
    """A structured-output spec that cannot be used (invalid, too large, not compilable); ``param`` names the
    request field at fault (``response_format`` unless the caller says otherwise)."""

    def __init__(self, message: str, param: str = "response_format") -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on a request's output text. ``source``: the schema as JSON text (``json_schema``; properties
    come out in its order), the pattern (``regex``), the grammar (``lark``: llguidance's Lark dialect, which may
    embed ``%json{...}``; ``gbnf``: llama.cpp's); empty for ``json_object``. Hashable: compiled grammars
    are cached by it."""

    kind: Kind
    source: str = ""

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str) -> StructuredOutput:
        """Output that validates against ``schema`` (a dict or its JSON text)."""
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def json_object(cls) -> StructuredOutput:
        """Any JSON object (OpenAI's JSON mode)."""
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutput:
        return cls("regex", pattern)

    @classmethod
    def grammar(cls, text: str, syntax: Literal["lark", "gbnf"] = "lark") -> StructuredOutput:
        return cls(syntax, text)

    def validate(self, max_chars: int | None = MAX_GRAMMAR_CHARS) -> None:
        """Refuse (``StructuredOutputError``) a spec of an unknown kind, larger than ``max_chars`` (None: any size) or,
        for a JSON
        schema, not a JSON object or nested deeper than ``MAX_SCHEMA_DEPTH``. The grammar itself is checked when
        compiled (``GrammarCompiler.compile``)."""
        if self.kind not in KINDS:
            raise StructuredOutputError(f"unknown structured output kind {self.kind!r}; use one of {list(KINDS)}")
        if not isinstance(self.source, str):
            raise StructuredOutputError(f"the {self.kind} must be given as text, got {type(self.source).__name__}")
        if max_chars is not None and len(self.source) > max_chars:
            raise StructuredOutputError(f"the {self.kind.replace('_', ' ')} is {len(self.source)} characters, more "
                                        f"than the limit of {max_chars}: simplify it")
        if self.kind in ("regex", "lark", "gbnf") and not self.source:
            raise StructuredOutputError(f"the {self.kind} is empty")
        if self.kind == "json_schema":
            schema = self.schema()
            depth = _depth(schema, MAX_SCHEMA_DEPTH + 1)
            if depth > MAX_SCHEMA_DEPTH:
                raise StructuredOutputError(f"the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels: simplify it")

    def schema(self) -> dict[str, Any]:
        """The JSON schema of a ``json_schema`` or ``json_object`` spec."""
        if self.kind == "json_object":
            return {"type": "object"}
        try:
            schema = json.loads(self.source)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise StructuredOutputError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise StructuredOutputError(f"a JSON schema must be a JSON object, got {type(schema).__name__}")
        return schema

    def llguidance_grammar(self) -> str:
        """The spec as an llguidance grammar (its JSON text); ``StructuredOutputError`` when it cannot be built."""
        try:
            if self.kind in ("json_schema", "json_object"):
                schema = closed_objects(self.schema())
                return LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)  # type: ignore[arg-type]
            if self.kind == "regex":
                return LLMatcher.grammar_from_regex(self.source)
            return grammar_from("lark" if self.kind == "lark" else "gbnf", self.source)
        except (ValueError, TypeError, RuntimeError) as exc:  # llguidance raises these for malformed input
            raise StructuredOutputError(f"the {self.kind.replace('_', ' ')} is invalid: {exc}") from None


# JSON-schema keywords whose value is a schema, a {name: schema} map, or a list of schemas.
_SUBSCHEMA = ("items", "additionalProperties", "not", "contains", "if", "then", "else", "propertyNames",
              "unevaluatedItems", "unevaluatedProperties", "additionalItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems", "items")


def map_schemas(schema: Any, change: Callable[[dict[str, Any]], dict[str, Any]]) -> Any:
    """``schema`` with ``change`` applied to every (sub)schema, the innermost first. A copy."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = map_schemas(out[key], change)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: map_schemas(sub, change) for name, sub in out[key].items()}
    for key in (*_SCHEMA_LISTS, "allOf"):
        if isinstance(out.get(key), list):
            out[key] = [map_schemas(sub, change) for sub in out[key]]
    return change(out)


def closed_objects(schema: Any, close: bool = True) -> Any:
    """``schema`` with every object schema that lists ``properties`` and says nothing of others closed to them
    (``additionalProperties: false``): OpenAI's strict mode requires it, and xgrammar (vLLM) assumes it. Left open,
    a small model adds properties of its own until ``max_tokens`` runs out. The parts of an ``allOf`` stay open
    (closed, each would refuse the others' properties). A copy; the input is not changed."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [closed_objects(sub, close=False) for sub in out["allOf"]]
    for key in _SUBSCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = closed_objects(out[key])
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(sub) for sub in out[key]]
    if close and isinstance(out.get("properties"), dict) and not any(
            k in out for k in ("additionalProperties", "patternProperties", "unevaluatedProperties")):
        out["additionalProperties"] = False
    return out


def _depth(value: Any, limit: int) -> int:
    """Nesting depth of a JSON value, counted no further than ``limit``."""
    if limit <= 0 or not isinstance(value, dict | list):
        return 0
    children = value.values() if isinstance(value, dict) else value
    return 1 + max((_depth(child, limit - 1) for child in children), default=0)
