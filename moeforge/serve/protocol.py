"""The OpenAI API's request and response bodies (the subset the server implements), as pydantic models.

Requests ignore fields they do not know (clients send many optional ones); fields whose meaning the engine
cannot honour (``echo``, ``suffix``, ``frequency_penalty``, ``logit_bias``, ``best_of``, ``tools`` /
``functions``, a ``response_format`` other than text) are refused with a 400 naming them rather than silently
dropped. Types are strict: ``"max_tokens": "5"`` or ``true`` is not a number (a 400 naming the field).
Extensions, as vLLM names them: ``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``,
``stop_token_ids``, ``return_token_ids`` (each choice then carries its ``token_ids``, the response its
``prompt_token_ids``).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, StrictInt, model_serializer

from moeforge.runtime.sampler import MAX_LOGPROBS, MAX_SEED, SamplingParams

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
        for name in ("tools", "functions"):
            if getattr(self, name):
                raise UnsupportedField(name, f"{name} (tool and function calling) is not supported")
        for name in ("tool_choice", "function_call"):
            if getattr(self, name) not in (None, "none"):
                raise UnsupportedField(name, f"{name} is not supported (no tool or function calling)")
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            raise UnsupportedField("response_format", "response_format other than text (JSON mode, schemas) is "
                                   "not supported")

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def sampling_params(self, max_tokens: int, logprobs: int | None, choice: int) -> SamplingParams:
        """The engine's params for choice ``choice`` (0..n-1). With a seed, choice i samples with seed + i, so
        the n choices differ and choice 0 equals a single-choice request with that seed."""
        seed = None if self.seed is None else (self.seed + choice) % 2**64
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_k=max(self.top_k or 0, 0), top_p=1.0 if self.top_p is None else self.top_p, min_p=self.min_p,
            repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty, seed=seed,
            max_tokens=max_tokens, stop_token_ids=tuple(self.stop_token_ids or ()), stop_strings=self.stop_strings,
            logprobs=logprobs, ignore_eos=self.ignore_eos)


class CompletionRequest(SamplingRequest):
    # One prompt (text or token ids) or a batch of them; StrictInt: true and 2.0 are not token ids.
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
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
    model_config = ConfigDict(extra="allow")  # name, tool_call_id...: passed on to the chat template
    role: str
    content: str | list[ContentPart] | None = None

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates expect it: content as one string (text parts joined)."""
        content = self.content
        if isinstance(content, list):
            if any(part.type != "text" for part in content):
                raise UnsupportedField("messages", "only text content parts are supported")
            content = "".join(part.text or "" for part in content)
        return {**(self.model_extra or {}), "role": self.role, "content": content or ""}


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.tools:
            raise UnsupportedField("tools", "tools are not supported")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise UnsupportedField("response_format", "only response_format type 'text' is supported")
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


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


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


class Delta(_Body):
    omit_if_none = ("role", "content")
    role: str | None = None
    content: str | None = None


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
