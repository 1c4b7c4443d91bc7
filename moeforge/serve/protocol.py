"""The OpenAI API's request and response bodies (the subset the server implements), as pydantic models.

Requests ignore fields they do not know (clients send many optional ones); fields whose meaning the engine
cannot honour (``echo``, ``suffix``, ``frequency_penalty``, ``logit_bias``, ``best_of``, the deprecated
``functions`` / ``function_call``, ``tools`` on completions) are refused with a 400 naming them rather than silently
dropped. ``response_format``: ``text``, ``json_object``, ``json_schema`` ({"json_schema": {"name", "schema",
"strict"}}) and two extensions, ``{"type": "grammar", "grammar": TEXT, "syntax": "lark" | "gbnf"}`` and
``{"type": "regex", "pattern": TEXT}``: constrained decoding (``runtime/grammar.py``). Types are strict:
``"max_tokens": "5"`` or ``true`` is not a number (a 400 naming the field).
Extensions, as vLLM names them: ``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``,
``stop_token_ids``, ``return_token_ids`` (each choice then carries its ``token_ids``, the response its
``prompt_token_ids``).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, StrictInt, model_serializer

from moeforge.runtime.sampler import MAX_LOGPROBS, MAX_SEED, SamplingParams
from moeforge.runtime.structured_output import StructuredOutput

MAX_N = 16  # choices per request: each is a request in the engine


class UnsupportedField(ValueError):
    """A request field the server cannot honour; ``param`` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    include_usage: bool = False


class SamplingRequest(BaseModel):
    """Fields common to completions and chat completions."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, allow_inf_nan=False)  # None: 1.0, as OpenAI
    top_p: float | None = Field(None, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    presence_penalty: float = Field(0.0, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extensions
    top_k: int | None = Field(None, ge=-1)  # None, 0 or -1: off (vLLM's); too large: the engine says so
    min_p: float = Field(0.0, allow_inf_nan=False)
    repetition_penalty: float = Field(1.0, allow_inf_nan=False)
    ignore_eos: bool = False
    stop_token_ids: list[StrictInt] | None = None
    return_token_ids: bool = False
    # Known OpenAI fields the server cannot honour: read only to refuse them (a client relying on one must know).
    best_of: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None

    def check_supported(self) -> None:
        if self.frequency_penalty:
            raise UnsupportedField("frequency_penalty", "frequency_penalty is not supported (use presence_penalty "
                                   "or repetition_penalty)")
        if self.logit_bias:
            raise UnsupportedField("logit_bias", "logit_bias is not supported")
        if self.best_of not in (None, self.n):
            raise UnsupportedField("best_of", "best_of is not supported (n choices are returned as sampled)")
        if self.functions:
            raise UnsupportedField("functions", "functions (deprecated) is not supported: use tools")
        if self.function_call not in (None, "none"):
            raise UnsupportedField("function_call", "function_call (deprecated) is not supported: use tool_choice")
        self.structured_output()  # refuses a malformed response_format

    def structured_output(self) -> StructuredOutput | None:
        """The constraint ``response_format`` asks for (None: plain text); ``UnsupportedField`` when malformed."""
        rf = self.response_format
        if rf is None:
            return None
        kind = rf.get("type", "text")
        if kind == "text":
            return None
        if kind == "json_object":
            return StructuredOutput.json_object()
        if kind == "json_schema":
            spec = rf.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise UnsupportedField("response_format", "response_format json_schema needs "
                                       "{'json_schema': {'name': ..., 'schema': {...}}}: the schema as a JSON object")
            return StructuredOutput.json_schema(schema)
        if kind == "grammar":
            grammar, syntax = rf.get("grammar"), rf.get("syntax", "lark")
            if not isinstance(grammar, str) or syntax not in ("lark", "gbnf"):
                raise UnsupportedField("response_format", "response_format grammar needs {'grammar': TEXT, "
                                       "'syntax': 'lark' or 'gbnf'}")
            return StructuredOutput.grammar(grammar, syntax)
        if kind == "regex":
            if not isinstance(rf.get("pattern"), str):
                raise UnsupportedField("response_format", "response_format regex needs {'pattern': TEXT}")
            return StructuredOutput.regex(rf["pattern"])
        raise UnsupportedField("response_format", f"response_format type {kind!r} is not supported: use text, "
                               "json_object, json_schema, grammar or regex")

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def sampling_params(self, max_tokens: int, logprobs: int | None, choice: int,
                        structured: StructuredOutput | None = None) -> SamplingParams:
        """The engine's params for choice ``choice`` (0..n-1). With a seed, choice i samples with seed + i, so
        the n choices differ and choice 0 equals a single-choice request with that seed. ``structured``: the
        output's constraint (``response_format``, or a forced tool call's grammar)."""
        seed = None if self.seed is None else (self.seed + choice) % 2**64
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_k=max(self.top_k or 0, 0), top_p=1.0 if self.top_p is None else self.top_p, min_p=self.min_p,
            repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty, seed=seed,
            max_tokens=max_tokens, stop_token_ids=tuple(self.stop_token_ids or ()), stop_strings=self.stop_strings,
            logprobs=logprobs, ignore_eos=self.ignore_eos, structured_output=structured)


class CompletionRequest(SamplingRequest):
    # One prompt (text or token ids) or a batch of them; StrictInt: true and 2.0 are not token ids.
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.tools:
            raise UnsupportedField("tools", "tools are not supported on /v1/completions: use /v1/chat/completions")
        if self.echo:
            raise UnsupportedField("echo", "echo is not supported")
        if self.suffix:
            raise UnsupportedField("suffix", "suffix is not supported")

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the batch, each text or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        out: list[str | list[int]] = []
        for item in p:
            if isinstance(item, int):  # p is one prompt of token ids
                return [[x for x in p if isinstance(x, int)]]
            out.append(item if isinstance(item, str) else list(item))
        return out or [[]]  # []: one empty prompt (the engine says what is wrong with it)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, tool_calls...: passed on to the chat template
    role: str
    content: str | list[ContentPart] | None = None
    tool_calls: list[dict[str, Any]] | None = None

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates expect it: content as one string (text parts joined)."""
        content = self.content
        if isinstance(content, list):
            if any(part.type != "text" for part in content):
                raise UnsupportedField("messages", "only text content parts are supported")
            content = "".join(part.text or "" for part in content)
        message = {**(self.model_extra or {}), "role": self.role, "content": content or ""}
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return message


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None  # a forced call: one, unless true
    response_format: dict[str, Any] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.tool_choice not in (None, "none", "auto") and self.structured_output() is not None:
            raise UnsupportedField("tool_choice", "a forced tool call and a response_format cannot be combined")
        if self.top_logprobs is not None and not self.logprobs:
            raise UnsupportedField("top_logprobs", "top_logprobs needs logprobs: true")

    @property
    def engine_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


# ---------------------------------------------------------------------------------------------- responses
class _Body(BaseModel):
    """A response body: the fields named in ``omit_if_none`` are left out while None (OpenAI's bodies carry
    ``finish_reason: null`` but no ``role`` in a content delta); every other field is always written."""

    omit_if_none: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _omit(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        for name in self.omit_if_none:
            if data.get(name) is None:
                data.pop(name, None)
        return data


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Body):
    omit_if_none = ("token_ids",)
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None


class CompletionResponse(_Body):
    omit_if_none = ("usage", "prompt_token_ids")
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    prompt_token_ids: list[list[int]] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] = Field(default_factory=list)


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(_Body):
    omit_if_none = ("reasoning_content", "tool_calls")
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(_Body):
    omit_if_none = ("token_ids",)
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(_Body):
    omit_if_none = ("prompt_token_ids",)
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = None


class FunctionCallDelta(_Body):
    omit_if_none = ("name", "arguments")
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_Body):
    omit_if_none = ("id", "type")
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class Delta(_Body):
    omit_if_none = ("role", "content", "reasoning_content", "tool_calls")
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(_Body):
    omit_if_none = ("token_ids",)
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(_Body):
    omit_if_none = ("usage",)
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "moeforge"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
