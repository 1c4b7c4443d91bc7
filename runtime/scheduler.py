"""Scheduler: which tokens of which sequences the next model step computes (continuous batching).

Each ``schedule()`` builds one step under a token budget (``max_num_batched_tokens``): a decode
costs 1 token, a prefill chunk its length. Sequences join (``add``) and leave (finish, ``abort``)
between steps. The step is described by a ``SchedulerOutput`` -- token ids, positions and block
tables as plain lists -- which the engine turns into backend inputs; the engine then samples and
hands the new tokens back through ``update()``. So one engine step is::

    output = scheduler.schedule()
    sampled = run_model_and_sample(output)      # {request_id: token} for completes_prompt rows
    finished = scheduler.update(output, sampled)
    # or, when the model step raised: finished = scheduler.fail(output, "why")

Policy (vLLM v1 style, first come first served by arrival order):

1. RUNNING sequences first, oldest first: a decode, or the next prefill chunk. When the cache has
   no room for one, the newest running sequence is preempted by recompute (blocks freed,
   ``num_computed_tokens`` reset to 0, back to the front of the waiting queue) and the append is
   retried; the newest may be the sequence itself. The oldest running sequence is never preempted,
   so it always progresses: no deadlock. A sequence that cannot get blocks while running alone
   never will, and finishes with FINISHED_ERROR.
2. Then WAITING sequences, oldest first, while the budget, ``max_num_seqs`` and the cache allow; the
   first one that does not fit stops admission (no overtaking), or finishes with FINISHED_ERROR if
   nothing is running (an empty cache cannot hold it). A step that had to preempt admits nobody:
   the preempted sequence would only be admitted to be preempted again.

A prefill is chunked by the budget left and by ``long_prefill_chunk``, so a long prompt cannot
hold decodes back for a whole step. Prefix-cache hits (``KVCacheManager.allocate``'s return) are
skipped: they cost neither budget nor compute.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from moeforge.runtime.kv_cache import KVCacheManager
from moeforge.runtime.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one step and of one sequence."""

    max_num_seqs: int = 64  # RUNNING sequences (those holding cache blocks) at most
    max_num_batched_tokens: int = 2048  # token budget per step, decodes and prefill chunks together
    long_prefill_chunk: int | None = None  # most prefill tokens of one sequence per step; None: budget only
    max_model_len: int = 4096  # prompt + max_tokens at most

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.long_prefill_chunk is not None and self.long_prefill_chunk < 1:
            raise ValueError(f"long_prefill_chunk must be None or >= 1, got {self.long_prefill_chunk}")


@dataclass(frozen=True)
class ScheduledSequence:
    """One sequence's share of a step. n = len(token_ids), B = the cache's block size.

    The backend computes positions [start, start + n): it writes their KV to slot
    ``block_table[p // B] * B + p % B`` of each position p and attends over positions [0, start + n),
    which it finds through ``block_table``.
    """

    request_id: int
    token_ids: list[int]  # [n] ids fed this step (n >= 1)
    start: int  # position of token_ids[0]; positions [0, start) already have KV in the cache
    is_prefill_chunk: bool  # computes prompt tokens (or recomputes after preemption); False: a decode
    completes_prompt: bool  # reaches the last known token: its logits are sampled (every decode, last chunk)
    block_table: list[int]  # [ceil((start + n) / B)] block ids in token order

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def positions(self) -> range:
        """[n] position of each fed token (the RoPE input)."""
        return range(self.start, self.start + len(self.token_ids))


@dataclass
class SchedulerOutput:
    """The contract with the engine: everything one model step needs, as explicit data.

    ``scheduled`` is in scheduling order (running sequences oldest first, then newly admitted ones);
    the engine samples one token for each entry with ``completes_prompt`` and passes them to
    ``Scheduler.update``. ``preempted`` sequences lost their cache blocks this step (their
    positions must not be read any more); ``finished`` ones ended outside ``update``: rejected by
    ``add``, aborted, or too big for the cache. A request id appears at most once in ``scheduled``.
    """

    scheduled: list[ScheduledSequence] = field(default_factory=list)
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

    ``waiting`` (WAITING and PREEMPTED sequences, oldest first) and ``running`` (sorted by arrival)
    are for reading only. Finished sequences are dropped; the caller keeps its ``Sequence`` objects.
    """

    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._seqs: dict[int, Sequence] = {}  # unfinished sequences by request id
        # How many of a sequence's tokens the cache manager has been told. It lags by one after a
        # sample: the new token is passed to ``append_slots`` when the decode that feeds it is scheduled.
        self._kv_num_tokens: dict[int, int] = {}
        self._finished_outside_update: list[int] = []  # reported by the next ``schedule``
        self._in_flight: SchedulerOutput | None = None  # scheduled, not yet passed to ``update``
        self._next_arrival = 0

    # -- joining and leaving ----------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence. One that can never run (empty prompt, prompt + max_tokens over
        ``max_model_len``, a prompt larger than the whole cache) finishes at once with
        FINISHED_ERROR and a message, rather than being truncated or blocking the queue."""
        if seq.request_id in self._seqs:
            raise ValueError(f"request {seq.request_id} is already scheduled")
        if seq.status is not SequenceStatus.WAITING or seq.num_computed_tokens or seq.output_token_ids:
            raise ValueError(f"request {seq.request_id}: add() takes a new WAITING sequence, got {seq.status.name}")
        seq.arrival, self._next_arrival = self._next_arrival, self._next_arrival + 1
        error = self._why_never_runs(seq)
        if error is not None:
            seq.finish(SequenceStatus.FINISHED_ERROR, error)
            self._finished_outside_update.append(seq.request_id)
            return
        self._seqs[seq.request_id] = seq
        self.waiting.append(seq)

    def _why_never_runs(self, seq: Sequence) -> str | None:
        n, max_tokens = seq.num_prompt_tokens, seq.params.max_tokens
        if n == 0:
            return f"request {seq.request_id}: the prompt is empty"
        if max_tokens < 1:
            return f"request {seq.request_id}: max_tokens must be >= 1, got {max_tokens}"
        if n + max_tokens > self.config.max_model_len:
            return (f"request {seq.request_id}: prompt ({n} tokens) + max_tokens ({max_tokens}) exceeds "
                    f"max_model_len ({self.config.max_model_len}); shorten the prompt or lower max_tokens")
        if -(-n // self.kv.block_size) > self.kv.config.num_blocks:
            return f"request {seq.request_id}: the prompt ({n} tokens) {self._too_big_for_cache()}"
        return None

    def _too_big_for_cache(self) -> str:
        return (f"does not fit in the KV cache ({self.kv.config.num_blocks} blocks of "
                f"{self.kv.block_size} tokens); give the engine more blocks (EngineConfig(kv_blocks=...)) "
                f"or shorten the prompt / lower max_tokens")

    def abort(self, request_id: int) -> bool:
        """Finish an unfinished request with FINISHED_ABORTED and free its blocks; False if unknown
        or already finished. A sequence aborted after ``schedule`` is ignored by ``update``."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return False
        self._finish(seq, SequenceStatus.FINISHED_ABORTED)
        self._finished_outside_update.append(request_id)
        return True

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    # -- one step -------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Pick this step's tokens (see the module docstring for the policy)."""
        if self._in_flight is not None:
            raise RuntimeError("schedule() called again before update() got the previous output")
        out = SchedulerOutput(finished=self._finished_outside_update)
        self._finished_outside_update = []
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:  # a sequence admitted now would only take blocks a running one needs
            budget = self._schedule_waiting(out, budget)
        out.num_batched_tokens = self.config.max_num_batched_tokens - budget
        self._in_flight = out if out.scheduled else None
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Decodes and prefill chunks of RUNNING sequences, oldest first, preempting the newest
        when the cache is full. Returns the budget left."""
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = self._num_new_tokens(seq, budget)
            while not self.kv.can_append(seq.request_id, num_new):
                if len(self.running) == 1:
                    # Alone, every block is free (or a prefix-cache entry it may evict): it never fits.
                    self._finish(seq, SequenceStatus.FINISHED_ERROR,
                                 f"request {seq.request_id} at {seq.num_tokens} tokens {self._too_big_for_cache()}")
                    out.finished.append(seq.request_id)
                    break
                # Newest first; never one already scheduled this step (those are running[:i]).
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                if victim is seq:
                    break
            else:
                new_token_ids = seq.all_token_ids[self._kv_num_tokens[seq.request_id]:]  # [] or [last sample]
                self.kv.append_slots(seq.request_id, num_new, new_token_ids)
                self._kv_num_tokens[seq.request_id] = seq.num_tokens
                out.scheduled.append(self._scheduled(seq, num_new, is_prefill=not new_token_ids))
                budget -= num_new
                i += 1
            # else: running[i] left the list (preempted or finished), so i already names the next one
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> int:
        """Admit WAITING/PREEMPTED sequences in queue order with their first prefill chunk.
        Returns the budget left."""
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            token_ids = seq.all_token_ids  # a preempted sequence recomputes its output tokens too
            chunk = self._chunk(budget)
            if not self.kv.can_allocate(seq.request_id, token_ids, chunk):
                if self.running:
                    break  # wait for running sequences to free blocks; FCFS: nobody overtakes
                # An empty cache cannot hold its first chunk: it never will.
                self._finish(seq, SequenceStatus.FINISHED_ERROR,
                             f"request {seq.request_id} at {seq.num_tokens} tokens {self._too_big_for_cache()}")
                out.finished.append(seq.request_id)
                continue
            self.waiting.popleft()
            cached = self.kv.allocate(seq.request_id, token_ids, chunk)  # prefix-cache hits cost no budget
            self._kv_num_tokens[seq.request_id] = len(token_ids)
            seq.num_computed_tokens = seq.num_cached_tokens = cached
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=lambda s: s.arrival)
            num_new = self.kv.num_slots(seq.request_id) - cached
            out.scheduled.append(self._scheduled(seq, num_new, is_prefill=True))
            budget -= num_new
        return budget

    def update(self, output: SchedulerOutput, sampled: dict[int, int]) -> list[Sequence]:
        """Record a computed step: advance ``num_computed_tokens``, append the sampled token of
        each ``completes_prompt`` entry (``sampled[request_id]``; other entries' tokens are
        ignored), and finish on a stop token or at ``max_tokens``. Returns the sequences finished.

        Stop tokens are ``params.stop_token_ids`` (kept in the output); the engine puts EOS there
        unless ``ignore_eos``, and handles ``stop_strings``, which need the detokenizer.
        """
        if output.scheduled and output is not self._in_flight:
            raise ValueError("update() takes the output of the latest schedule(), once")
        # Sequences aborted after ``schedule`` are skipped (a request id may even be back, WAITING).
        live = [(item, seq) for item in output.scheduled
                if (seq := self._seqs.get(item.request_id)) is not None and seq.status is SequenceStatus.RUNNING]
        # Check before changing anything, so that a failed call can be retried with the tokens.
        for item, _ in live:
            if item.completes_prompt and item.request_id not in sampled:
                raise ValueError(f"request {item.request_id} completed its prompt but has no sampled token")
        self._in_flight = None
        self.kv.commit_step()  # the step's KV is written: its full blocks' prefix-cache keys are valid
        finished: list[Sequence] = []
        for item, seq in live:
            seq.num_computed_tokens += item.num_tokens
            if not item.completes_prompt:
                continue
            token = sampled[item.request_id]
            seq.output_token_ids.append(token)
            if token in seq.params.stop_token_ids:
                self._finish(seq, SequenceStatus.FINISHED_STOPPED)
            elif seq.num_output_tokens >= seq.params.max_tokens:
                self._finish(seq, SequenceStatus.FINISHED_LENGTH)
            else:
                continue
            finished.append(seq)
        return finished

    def fail(self, output: SchedulerOutput, error: str) -> list[Sequence]:
        """The model step of ``output`` (the latest ``schedule()``) raised: finish every sequence it
        scheduled with FINISHED_ERROR and ``error`` (their KV is in an unknown state), drop the
        prefix-cache keys the step registered (their blocks may hold no KV), and accept a new
        ``schedule()``. Other sequences are untouched. Returns the sequences finished."""
        if output.scheduled and output is not self._in_flight:
            raise ValueError("fail() takes the output of the latest schedule(), once")
        self._in_flight = None
        finished = []
        for item in output.scheduled:
            seq = self._seqs.get(item.request_id)
            if seq is not None and seq.status is SequenceStatus.RUNNING:
                self._finish(seq, SequenceStatus.FINISHED_ERROR, f"request {seq.request_id}: {error}")
                finished.append(seq)
        self.kv.rollback_step()  # after the frees: the blocks become plain free blocks
        return finished

    # -- helpers --------------------------------------------------------------------------

    def _chunk(self, budget: int) -> int:
        """Most tokens one sequence's prefill may take this step."""
        chunk = self.config.long_prefill_chunk
        return budget if chunk is None else min(budget, chunk)

    def _num_new_tokens(self, seq: Sequence, budget: int) -> int:
        return min(seq.num_uncomputed_tokens, self._chunk(budget))  # a decode has 1 uncomputed token

    def _scheduled(self, seq: Sequence, num_new: int, *, is_prefill: bool) -> ScheduledSequence:
        start = seq.num_computed_tokens
        end = start + num_new
        return ScheduledSequence(
            request_id=seq.request_id,
            token_ids=seq.all_token_ids[start:end],
            start=start,
            is_prefill_chunk=is_prefill,
            completes_prompt=end == seq.num_tokens,
            block_table=self.kv.block_table(seq.request_id),
        )

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop the blocks, keep every token, requeue at the front. The
        victim is the newest running sequence, and admission is strictly in queue order, so it is
        older than everything waiting: the queue stays in arrival order."""
        self.running.remove(seq)
        self.kv.preempt(seq.request_id)
        del self._kv_num_tokens[seq.request_id]
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.PREEMPTED
        self.waiting.appendleft(seq)

    def _finish(self, seq: Sequence, status: SequenceStatus, error: str | None = None) -> None:
        """Finish a tracked sequence wherever it is, freeing its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.kv.free(seq.request_id)
            del self._kv_num_tokens[seq.request_id]
        else:
            self.waiting.remove(seq)
        del self._seqs[seq.request_id]
        seq.finish(status, error)
