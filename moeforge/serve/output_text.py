"""One choice's text as it grows: deltas for streaming, stop strings cut off, logprobs in the API's shapes.

The engine finishes a request once its text contains a stop string, but its tokens may run past the stop
string's end, and OpenAI's text ends before it: the cut is made here. While streaming, text that could still
become a stop string (a suffix that is a prefix of one) and an incomplete UTF-8 character (byte-level BPE
decodes half a character as U+FFFD) are held back until the next tokens settle them.
"""

from __future__ import annotations

from collections.abc import Sequence

from moeforge.model.tokenizer import Tokenizer
from moeforge.runtime.engine import RequestOutput
from moeforge.serve.protocol import ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob

REPLACEMENT = "\ufffd"
MIN_LOGPROB = -9999.0  # JSON has no -inf: a token of probability 0 gets this (as vLLM does)


class ChoiceText:
    """Text deltas of one choice. ``update(out)`` after each output returns the new text to send."""

    def __init__(self, tokenizer: Tokenizer | None, stop: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.text = ""  # sent so far
        self.num_tokens = 0  # tokens whose text (and logprobs) were sent
        self.stopped = False  # the text reached a stop string

    def update(self, out: RequestOutput) -> str:
        if self.tokenizer is None or self.stopped:
            self.num_tokens = len(out.token_ids)
            return ""
        full = out.text or ""
        cut = min((i for i in (full.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            visible, self.stopped = full[:cut], True
        elif out.finished:
            visible = full
        else:
            visible = self._settled(full)
        self.num_tokens = len(out.token_ids)
        delta = visible[len(self.text):] if len(visible) > len(self.text) else ""
        self.text += delta
        return delta

    def _settled(self, text: str) -> str:
        """``text`` less what the next tokens may still change: a trailing partial character, and the longest
        suffix that is a prefix of a stop string."""
        text = text.rstrip(REPLACEMENT)
        hold = 0
        for stop in self.stop:
            for k in range(min(len(stop) - 1, len(text)), hold, -1):
                if text.endswith(stop[:k]):
                    hold = k
                    break
        return text[:len(text) - hold]


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
