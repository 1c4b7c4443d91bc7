"""Request: everything the runtime knows about one generation request, on one object (vLLM v1's word).

Token accounting follows vLLM v1: a request's known tokens are its prompt followed by its output
tokens, and ``num_computed_tokens`` of them (a prefix) have their KV in the cache. A step computes
some of the rest; when it reaches the end of the known tokens, the logits of the last one are
sampled and the new token is appended to the output. A decode step is the same rule with one
token left: the token sampled last step. Preemption by recompute resets ``num_computed_tokens`` to
0, so the prompt *and* the output tokens so far are computed again before the next sample.

Life cycle (only the ``Scheduler`` changes ``status``, ``Scheduler.finish`` ends a request early; the engine
relabels a length finish "stop" when that last token completed a stop string)::

    WAITING -> RUNNING -> FINISHED_STOPPED | FINISHED_LENGTH
                  |  ^
                  v  |
               PREEMPTED            (any unfinished state) -> FINISHED_ABORTED | FINISHED_ERROR
"""

from __future__ import annotations

import enum
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from moeforge.core.errors import MoeforgeError
from moeforge.runtime.grammar import GrammarState
from moeforge.runtime.output_text import OutputText
from moeforge.runtime.sampler import SamplingParams
from moeforge.runtime.speculative import Drafter


class RequestError(MoeforgeError):
    """A request that cannot be served as given (the message says why and what to change); ``param`` names the
    request field at fault, when one is (``prompt``, ``max_tokens``)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def prompt_token_ids(prompt: object, vocab_size: int) -> list[int]:
    """A prompt given as token ids, checked and as plain ints: a non-empty sequence (or 1-D integer array or
    tensor) of integers in [0, vocab_size). Raises ``RequestError`` naming the first bad position; nothing is
    converted silently (2.7 is not token 2, True is not token 1). Shared by the engine and the PyTorch reference."""
    if getattr(prompt, "ndim", None) == 1 and hasattr(prompt, "tolist"):  # numpy array or torch tensor
        prompt = prompt.tolist()
    if isinstance(prompt, str | bytes) or not isinstance(prompt, Sequence):
        raise RequestError(f"a prompt must be text or a sequence of integer token ids, got {type(prompt).__name__}")
    if not prompt:
        raise RequestError("the prompt is empty: give at least one token")
    ids: list[int] = []
    for pos, token in enumerate(prompt):
        if not isinstance(token, int | np.integer) or isinstance(token, bool):
            raise RequestError(f"prompt token {pos} is {token!r} ({type(token).__name__}): token ids must be integers")
        ids.append(int(token))
    bad = [pos for pos, token in enumerate(ids) if not 0 <= token < vocab_size]
    if bad:
        raise RequestError(f"prompt token ids {[ids[p] for p in bad[:5]]} (positions {bad[:5]}) are outside the "
                           f"vocabulary [0, {vocab_size})")
    return ids


def check_room(prompt_len: int, max_tokens: int, limit: int, limit_name: str,
               names: Mapping[str, str] | None = None) -> None:
    """Refuse (``RequestError``) a prompt that leaves no room for ``max_tokens`` new tokens within ``limit``
    positions (``limit_name`` says whose: the artifact's max_seq_len, the model's positions). Nothing is ever
    truncated. ``names`` maps ``max_tokens`` to the name the caller's user knows (a CLI flag), as
    ``SamplingParams.validate`` does. Shared by the engine, the PyTorch reference and the CLI."""
    if prompt_len + max_tokens > limit:
        name = (names or {}).get("max_tokens", "max_tokens")
        raise RequestError(f"prompt ({prompt_len} tokens) + {name} ({max_tokens}) exceeds {limit_name} {limit}; "
                           f"shorten the prompt or lower {name}; nothing is truncated", param="max_tokens")


class RequestStatus(enum.Enum):
    WAITING = enum.auto()  # added, never had KV-cache blocks
    RUNNING = enum.auto()  # holds blocks; scheduled each step while the token budget lasts
    PREEMPTED = enum.auto()  # lost its blocks to an older request; waits to be recomputed
    FINISHED_STOPPED = enum.auto()  # sampled one of ``params.stop_token_ids``, or its text hit a stop string
    FINISHED_LENGTH = enum.auto()  # reached ``params.max_tokens``
    FINISHED_ABORTED = enum.auto()  # the caller gave up on it
    FINISHED_ERROR = enum.auto()  # can never run, or its model step raised (see ``Request.error``)

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS


# OpenAI-style finish reasons, as an engine reports them.
_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass
class RequestMetrics:
    """Per-request timings (seconds, from ``time.perf_counter``)."""

    arrival: float
    first_token: float | None = None
    finished: float | None = None

    @property
    def ttft(self) -> float | None:
        """Time to first token."""
        return None if self.first_token is None else self.first_token - self.arrival

    def tokens_per_second(self, num_tokens: int) -> float | None:
        """Decode speed after the first token."""
        if self.finished is None or self.first_token is None or num_tokens < 2:
            return None
        return (num_tokens - 1) / max(self.finished - self.first_token, 1e-9)


@dataclass(eq=False)  # identity, not value: two requests with equal tokens are still two requests
class Request:
    """One request. The caller creates it (status WAITING) and hands it to ``Scheduler.add``.

    Two owners, so that each field has one writer: the scheduler writes the scheduling fields
    (``output_token_ids`` to ``error``) from ``Scheduler.add`` on; the engine writes the serving
    fields (``generator`` to ``num_reported_tokens``). Everyone else only reads.
    """

    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    # -- scheduling: the scheduler's ------------------------------------------------------------
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # leading known tokens whose KV is in the cache
    num_cached_tokens: int = 0  # of those, found in the prefix cache at the latest admission
    arrival: int = -1  # order of ``Scheduler.add`` calls: FCFS priority, lower is older
    error: str | None = None  # why a FINISHED_ERROR request could not run or failed
    # -- serving: the engine's ------------------------------------------------------------------
    # Its own random stream (None without a seed: the sampler's shared one), so that a seeded request
    # samples the same tokens whatever else is in its batch.
    generator: np.random.Generator | None = field(init=False)
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(arrival=time.perf_counter()))
    # With ``params.logprobs`` set: per output token, its logprob and the top ``params.logprobs`` (token, logprob).
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    slot: int | None = None  # the backend cache row (``RowInput.slot``) while it holds one
    # Speculative decoding (runtime/speculative.py): tokens proposed to follow the known ones, which the next decode
    # feeds after the last sampled token for the model to verify (the scheduler trims them to its limits), and
    # the drafter that proposes them (its n-gram index and draft length).
    spec_token_ids: list[int] = field(default_factory=list)
    drafter: Drafter | None = None
    num_reported_tokens: int = 0  # output tokens already returned to the caller (streaming deltas)
    # The output's text (incremental detokenisation, stop strings: runtime/output_text.py); None without a tokenizer.
    text: OutputText | None = None
    # With ``params.structured_output``: its matcher (runtime/grammar.py), advanced by every sampled token.
    grammar: GrammarState | None = None

    def __post_init__(self) -> None:
        self.generator = self.params.make_generator()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Known tokens: prompt plus output."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then output tokens (a new list)."""
        return [*self.prompt_token_ids, *self.output_token_ids]

    def token_ids(self, start: int, end: int | None = None) -> list[int]:
        """``all_token_ids[start:end]`` without building the whole list: a decode step's slice costs O(slice),
        not O(sequence length)."""
        prompt = len(self.prompt_token_ids)
        end = self.num_tokens if end is None else end
        if start >= prompt:
            return self.output_token_ids[start - prompt:end - prompt]
        return [*self.prompt_token_ids[start:end], *self.output_token_ids[:max(end - prompt, 0)]]

    @property
    def num_uncomputed_tokens(self) -> int:
        """Known tokens without KV: the rest of the prompt, 1 for a decode, everything after a preemption."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        """"stop", "length", "abort" or "error" once finished, else None (derived from ``status``)."""
        return _FINISH_REASONS.get(self.status)
