"""Scheduler: which tokens of which requests the next model step computes (continuous batching).

Each ``schedule()`` builds one step under a token budget (``max_num_batched_tokens``): a decode
costs 1 token, a prefill chunk its length. Requests join (``add``) and leave (``update`` at a stop
token or ``max_tokens``; ``finish`` for aborts, errors and stop strings) between steps. The step is
described by a ``SchedulerOutput`` -- token ids, positions and block tables as plain lists -- which
the engine turns into backend inputs; the engine then samples and hands the new tokens back
through ``update()``. So one engine step is::

    output = scheduler.schedule()
    sampled = run_model_and_sample(output)      # {request_id: token} for completes_prompt rows
    finished = scheduler.update(output, sampled)
    # or, when the model step raised: finished = scheduler.fail(output, "why")

Policy (vLLM v1 style, first come first served by arrival order):

1. RUNNING requests first, oldest first: a decode, or the next prefill chunk. When the cache has
   no room for one, the newest running request is preempted by recompute (blocks freed,
   ``num_computed_tokens`` reset to 0, back to the front of the waiting queue) and the append is
   retried; the newest may be the request itself. The oldest running request is never preempted,
   so it always progresses: no deadlock. A request that cannot get blocks while running alone
   never will, and finishes with FINISHED_ERROR.
2. Then WAITING requests, oldest first, while the budget, ``max_num_seqs`` and the cache allow; the
   first one that does not fit stops admission (no overtaking), or finishes with FINISHED_ERROR if
   nothing is running (an empty cache cannot hold it). A step that had to preempt admits nobody:
   the preempted request would only be admitted to be preempted again.

A prefill is chunked by the budget left and by ``long_prefill_chunk``, so a long prompt cannot
hold decodes back for a whole step. Speculative decoding: a decode also feeds the request's
``spec_token_ids`` (draft tokens the engine proposed), as many as the budget left and ``max_tokens``
allow and only where the cache has room for them without preempting anyone; ``update`` then takes
the tokens the verification accepted plus the next one, and the cache keeps the accepted drafts' KV.
Prefix-cache hits (``KVCacheManager.allocate``'s return) are
skipped: they cost neither budget nor compute.

The scheduler alone changes ``Request.status``; a finished request leaves ``requests`` at once (vLLM
v1's ``_free_request``), and the caller keeps its ``Request`` object to read the result.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from moeforge.runtime.kv_cache_manager import KVCacheManager
from moeforge.runtime.request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one step and of one request."""

    max_num_seqs: int = 64  # RUNNING requests (those holding cache blocks) at most
    max_num_batched_tokens: int = 2048  # token budget per step, decodes and prefill chunks together
    long_prefill_chunk: int | None = None  # most prefill tokens of one request per step; None: budget only
    max_model_len: int = 4096  # prompt + max_tokens at most

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.long_prefill_chunk is not None and self.long_prefill_chunk < 1:
            raise ValueError(f"long_prefill_chunk must be None or >= 1, got {self.long_prefill_chunk}")


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step. n = len(token_ids), B = the cache's block size.

    The backend computes positions [start, start + n): a paged backend writes their KV at pool index
    ``block_table[p // B] * B + p % B`` of each position p and attends over positions [0, start + n),
    which it finds through ``block_table``.
    """

    request_id: int
    token_ids: list[int]  # [n] ids fed this step (n >= 1)
    start: int  # position of token_ids[0]; positions [0, start) already have KV in the cache
    is_prefill_chunk: bool  # computes prompt tokens (or recomputes after preemption); False: a decode
    completes_prompt: bool  # reaches the last known token: its logits are sampled (every decode, last chunk)
    block_table: list[int]  # [>= ceil((start + n) / B)] block ids in token order
    # A decode's speculative draft tokens: the last of ``token_ids``, after the known ones. Each fed token's logits
    # are sampled: draft i is accepted while it equals the token sampled after fed token i.
    num_draft_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def draft_token_ids(self) -> list[int]:
        """[num_draft_tokens] the speculative draft tokens fed after the known ones."""
        return self.token_ids[len(self.token_ids) - self.num_draft_tokens:]

    @property
    def positions(self) -> range:
        """[n] position of each fed token (the RoPE input)."""
        return range(self.start, self.start + len(self.token_ids))


@dataclass
class SchedulerOutput:
    """The contract with the engine: everything one model step needs, as explicit data.

    ``scheduled`` is in scheduling order (running requests oldest first, then newly admitted ones);
    the engine samples one token for each entry with ``completes_prompt`` and passes them to
    ``Scheduler.update``. ``preempted`` requests lost their cache blocks this step (their
    positions must not be read any more); ``finished`` ones ended outside ``update``: rejected by
    ``add``, ended by ``finish`` (aborts, stop strings) since the last step, or too big for the cache.
    A request id appears at most once in ``scheduled``.
    """

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_batched_tokens: int = 0  # sum of n over ``scheduled``, <= max_num_batched_tokens
    preempted: list[int] = field(default_factory=list)  # request ids
    finished: list[int] = field(default_factory=list)  # request ids

    @property
    def num_scheduled_tokens(self) -> dict[int, int]:
        """request id -> tokens computed for it this step."""
        return {s.request_id: s.num_tokens for s in self.scheduled}

    @property
    def is_empty(self) -> bool:
        """Nothing to compute: the engine can skip the model."""
        return not self.scheduled



class Scheduler:
    """FCFS continuous batching over a paged ``KVCacheManager`` (see the module docstring).

    ``requests`` (unfinished requests by id), ``waiting`` (WAITING and PREEMPTED requests, oldest
    first) and ``running`` (sorted by arrival) are for reading only.
    """

    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_manager
        self.requests: dict[int, Request] = {}  # unfinished: exactly the requests in waiting and running
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_outside_update: list[int] = []  # reported by the next ``schedule``
        self._in_flight: SchedulerOutput | None = None  # scheduled, not yet passed to ``update``
        self._next_arrival = 0

    # -- joining and leaving ----------------------------------------------------------------

    def add(self, request: Request) -> None:
        """Queue a new request. One that can never run (empty prompt, prompt + max_tokens over
        ``max_model_len``, prompt + max_tokens - 1 positions beyond the whole cache) finishes at once with
        FINISHED_ERROR and a message, rather than being truncated or blocking the queue."""
        if request.request_id in self.requests:
            raise ValueError(f"request {request.request_id} is already scheduled")
        if request.status is not RequestStatus.WAITING or request.num_computed_tokens or request.output_token_ids:
            raise ValueError(f"request {request.request_id}: add() takes a new WAITING request, "
                             f"got {request.status.name}")
        request.arrival, self._next_arrival = self._next_arrival, self._next_arrival + 1
        error = self._why_never_runs(request)
        if error is not None:
            self._free(request, RequestStatus.FINISHED_ERROR, error)
            self._finished_outside_update.append(request.request_id)
            return
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def _why_never_runs(self, request: Request) -> str | None:
        n, max_tokens = request.num_prompt_tokens, request.params.max_tokens
        if n == 0:
            return f"request {request.request_id}: the prompt is empty"
        if max_tokens < 1:
            return f"request {request.request_id}: max_tokens must be >= 1, got {max_tokens}"
        if n + max_tokens > self.config.max_model_len:
            return (f"request {request.request_id}: prompt ({n} tokens) + max_tokens ({max_tokens}) exceeds "
                    f"max_model_len ({self.config.max_model_len}); shorten the prompt or lower max_tokens")
        # The KV of every token but the last sampled one is written: n + max_tokens - 1 positions.
        if -(-(n + max_tokens - 1) // self.kv.block_size) > self.kv.config.num_blocks:
            return (f"request {request.request_id}: prompt ({n} tokens) + max_tokens ({max_tokens}) "
                    f"{self._too_big_for_cache()}")
        return None

    def _too_big_for_cache(self) -> str:
        return (f"does not fit in the KV cache ({self.kv.config.num_blocks} blocks of "
                f"{self.kv.block_size} tokens); give the engine more blocks (CacheOptions(kv_blocks=...), "
                f"--kv-blocks) or shorten the prompt / lower max_tokens")

    def finish(self, request_id: int, status: RequestStatus, error: str | None = None) -> bool:
        """End an unfinished request now with a finished ``status`` (an abort, an error, a stop string
        the caller found) and free its blocks; the next ``SchedulerOutput.finished`` lists it. False if
        unknown or already finished. A request finished after ``schedule`` is ignored by ``update``."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        self._free(request, status, error)
        self._finished_outside_update.append(request_id)
        return True

    def abort(self, request_id: int) -> bool:
        """``finish`` with FINISHED_ABORTED."""
        return self.finish(request_id, RequestStatus.FINISHED_ABORTED)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- one step -------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Pick this step's tokens (see the module docstring for the policy)."""
        if self._in_flight is not None:
            raise RuntimeError("schedule() called again before update() got the previous output")
        out = SchedulerOutput(finished=self._finished_outside_update)
        self._finished_outside_update = []
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:  # a request admitted now would only take blocks a running one needs
            budget = self._schedule_waiting(out, budget)
        out.num_batched_tokens = self.config.max_num_batched_tokens - budget
        self._in_flight = out if out.scheduled else None
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Decodes and prefill chunks of RUNNING requests, oldest first, preempting the newest
        when the cache is full. Returns the budget left."""
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = self._num_new_tokens(request, budget)
            # Room for the tokens computed this step. More than num_new after a step that accepted draft tokens:
            # their KV is already written, and the cache manager learns their token ids now.
            room = request.num_computed_tokens + num_new - self.kv.num_allocated_tokens(request.request_id)
            drafts = self._drafts(request, num_new, budget)
            if drafts and not self.kv.can_append(request.request_id, room, len(drafts)):
                drafts = []  # speculation never preempts anyone
            while not self.kv.can_append(request.request_id, room):
                if len(self.running) == 1:
                    # Alone, every block is free (or a prefix-cache entry it may evict): it never fits.
                    self._free(request, RequestStatus.FINISHED_ERROR,
                               f"request {request.request_id} at {request.num_tokens} tokens "
                               f"{self._too_big_for_cache()}")
                    out.finished.append(request.request_id)
                    break
                # Newest first; never one already scheduled this step (those are running[:i]).
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                if victim is request:
                    break
            else:
                # The cache manager learns a sampled token when the decode that feeds it is scheduled,
                # so it lags by at most that one token: [] or [last sample].
                new_token_ids = request.token_ids(self.kv.num_known_tokens(request.request_id))
                self.kv.append(request.request_id, room, new_token_ids, len(drafts))
                out.scheduled.append(self._scheduled(request, num_new, is_prefill=not new_token_ids, drafts=drafts))
                budget -= num_new + len(drafts)
                i += 1
            # else: running[i] left the list (preempted or finished), so i already names the next one
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> int:
        """Admit WAITING/PREEMPTED requests in queue order with their first prefill chunk.
        Returns the budget left."""
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            token_ids = request.all_token_ids  # a preempted request recomputes its output tokens too
            chunk = self._chunk(budget)
            if not self.kv.can_allocate(request.request_id, token_ids, chunk):
                if self.running:
                    break  # wait for running requests to free blocks; FCFS: nobody overtakes
                # An empty cache cannot hold its first chunk: it never will.
                self._free(request, RequestStatus.FINISHED_ERROR,
                           f"request {request.request_id} at {request.num_tokens} tokens {self._too_big_for_cache()}")
                out.finished.append(request.request_id)
                continue
            self.waiting.popleft()
            cached = self.kv.allocate(request.request_id, token_ids, chunk)  # prefix-cache hits cost no budget
            request.num_computed_tokens = request.num_cached_tokens = cached
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=lambda r: r.arrival)
            num_new = self.kv.num_allocated_tokens(request.request_id) - cached
            out.scheduled.append(self._scheduled(request, num_new, is_prefill=True))
            budget -= num_new
        return budget

    def update(self, output: SchedulerOutput, sampled: Mapping[int, int | Sequence[int]]) -> list[Request]:
        """Record a computed step: advance ``num_computed_tokens``, append the sampled token of
        each ``completes_prompt`` entry (``sampled[request_id]``; other entries' tokens are
        ignored), and finish on a stop token or at ``max_tokens``. Returns the requests finished.

        An entry with draft tokens takes a sequence: the drafts its verification accepted (a prefix of
        ``draft_token_ids``), then the token sampled after them. They are appended in order up to the
        first stop token or ``max_tokens``; the KV of the rejected drafts is dropped (``num_computed_tokens``
        counts only the fed tokens before them).

        Stop tokens are ``params.stop_token_ids`` (kept in the output); the engine puts EOS there
        unless ``ignore_eos``, and handles ``stop_strings``, which need the detokenizer.
        """
        if output.scheduled and output is not self._in_flight:
            raise ValueError("update() takes the output of the latest schedule(), once")
        # Requests finished after ``schedule`` are skipped (a request id may even be back, WAITING).
        live = [(item, request) for item in output.scheduled
                if (request := self.requests.get(item.request_id)) is not None
                and request.status is RequestStatus.RUNNING]
        # Check before changing anything, so that a failed call can be retried with the tokens.
        tokens_of: dict[int, list[int]] = {}
        for item, _ in live:
            if not item.completes_prompt:
                continue
            if item.request_id not in sampled:
                raise ValueError(f"request {item.request_id} completed its prompt but has no sampled token")
            got = sampled[item.request_id]
            tokens = list(got) if isinstance(got, Sequence) else [got]
            accepted = tokens[:-1]
            if not tokens or accepted != item.draft_token_ids[:len(accepted)]:  # also refuses more than the drafts
                raise ValueError(f"request {item.request_id}: sampled {tokens} is not accepted draft tokens (a prefix "
                                 f"of {item.draft_token_ids}) followed by one sampled token")
            tokens_of[item.request_id] = tokens
        self._in_flight = None
        self.kv.commit_step()  # the step's KV is written: its full blocks' prefix-cache keys are valid
        finished: list[Request] = []
        for item, request in live:
            if not item.completes_prompt:
                request.num_computed_tokens += item.num_tokens
                continue
            tokens = tokens_of[item.request_id]
            # The fed tokens whose KV stays: all but the rejected drafts.
            request.num_computed_tokens += item.num_tokens - item.num_draft_tokens + len(tokens) - 1
            for token in tokens:
                request.output_token_ids.append(token)
                if token in request.params.stop_token_ids:
                    self._free(request, RequestStatus.FINISHED_STOPPED)
                elif request.num_output_tokens >= request.params.max_tokens:
                    self._free(request, RequestStatus.FINISHED_LENGTH)
                else:
                    continue
                finished.append(request)
                break
        return finished

    def fail(self, output: SchedulerOutput, error: str) -> list[Request]:
        """The model step of ``output`` (the latest ``schedule()``) raised: finish every request it
        scheduled with FINISHED_ERROR and ``error`` (their KV is in an unknown state), drop the
        prefix-cache keys the step registered (their blocks may hold no KV), and accept a new
        ``schedule()``. Other requests are untouched. Returns the requests finished."""
        if output.scheduled and output is not self._in_flight:
            raise ValueError("fail() takes the output of the latest schedule(), once")
        self._in_flight = None
        finished = []
        for item in output.scheduled:
            request = self.requests.get(item.request_id)
            if request is not None and request.status is RequestStatus.RUNNING:
                self._free(request, RequestStatus.FINISHED_ERROR, f"request {request.request_id}: {error}")
                finished.append(request)
        self.kv.rollback_step()  # after the frees: the blocks become plain free blocks
        return finished

    # -- helpers --------------------------------------------------------------------------

    def _chunk(self, budget: int) -> int:
        """Most tokens one request's prefill may take this step."""
        chunk = self.config.long_prefill_chunk
        return budget if chunk is None else min(budget, chunk)

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        return min(request.num_uncomputed_tokens, self._chunk(budget))  # a decode has 1 uncomputed token

    def _drafts(self, request: Request, num_new: int, budget: int) -> list[int]:
        """The draft tokens a decode of ``request`` feeds: its ``spec_token_ids``, within the budget left after its
        ``num_new`` tokens and short of ``max_tokens`` (a run yields at most one token more than its drafts, so a
        draft past that could only be wasted; this also keeps every position inside ``max_model_len``)."""
        if not request.spec_token_ids or num_new != request.num_uncomputed_tokens or num_new != 1:
            return []
        limit = min(budget - num_new, request.params.max_tokens - request.num_output_tokens - 1)
        return request.spec_token_ids[:max(limit, 0)]

    def _scheduled(self, request: Request, num_new: int, *, is_prefill: bool,
                   drafts: Sequence[int] = ()) -> ScheduledRequest:
        start = request.num_computed_tokens
        end = start + num_new
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=[*request.token_ids(start, end), *drafts],
            start=start,
            is_prefill_chunk=is_prefill,
            completes_prompt=end == request.num_tokens,
            block_table=self.kv.block_table(request.request_id),
            num_draft_tokens=len(drafts),
        )

    def _preempt(self, request: Request) -> None:
        """Recompute preemption: drop the blocks, keep every token, requeue at the front. The
        victim is the newest running request, and admission is strictly in queue order, so it is
        older than everything waiting: the queue stays in arrival order."""
        self.running.remove(request)
        self.kv.preempt(request.request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)

    def _free(self, request: Request, status: RequestStatus, error: str | None = None) -> None:
        """Finish a request wherever it is (vLLM v1's ``_free_request``): leave its queue and
        ``requests``, free its blocks, set the finished ``status`` and ``error``."""
        if not status.is_finished:
            raise ValueError(f"request {request.request_id}: {status.name} is not a finished status")
        if self.requests.pop(request.request_id, None) is not None:  # not yet queued when ``add`` rejects it
            if request.status is RequestStatus.RUNNING:
                self.running.remove(request)
                self.kv.free(request.request_id)
            else:
                self.waiting.remove(request)
        request.status, request.error = status, error
