"""The two generation endpoints: /v1/completions and /v1/chat/completions, streamed (SSE) or not.

One flow for both: check the request -> token ids of each prompt (chat: the chat template, off the event loop,
with the request's tools: ``chat_tools.py``) -> its output constraint compiled (``response_format``, or a forced
tool call's grammar; off the event loop) -> one engine request per prompt and choice (``n``) -> admission (429
beyond the limit) -> submit to the engine loop (its refusals become 400s) -> collect the outputs into one response,
or send each as an SSE chunk as it comes, ending with ``data: [DONE]``. Whatever ends a request early (client
disconnect, error, shutdown) aborts its unfinished choices, which frees their KV blocks at once. A chat choice's
text is split into reasoning, content and tool calls (``chat_output.py``), streamed as deltas too.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from moeforge.core.errors import MoeforgeError
from moeforge.core.strict_json import dumps_strict
from moeforge.model.tokenizer import Tokenizer
from moeforge.runtime.grammar import GrammarCompiler
from moeforge.runtime.outputs import RequestOutput
from moeforge.runtime.sampler import SamplingParams
from moeforge.runtime.structured_output import MAX_GRAMMAR_CHARS, StructuredOutput, StructuredOutputError
from moeforge.serve.api_errors import APIError
from moeforge.serve.chat_output import ChatDelta, ChatOutputOptions, ChatOutputStream, split_chat_output
from moeforge.serve.chat_tools import MAX_TOOLS, ToolsError, check_tools, render_chat, tool_call_grammar
from moeforge.serve.engine_loop import EngineLoop, ServerShuttingDown
from moeforge.serve.logprobs import chat_logprobs, completion_logprobs
from moeforge.serve.metrics import ServerMetrics
from moeforge.serve.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    Delta,
    FunctionCall,
    FunctionCallDelta,
    SamplingRequest,
    ToolCall,
    ToolCallDelta,
    UnsupportedField,
    Usage,
)
from moeforge.serve.reasoning import THINK_START, template_has_thinking
from moeforge.serve.streams import DEFAULT_STALL_TIMEOUT_S, Admission, ChoiceStream
from moeforge.serve.tool_calls import detect_format

RETRY_AFTER_S = 1


class _EventStream(StreamingResponse):
    """An SSE response that aborts its requests however it ends -- even when the client is gone before the
    body generator ever ran (its own ``finally`` would then never run)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


@dataclass
class _Job:
    """One HTTP request, prepared: its prompts' token ids and the engine requests (prompt x n) to run."""

    request: SamplingRequest
    prompts: list[list[int]]
    logprobs: int | None
    max_tokens: list[int]  # per prompt
    chat: bool
    id: str
    created: int
    structured: StructuredOutput | None = None
    output: ChatOutputOptions = field(default_factory=ChatOutputOptions)

    def engine_requests(self) -> list[tuple[list[int], SamplingParams]]:
        n = self.request.n
        return [(ids, self.request.sampling_params(self.max_tokens[p], self.logprobs, j, self.structured))
                for p, ids in enumerate(self.prompts) for j in range(n)]


# Characters that JSON leaves raw but that ``str.splitlines`` (httpx's ``iter_lines``, many SSE readers) takes for
# line ends: generated text holding one would split an event in two. They occur only inside JSON strings, where
# the JSON escape means the same character.
_LINE_BREAKING = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def _sse(body: BaseModel | dict[str, Any]) -> str:
    """One server-sent event: ``data: <json>`` on one line, whatever characters the text holds. Standard JSON:
    pydantic writes a non-finite number as null; a dict with one raises (``dumps_strict``) rather than send NaN."""
    payload = body.model_dump_json() if isinstance(body, BaseModel) else dumps_strict(body)
    return f"data: {payload.translate(_LINE_BREAKING)}\n\n"


class OpenAIServing:
    """Serves the generation endpoints over one engine loop."""

    def __init__(self, loop: EngineLoop, *, model_name: str, tokenizer: Tokenizer | None,
                 tokenize: Callable[[str], list[int]], chat_tokenizer: Tokenizer | None, max_seq_len: int,
                 admission: Admission, metrics: ServerMetrics,
                 stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S, grammars: GrammarCompiler | None = None,
                 max_schema_chars: int = MAX_GRAMMAR_CHARS, max_tools: int = MAX_TOOLS) -> None:
        """``tokenize``: the engine's prompt encoding (``LLMEngine.tokenize``), the one the engine itself uses.
        ``tokenizer``: names tokens in logprobs. ``stall_timeout_s``: a client that reads nothing this long while
        its requests produce is aborted (``ChoiceStream``). ``grammars``: the engine's compiler of output
        constraints (thread-safe), which checks them before they reach the engine. ``max_schema_chars`` /
        ``max_tools``: the largest schema (or grammar, or all tools' parameter schemas) and tool list taken."""
        self.grammars = grammars
        self.max_schema_chars = max_schema_chars
        self.max_tools = max_tools
        self.loop = loop
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.tokenize = tokenize
        self.stall_timeout_s = stall_timeout_s
        self.chat_tokenizer = chat_tokenizer  # the tokenizer with the chat template in use
        self.max_seq_len = max_seq_len
        self.admission = admission
        self.metrics = metrics

    # ---- preparing
    def _check(self, request: SamplingRequest) -> None:
        if request.model != self.model_name:
            raise APIError(404, f"the model {request.model!r} does not exist; this server serves "
                           f"{self.model_name!r}", param="model", code="model_not_found")
        try:
            request.check_supported()
        except UnsupportedField as exc:
            raise APIError.bad_request(str(exc), exc.param) from None

    def _chat_prompt(self, request: ChatCompletionRequest
                     ) -> tuple[list[int], StructuredOutput | None, ChatOutputOptions]:
        """The chat's prompt ids, the constraint of its output (``response_format`` or a forced tool call) and how
        its output is read."""
        tokenizer = self.chat_tokenizer
        if tokenizer is None or not tokenizer.chat_template:
            raise APIError.bad_request("this artifact has no chat template: use /v1/completions, or start the "
                                       "server with --chat-template FILE", "messages")
        try:
            tools, forced = check_tools(request.tools, request.tool_choice, self.max_tools, self.max_schema_chars)
        except ToolsError as exc:
            raise APIError.bad_request(str(exc), exc.param) from None
        if request.tool_choice == "none":
            tools = []
        fmt = detect_format(tokenizer.chat_template)
        try:
            messages = [m.for_template() for m in request.messages]
            text = render_chat(tokenizer, messages, tools, fmt, request.add_generation_prompt)
            ids = tokenizer.encode(text, add_bos=False, max_tokens=self.max_seq_len)
        except UnsupportedField as exc:
            raise APIError.bad_request(str(exc), exc.param) from None
        except MoeforgeError as exc:
            raise APIError.bad_request(str(exc), "messages") from None
        structured = request.structured_output()
        if forced is not None:
            structured = tool_call_grammar(tools, forced, fmt, tokenizer, bool(request.parallel_tool_calls))
        thinking = template_has_thinking(tokenizer.chat_template)
        options = ChatOutputOptions(tool_format=fmt if tools else None, reasoning=thinking,
                                    in_reasoning=thinking and text.rstrip().endswith(THINK_START))
        return ids, structured, options

    def _compile(self, spec: StructuredOutput, param: str) -> None:
        """Refuse (400) a constraint the engine could not use: too large, invalid, beyond the grammar limits. A forced
        tool call's grammar is not measured: its tools were (``check_tools``)."""
        if self.grammars is None:
            raise APIError.bad_request("structured output needs the artifact's tokenizer, and this artifact has "
                                       "none", param)
        try:
            self.grammars.compile(spec, None if param == "tools" else self.max_schema_chars)
        except StructuredOutputError as exc:
            raise APIError.bad_request(str(exc), param) from None

    async def _prepare(self, request: CompletionRequest | ChatCompletionRequest) -> _Job:
        self._check(request)
        chat = isinstance(request, ChatCompletionRequest)
        output = ChatOutputOptions()
        try:
            if isinstance(request, ChatCompletionRequest):
                # Templates and long prompts cost milliseconds: off the event loop, which serves every stream.
                ids, structured, output = await asyncio.to_thread(self._chat_prompt, request)
                prompts = [ids]
                logprobs = request.engine_logprobs
                limit = request.max_completion_tokens or request.max_tokens
            else:
                texts = request.prompts()
                prompts = [await asyncio.to_thread(self.tokenize, p) if isinstance(p, str) else p for p in texts]
                structured = request.structured_output()
                logprobs, limit = request.logprobs, request.max_tokens or 16  # OpenAI's default
        except MoeforgeError as exc:  # a tokenizer refusing the text
            raise APIError.bad_request(str(exc), "prompt") from None
        if not prompts:
            raise APIError.bad_request("prompt is an empty batch", "prompt")
        if structured is not None:  # compiled once here (off the event loop); the engine finds it cached
            forced = isinstance(request, ChatCompletionRequest) and request.tool_choice not in (None, "none", "auto")
            await asyncio.to_thread(self._compile, structured, "tools" if forced else "response_format")
        # Chat without max_tokens: whatever room the context leaves (vLLM's default).
        max_tokens = [limit or max(self.max_seq_len - len(p), 1) for p in prompts]
        prefix = "chatcmpl-" if chat else "cmpl-"
        return _Job(request, prompts, logprobs, max_tokens, chat, prefix + uuid.uuid4().hex, int(time.time()),
                    structured, output)

    async def _start(self, job: _Job) -> ChoiceStream:
        """Admit and submit the job's engine requests; its stream, or the APIError that refused it."""
        engine_requests = job.engine_requests()
        arrival = time.perf_counter()
        if len(engine_requests) > self.admission.capacity:  # would never fit: not a "retry later"
            raise APIError.bad_request(
                f"this request makes {len(engine_requests)} engine requests (prompts x n) but the server holds at "
                f"most {self.admission.capacity} (max_num_seqs + --max-queued): split it", "n")
        if not self.admission.try_acquire(len(engine_requests)):
            raise APIError(429, f"the server is at capacity ({self.admission.in_flight} requests in flight, at most "
                           f"{self.admission.capacity} = max_num_seqs + --max-queued): retry later",
                           type="rate_limit_exceeded", code="rate_limit_exceeded",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        stream = ChoiceStream(self.loop, self.admission, len(engine_requests), self.stall_timeout_s)
        try:
            await stream.submit(engine_requests, arrival)
        except ServerShuttingDown as exc:
            raise APIError(503, str(exc), type="server_error", code="shutting_down",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except MoeforgeError as exc:  # RequestError, SamplingParamsError, a request that can never run
            raise APIError.from_engine(exc) from None
        return stream

    # ---- endpoints
    async def completions(self, request: CompletionRequest, raw: Request) -> JSONResponse | StreamingResponse:
        return await self._serve(await self._prepare(request), raw)

    async def chat(self, request: ChatCompletionRequest, raw: Request) -> JSONResponse | StreamingResponse:
        return await self._serve(await self._prepare(request), raw)

    async def _serve(self, job: _Job, raw: Request) -> JSONResponse | StreamingResponse:
        stream = await self._start(job)
        if job.request.stream:
            return _EventStream(self._events(job, stream), stream.close)
        watcher = asyncio.ensure_future(_disconnected(raw))
        collector = asyncio.ensure_future(self._collect(job, stream))
        try:
            done, _ = await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if collector not in done:  # the client left: stop its requests now, not after max_tokens
                raise APIError(499, "client disconnected", type="client_closed_request")
            return collector.result()
        finally:  # also when this handler is cancelled (shutdown deadline)
            watcher.cancel()
            collector.cancel()
            stream.close()

    async def _collect(self, job: _Job, stream: ChoiceStream) -> JSONResponse:
        final: dict[int, RequestOutput] = {}
        while not stream.done:
            index, out = await stream.next()
            if out.finished:
                final[index] = out
                if out.finish_reason == "error":
                    raise APIError(500, out.error or "the request failed", type="server_error")
        outs = [final[i] for i in range(len(job.prompts) * job.request.n)]
        usage = Usage(prompt_tokens=sum(len(p) for p in job.prompts),
                      completion_tokens=sum(len(o.token_ids) for o in outs),
                      total_tokens=sum(len(p) for p in job.prompts) + sum(len(o.token_ids) for o in outs))
        ids = job.request.return_token_ids
        body: BaseModel
        if job.chat:
            body = ChatCompletionResponse(
                id=job.id, created=job.created, model=self.model_name, usage=usage,
                prompt_token_ids=job.prompts[0] if ids else None,
                choices=[self._chat_choice(job, i, o, ids) for i, o in enumerate(outs)])
        else:
            body = CompletionResponse(
                id=job.id, created=job.created, model=self.model_name, usage=usage,
                prompt_token_ids=job.prompts if ids else None,
                choices=[CompletionChoice(index=i, text=o.text or "", finish_reason=o.finish_reason,
                                          token_ids=o.token_ids if ids else None,
                                          logprobs=completion_logprobs(self.tokenizer, o, 0, len(o.token_ids), 0)
                                          if job.logprobs is not None else None)
                         for i, o in enumerate(outs)])
        return JSONResponse(body.model_dump())

    def _chat_choice(self, job: _Job, index: int, out: RequestOutput, return_ids: bool) -> ChatChoice:
        reasoning, content, calls = split_chat_output(out.text or "", job.output)
        tool_calls = [ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", function=FunctionCall(name=c.name,
                                                                                        arguments=c.arguments or "{}"))
                      for c in calls] or None
        message = AssistantMessage(content=content if content or not tool_calls else None,
                                   reasoning_content=reasoning, tool_calls=tool_calls)
        reason = "tool_calls" if tool_calls and out.finish_reason == "stop" else out.finish_reason
        return ChatChoice(index=index, message=message, finish_reason=reason,
                          token_ids=out.token_ids if return_ids else None,
                          logprobs=chat_logprobs(self.tokenizer, out, 0, len(out.token_ids))
                          if job.logprobs is not None else None)

    async def _events(self, job: _Job, stream: ChoiceStream) -> AsyncIterator[str]:
        choices = len(job.prompts) * job.request.n
        parsers = [ChatOutputStream(job.output) for _ in range(choices)] if job.chat else []
        sent_tokens, sent_chars = [0] * choices, [0] * choices  # per choice: output tokens and text already sent
        completion_tokens = 0
        try:
            if job.chat:  # OpenAI opens each choice with the assistant role
                for i in range(choices):
                    yield _sse(self._chat_chunk(job, ChatChunkChoice(index=i, delta=Delta(role="assistant",
                                                                                          content=""))))
            while not stream.done:
                index, out = await stream.next()
                if out.finish_reason == "error":
                    yield _sse({"error": {"message": out.error or "the request failed", "type": "server_error",
                                          "param": None, "code": None}})
                    break
                start, offset, delta = sent_tokens[index], sent_chars[index], out.text_delta
                sent_tokens[index], sent_chars[index] = len(out.token_ids), offset + len(delta)
                new_ids = out.token_ids[start:]
                parts = parsers[index].feed(delta, out.finished) if job.chat else None
                if not ((parts if parts is not None else delta) or out.finished or
                        (new_ids and (job.logprobs is not None or job.request.return_token_ids))):
                    continue  # held back (a partial character, stop string or marker): nothing to send yet
                if out.finished:
                    completion_tokens += len(out.token_ids)
                called = job.chat and parsers[index].called
                yield _sse(self._chunk(job, index, out, delta, start, offset, parts, called))
            if job.request.stream_options is not None and job.request.stream_options.include_usage:
                prompt_tokens = sum(len(p) for p in job.prompts)
                usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                              total_tokens=prompt_tokens + completion_tokens)
                if job.chat:
                    yield _sse(self._chat_chunk(job, None, usage))
                else:
                    yield _sse(CompletionResponse(id=job.id, created=job.created, model=self.model_name, choices=[],
                                                  usage=usage))
            yield "data: [DONE]\n\n"
        finally:
            stream.close()

    def _chunk(self, job: _Job, index: int, out: RequestOutput, delta: str, start: int, offset: int,
               parts: ChatDelta | None = None, called: bool = False) -> BaseModel:
        """The SSE chunk of one output: its text ``delta`` (which starts at ``offset`` of the choice's text) and
        output tokens [start, end); a chat's ``parts``: the delta split into reasoning, content and call deltas."""
        reason = out.finish_reason if out.finished else None
        ids = out.token_ids[start:] if job.request.return_token_ids else None
        end = len(out.token_ids)
        if job.chat:
            parts = parts if parts is not None else ChatDelta(content=delta)
            if called and reason == "stop":
                reason = "tool_calls"
            calls = [ToolCallDelta(index=c.index, id=c.id, type="function",
                                   function=FunctionCallDelta(name=c.name, arguments=c.arguments))
                     for c in parts.calls] or None
            choice = ChatChunkChoice(index=index, delta=Delta(content=parts.content or None,
                                                              reasoning_content=parts.reasoning or None,
                                                              tool_calls=calls),
                                     finish_reason=reason, token_ids=ids,
                                     logprobs=chat_logprobs(self.tokenizer, out, start, end)
                                     if job.logprobs is not None else None)
            return self._chat_chunk(job, choice)
        choice_c = CompletionChoice(index=index, text=delta, finish_reason=reason, token_ids=ids,
                                    logprobs=completion_logprobs(self.tokenizer, out, start, end, offset)
                                    if job.logprobs is not None else None)
        return CompletionResponse(id=job.id, created=job.created, model=self.model_name, choices=[choice_c])

    def _chat_chunk(self, job: _Job, choice: ChatChunkChoice | None, usage: Usage | None = None) -> BaseModel:
        return ChatCompletionChunk(id=job.id, created=job.created, model=self.model_name,
                                   choices=[] if choice is None else [choice], usage=usage)


async def _disconnected(raw: Request) -> None:
    """Returns when the client closes the connection (the body has been read: the next message says so)."""
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return
