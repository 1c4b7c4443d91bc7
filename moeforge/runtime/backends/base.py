"""The Backend protocol: what the engine needs from an execution backend (ONNX Runtime, TensorRT).

Dimension letters: S tokens of one row this step, V vocabulary.

If ``execute`` raises, the engine finishes that step's requests with an error and keeps serving: a
backend must stay usable after a failed step (the failed rows' slots are released, their blocks freed).

A backend owns the KV-cache memory of one artifact. The engine gives it, per step, the rows to run:
each row names its cache slot, the tokens to feed and the position of the first one; the backend
returns, per row, the logits of the row's last token (of its last ``num_logits`` tokens for a row that verifies
speculative draft tokens). Everything a step needs is in ``StepInput``: no state about sequences lives in the
backend besides the cache contents.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from moeforge.core.errors import MoeforgeError


@dataclass(frozen=True)
class BackendOptions:
    """How a backend runs its artifact, given to the backend as one object (``EngineConfig.backend``).

    ``threads``: ONNX Runtime intra-op threads (None: its default). ``providers``: ONNX Runtime execution providers
    (empty: ``core/ort_session.default_providers``, CPU unless MOEFORGE_ORT_PROVIDERS says otherwise).
    ``session_config``: ONNX Runtime session config entries and ``options.<attribute>`` settings
    (``core/ort_session.make_session``), e.g. (("session.intra_op.allow_spinning", "0"),).
    ``track_expert_load``: MoE artifacts count routed tokens per layer and expert (a small output fetch per step).
    ``profile``: time kernels so ``op_time_shares`` can answer. ``huge_pages``: put the memory the session allocates
    (its prepacked weights) on transparent huge pages (``core/huge_pages.py``): a decode step streams every weight,
    and 4 KiB pages cost a TLB miss every 4 KiB. ``micro_batches``: see the field. The TensorRT backend reads none of
    the ONNX Runtime fields."""

    threads: int | None = None
    providers: tuple[str, ...] = ()
    session_config: tuple[tuple[str, str], ...] = ()
    track_expert_load: bool = False
    profile: bool = False
    huge_pages: bool = True
    # A pipeline artifact (``--pp``): how many micro-batches each step is split into, so that the stages overlap
    # (``runtime/backends/pipeline.py``); 0: as many as the stages.
    micro_batches: int = 0


DEFAULT_BACKEND_OPTIONS = BackendOptions()


class FatalBackendError(MoeforgeError):
    """The backend cannot run another step (a rank of a sharded artifact died): the engine re-raises it rather
    than failing one step's requests and serving on."""


@dataclass(frozen=True)
class RowInput:
    """One sequence's work this step: feed ``token_ids`` [S] at positions start .. start+S-1 into ``slot``.

    The slot's cache must already hold ``start`` tokens (positions 0 .. start-1) of this sequence. It may hold more
    (draft tokens that the previous step's verification rejected): those are dropped and overwritten.
    """

    slot: int
    token_ids: tuple[int, ...]
    start: int
    block_table: tuple[int, ...] | None = None  # paged backends: the sequence's pool blocks, in token order
    # Logits of the row's last ``num_logits`` tokens (1 <= num_logits <= S): > 1 for a decode that feeds speculative
    # draft tokens, whose every position's argmax verifies the next draft. Only for backends whose
    # ``multi_logit_rows`` is True.
    num_logits: int = 1


def check_row_tokens(row: RowInput) -> None:
    """Raise ValueError for a row without tokens or whose ``num_logits`` is outside 1..S (every backend's check)."""
    if not row.token_ids:
        raise ValueError(f"slot {row.slot}: a row needs at least one token")
    if not 1 <= row.num_logits <= len(row.token_ids):
        raise ValueError(f"slot {row.slot}: num_logits {row.num_logits} must be in 1..{len(row.token_ids)} "
                         "(the row's tokens)")


@dataclass(frozen=True)
class PoolInfo:
    """A paged backend's KV block pools: ``num_blocks`` blocks of ``block_size`` tokens per layer buffer."""

    num_blocks: int
    block_size: int


@dataclass(frozen=True)
class PoolShape:
    """One pool's block: ``shape`` [Bs, Hkv, D] of numpy dtype ``dtype`` (e.g. "float32")."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize


@dataclass(frozen=True)
class BlockLayout:
    """Every pool's block, in the order the backend reads and writes them."""

    pools: tuple[PoolShape, ...]

    @property
    def nbytes(self) -> int:
        """Bytes of one block in the pools (all layers)."""
        return sum(p.nbytes for p in self.pools)


@dataclass(frozen=True)
class StepInput:
    """All rows of one engine step (prefill chunks and decodes mixed)."""

    rows: tuple[RowInput, ...]
    # The caller takes only each row's argmax (plain greedy, no logprobs): a backend may then return logits whose
    # argmax is the exact one and whose other values are approximate (moeforge/passes/argmax_head.py). Optional.
    argmax_only: bool = False


@dataclass(frozen=True)
class ArgmaxHeadStats:
    """Runs of the certified argmax head (moeforge/passes/argmax_head.py) over a backend's life: ``runs`` fed
    ``argmax_only``, ``reruns`` of them repeated on the float head because a row was not certified."""

    runs: int
    reruns: int


class Backend(Protocol):
    """An artifact ready to run, with its cache memory."""

    @property
    def num_slots(self) -> int:
        """How many sequences can hold a cache at once."""
        ...

    @property
    def max_seq_len(self) -> int:
        """Most tokens one slot holds (prompt + generated)."""
        ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def kv_pool(self) -> PoolInfo | None:
        """The block pools of a paged backend, whose blocks are the engine's ``KVCacheManager`` blocks
        (rows then carry ``block_table``); None for per-slot contiguous caches. Optional: the engine
        treats a backend without this property as contiguous."""
        ...

    def execute(self, step: StepInput) -> np.ndarray:
        """Run one step; return logits [sum of rows' num_logits, V] float32: each row's last ``num_logits`` tokens
        in position order, rows in step order ([len(step.rows), V] when every row has num_logits 1)."""
        ...

    def release(self, slot: int) -> None:
        """Forget a slot's contents (its sequence finished or was preempted)."""
        ...

    def op_time_shares(self) -> dict[str, float] | None:
        """Share of compute time per op type, if the backend can tell (else None)."""
        ...

    # Optional (the engine reads them with getattr): ``end_profile() -> Path | None``, ONNX Runtime's JSON trace of a
    # profiled backend's runs (the ORT backends); ``argmax_head_stats() -> ArgmaxHeadStats | None``, the certified
    # argmax head's runs where the artifact has one; ``multi_logit_rows: bool`` (absent: False), whether rows may ask
    # for ``num_logits`` > 1 and start before the cache's end (what speculative decoding needs); ``block_io() ->
    # BlockIO | None``, a paged backend's pools as whole blocks to copy out and in (the KV tiers, runtime/kv_tiers).


def block_io_of(backend: object) -> BlockIO | None:
    """The backend's pools as a ``BlockIO`` (its optional ``block_io()``), or None when it has none."""
    block_io = getattr(backend, "block_io", None)
    io: BlockIO | None = block_io() if block_io is not None else None
    return io


class BlockIO(Protocol):
    """Copy whole KV-cache blocks out of and into a paged backend's pools (every layer's row ``block_id``), for the
    tiers below the pool (runtime/kv_tiers). Called only between steps, on the engine's thread."""

    def layout(self) -> BlockLayout:
        """The pools' block shapes and dtypes, in the order ``read`` returns and ``write`` takes them."""
        ...

    def read(self, block_ids: Sequence[int]) -> list[list[np.ndarray]]:
        """Per block, a copy of its row in each pool ([Bs, Hkv, D] each, layout order)."""
        ...

    def write(self, block_ids: Sequence[int], rows: Sequence[Sequence[np.ndarray]]) -> None:
        """Overwrite each block's row in every pool with ``rows`` (as ``read`` returns them)."""
        ...


@dataclass(frozen=True)
class ExpertActivity:
    """``active`` [L_moe]: distinct experts computed per MoE layer, summed over ``runs`` model runs. Two snapshots'
    difference over the decode steps of a benchmark gives the experts a step reads (``(a1 - a0) / (r1 - r0)``)."""

    active: np.ndarray
    runs: int

    def since(self, earlier: ExpertActivity) -> ExpertActivity:
        return ExpertActivity(self.active - earlier.active, self.runs - earlier.runs)

    def per_run(self) -> np.ndarray:
        """Mean distinct experts per run and layer, [L_moe] float (zeros when nothing ran)."""
        return self.active / max(self.runs, 1)
