"""LLMEngine: the decode loop over an artifact. One step is schedule -> execute -> sample -> update.

The scheduler decides which tokens of which requests run (continuous batching, chunked prefill,
preemption) and alone changes a request's status; the backend runs them on its cache slots (one
row per running request) and returns each row's last logits; the sampler picks tokens; the
scheduler records them. The engine owns the slots, stop strings (they need the tokenizer) and
metrics. With ``SpeculativeOptions.tokens`` it also drafts each greedy request's next tokens after a
step (moeforge/runtime/speculative.py); the next decode feeds them, and sampling verifies them (``_verify``). A
request with ``SamplingParams.structured_output`` is decoded under its grammar (moeforge/runtime/grammar.py): its
token mask is computed on a thread while the backend runs the step, the sampler applies it to its row, and the
request stops as soon as its output is a complete match.

Per-request state lives on one ``Request`` (moeforge/runtime/request.py). The engine holds each in
``requests`` from ``add_request`` until its final output has been returned, then drops it; the
scheduler indexes only the unfinished ones and drops a request the moment it finishes. The engine
keeps its own map because a request must outlive the scheduler's: an aborted or rejected request
is reported by the next ``step``, after the scheduler has let it go.

A bad request fails alone: it is rejected with a clear error (or finished with one) and the engine
keeps serving the others; ``generate`` checks every prompt of its batch before it queues any. A step
whose backend call (or sampling) raises fails alone too: the requests it scheduled finish with
``finish_reason="error"`` and the exception's message, the prefix-cache keys it registered are
dropped, and the next steps serve the other and new requests as usual. ``from_artifact`` refuses a
configuration whose caches cannot fit in host memory before allocating them.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from moeforge.core.artifact import Artifact, artifact_digest, load_artifact
from moeforge.core.errors import MoeforgeError, TokenizerError
from moeforge.core.manifest import Manifest
from moeforge.model.tokenizer import Tokenizer
from moeforge.runtime.backends.base import (
    ArgmaxHeadStats,
    Backend,
    BackendOptions,
    ExpertActivity,
    FatalBackendError,
    RowInput,
    StepInput,
    block_io_of,
)
from moeforge.runtime.backends.registry import backend_for, open_backend
from moeforge.runtime.engine_config import (
    CacheOptions,
    EngineConfig,
    EngineConfigError,
    SchedulingOptions,
    SpeculativeOptions,
    check_host_memory,
)
from moeforge.runtime.grammar import GrammarCompiler, GrammarState
from moeforge.runtime.kv_cache_manager import KVCacheConfig, KVCacheManager
from moeforge.runtime.kv_tiers.tiers import KVTiers
from moeforge.runtime.output_text import OutputText
from moeforge.runtime.outputs import EngineMetrics, EngineStats, RequestOutput
from moeforge.runtime.request import Request, RequestStatus, check_room, prompt_token_ids
from moeforge.runtime.request import RequestError as RequestError  # re-exported: raised by add_request
from moeforge.runtime.sampler import Sampler, SamplingParams
from moeforge.runtime.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from moeforge.runtime.speculative import Drafter

# The engine's public API, with the parts of its config (runtime/engine_config.py) and the backend options
# (runtime/backends/base.py) re-exported, so that one import serves a user.
__all__ = ["BackendOptions", "CacheOptions", "EngineConfig", "EngineConfigError", "EngineMetrics", "EngineStats",
           "LLMEngine", "RequestError", "RequestOutput", "SchedulingOptions", "SpeculativeOptions",
           "check_host_memory", "engine_sizes", "open_engine_backend"]

log = logging.getLogger(__name__)

DEFAULT_PARAMS = SamplingParams()


class LLMEngine:
    """Serve generation requests on one backend (``from_artifact`` builds the ONNX Runtime one)."""

    def __init__(self, backend: Backend, *, tokenizer: Tokenizer | None = None, eos_token_ids: Sequence[int] = (),
                 config: EngineConfig | None = None, artifact_id: str | None = None) -> None:
        """``artifact_id``: the artifact's digest (``core/artifact.artifact_digest``), which keys a disk KV tier's
        files so that no other artifact's blocks are ever loaded; ``from_artifact`` gives it."""
        config = config or EngineConfig()
        if config.speculative.tokens and not getattr(backend, "multi_logit_rows", False):
            raise EngineConfigError(f"SpeculativeOptions(tokens={config.speculative.tokens}): the "
                                    f"{type(backend).__name__} cannot verify draft tokens (it returns one row of "
                                    "logits per sequence, or its cache cannot drop rejected drafts: DeepSeek-V4's "
                                    "rings); set tokens=0")
        self.backend = backend
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        self.config = config
        # A paged backend (block pools) has its own block size and pool; its blocks ARE the manager's
        # blocks, so prefix-cache hits are shared physically. Contiguous-slot artifacts cannot share a
        # cached prefix, so prefix caching is off for them.
        pool = backend.kv_pool
        # Requests that may run with drafts at once (SpeculativeOptions.max_batch, or the backend's default).
        self.speculative_max_batch = config.speculative.max_batch or (1 if pool is None else backend.num_slots)
        if pool is not None:
            config.cache.check_block_size(pool.block_size)
            if config.cache.kv_blocks is not None and config.cache.kv_blocks != pool.num_blocks:
                raise EngineConfigError(f"CacheOptions(kv_blocks={config.cache.kv_blocks}) differs from the backend's "
                                        f"pool of {pool.num_blocks} blocks")
            block_size, num_blocks = pool.block_size, pool.num_blocks
        else:
            block_size = config.cache.block_size or 16
            # Blocks beyond what the slots can hold could never be used; capping them keeps a huge kv_blocks
            # from costing the block pool's bookkeeping (one object per block).
            slots_blocks = backend.num_slots * -(-backend.max_seq_len // block_size)
            wanted = config.cache.num_kv_blocks(backend.num_slots, backend.max_seq_len, block_size)
            num_blocks = min(wanted, slots_blocks)
        self.tiers = _open_tiers(backend, config.cache, artifact_id)
        self.kv = KVCacheManager(KVCacheConfig(num_blocks, block_size, enable_prefix_caching=pool is not None),
                                 self.tiers)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=min(config.scheduling.max_num_seqs, backend.num_slots),
            max_num_batched_tokens=config.scheduling.max_num_batched_tokens,
            long_prefill_chunk=config.scheduling.long_prefill_chunk, max_model_len=backend.max_seq_len,
        ), self.kv)
        self.sampler = Sampler()
        # Constrained decoding (SamplingParams.structured_output): specs compiled against the tokenizer, and one
        # thread that computes a step's token masks while the backend runs it.
        self.grammars = GrammarCompiler(tokenizer, backend.vocab_size) if tokenizer is not None else None
        self._mask_thread: ThreadPoolExecutor | None = None
        self.metrics = EngineMetrics()
        self._ids = itertools.count()
        self.requests: dict[int, Request] = {}  # added, final output not returned yet (read-only outside)
        self._free_slots = list(range(backend.num_slots))  # a heap: the lowest free slot first
        # Outputs of other requests that generate() / stream() stepped past: the next step() returns them first.
        self._held: list[RequestOutput] = []

    @classmethod
    def from_artifact(cls, path: str | Path, config: EngineConfig | None = None,
                      backend: Backend | None = None) -> LLMEngine:
        """Open an artifact directory (hashes verified) on the backend its manifest's target names
        (``runtime/backends/registry.py``; ONNX Runtime on CPU by default). Raises
        ``EngineConfigError`` before allocating anything when ``config`` needs more host memory than is
        available (see ``check_host_memory``). ``backend``: one already opened on this artifact (a sharded
        artifact's ``ShardedBackend``, with ``path`` its rank 0): only the tokenizer is read here."""
        config = config or EngineConfig()
        artifact = load_artifact(path)
        if backend is None:
            backend = open_engine_backend(artifact, config)
        tokenizer, eos = _tokenizer_and_eos(artifact)
        return cls(backend, tokenizer=tokenizer, eos_token_ids=eos, config=config,
                   artifact_id=artifact_digest(artifact.root) if config.cache.disk_dir is not None else None)

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt: str | Sequence[int], params: SamplingParams = DEFAULT_PARAMS) -> int:
        """Queue a request; returns its id. Raises ``RequestError`` or ``SamplingParamsError`` (nothing queued)
        for bad input."""
        ids, params = self._check_request(prompt, params)
        return self._queue(ids, params)

    def tokenize(self, prompt: str) -> list[int]:
        """A text prompt's token ids, the one way every caller (``add_request``, the server) encodes one: refused
        with ``RequestError`` without a tokenizer, or when it is longer than the model's context (never truncated).
        Reads only the tokenizer, so any thread may call it."""
        if self.tokenizer is None:
            raise RequestError("this artifact has no tokenizer: pass prompt token ids")
        try:
            return self.tokenizer.encode(prompt, max_tokens=self.max_model_len)
        except TokenizerError as exc:
            raise RequestError(f"the prompt: {exc}") from None

    def _check_request(self, prompt: object, params: object) -> tuple[list[int], SamplingParams]:
        """The prompt's token ids and the params to run with, or the error a bad request raises."""
        if not isinstance(params, SamplingParams):
            raise RequestError(f"params must be a SamplingParams, got {type(params).__name__}")
        params.validate(self.backend.vocab_size)
        if isinstance(prompt, str):
            ids = prompt_token_ids(self.tokenize(prompt), self.backend.vocab_size)
        else:
            ids = prompt_token_ids(prompt, self.backend.vocab_size)
        check_room(len(ids), params.max_tokens, self.backend.max_seq_len, "the artifact's max_seq_len")
        if params.structured_output is not None:
            if self.grammars is None:
                raise RequestError("structured output needs the artifact's tokenizer, and this artifact has none",
                                   param="response_format")
            self.grammars.compile(params.structured_output)  # StructuredOutputError: the spec cannot be used
        if not params.ignore_eos and self.eos_token_ids:
            params = dataclasses.replace(params, stop_token_ids=tuple({*params.stop_token_ids, *self.eos_token_ids}))
        return ids, params

    def _queue(self, ids: list[int], params: SamplingParams) -> int:
        request = Request(next(self._ids), ids, params)
        if self.tokenizer is not None:
            request.text = OutputText(self.tokenizer, params.stop_strings)
        if params.structured_output is not None and self.grammars is not None:
            request.grammar = self.grammars.new_state(params.structured_output)
        self.requests[request.request_id] = request
        self.scheduler.add(request)
        self.kv.prefetch(ids)  # its prefix blocks below the pool start loading before its turn
        return request.request_id

    def abort(self, request_id: int) -> None:
        """Stop a request; its cache slot and blocks are freed, the next ``step`` returns its final output."""
        if self.scheduler.abort(request_id):
            self._release_slot(self.requests[request_id])

    def has_unfinished(self) -> bool:
        """Whether some request's final output has not been returned yet (call ``step``)."""
        return bool(self.requests) or bool(self._held)

    def stats(self) -> EngineStats:
        """A snapshot of the engine's state and totals (copied: later steps do not change it)."""
        return EngineStats(running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
                           max_num_seqs=self.scheduler.config.max_num_seqs, num_blocks=self.kv.config.num_blocks,
                           kv=self.kv.stats(), totals=dataclasses.replace(self.metrics),
                           argmax_head=self.argmax_head_stats(),
                           kv_tiers=self.tiers.stats() if self.tiers is not None else None)

    def shutdown(self) -> int:
        """End of service: write every cached KV block to the disk tier (when there is one), so the next process
        serving this artifact starts with its prefixes, and stop the tiers' threads. Returns the blocks written.
        Call it between steps; the engine can still step afterwards, without tiers' background work."""
        if self.tiers is None:
            return 0
        try:
            return self.kv.flush_tiers()
        finally:
            self.tiers.close()

    def attention_time_share(self) -> float | None:
        """Fraction of backend compute spent in attention kernels so far, when the backend can tell
        (ONNX Runtime with ``EngineConfig(backend=BackendOptions(profile=True))``); None otherwise. Ends profiling."""
        shares = self.backend.op_time_shares()
        if shares is None:
            return None
        return sum(share for op, share in shares.items() if "Attention" in op)

    def expert_load(self) -> np.ndarray | None:
        """Tokens routed to each expert of each MoE layer so far, [L_moe, E] int64 (prompt and generated tokens
        the model ran, recomputed ones again), when the backend tracks them (``BackendOptions(track_expert_load=True)``
        on a MoE artifact); None otherwise."""
        counter = getattr(self.backend, "expert_load", None)
        return counter() if counter is not None else None

    def expert_activity(self) -> ExpertActivity | None:
        """Distinct experts computed per MoE layer, summed over the model runs so far, and the run count
        (``ExpertActivity``), when the backend tracks expert load; None otherwise. What a step's sparse MoE kernels
        read: the memory roofline's active-expert bytes (``moeforge bench --roofline``)."""
        counter = getattr(self.backend, "expert_activity", None)
        return counter() if counter is not None else None

    def rank_expert_load(self) -> np.ndarray | None:
        """Expert computations (token x expert) each rank of a sharded artifact ran so far, [L_moe, N] (its max / mean
        per layer is the expert-parallel imbalance), when the backend tracks expert load; None otherwise (one rank)."""
        counter = getattr(self.backend, "rank_expert_load", None)
        return counter() if counter is not None else None

    def rank_expert_activity(self) -> list[ExpertActivity] | None:
        """Each rank's ``ExpertActivity`` so far (a sharded artifact's ranks, in rank order: the distinct experts of
        its own each computed), when the backend gathers them; None otherwise (one rank, a pipeline)."""
        counter = getattr(self.backend, "rank_expert_activity", None)
        return counter() if counter is not None else None

    def argmax_head_stats(self) -> ArgmaxHeadStats | None:
        """Runs of the certified argmax head so far (greedy steps fed ``argmax_only``, and those repeated on the
        float head), when the backend's artifact has one (moeforge/passes/argmax_head.py); None otherwise."""
        stats = getattr(self.backend, "argmax_head_stats", None)
        return stats() if stats is not None else None

    @property
    def max_model_len(self) -> int:
        """The longest prompt + max_tokens one request can have: the artifact's max_seq_len, or less when the
        KV cache holds fewer tokens (``kv_blocks``; the last sampled token needs no cache)."""
        return min(self.backend.max_seq_len, self.kv.config.num_blocks * self.kv.block_size + 1)

    @property
    def kv_blocks_in_use(self) -> int:
        """KV-cache blocks held by running requests now."""
        return self.kv.stats().blocks_in_use

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; return the outputs of requests that advanced or finished (after any that
        ``generate`` / ``stream`` stepped past for other callers). A finished request's output is its last one:
        the engine then forgets it."""
        plan = self.scheduler.schedule()
        for request_id in plan.preempted:
            self._release_slot(self.requests[request_id])
            self.metrics.preemptions += 1
        # ``finished`` may name a request that a stop string ended last step: its final output went out then.
        ended = [self.requests[i] for i in plan.finished if i in self.requests]
        for request in ended:
            self._release_slot(request)
        try:
            sampled, logprobs = self._execute(plan) if plan.scheduled else ({}, {})
        except FatalBackendError:  # the backend itself is gone (a sharded rank died): nothing more can run
            raise
        except Exception as exc:  # any failure of the model step: fail its requests, keep serving
            log.exception("engine step failed; its %d requests finish with an error", len(plan.scheduled))
            self.metrics.failed_steps += 1
            sampled, logprobs = {}, {}
            done = self.scheduler.fail(plan, f"the model step failed ({type(exc).__name__}: {exc})")
        else:
            done = self.scheduler.update(plan, sampled)
            done.extend(self._advance_grammars(sampled))
        now = time.perf_counter()
        for request_id in sampled:
            request = self.requests[request_id]
            if request.metrics.first_token is None:
                request.metrics.first_token = now
        for request_id, (logprob, top) in logprobs.items():
            request = self.requests[request_id]
            request.logprobs.append(logprob)
            request.top_logprobs.append(top)
        touched = {item.request_id: self.requests[item.request_id] for item in plan.scheduled}
        touched.update((request.request_id, request) for request in ended)
        self._apply_stop_strings(touched.values())
        for request in done:
            self._release_slot(request)
        if self.config.speculative.tokens:
            self._propose_drafts(request for request in touched.values() if not request.is_finished)
        outputs, self._held = self._held, []
        for request_id in sorted(touched):
            request = touched[request_id]
            if request_id in sampled or request.is_finished:
                outputs.append(self._output(request))
            if request.is_finished:
                del self.requests[request_id]  # its final output is in ``outputs``
        return outputs

    def _execute(self, plan: SchedulerOutput
                 ) -> tuple[dict[int, int | list[int]], dict[int, tuple[float, list[tuple[int, float]]]]]:
        """Run the backend on ``plan`` and sample; returns {request id: token, or for a decode with draft tokens the
        accepted drafts and the token after them} and, for requests that asked for logprobs, {request id:
        (logprob, top logprobs)}."""
        rows = []
        argmax_only = True  # every request of the step reads only its argmax (StepInput.argmax_only)
        for item in plan.scheduled:
            request = self.requests[item.request_id]
            if request.slot is None:
                request.slot = heapq.heappop(self._free_slots)
            rows.append(RowInput(request.slot, tuple(item.token_ids), item.start, tuple(item.block_table),
                                 item.num_draft_tokens + 1))
            argmax_only = argmax_only and request.params.argmax_only
        sample_rows = [i for i, item in enumerate(plan.scheduled) if item.completes_prompt]
        masks = self._start_masks([self.requests[plan.scheduled[i].request_id].grammar for i in sample_rows])
        start = time.perf_counter()
        try:
            logits = self.backend.execute(StepInput(tuple(rows), argmax_only))
        finally:  # the matchers are touched again only after their masks are done
            bitmask = masks.result() if masks is not None else None
        self.metrics.execute_seconds += time.perf_counter() - start
        self.metrics.steps += 1
        for item in plan.scheduled:
            if item.is_prefill_chunk:
                self.metrics.prefill_tokens += item.num_tokens
            else:
                self.metrics.decode_tokens += item.num_tokens
        if not sample_rows:
            return {}, {}
        if any(item.num_draft_tokens for item in plan.scheduled):
            return self._verify(plan, logits, bitmask)
        requests = [self.requests[plan.scheduled[i].request_id] for i in sample_rows]
        out = self.sampler.sample(
            logits if len(sample_rows) == len(logits) else logits[sample_rows],  # no copy in steady decode
            [r.params for r in requests], [r.generator for r in requests],
            [r.output_token_ids for r in requests], [r.prompt_token_ids for r in requests], bitmask,
        )
        tokens = {r.request_id: t for r, t in zip(requests, out.token_ids.tolist(), strict=True)}
        if all(r.params.logprobs is None for r in requests):
            return tokens, {}
        logprobs = {r.request_id: (float(lp), top)
                    for r, lp, top in zip(requests, out.logprobs, out.top_logprobs, strict=True)
                    if r.params.logprobs is not None}
        return tokens, logprobs

    def _start_masks(self, states: list[GrammarState | None]) -> Future[np.ndarray] | None:
        """Start computing the token masks of a step's sampled rows (``GrammarCompiler.fill_bitmask``) on the mask
        thread, so that they are ready when the backend's step is; None when no row is constrained."""
        if self.grammars is None or all(state is None for state in states):
            return None
        if self._mask_thread is None:
            self._mask_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moeforge-grammar")
        return self._mask_thread.submit(self.grammars.fill_bitmask, states)

    def _advance_grammars(self, sampled: dict[int, int | list[int]]) -> list[Request]:
        """Feed each constrained request its sampled tokens; finish (stop) those whose output is now complete: a
        finished grammar allows only end-of-sequence. Returns the requests it finished."""
        finished = []
        for request_id, tokens in sampled.items():
            request = self.requests[request_id]
            if request.grammar is None:
                continue
            request.grammar.accept([tokens] if isinstance(tokens, int) else tokens)
            if request.grammar.is_finished and not request.is_finished:
                self.scheduler.finish(request_id, RequestStatus.FINISHED_STOPPED)
                finished.append(request)
        return finished

    def _verify(self, plan: SchedulerOutput, logits: np.ndarray, bitmask: np.ndarray | None = None
                ) -> tuple[dict[int, int | list[int]], dict[int, tuple[float, list[tuple[int, float]]]]]:
        """``_execute``'s sampling for a step with draft tokens (their requests are greedy, ``argmax_only``): per
        decode with drafts, the drafts that equal the argmax after the token before them, then the argmax after the
        last accepted one; per other sampled row, its token (and logprobs where asked). ``logits`` [sum of
        num_logits, V] (``Backend.execute``)."""
        ends = np.cumsum([item.num_draft_tokens + 1 for item in plan.scheduled]).tolist()
        picked = [(item, range(end - item.num_draft_tokens - 1, end))
                  for item, end in zip(plan.scheduled, ends, strict=True) if item.completes_prompt]
        lines = [line for _, span in picked for line in span]
        owners = [self.requests[item.request_id] for item, span in picked for _ in span]  # per line, its request
        if bitmask is not None:  # one mask per sampled request: its lines (a constrained request has one) share it
            bitmask = bitmask[np.repeat(np.arange(len(picked)), [len(span) for _, span in picked])]
        out = self.sampler.sample(logits[lines], [r.params for r in owners], [r.generator for r in owners],
                                  [r.output_token_ids for r in owners], [r.prompt_token_ids for r in owners],
                                  bitmask)
        greedy, at = out.token_ids.tolist(), 0
        tokens: dict[int, int | list[int]] = {}
        logprobs = {}
        for item, span in picked:
            chosen = greedy[at:at + len(span)]
            if owners[at].params.logprobs is not None:  # a request with logprobs is never greedy-only: no drafts
                logprobs[item.request_id] = (float(out.logprobs[at]), out.top_logprobs[at])
            at += len(span)
            drafts = item.draft_token_ids
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == chosen[accepted]:
                accepted += 1
            tokens[item.request_id] = chosen[:accepted + 1] if drafts else chosen[0]
            self.metrics.draft_tokens += len(drafts)
            self.metrics.accepted_draft_tokens += accepted
            drafter = self.requests[item.request_id].drafter
            if drafter is not None:
                drafter.record(len(drafts), accepted)
        return tokens, logprobs

    def _propose_drafts(self, requests: Iterable[Request]) -> None:
        """Draft the next tokens of each greedy request (``SpeculativeOptions.tokens``) for its next decode,
        while at most ``speculative_max_batch`` requests run (else none has drafts; see ``EngineConfig``)."""
        running = self.scheduler.running
        if len(running) > self.speculative_max_batch:
            for request in running:
                request.spec_token_ids = []
            return
        for request in requests:
            if not request.params.argmax_only:
                continue
            drafter = request.drafter
            if drafter is None:
                config = self.config
                drafter = request.drafter = Drafter(config.speculative.tokens, config.speculative.max_ngram,
                                                    config.speculative.min_ngram)
            request.spec_token_ids = drafter.propose(request.token_ids(len(drafter.index.tokens)))

    def _apply_stop_strings(self, requests: Iterable[Request]) -> None:
        """Decode each request's new tokens (``runtime/output_text.py``) and finish a request whose text completed a
        stop string, at the token that completed it: a step that yields several tokens (accepted draft tokens) drops
        those after it, as plain decoding would never have made them."""
        for request in requests:
            text = request.text
            ids = request.output_token_ids
            # A request that reached max_tokens or a stop token this step still reports "stop" (and loses the tokens
            # after it) when one of its new tokens completed a stop string (vLLM's order); other endings stand.
            ended_now = request.status in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED)
            if text is None or len(ids) <= text.num_tokens or (request.is_finished and not ended_now):
                continue
            end = text.feed(ids[text.num_tokens:])
            if end is None:
                continue
            if not request.is_finished:
                self.scheduler.finish(request.request_id, RequestStatus.FINISHED_STOPPED)
                self._release_slot(request)
            request.status = RequestStatus.FINISHED_STOPPED  # for one already ended, only the reason changes
            del ids[end:]  # the request is finished: the scheduler no longer reads its tokens

    def _release_slot(self, request: Request) -> None:
        if request.slot is not None:
            self.backend.release(request.slot)
            heapq.heappush(self._free_slots, request.slot)
            request.slot = None

    def _output(self, request: Request) -> RequestOutput:
        ids = list(request.output_token_ids)
        new = ids[request.num_reported_tokens:]
        request.num_reported_tokens = len(ids)
        if request.is_finished and request.metrics.finished is None:
            request.metrics.finished = time.perf_counter()
        text, delta = None, ""
        if request.text is not None:
            if request.is_finished:
                request.text.finish(ids)
            text, delta = request.text.text, request.text.delta(request.is_finished)
        return RequestOutput(request.request_id, ids, new, request.is_finished, request.finish_reason,
                             request.error, list(request.logprobs), request.metrics, list(request.top_logprobs),
                             text, delta)

    # ------------------------------------------------------------------ conveniences
    def generate(self, prompts: Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] = DEFAULT_PARAMS) -> list[RequestOutput]:
        """Run prompts to completion together; a bad prompt (or its params) yields an output with ``error``
        set, naming its index. Every prompt is checked before any is queued, and if the run itself is
        interrupted the batch's requests are aborted and forgotten: the engine never keeps half a batch.
        Raises ``RequestError`` (nothing queued) when the batch itself is malformed."""
        if isinstance(prompts, str | bytes) or not isinstance(prompts, Sequence):
            raise RequestError(f"generate() takes a list of prompts, got {type(prompts).__name__}; "
                               "for one prompt pass [prompt]")
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(per_prompt) != len(prompts):
            raise RequestError(f"generate() got {len(per_prompt)} SamplingParams for {len(prompts)} prompts: "
                               "give one SamplingParams, or one per prompt")
        checked: list[tuple[list[int], SamplingParams] | RequestOutput] = []
        for index, (prompt, p) in enumerate(zip(prompts, per_prompt, strict=True)):
            try:
                checked.append(self._check_request(prompt, p))
            except MoeforgeError as exc:
                checked.append(RequestOutput(-1, [], [], True, "error", f"prompt {index}: {exc}"))
        order = [item if isinstance(item, RequestOutput) else self._queue(*item) for item in checked]
        mine = {item for item in order if isinstance(item, int)}
        results: dict[int, RequestOutput] = {}
        held: list[RequestOutput] = []  # other callers' requests run alongside: theirs, kept for their step()
        try:
            while len(results) < len(mine):
                for out in self.step():
                    if out.request_id not in mine:
                        held.append(out)
                    elif out.finished:
                        results[out.request_id] = out
        except BaseException:
            # Interrupted (Ctrl-C, an unexpected error): drop this batch so later calls start clean.
            for item in order:
                if isinstance(item, int) and item in self.requests:
                    self.abort(item)
                    del self.requests[item]
            held = [out for out in held if out.request_id not in mine]
            self._held = [out for out in self._held if out.request_id not in mine]
            raise
        finally:
            self._held = held + self._held
        return [item if isinstance(item, RequestOutput) else results[item] for item in order]

    def stream(self, prompt: str | Sequence[int], params: SamplingParams = DEFAULT_PARAMS) -> Iterator[RequestOutput]:
        """Yield the request's output after every step that gave it new tokens, until it finishes."""
        request_id = self.add_request(prompt, params)
        finished = False
        try:
            while not finished:
                outputs = self.step()
                self._held.extend(out for out in outputs if out.request_id != request_id)  # other callers'
                for out in outputs:
                    if out.request_id == request_id:
                        finished = out.finished
                        yield out
        finally:  # the caller stopped iterating (break, close, an error): the request stops and is forgotten
            if not finished and request_id in self.requests:
                self.abort(request_id)
                del self.requests[request_id]
            if not finished:  # outputs another stream() or generate() held for it: nobody will read them
                self._held = [out for out in self._held if out.request_id != request_id]


def _tokenizer_and_eos(artifact: Artifact) -> tuple[Tokenizer | None, tuple[int, ...]]:
    """The artifact's tokenizer (None without tokenizer.json) and EOS ids (the tokenizer's, else the manifest's)."""
    tokenizer = Tokenizer.from_file(artifact.root) if (artifact.root / "tokenizer.json").is_file() else None
    eos = tuple(tokenizer.eos_token_ids) if tokenizer is not None else tuple(
        artifact.manifest.model_config.get("eos_token_ids", ()))
    return tokenizer, eos


def open_engine_backend(artifact: Artifact, config: EngineConfig, *, collectives: bool = False,
                        num_slots: int | None = None, num_blocks: int | None = None) -> Backend:
    """The backend of ``artifact`` sized by ``config`` (its registry entry decides which): slots = ``max_num_seqs``
    (or ``num_slots``), a paged artifact's pool = ``kv_blocks`` or the default (or ``num_blocks``); host-memory
    backends are refused before allocating when their caches cannot fit (``check_host_memory``)."""
    slots, num_blocks = engine_sizes(artifact.manifest, config, num_slots=num_slots, num_blocks=num_blocks)
    return open_backend(artifact, config.backend, num_slots=slots, num_blocks=num_blocks, collectives=collectives)


def engine_sizes(manifest: Manifest, config: EngineConfig, *, num_slots: int | None = None,
                 num_blocks: int | None = None) -> tuple[int, int | None]:
    """The slots and (paged) pool blocks ``open_engine_backend`` gives the artifact of ``manifest`` under ``config``,
    refused (``EngineConfigError``) when the block size does not fit the artifact's or host-memory backends' caches
    cannot fit (``check_host_memory``). Reads the manifest alone: the CLI asks it before a sharded artifact's ranks
    start, so a setting every rank would refuse is refused once."""
    kv = manifest.kv_cache
    slots = num_slots or config.scheduling.max_num_seqs
    if kv.paged:
        assert kv.block_size is not None
        config.cache.check_block_size(kv.block_size)
        num_blocks = num_blocks or config.cache.num_kv_blocks(slots, kv.max_seq_len, kv.block_size)
    else:
        num_blocks = None
    if backend_for(manifest).host_kv:  # device caches (TensorRT) are TensorRT's and torch's to account for
        check_host_memory(config, kv, int(manifest.model_config["vocab_size"]), num_blocks)
    return slots, num_blocks


def _open_tiers(backend: Backend, cache: CacheOptions, artifact_id: str | None) -> KVTiers | None:
    """The KV tiers ``cache`` asks for, over ``backend``'s pools; None when it asks for none."""
    if not cache.tiered:
        return None
    if backend.kv_pool is None:
        raise EngineConfigError("KV host/disk tiers (--kv-host-bytes, --kv-disk-dir) keep prefix-cache blocks, which "
                                "only paged artifacts have: compile with --kv-cache paged, or drop the tier options")
    io = block_io_of(backend)
    if io is None:
        raise EngineConfigError(f"the {type(backend).__name__} cannot copy KV blocks out of its pools, so it cannot "
                                "have host/disk tiers: drop --kv-host-bytes / --kv-disk-dir")
    if cache.disk_dir is not None and not artifact_id:
        raise EngineConfigError("CacheOptions(disk_dir=...) needs the artifact's identity to key its files: open the "
                                "engine with LLMEngine.from_artifact, or pass artifact_id")
    opener = getattr(backend, "open_kv_tiers", None)  # a sharded artifact: every rank tiers its own shard
    if opener is not None:
        tiers: KVTiers = opener(cache.tier_settings(), io, artifact_id)
        return tiers
    return KVTiers(cache.tier_settings(), io, artifact_id)
