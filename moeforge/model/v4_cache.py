"""DeepSeek-V4 attention over its KV cache buffers (``core/kv_layout_v4.py``): the graph a V4 compile exports.

The same math as ``compressed_attention.py`` (the reference, exactly transformers'), over packed tokens whose cache
lives in ring and entry buffers addressed through block tables, written with index_put (ONNX ScatterND, bound in
place by the backends). Contiguous caches are the one-block case: sequence b's block is b and a block is longer
than any sequence.

Dimension letters: T packed tokens, N sequences of the step, M block-table width, Hn heads, D head_dim, Dr rotary
dims, W sliding_window, m compress rate, c = 2 (CSA, overlapping windows) or 1 (HCA), R ring rows, E entry rows of
a sequence (M x entries per block), K = min(index_topk, E), Hi / Di indexer heads / head size.

Rules that keep the in-place writes exact:
- every read of a buffer a step also writes comes before the write: rings are read first and their writes take
  the read as a (never chosen) fallback, so the write depends on the read; entries and the window are read after
  their write, from the written buffer;
- positions of this step are read from the step's own new rows, never from a ring (a long chunk wraps the ring);
- a buffer row written by several tokens of a step gets the same value from each (the last of them in position
  order: the ring's final writer, or the window's closing token), so ScatterND's order among duplicates is moot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moeforge.model.compressed_attention import CompressedAttention
from moeforge.model.kv_compressor import KVCompressor
from moeforge.model.lightning_indexer import SparseCompressor
from moeforge.model.norm import rms_normalize
from moeforge.model.rope import apply_rotary_tail


@dataclass(frozen=True)
class CacheAddress:
    """Where each packed token of a step sits: its sequence ``seq`` [T] and position ``positions`` [T]; per sequence
    its block table ``tables`` [N, M], the first position ``step_start`` [N], last position ``step_end`` [N] and
    first packed index ``first_index`` [N] of its tokens in this step; ``block_tokens`` tokens per block (int)."""

    seq: torch.Tensor
    positions: torch.Tensor
    tables: torch.Tensor
    step_start: torch.Tensor
    step_end: torch.Tensor
    first_index: torch.Tensor
    block_tokens: int
    # Contiguous steps: (B, S), the tokens are B rows of S (row b = sequence b), and ``context`` the longest row's
    # cached + new tokens (attention_mask's width): no entry past it is read. None / None for packed (paged) tokens.
    rows: tuple[int, int] | None = None
    context: int | None = None

    def block_of(self, seq: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """The pool block holding ``position`` of sequence ``seq`` (same shapes)."""
        return self.tables[seq, torch.div(position, self.block_tokens, rounding_mode="floor")]

    def packed_index(self, seq: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """The packed index of ``position`` of ``seq`` when it is one of this step's tokens (clamped otherwise)."""
        index = self.first_index[seq] + position - self.step_start[seq]
        return index.clamp(0, self.positions.shape[0] - 1)

    def in_step(self, seq: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        return position >= self.step_start[seq]


def contiguous_address(positions: torch.Tensor, max_seq_len: int, context: int) -> CacheAddress:
    """positions [B, S] (row b is cache row b, right after what it holds), ``context`` the longest row's cached + new
    tokens -> the address of its B*S tokens."""
    b, s = positions.shape
    rows = torch.arange(b, dtype=torch.int64, device=positions.device)
    return CacheAddress(seq=rows[:, None].expand(b, s).reshape(-1), positions=positions.reshape(-1),
                        tables=rows[:, None], step_start=positions[:, 0], step_end=positions[:, -1],
                        first_index=rows * s, block_tokens=max_seq_len, rows=(b, s), context=context)


def paged_address(positions: torch.Tensor, block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                  block_size: int) -> CacheAddress:
    """positions [T] (packed), block_tables [N, M] int32, query_start_loc [N+1] int32 -> the tokens' address."""
    starts = query_start_loc.to(torch.int64)
    tokens = torch.arange(positions.shape[0], dtype=torch.int64, device=positions.device)
    seq = (starts[1:][None, :] <= tokens[:, None]).to(torch.int64).sum(dim=1)  # [T]: the sequence of each token
    return CacheAddress(seq=seq, positions=positions, tables=block_tables.to(torch.int64),
                        step_start=positions[starts[:-1]], step_end=positions[starts[1:] - 1], first_index=starts[:-1],
                        block_tokens=block_size)


def _ring_read(address: CacheAddress, ring: torch.Tensor, new_rows: torch.Tensor,
               wanted: torch.Tensor) -> torch.Tensor:
    """Rows of positions ``wanted`` [T, k] (each token's sequence; < 0 allowed, clamped) from this step's
    ``new_rows`` [T, w] or, before the step, from ``ring`` [N, R, w] -> [T, k, w]."""
    seq = address.seq[:, None].expand_as(wanted)
    at = wanted.clamp(min=0)
    old = ring[address.block_of(seq, at), at % ring.shape[1]]  # [T, k, w]
    new = new_rows[address.packed_index(seq, at)]  # [T, k, w]
    return torch.where(address.in_step(seq, at)[..., None], new, old)


def _ring_write(address: CacheAddress, ring: torch.Tensor, new_rows: torch.Tensor,
                read_first: torch.Tensor) -> torch.Tensor:
    """Write each token's row of ``new_rows`` [T, w] at ring row ``p % R`` of its block; every token of a row writes
    the row's final value (the last token of its block with that remainder). ``read_first`` [T, k, w]: what was
    read from ``ring`` this step, which the write must follow (an in-place buffer)."""
    rows = ring.shape[1]
    p, seq = address.positions, address.seq
    block_end = (torch.div(p, address.block_tokens, rounding_mode="floor") + 1) * address.block_tokens - 1
    last = torch.minimum(address.step_end[seq], block_end)
    final = p + torch.div(last - p, rows, rounding_mode="floor") * rows  # the last position writing this row
    block = address.block_of(seq, p)
    values = torch.where(block[:, None] >= 0, new_rows[address.packed_index(seq, final)], read_first[:, 0, :])
    return ring.index_put((block, p % rows), values)


def _window_keys(address: CacheAddress, window: torch.Tensor, kv: torch.Tensor,
                 size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sliding window of each token: keys [T, W, D], which are real [T, W], and the window ring written."""
    p = address.positions
    wanted = p[:, None] - (size - 1) + torch.arange(size, device=p.device)  # [T, W]: p-W+1 .. p
    keys = _ring_read(address, window, kv, wanted)
    return keys, wanted >= 0, _ring_write(address, window, kv, keys)


def _compress(address: CacheAddress, comp: KVCompressor, x: torch.Tensor, pending: torch.Tensor,
              entries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One compressor over the step: x [T, H] -> (pending ring, entries, both written; each sequence's entries
    [N, E, w] in entry order, as they are after the step)."""
    m, w, c = comp.rate, comp.width, 2 if comp.overlap else 1
    p, seq = address.positions, address.seq
    raw = torch.cat((comp.kv_proj(x), comp.gate_proj(x)), dim=-1)  # [T, 2cw]: kv | gate, before the position bias
    # The candidate entry that closes at each token: its c*m window positions p-cm+1 .. p (the overlap: the previous
    # window's first half, then this window's second half).
    wanted = p[:, None] - (c * m - 1) + torch.arange(c * m, device=p.device)  # [T, cm]
    rows = _ring_read(address, pending, raw, wanted)  # [T, cm, 2cw]
    bias = comp.position_bias[torch.arange(c * m, device=p.device) % m]  # [cm, cw]: by index within its window
    kv, gate = rows[..., : c * w], rows[..., c * w:] + bias
    if c == 2:  # slots 0..m-1 read the previous window's Ca (first w), slots m..2m-1 this window's Cb (last w)
        kv = torch.cat((kv[:, :m, :w], kv[:, m:, w:]), dim=1)  # [T, 2m, w]
        gate = torch.cat((gate[:, :m, :w], gate[:, m:, w:]), dim=1)
        absent = (wanted < 0)[..., None]  # before the first window: kv 0, gate -inf (weight 0)
        kv = kv.masked_fill(absent, 0.0)
        gate = gate.masked_fill(absent, float("-inf"))
    pooled = (kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1)  # [T, w]
    entry_index = torch.div(p, m, rounding_mode="floor")  # [T]: the window each token belongs to
    cos, sin = comp.rotary((entry_index * m)[None, :])  # [1, T, Dr/2] at the window's first position
    candidate = apply_rotary_tail(comp.kv_norm(pooled)[None, :, None, :], cos, sin)[0, :, 0]  # [T, w]

    new_pending = _ring_write(address, pending, raw, rows)
    # Entry e: every token of window e in the step writes the same value: the candidate of its closing token when
    # that token is in the step, else the entry as it was (read before this write).
    per_block = entries.shape[1]
    closing = entry_index * m + (m - 1)  # [T]
    block = address.tables[seq, torch.div(entry_index, per_block, rounding_mode="floor")]
    row = entry_index % per_block
    closes_now = closing <= address.step_end[seq]
    value = torch.where(closes_now[:, None], candidate[address.packed_index(seq, closing)], entries[block, row])
    new_entries = entries.index_put((block, row), value)
    return new_pending, new_entries, _sequence_entries(address, new_entries, m)


def _entry_places(address: CacheAddress, per_block: int, rate: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block [N, E], row [E]) of every entry a sequence may read, in entry order: its block table's (paged), or the
    first ceil(context / m) of its row (contiguous: what the longest row has reached, not the whole buffer)."""
    count = (address.tables.shape[1] * per_block if address.context is None
             else (address.context + rate - 1) // rate)
    j = torch.arange(count, device=address.tables.device)
    return address.tables[:, torch.div(j, per_block, rounding_mode="floor")], j % per_block


def _sequence_entries(address: CacheAddress, entries: torch.Tensor, rate: int) -> torch.Tensor:
    """Each sequence's entries [N, E, w] from the written buffer [blocks, per_block, w]."""
    blocks, rows = _entry_places(address, entries.shape[1], rate)
    return entries[blocks, rows[None, :].expand_as(blocks)]


def _token_scores(address: CacheAddress, q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q [T, H, w] . each token's sequence's keys [N, E, w] -> [T, H, E]. Contiguous rows are batched (the keys are
    read once per row); packed tokens read their sequence's keys each."""
    if address.rows is not None:
        b, s = address.rows
        return torch.matmul(q.reshape(b, s * q.shape[1], -1), keys.transpose(1, 2)).reshape(b * s, q.shape[1], -1)
    return torch.matmul(q, keys[address.seq].transpose(1, 2))


def _token_values(address: CacheAddress, probs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """probs [T, H, E] . each token's sequence's values [N, E, w] -> [T, H, w] (batched as ``_token_scores``)."""
    if address.rows is not None:
        b, s = address.rows
        return torch.matmul(probs.reshape(b, s * probs.shape[1], -1), values).reshape(b * s, probs.shape[1], -1)
    return torch.matmul(probs, values[address.seq])


def _readable(address: CacheAddress, count: int, rate: int) -> torch.Tensor:
    """[T, E] bool: entry j is closed for token p (j < (p + 1) // m)."""
    closed = torch.div(address.positions + 1, rate, rounding_mode="floor")
    return torch.arange(count, device=closed.device)[None, :] < closed[:, None]


def cached_attention(attn: CompressedAttention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     address: CacheAddress, buffers: tuple[torch.Tensor, ...]
                     ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """One V4 attention layer over the step: x [T, H] (normed), cos/sin [T, Dr/2] of the layer's RoPE at the tokens'
    positions, ``buffers`` in ``kv_layout_v4.layer_buffers`` order -> (out [T, H], the buffers written)."""
    t = x.shape[0]
    n, d = attn.num_heads, attn.head_dim
    cos3, sin3 = cos[None], sin[None]  # [1, T, Dr/2]
    q_resid = attn.q_a_norm(attn.q_a_proj(x))  # [T, Q]
    q = rms_normalize(attn.q_b_proj(q_resid).view(1, t, n, d), attn.norm_eps)
    q = apply_rotary_tail(q, cos3, sin3)[0]  # [T, Hn, D]
    kv = apply_rotary_tail(attn.kv_norm(attn.kv_proj(x)).view(1, t, 1, d), cos3, sin3)[0, :, 0]  # [T, D]

    keys, mask, window = _window_keys(address, buffers[0], kv, attn.window)  # [T, W, D], [T, W]
    written: tuple[torch.Tensor, ...] = (window,)
    # Scores against the window, then (compressed layers) against the entries; one softmax over both and the sink.
    scores = torch.matmul(q, keys.transpose(1, 2)).masked_fill(~mask[:, None, :], float("-inf"))  # [T, Hn, W]
    comp = attn.compressor
    entry_scores = picked = seq_entries = None
    if comp is not None:
        pending, entries, seq_entries = _compress(address, comp, x, buffers[1], buffers[2])  # seq_entries [N, E, D]
        written = (window, pending, entries)
        readable = _readable(address, seq_entries.shape[1], comp.rate)  # [T, E]
        if isinstance(comp, SparseCompressor):  # CSA: the indexer's top-k entries, gathered alone
            ix = comp.indexer
            index_pending, index_entries, index_keys = _compress(address, ix, x, buffers[3], buffers[4])
            written = (*written, index_pending, index_entries)
            iq = apply_rotary_tail(ix.q_b_proj(q_resid).view(1, t, ix.n_heads, ix.width), cos3, sin3)[0]  # [T,Hi,Di]
            relu = F.relu(_token_scores(address, iq, index_keys)) * ix.scale  # [T, Hi, E]
            weights = ix.scorer.weights_proj(x) * ix.n_heads ** -0.5  # [T, Hi]
            index = (relu * weights[..., None]).sum(dim=1).masked_fill(~readable, float("-inf"))  # [T, E]
            # topk columns of -inf after the E entries: K = topk whatever E is (no shape-dependent min to export); a
            # pick among them (fewer readable entries than topk) is not readable, and reads entry 0, masked.
            index = torch.cat((index, index.new_full((t, ix.topk), float("-inf"))), dim=1)
            top, chosen = index.topk(ix.topk, dim=-1)  # [T, K]
            chosen = torch.where(top > float("-inf"), chosen, 0)
            blocks, rows = _entry_places(address, entries.shape[1], comp.rate)
            picked = entries[blocks[address.seq[:, None], chosen], rows[chosen]]  # [T, K, D]
            entry_scores = torch.matmul(q, picked.transpose(1, 2)).masked_fill(
                ~(top > float("-inf"))[:, None, :], float("-inf"))  # [T, Hn, K]
        else:  # HCA: every closed entry
            entry_scores = _token_scores(address, q, seq_entries).masked_fill(~readable[:, None, :], float("-inf"))
        scores = torch.cat((scores, entry_scores), dim=-1)  # [T, Hn, W + E]
    logits = torch.cat((scores * attn.scale, attn.sinks.to(scores.dtype)[None, :, None].expand(t, -1, 1)), dim=-1)
    probs = torch.softmax(logits, dim=-1)  # [T, Hn, W + E + 1]: the sink's column is dropped below
    window_size = keys.shape[1]
    out = torch.matmul(probs[..., :window_size], keys)  # [T, Hn, D]
    if picked is not None:
        out = out + torch.matmul(probs[..., window_size:-1], picked)
    elif seq_entries is not None:
        out = out + _token_values(address, probs[..., window_size:-1], seq_entries)
    out = apply_rotary_tail(out[None], cos3, -sin3)  # [1, T, Hn, D]
    grouped = attn.o_a_proj(out.reshape(1, t, attn.groups, -1))  # [1, T, G, R]
    return attn.o_b_proj(grouped.flatten(2))[0], written
