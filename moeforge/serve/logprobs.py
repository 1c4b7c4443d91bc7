"""Logprobs in the OpenAI API's shapes (completions and chat), each token named by its text.

The output text itself (incremental detokenisation, stop strings, what is safe to stream) is made once, by the
engine (``runtime/output_text.py``): ``RequestOutput.text`` and ``text_delta``.
"""

from __future__ import annotations

from moeforge.model.tokenizer import Tokenizer
from moeforge.runtime.outputs import RequestOutput
from moeforge.serve.protocol import ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob

MIN_LOGPROB = -9999.0  # JSON has no -inf: a token of probability 0 gets this (as vLLM does)


def token_text(tokenizer: Tokenizer | None, token_id: int) -> str:
    """How logprobs name a token: its decoded text, or ``token_id:N`` without a tokenizer (vLLM's form)."""
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id])


def _lp(value: float) -> float:
    return max(value, MIN_LOGPROB)


def completion_logprobs(tokenizer: Tokenizer | None, out: RequestOutput, start: int, end: int,
                        text_offset: int) -> CompletionLogprobs:
    """The legacy completions ``logprobs`` object of output tokens [start, end)."""
    result = CompletionLogprobs()
    offset = text_offset
    for i in range(start, min(end, len(out.logprobs))):
        token = token_text(tokenizer, out.token_ids[i])
        result.tokens.append(token)
        result.token_logprobs.append(_lp(out.logprobs[i]))
        top = out.top_logprobs[i] if i < len(out.top_logprobs) else []
        result.top_logprobs.append({token_text(tokenizer, t): _lp(lp) for t, lp in top})
        result.text_offset.append(offset)
        offset += len(token)
    return result


def chat_logprobs(tokenizer: Tokenizer | None, out: RequestOutput, start: int, end: int) -> ChatLogprobs:
    """The chat ``logprobs.content`` entries of output tokens [start, end)."""
    content = []
    for i in range(start, min(end, len(out.logprobs))):
        token = token_text(tokenizer, out.token_ids[i])
        top = out.top_logprobs[i] if i < len(out.top_logprobs) else []
        content.append(TokenLogprob(
            token=token, logprob=_lp(out.logprobs[i]), bytes=list(token.encode()),
            top_logprobs=[TopLogprob(token=(t_text := token_text(tokenizer, t)), logprob=_lp(lp),
                                     bytes=list(t_text.encode())) for t, lp in top]))
    return ChatLogprobs(content=content)
