"""How an engine runs: ``EngineConfig`` = scheduling limits + cache budget + speculative decoding + backend options.

Each part is validated where it is built and names the field to change; ``check_host_memory`` refuses, before
anything is allocated, a configuration whose buffers cannot fit in host memory (``core/host_memory.py`` counts).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from moeforge.core.errors import MoeforgeError
from moeforge.core.host_memory import available_memory, gib, host_bytes
from moeforge.core.kv_layout import KVCacheSpec
from moeforge.core.ort_session import OPTION_PREFIX, session_option
from moeforge.runtime.backends.base import BackendOptions
from moeforge.runtime.kv_tiers.block_codec import OFFLOAD_DTYPES
from moeforge.runtime.kv_tiers.tiers import TierSettings

DEFAULT_DISK_BYTES = 16 << 30  # --kv-disk-bytes when only --kv-disk-dir is given


class EngineConfigError(MoeforgeError):
    """An ``EngineConfig`` that cannot work (with this artifact): the message names the field to change."""


def _is_int(value: object) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _check_ints(owner: object, fields: tuple[tuple[str, int, bool], ...]) -> None:
    """Each (name, minimum, optional) field of ``owner`` is an integer >= minimum (or None when optional)."""
    for name, minimum, optional in fields:
        value = getattr(owner, name)
        if not (value is None and optional) and not (_is_int(value) and value >= minimum):
            raise EngineConfigError(f"{type(owner).__name__}({name}={value!r}) must be an integer >= {minimum}"
                                    + (" (or None)" if optional else ""))


@dataclass(frozen=True)
class SchedulingOptions:
    """Limits of one step: running requests (``max_num_seqs``, also the backend's slots), the token budget of a
    step (decodes and prefill chunks together), and the most prefill tokens of one request per step (None: the
    budget only)."""

    max_num_seqs: int = 8
    max_num_batched_tokens: int = 512
    long_prefill_chunk: int | None = None

    def __post_init__(self) -> None:
        _check_ints(self, (("max_num_seqs", 1, False), ("max_num_batched_tokens", 1, False),
                           ("long_prefill_chunk", 1, True)))


@dataclass(frozen=True)
class CacheOptions:
    """The KV memory budget that drives admission and preemption: ``kv_blocks`` blocks of ``block_size`` tokens.
    Default: ``max_num_seqs * ceil(max_seq_len / block_size)`` blocks, so every slot can reach ``max_seq_len`` at
    once -- for a paged artifact the same memory as the contiguous layout; set ``kv_blocks`` lower to save memory
    when typical requests are much shorter than ``max_seq_len`` (requests then wait for blocks or are preempted and
    recomputed).

    Paged artifacts: ``kv_blocks`` is also the number of blocks preallocated in each pool, and the block size is the
    artifact's (``--kv-block-size`` at compile time): leave ``block_size`` None or give that value (another one
    raises). Contiguous artifacts: ``block_size`` (None: 16) is only the accounting unit of the budget."""

    block_size: int | None = None
    kv_blocks: int | None = None
    # Tiers below the pool (runtime/kv_tiers; paged artifacts): L2 host memory, L3 a directory shared by processes
    # and restarts, blocks stored as ``offload_dtype`` ("native": bit for bit; "int8": 4x smaller, lossy), queued
    # requests' disk blocks read ahead by a background thread (``prefetch``).
    host_bytes: int = 0
    disk_dir: str | Path | None = None
    disk_bytes: int = DEFAULT_DISK_BYTES
    offload_dtype: str = "native"
    prefetch: bool = True

    def __post_init__(self) -> None:
        if self.kv_blocks is not None and not (_is_int(self.kv_blocks) and self.kv_blocks >= 1):
            raise EngineConfigError(f"CacheOptions(kv_blocks={self.kv_blocks!r}): give at least 1 block, "
                                    "or None for the default (every slot can reach max_seq_len)")
        _check_ints(self, (("block_size", 1, True), ("host_bytes", 0, False), ("disk_bytes", 1, False)))
        if self.offload_dtype not in OFFLOAD_DTYPES:
            raise EngineConfigError(f"CacheOptions(offload_dtype={self.offload_dtype!r}) is unknown: use one of "
                                    f"{', '.join(OFFLOAD_DTYPES)} (--kv-offload-dtype)")
        if self.disk_dir is not None and not isinstance(self.disk_dir, str | Path):
            raise EngineConfigError(f"CacheOptions(disk_dir={self.disk_dir!r}) must be a path (--kv-disk-dir)")
        if not isinstance(self.prefetch, bool):
            raise EngineConfigError(f"CacheOptions(prefetch={self.prefetch!r}) must be True or False")

    @property
    def tiered(self) -> bool:
        """Whether a host or disk tier is configured below the pool."""
        return self.host_bytes > 0 or self.disk_dir is not None

    def tier_settings(self) -> TierSettings:
        """The tiers as ``KVTiers`` takes them."""
        return TierSettings(self.host_bytes, None if self.disk_dir is None else Path(self.disk_dir),
                            self.disk_bytes, self.offload_dtype, self.prefetch)

    def num_kv_blocks(self, num_slots: int, max_seq_len: int, block_size: int) -> int:
        """``kv_blocks``, or the default: ``num_slots`` sequences of ``max_seq_len`` tokens each."""
        return self.kv_blocks or num_slots * -(-max_seq_len // block_size)

    def check_block_size(self, artifact_block_size: int) -> None:
        """Refuse a ``block_size`` that differs from a paged artifact's."""
        if self.block_size is not None and self.block_size != artifact_block_size:
            raise EngineConfigError(
                f"CacheOptions(block_size={self.block_size}) differs from the paged artifact's block size "
                f"{artifact_block_size} (set at compile time with --kv-block-size): leave block_size None")


@dataclass(frozen=True)
class SpeculativeOptions:
    """Prompt-lookup speculative decoding (runtime/speculative.py): greedy requests (SamplingParams.argmax_only)
    feed up to ``tokens`` draft tokens per decode (fewer, or none for a while, after rejected ones), copied from
    where the sequence's last tokens occurred before, and the model verifies them in the same run. Output is plain
    greedy decoding's (token for token on float artifacts; see benchmarks/speculative_decoding.py); 0 turns it off.

    ``max_ngram`` / ``min_ngram``: the longest / shortest tail matched to find drafts (2 drafts less often than 1
    but far better). ``max_batch``: drafts only while at most this many requests run. None: 1 on a contiguous
    artifact, which verifies each row with drafts in a run of its own (ONNX Runtime's GroupQueryAttention takes
    several new tokens on a filled cache only at batch 1) and so beats one batched decode step only at batch 1;
    every slot on a paged artifact, which verifies all rows in its one packed run."""

    tokens: int = 0
    max_ngram: int = 3
    min_ngram: int = 2
    max_batch: int | None = None

    def __post_init__(self) -> None:
        _check_ints(self, (("tokens", 0, False), ("max_ngram", 1, False), ("min_ngram", 1, False),
                           ("max_batch", 1, True)))
        if self.min_ngram > self.max_ngram:
            raise EngineConfigError(f"SpeculativeOptions(min_ngram={self.min_ngram}) exceeds "
                                    f"max_ngram={self.max_ngram}: lower it or raise the max")


def check_backend_options(options: BackendOptions) -> None:
    """Refuse backend options that cannot work, naming the field (the backend reads them as given)."""
    entries = options.session_config
    if not isinstance(entries, tuple) or not all(
            isinstance(e, tuple) and len(e) == 2 and all(isinstance(x, str) for x in e) for e in entries):
        raise EngineConfigError(f"BackendOptions(session_config={entries!r}) must be a tuple of (key, value) string "
                                "pairs, e.g. (('session.intra_op.allow_spinning', '0'),)")
    for key, value in entries:
        if key.startswith(OPTION_PREFIX):
            try:
                session_option(key, value)
            except ValueError as error:
                raise EngineConfigError(f"BackendOptions: {error}") from None
    for name in ("huge_pages", "profile", "track_expert_load"):
        if not isinstance(getattr(options, name), bool):
            raise EngineConfigError(f"BackendOptions({name}={getattr(options, name)!r}) must be True or False")
    if not isinstance(options.providers, tuple) or not all(isinstance(p, str) for p in options.providers):
        raise EngineConfigError(f"BackendOptions(providers={options.providers!r}) must be a tuple of ONNX Runtime "
                                "provider names, e.g. ('CPUExecutionProvider',)")
    _check_ints(options, (("threads", 0, True),))


@dataclass(frozen=True)
class EngineConfig:
    """Everything that decides how an engine runs, in four parts: ``scheduling`` (step limits), ``cache`` (the KV
    budget), ``speculative`` (prompt-lookup drafts), ``backend`` (threads, providers, session settings, expert
    counting, profiling, huge pages), the last handed to the backend as it is."""

    scheduling: SchedulingOptions = field(default_factory=SchedulingOptions)
    cache: CacheOptions = field(default_factory=CacheOptions)
    speculative: SpeculativeOptions = field(default_factory=SpeculativeOptions)
    backend: BackendOptions = field(default_factory=BackendOptions)

    def __post_init__(self) -> None:
        for name, kind in (("scheduling", SchedulingOptions), ("cache", CacheOptions),
                           ("speculative", SpeculativeOptions), ("backend", BackendOptions)):
            if not isinstance(getattr(self, name), kind):
                raise EngineConfigError(f"EngineConfig({name}=...) must be a {kind.__name__}, "
                                        f"got {type(getattr(self, name)).__name__}")
        check_backend_options(self.backend)


def check_host_memory(config: EngineConfig, kv: KVCacheSpec, vocab_size: int, num_blocks: int | None = None) -> None:
    """Refuse, before anything is allocated, an ``EngineConfig`` whose buffers cannot fit in the host memory
    ``available_memory()`` reports. Counted (``core/host_memory.host_bytes``, a lower bound): the KV cache --
    ``num_blocks`` pool blocks of a paged artifact, else ``max_num_seqs`` contiguous rows of ``max_seq_len`` tokens
    -- the float32 logits of one full step, and the host KV tier's bound (``host_bytes``). Only what certainly cannot
    fit is refused."""
    limit = available_memory()
    if limit is None:
        return
    sched = config.scheduling
    step_tokens = min(sched.max_num_batched_tokens, sched.max_num_seqs * kv.max_seq_len)
    need = host_bytes(kv, vocab_size, num_seqs=sched.max_num_seqs, step_tokens=step_tokens, num_blocks=num_blocks)
    fix = "lower kv_blocks (or max_num_seqs, which sets the default)" if num_blocks is not None else \
        "lower max_num_seqs"
    tier = config.cache.host_bytes  # the host KV tier fills up to its bound
    if need.total + tier > limit and need.total <= limit:
        raise EngineConfigError(
            f"CacheOptions(host_bytes={tier:,}) (--kv-host-bytes) with the engine's own buffers ({gib(need.total)}) "
            f"needs {gib(need.total + tier)} of host memory and {gib(limit)} is available: lower --kv-host-bytes")
    if need.total > limit:
        raise EngineConfigError(
            f"EngineConfig(max_num_seqs={sched.max_num_seqs}, kv_blocks={config.cache.kv_blocks}, "
            f"max_num_batched_tokens={sched.max_num_batched_tokens}) needs at least {gib(need.total)} of host memory "
            f"({need.cache_what} = {gib(need.cache)}; step logits {step_tokens:,} tokens x {vocab_size:,} x 4 bytes "
            f"= {gib(need.logits)}) and {gib(limit)} is available: {fix}, or max_num_batched_tokens if the logits "
            "dominate")
