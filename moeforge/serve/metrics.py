"""Prometheus metrics of the server, named as vLLM names its own (``vllm:x`` -> ``moeforge:x``).

Each app gets its own ``CollectorRegistry`` (several servers can live in one process, as in the tests). The
engine loop thread writes every metric (prometheus_client is thread-safe); ``/metrics`` renders the registry.

vLLM names kept: ``num_requests_running`` / ``num_requests_waiting`` (gauges), ``request_success_total
{finished_reason}``, ``prompt_tokens_total``, ``generation_tokens_total``, ``time_to_first_token_seconds``,
``inter_token_latency_seconds``, ``e2e_request_latency_seconds`` (histograms), ``kv_cache_usage_perc``,
``prefix_cache_queries_total`` / ``prefix_cache_hits_total``, ``num_preemptions_total``. Ours on top:
``kv_cache_blocks_in_use`` / ``kv_cache_blocks_capacity``, ``prefix_cache_hit_rate``, ``request_rejected_total
{reason}``, ``engine_steps_total``, ``argmax_head_runs_total`` / ``argmax_head_reruns_total`` (artifacts with the
certified argmax head: greedy runs fed ``argmax_only``, and those repeated on the float head),
``spec_decode_num_draft_tokens_total`` / ``spec_decode_num_accepted_tokens_total`` (vLLM's names; with
``--speculative-tokens``) and ``attention_time_share`` (only with ``--profile-steps``).
Prefix-cache queries and hits count KV blocks (the
engine's unit), where vLLM counts tokens. MoE artifacts add ``expert_routed_tokens_total{layer, expert}`` (tokens
the router sent to each expert of each MoE layer, read from the graph's routing output) and
``expert_load_imbalance{layer}`` (max / mean of that layer's counts; 1 = perfectly balanced); sharded expert-parallel
artifacts also ``expert_rank_routed_tokens_total{layer, rank}`` (token x expert computations each rank ran: its
experts' or placement slots' share) and ``expert_rank_load_imbalance{layer}`` (max / mean over the ranks, the
straggler factor a placement lowers). Those are built at
scrape time from the loop thread's latest snapshot (``ExpertLoad``): DeepSeek-V3 has 58 x 256 of them, too many to
update one by one after every step. Servers with KV tiers (``--kv-host-bytes``, ``--kv-disk-dir``) add the
``kv_tier_*`` series of kv_tier_metrics.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from moeforge.runtime.backends.base import ArgmaxHeadStats
from moeforge.runtime.outputs import EngineMetrics, EngineStats
from moeforge.serve.kv_tier_metrics import KVTierMetrics

PREFIX = "moeforge:"
CONTENT_TYPE = CONTENT_TYPE_LATEST
# Buckets of vLLM's histograms (seconds), so dashboards built for it read ours the same way.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort", "error")
REJECT_REASONS = ("queue_full", "invalid", "unauthorized", "shutting_down", "body_too_large")


class ExpertLoad(Collector):
    """Expert-load metrics from the latest [L_moe, E] routed-token counts (``LLMEngine.expert_load``). The loop
    thread replaces the snapshot (a new array, never written afterwards); a scrape reads whichever is current."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.snapshot: np.ndarray | None = None
        self.rank_snapshot: np.ndarray | None = None  # [L_moe, N] per-rank load of a sharded artifact

    def collect(self) -> Iterator[Metric]:
        ranks = self.rank_snapshot
        if ranks is not None:
            yield from self._families(
                ranks, "rank", "expert_rank_routed_tokens", "Expert computations (token x expert) each rank of a "
                "sharded artifact ran per MoE layer (its experts or placement slots).", "expert_rank_load_imbalance",
                "Max / mean over the ranks of a MoE layer's per-rank expert load (1 = balanced; 0 before any "
                "token): the expert-parallel straggler factor.")
        counts = self.snapshot
        if counts is not None:
            yield from self._families(
                counts, "expert", "expert_routed_tokens", "Tokens the router sent to each expert of each MoE layer "
                "(prompt and generated tokens the model ran).", "expert_load_imbalance", "Max / mean of a MoE "
                "layer's routed-token counts over its experts (1 = balanced; 0 before any token).")

    def _families(self, counts: np.ndarray, label: str, counter: str, counter_help: str, gauge: str,
                  gauge_help: str) -> Iterator[Metric]:
        """A counter per (layer, ``label``) of ``counts`` [L_moe, X] and a max / mean gauge per layer."""
        routed = CounterMetricFamily(PREFIX + counter, counter_help, labels=("model_name", "layer", label))
        imbalance = GaugeMetricFamily(PREFIX + gauge, gauge_help, labels=("model_name", "layer"))
        for layer, row in enumerate(counts.tolist()):
            for index, count in enumerate(row):
                routed.add_metric((self.model_name, str(layer), str(index)), count)
            mean = sum(row) / len(row)
            imbalance.add_metric((self.model_name, str(layer)), max(row) / mean if mean else 0.0)
        yield routed
        yield imbalance


@dataclass
class ServerMetrics:
    """Every metric the server exports, in one registry."""

    def __init__(self, model_name: str) -> None:
        # No ``*_created`` series (a timestamp per counter and histogram): vLLM turns them off too. The switch is
        # process-wide in prometheus_client; nothing else in moeforge exports metrics.
        disable_created_metrics()  # type: ignore[no-untyped-call]  # prometheus_client leaves it unannotated
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ("model_name",)
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=r)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, labels + extra, registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=r)

        self.running = gauge("num_requests_running", "Requests in the running batch (they hold KV blocks).")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to run (new or preempted).")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).")
        self.kv_blocks_in_use = gauge("kv_cache_blocks_in_use", "KV-cache blocks held by requests.")
        self.kv_blocks_total = gauge("kv_cache_blocks_capacity", "KV-cache blocks in the pool (used or free).")
        self.prefix_hit_rate = gauge("prefix_cache_hit_rate", "Prefix-cache hits / lookups (full prompt blocks), "
                                     "over the server's life; 0 while there were no lookups.")
        self.attention_share = gauge("attention_time_share", "Attention's share of kernel time over the profiled "
                                     "first steps (--profile-steps); absent without profiling.")
        self.prefix_queries = counter("prefix_cache_queries", "Full prompt blocks looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Full prompt blocks found in the prefix cache.")
        self.preemptions = counter("num_preemptions", "Requests preempted (their KV dropped, recomputed later).")
        self.steps = counter("engine_steps", "Engine steps run (one batched model call each).")
        self.argmax_runs = counter("argmax_head_runs", "Model runs that took the certified argmax head (every row "
                                   "plain greedy); absent when the artifact has none.")
        self.argmax_reruns = counter("argmax_head_reruns", "Argmax-head runs repeated on the full-precision head "
                                     "because a row's argmax was not certified.")
        self.draft_tokens = counter("spec_decode_num_draft_tokens", "Speculative draft tokens fed for verification "
                                    "(--speculative-tokens).")
        self.accepted_draft_tokens = counter("spec_decode_num_accepted_tokens", "Speculative draft tokens the model "
                                             "accepted (each one a decode step saved).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.success = counter("request_success", "Finished requests by finish reason.", ("finished_reason",))
        self.rejected = counter("request_rejected", "Requests refused before they ran, by reason.", ("reason",))
        self.ttft = histogram("time_to_first_token_seconds", "Time from arrival to the first token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive tokens of a request.",
                             ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Time from arrival to the final token.", E2E_BUCKETS)
        self.expert_load = ExpertLoad(model_name)
        r.register(self.expert_load)
        self.kv_tiers = KVTierMetrics(model_name)  # moeforge/serve/kv_tier_metrics.py; absent without tiers
        r.register(self.kv_tiers)
        self._model = model_name
        self._seen: EngineStats | None = None  # the previous snapshot: counters advance by the difference
        # Every labelled series exists from the start (at 0), so a scrape before the first request shows them.
        for metric in (self.running, self.waiting, self.kv_usage, self.kv_blocks_in_use, self.kv_blocks_total,
                       self.prefix_hit_rate, self.prefix_queries, self.prefix_hits, self.preemptions, self.steps,
                       self.draft_tokens, self.accepted_draft_tokens, self.prompt_tokens, self.generation_tokens,
                       self.ttft, self.itl, self.e2e):
            metric.labels(model_name)
        for reason in FINISH_REASONS:
            self.success.labels(model_name, reason)
        for reason in REJECT_REASONS:
            self.rejected.labels(model_name, reason)

    # ---- written by the engine loop thread
    def set_baseline(self, stats: EngineStats) -> None:
        """Count from ``stats`` on (the engine's state after its warm-up): nothing before it is exported."""
        self._seen = stats

    def update_engine(self, stats: EngineStats) -> None:
        """Gauges and cumulative counters from the engine's snapshot after a step (``LLMEngine.stats()``); the
        argmax head's series stay absent for artifacts without the head."""
        m = self._model
        kv = stats.kv
        self.running.labels(m).set(stats.running)
        self.waiting.labels(m).set(stats.waiting)
        self.kv_blocks_in_use.labels(m).set(kv.blocks_in_use)
        self.kv_blocks_total.labels(m).set(stats.num_blocks)
        self.kv_usage.labels(m).set(kv.blocks_in_use / stats.num_blocks if stats.num_blocks else 0.0)
        self.prefix_hit_rate.labels(m).set(kv.hit_rate)
        seen = self._seen

        def advance(counter: Counter, now: int, before: int) -> None:
            counter.labels(m).inc(max(now - before, 0))

        totals, was = stats.totals, seen.totals if seen is not None else EngineMetrics()
        old_kv = seen.kv if seen is not None else None
        advance(self.prefix_queries, kv.hits + kv.misses, old_kv.hits + old_kv.misses if old_kv else 0)
        advance(self.prefix_hits, kv.hits, old_kv.hits if old_kv else 0)
        advance(self.preemptions, totals.preemptions, was.preemptions)
        advance(self.steps, totals.steps, was.steps)
        if stats.argmax_head is not None:
            head = seen.argmax_head if seen is not None and seen.argmax_head is not None else ArgmaxHeadStats(0, 0)
            advance(self.argmax_runs, stats.argmax_head.runs, head.runs)
            advance(self.argmax_reruns, stats.argmax_head.reruns, head.reruns)
        advance(self.draft_tokens, totals.draft_tokens, was.draft_tokens)
        advance(self.accepted_draft_tokens, totals.accepted_draft_tokens, was.accepted_draft_tokens)
        self.kv_tiers.snapshot = stats.kv_tiers
        self._seen = stats

    def admitted(self, prompt_tokens: int) -> None:
        self.prompt_tokens.labels(self._model).inc(prompt_tokens)

    def tokens(self, count: int, *, ttft: float | None, itl: float | None) -> None:
        """``count`` new tokens of one request; ``ttft`` when they include its first, else the time since its
        previous tokens (``itl``), spread over them."""
        m = self._model
        self.generation_tokens.labels(m).inc(count)
        if ttft is not None:
            self.ttft.labels(m).observe(ttft)
        elif itl is not None and count:
            for _ in range(count):
                self.itl.labels(m).observe(itl / count)

    def finished(self, reason: str, e2e: float) -> None:
        m = self._model
        self.success.labels(m, reason if reason in FINISH_REASONS else "error").inc()
        self.e2e.labels(m).observe(e2e)

    def set_expert_load(self, counts: np.ndarray) -> None:
        """The engine's routed-token counts [L_moe, E] after a step (a copy the caller no longer writes)."""
        self.expert_load.snapshot = counts

    def set_rank_expert_load(self, counts: np.ndarray) -> None:
        """A sharded artifact's per-rank expert load [L_moe, N] after a step (a copy the caller no longer writes)."""
        self.expert_load.rank_snapshot = counts

    def set_attention_share(self, share: float) -> None:
        self.attention_share.labels(self._model).set(share)

    # ---- written by the request handlers
    def reject(self, reason: str) -> None:
        self.rejected.labels(self._model, reason).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
