"""What the engine gives back: a request's ``RequestOutput`` after a step, the engine's totals (``EngineMetrics``) and
a snapshot of its state for monitors (``EngineStats``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from moeforge.runtime.backends.base import ArgmaxHeadStats
from moeforge.runtime.block_pool import KVCacheStats
from moeforge.runtime.kv_tiers.tiers import KVTierStats
from moeforge.runtime.request import RequestMetrics


@dataclass
class RequestOutput:
    """A request's state after a step: all generated ids so far, the new ones, and -- when the artifact has a
    tokenizer -- their text (``text``: the whole output so far, ending before the stop string that ended it;
    ``text_delta``: what this output adds to the text the previous ones gave, a suffix that may still become a stop
    string held back until it cannot)."""

    request_id: int
    token_ids: list[int]
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    error: str | None = None
    logprobs: list[float] = field(default_factory=list)  # per token, when SamplingParams.logprobs is set
    metrics: RequestMetrics | None = None
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # per token: (id, logprob) pairs
    text: str | None = None
    text_delta: str = ""


@dataclass
class EngineMetrics:
    """Totals over the engine's life."""

    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    preemptions: int = 0
    failed_steps: int = 0  # steps whose backend call or sampling raised (their requests finished with an error)
    execute_seconds: float = 0.0
    # Speculative decoding: draft tokens fed for verification (counted in decode_tokens too) and those accepted.
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine after a step, for monitors (the server's metrics): requests running and waiting,
    the KV block manager's counts, the totals so far, the argmax head's runs (None without one) and the KV tiers'
    counts (None without tiers)."""

    running: int
    waiting: int
    max_num_seqs: int
    num_blocks: int
    kv: KVCacheStats
    totals: EngineMetrics
    argmax_head: ArgmaxHeadStats | None
    kv_tiers: KVTierStats | None = None  # the host / disk tiers below the pool, when configured
