"""Sequence: one request's tokens and where it stands in the scheduler's life cycle.

Token accounting follows vLLM v1: a sequence's known tokens are its prompt followed by its output
tokens, and ``num_computed_tokens`` of them (a prefix) have their KV in the cache. A step computes
some of the rest; when it reaches the end of the known tokens, the logits of the last one are
sampled and the new token is appended to the output. A decode step is the same rule with one
token left: the token sampled last step. Preemption by recompute resets ``num_computed_tokens`` to
0, so the prompt *and* the output tokens so far are computed again before the next sample.

Life cycle::

    WAITING -> RUNNING -> FINISHED_STOPPED | FINISHED_LENGTH
                  |  ^
                  v  |
               PREEMPTED            (any unfinished state) -> FINISHED_ABORTED | FINISHED_ERROR
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from moeforge.runtime.sampler import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()  # added, never had KV-cache blocks
    RUNNING = enum.auto()  # holds blocks; scheduled each step while the token budget lasts
    PREEMPTED = enum.auto()  # lost its blocks to an older sequence; waits to be recomputed
    FINISHED_STOPPED = enum.auto()  # sampled one of ``params.stop_token_ids``
    FINISHED_LENGTH = enum.auto()  # reached ``params.max_tokens``
    FINISHED_ABORTED = enum.auto()  # the caller gave up on it
    FINISHED_ERROR = enum.auto()  # can never run, or its model step raised (see ``Sequence.error``)

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS


# OpenAI-style finish reasons, as an engine reports them.
_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
    SequenceStatus.FINISHED_ERROR: "error",
}


@dataclass(eq=False)  # identity, not value: two requests with equal tokens are still two requests
class Sequence:
    """One request. The caller creates it (status WAITING); the scheduler owns every field below
    ``params`` from ``Scheduler.add`` on, and the caller only reads them."""

    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # leading known tokens whose KV is in the cache
    num_cached_tokens: int = 0  # of those, found in the prefix cache at the latest admission
    arrival: int = -1  # order of ``Scheduler.add`` calls: FCFS priority, lower is older
    error: str | None = None  # why a FINISHED_ERROR sequence could not run or failed

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

    @property
    def num_uncomputed_tokens(self) -> int:
        """Known tokens without KV: the rest of the prompt, 1 for a decode, everything after a preemption."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def num_remaining_prompt_tokens(self) -> int:
        """Prompt tokens whose KV is not computed yet."""
        return max(self.num_prompt_tokens - self.num_computed_tokens, 0)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        """"stop", "length", "abort" or "error" once finished, else None (derived from ``status``)."""
        return _FINISH_REASONS.get(self.status)

    def finish(self, status: SequenceStatus, error: str | None = None) -> None:
        """Move to a finished ``status``; ``error`` is the message of a FINISHED_ERROR."""
        if not status.is_finished:
            raise ValueError(f"request {self.request_id}: {status.name} is not a finished status")
        self.status = status
        self.error = error
