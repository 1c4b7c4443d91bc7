"""Constrained decoding with llguidance: a compiler of ``StructuredOutput`` specs and each request's matcher.

Why llguidance (measured on this project's CPU, SmolLM2's 49,152-token vocabulary, a 4-field JSON schema): a token
mask in ~8 us median (xgrammar 0.2.9: ~12 us), a schema compiled in ~13 ms (xgrammar ~29 ms), and it reads the
tokenizer from the very ``tokenizer.json`` the engine encodes with (the Rust ``tokenizers`` library), so the
vocabulary it masks is exactly the model's. It needs only numpy (xgrammar pulls in torch, triton, transformers).

Masks are packed bitmasks, int32 [W] with W = ceil(V / 32), bit t of word t // 32 set when token t is allowed
(V: the model's vocabulary, which may be larger than the tokenizer's: the extra ids are never allowed). An
unconstrained row is all ones (-1), so constrained and free requests share one [B, W] bitmask per step.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import llguidance
import numpy as np

from moeforge.model.tokenizer import Tokenizer
from moeforge.runtime.structured_output import MAX_GRAMMAR_CHARS, StructuredOutput, StructuredOutputError

CACHE_SIZE = 256  # compiled grammars kept (by spec): a service reuses few schemas
# Bounds on what one grammar may cost, below llguidance's defaults: a request must not stall every other one.
_LIMITS: dict[str, Any] = {"step_lexer_fuel": 200_000, "step_max_items": 50_000, "max_grammar_size": 200_000,
                           "initial_lexer_fuel": 1_000_000, "max_lexer_states": 100_000}


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def unpack_bitmask(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """bool [..., V] of packed int32 bitmask [..., W]."""
    bits = np.unpackbits(np.ascontiguousarray(bitmask).view(np.uint8), axis=-1, bitorder="little")
    allowed: np.ndarray = bits[..., :vocab_size].astype(bool)
    return allowed


class GrammarState:
    """One request's matcher: the tokens it may sample next, and the tokens it has sampled. A matcher that fails
    (a token outside its mask: a bug elsewhere) or has finished allows only the end-of-sequence tokens, so the
    request ends instead of the engine raising."""

    def __init__(self, matcher: llguidance.LLMatcher, eos_token_ids: Sequence[int]) -> None:
        self.matcher = matcher
        self.eos_token_ids = tuple(eos_token_ids)

    def fill(self, row: np.ndarray) -> None:
        """Write the allowed next tokens into ``row`` (int32 [W], C-contiguous)."""
        self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        if not row.any():  # nothing allowed (an error state): end the request; without EOS ids, free it
            if not self.eos_token_ids:
                row[:] = -1
            for token in self.eos_token_ids:
                row[token // 32] |= np.int32(np.uint32(1 << (token % 32)).view(np.int32))

    def accept(self, tokens: Sequence[int]) -> bool:
        """Advance past sampled ``tokens``; False when one was not allowed (the matcher then only allows EOS)."""
        return all(self.matcher.consume_token(int(t)) for t in tokens) if not self.matcher.is_error() else False

    @property
    def error(self) -> str | None:
        return self.matcher.get_error() or None if self.matcher.is_error() else None

    @property
    def is_finished(self) -> bool:
        """The output matches in full and nothing may follow."""
        return bool(self.matcher.is_stopped())


class GrammarCompiler:
    """Compiles specs against one tokenizer, caching the result by spec. Thread-safe: the server compiles (and so
    checks) a request's spec off its event loop, and the engine thread then finds it in the cache."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = max(vocab_size, tokenizer.vocab_size)
        self._lock = threading.Lock()  # the cache's; compiling runs outside it (the engine thread never waits long)
        self._tokenizer_lock = threading.Lock()
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[StructuredOutput, llguidance.LLMatcher] = OrderedDict()

    def _tokenizer(self) -> llguidance.LLTokenizer:
        with self._tokenizer_lock:
            return self._build_tokenizer()

    def _build_tokenizer(self) -> llguidance.LLTokenizer:
        if self._ll_tokenizer is None:
            # Built from the tokenizer.json text itself (~1 s for a 50k vocabulary, once per engine).
            self._ll_tokenizer = llguidance.LLTokenizer(self.tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                                                        eos_token=list(self.tokenizer.eos_token_ids) or None)
        return self._ll_tokenizer

    def compile(self, spec: StructuredOutput, max_chars: int | None = MAX_GRAMMAR_CHARS) -> llguidance.LLMatcher:
        """The compiled matcher of ``spec`` (a template: ``new_state`` copies it), or ``StructuredOutputError``
        naming why it cannot be used. A spec compiled before comes from the cache, unchecked again; a new one is
        first checked by ``StructuredOutput.validate(max_chars)`` (None: no size limit)."""
        with self._lock:
            cached = self._cache.get(spec)
            if cached is not None:
                self._cache.move_to_end(spec)
                return cached
        spec.validate(max_chars)
        grammar = spec.llguidance_grammar()
        limits = llguidance.LLParserLimits(**_LIMITS)
        matcher = llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0, limits=limits)
        if matcher.is_error():
            raise StructuredOutputError(f"the {spec.kind.replace('_', ' ')} cannot be used: {matcher.get_error()}")
        with self._lock:
            self._cache[spec] = matcher
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return matcher

    def new_state(self, spec: StructuredOutput) -> GrammarState:
        return GrammarState(self.compile(spec).deep_copy(), self.tokenizer.eos_token_ids)

    def fill_bitmask(self, states: Sequence[GrammarState | None]) -> np.ndarray:
        """int32 [len(states), W]: each state's allowed tokens, all ones for a row without one. One matcher after
        the other on the calling thread (without the GIL): ~6 us a row for SmolLM2's vocabulary, where llguidance's
        own thread pool would wake threads that compete with the model's for the cores."""
        bitmask = np.full((len(states), bitmask_words(self.vocab_size)), -1, np.int32)
        for i, state in enumerate(states):
            if state is not None:
                state.fill(bitmask[i])
        return bitmask
