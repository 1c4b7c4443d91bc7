"""A request's output text, made once on the output path (as vLLM v1's output processor): incremental
detokenisation, stop strings, and the text that is safe to send.

Each request's tokens are decoded as they arrive with the tokenizers library's ``DecodeStream`` (no re-decoding of
the whole output per step). The token whose text completes a stop string ends the request there (the engine drops
the tokens after it); the text then ends where the stop string begins (OpenAI's and vLLM's default). While a request
runs, ``delta`` holds back a suffix that may still become a stop string (and a character whose bytes are still
coming, which the stream keeps to itself), so that streamed text never has to be taken back.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers.decoders import DecodeStream

from moeforge.model.tokenizer import Tokenizer


class OutputText:
    """The text of one request's output tokens, fed in order (``feed``); ``delta`` returns what is new to send."""

    def __init__(self, tokenizer: Tokenizer, stop_strings: Sequence[str] = ()) -> None:
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)
        self.stop_strings = tuple(s for s in stop_strings if s)
        self._longest_stop = max((len(s) for s in self.stop_strings), default=0)
        self.decoded = ""  # the text of every token fed (a trailing partial character excepted)
        self.num_tokens = 0  # tokens fed
        self.stop_at: int | None = None  # where the stop string that ended the request begins in ``decoded``
        self.sent = 0  # characters of ``text`` already returned by ``delta``

    @property
    def text(self) -> str:
        """The output text so far: up to the stop string when one ended the request."""
        return self.decoded if self.stop_at is None else self.decoded[:self.stop_at]

    def feed(self, token_ids: Sequence[int]) -> int | None:
        """Decode the next tokens. Returns the number of tokens fed in all when one of them completed a stop string
        (the request ends at that token: the caller drops the ones after it), else None. Nothing is fed after a
        stop string."""
        if self.stop_at is not None:
            return self.num_tokens
        for token in token_ids:
            self.num_tokens += 1
            chunk = self._stream.step(self._tokenizer.backend, int(token))
            if not chunk:
                continue
            start = max(0, len(self.decoded) - self._longest_stop + 1)  # a new match ends in the new chunk
            self.decoded += chunk
            hits = [i for i in (self.decoded.find(s, start) for s in self.stop_strings) if i >= 0]
            if hits:
                self.stop_at = min(hits)
                return self.num_tokens
        return None

    def finish(self, token_ids: Sequence[int]) -> None:
        """The request ended (``token_ids``: all its output tokens): a trailing character whose bytes never completed
        is decoded as the tokenizer decodes it (U+FFFD), as a whole-output decode would give it."""
        if self.stop_at is None:
            whole = self._tokenizer.decode(token_ids, skip_special_tokens=True)
            if whole.startswith(self.decoded):
                self.decoded = whole

    def delta(self, finished: bool) -> str:
        """The text not returned before that can be sent now: all of it once the request finished, else all but the
        longest suffix that is the start of a stop string."""
        text = self.text
        end = len(text)
        if not finished and self.stop_at is None:
            for stop in self.stop_strings:
                for k in range(min(len(stop) - 1, len(text)), 0, -1):
                    if text.endswith(stop[:k]):
                        end = min(end, len(text) - k)
                        break
        end = max(end, self.sent)
        out = text[self.sent:end]
        self.sent = end
        return out
