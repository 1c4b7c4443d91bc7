"""DeepSeek-V4's KV cache (layout ``v4_hybrid``): what each layer keeps, as buffers of rows.

Dimension letters: D head_dim, Di index_head_dim, W sliding_window, m a layer's compress rate, c = 2 for CSA (its
windows overlap) else 1, Bs tokens per block (paged), L max_seq_len (contiguous).

A layer's cache is a list of buffers of two kinds (``V4Buffer``):
- a **ring** of R rows: token p's row is row ``p % R`` of the block holding p (contiguous: the sequence's one
  block). It holds the last R tokens of each block, all a later token reads:
  - ``window``  [R = W, D]: the rotated shared key/value of the sliding window (every layer);
  - ``pending`` [R = c*m, 2*c*D]: the compressor's kv | gate projections of the tokens not yet compressed (CSA: and
    the previous window's, whose first half every entry overlaps); ``index_pending`` [c*m, 2*c*Di]: the indexer's.
- **entries**, one row per m tokens: ``entries`` [D] (compressed keys/values), ``index_entries`` [Di] (the
  indexer's keys); entry e is written when token e*m + m - 1 arrives, into the block that holds token e*m.
Paged: a block of Bs tokens (a multiple of every compress rate) holds min(R, Bs) rows of each ring and Bs / m
entries, all a function of the tokens up to its end: a cached prefix block is exact for any sequence that shares
the prefix. Contiguous: a sequence holds R rows of each ring and ceil(L / m) entries, so the memory that grows
with the context is only the entries' (V4's point: D / m per token on a compressed layer instead of a KV per token).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from moeforge.core.errors import ArtifactError, ConfigError

BufferKind = Literal["window", "pending", "entries", "index_pending", "index_entries"]
BUFFER_KINDS: tuple[str, ...] = ("window", "pending", "entries", "index_pending", "index_entries")
CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"


@dataclass(frozen=True)
class V4Buffer:
    """One cache buffer of a V4 layer: ``width`` values per row; ``ring`` rows (a ring) or one row per
    ``tokens_per_row`` tokens (entries); exactly one of the two is non-zero."""

    kind: BufferKind
    width: int
    ring: int = 0
    tokens_per_row: int = 0

    def __post_init__(self) -> None:
        if self.kind not in BUFFER_KINDS:
            raise ArtifactError(f"kv_cache buffer kind {self.kind!r} is not one of {', '.join(BUFFER_KINDS)}")
        if self.width <= 0 or (self.ring > 0) == (self.tokens_per_row > 0) or min(self.ring, self.tokens_per_row) < 0:
            raise ArtifactError(f"kv_cache buffer {self}: a positive width and exactly one of ring / tokens_per_row")

    def rows_per_block(self, block_size: int) -> int:
        """Rows this buffer has in one pool block of ``block_size`` tokens."""
        return min(self.ring, block_size) if self.ring else block_size // self.tokens_per_row

    def rows_per_sequence(self, max_seq_len: int) -> int:
        """Rows of one sequence's contiguous buffer."""
        return self.ring if self.ring else -(-max_seq_len // self.tokens_per_row)

    @property
    def values_per_token(self) -> float:
        """Values one more token adds (0 for a ring: its size does not grow with the context)."""
        return self.width / self.tokens_per_row if self.tokens_per_row else 0.0

    @classmethod
    def from_dict(cls, data: Any) -> V4Buffer:
        if not isinstance(data, dict):
            raise ArtifactError(f"kv_cache.layer_buffers: {data!r} is not an object")
        try:
            return cls(kind=data["kind"], width=int(data["width"]), ring=int(data.get("ring", 0)),
                       tokens_per_row=int(data.get("tokens_per_row", 0)))
        except (KeyError, TypeError, ValueError) as err:
            raise ArtifactError(f"kv_cache.layer_buffers: {data!r}: {err}") from None


def layer_buffers(config: Any, layer: int) -> list[V4Buffer]:
    """The buffers of V4 layer ``layer`` (``config`` a ModelConfig with ``compressed_attention``), in graph order."""
    attn = config.compressed_attention
    assert attn is not None and config.sliding_window is not None
    d = config.head_dim
    buffers = [V4Buffer("window", d, ring=config.sliding_window)]
    kind = attn.layer_types[layer]
    if kind == HCA:
        m = attn.hca_rate
        buffers += [V4Buffer("pending", 2 * d, ring=m), V4Buffer("entries", d, tokens_per_row=m)]
    elif kind == CSA:
        m, di = attn.csa_rate, attn.indexer.index_head_dim
        buffers += [V4Buffer("pending", 4 * d, ring=2 * m), V4Buffer("entries", d, tokens_per_row=m),
                    V4Buffer("index_pending", 4 * di, ring=2 * m), V4Buffer("index_entries", di, tokens_per_row=m)]
    return buffers


def compress_rates(config: Any) -> list[int]:
    """The distinct compress rates of the model's layers (a paged block must hold whole windows of each)."""
    attn = config.compressed_attention
    assert attn is not None
    return sorted({r for r in (attn.compress_rate(i) for i in range(config.num_hidden_layers)) if r})


def block_quantum(config: Any, requested: int) -> int:
    """The smallest multiple of ``requested`` that every compress rate divides (DeepSeek-V4-Flash: 128 from 16): a
    block size must be a multiple of it."""
    lcm = math.lcm(*compress_rates(config)) if compress_rates(config) else 1
    return requested * lcm // math.gcd(requested, lcm)


def default_block_size(config: Any, requested: int) -> int:
    """The pool block size without ``--kv-block-size``: the smallest multiple of ``block_quantum`` that is at least
    twice the sliding window. A block keeps its own rings (the window and pending tokens at its end), so the window
    ring costs W / block rows per token: at most half a row this way (DeepSeek-V4-Flash: 256 tokens, vLLM's block
    size for it, 108 KiB per token in float32 against 203 KiB at 128)."""
    quantum = block_quantum(config, requested)
    window = config.sliding_window or 0
    return quantum * max(1, -(-2 * window // quantum))


def check_block_size(config: Any, block_size: int) -> None:
    """Refuse a block size that some compress rate does not divide (a block must close its own windows)."""
    bad = [r for r in compress_rates(config) if block_size % r]
    if bad:
        raise ConfigError(f"--kv-block-size {block_size}: DeepSeek-V4 compresses every {', '.join(map(str, bad))} "
                          f"tokens and a block must hold whole windows; use a multiple of "
                          f"{block_quantum(config, 1)} (e.g. {block_quantum(config, block_size)}), or "
                          "leave --kv-block-size out")
