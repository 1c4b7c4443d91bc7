"""Sampler: picks the next token for every row of a batch of logits, each row with its own parameters.

Dimension letters: B batch rows, R rows a transform acts on, V vocabulary.

Processing order (vLLM / Hugging Face semantics), each step on the output of the previous one:

0. the request's token mask, when constrained decoding gives one (``token_bitmask``: disallowed tokens get -inf;
   a greedy row reads one bit to see that its argmax is allowed, and is masked only when it is not);
1. repetition penalty over prompt + output tokens (HF: a positive logit is divided by the
   penalty, a negative one multiplied, so a penalty > 1 always makes a seen token less likely);
2. presence penalty over output tokens (subtracted once per distinct token, as in vLLM/OpenAI);
3. temperature (0 = greedy: the row takes the argmax here and skips the rest);
4. top-k, 5. top-p, 6. min-p (removed tokens get -inf);
7. one draw from what is left, with the row's own generator.

Why this order: penalties act on the model's scores, so a penalty means the same at any
temperature; temperature comes before the filters so that top-p and min-p measure the
distribution that is actually sampled from; top-k before top-p before min-p is the order of
Hugging Face's warpers, so top-p's mass is taken over the top-k survivors (renormalised). The
filters never remove the most likely token, so greedy (argmax of the penalised logits) equals the
argmax after any filter, and a filtered row always keeps at least one token.

Ties: top-k keeps every token tied with the k-th largest logit, and top-p keeps every token tied
with the last one it needs; so the kept set never depends on how a sort orders equal values.

Drawing: inverse CDF. A sampled row draws exactly one uniform u in [0, 1) from its generator and
takes the first token whose cumulative (unnormalised) weight exceeds u times the total. One draw
per sampled step makes a seeded request's stream easy to reason about: its generator is advanced
only by its own rows, so the tokens it gets do not depend on which other requests share the batch.
Rows without a generator share the sampler's own (seeded at construction) in row order.

Logprobs are those of the raw model distribution: log-softmax of the logits as given, before any
penalty, temperature or filter (vLLM's default, ``raw_logprobs``). They describe what the model
predicted, independent of how it was sampled, and so stay comparable across sampling settings.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from moeforge.core.errors import MoeforgeError
from moeforge.runtime.structured_output import StructuredOutput

MAX_LOGPROBS = 20
MAX_PRESENCE_PENALTY = 2.0  # vLLM and the OpenAI API accept [-2, 2]
MAX_SEED = 2**64 - 1  # the widest seed both numpy's and torch's generators take
MAX_TOP_K = 2**31 - 1  # int32; any k >= the vocabulary is off anyway
MAX_PENALTY = float(np.finfo(np.float32).max)  # a larger repetition penalty overflows the float32 logits


class SamplingParamsError(MoeforgeError, ValueError):
    """A sampling parameter outside its valid range; ``param`` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param} {message}")
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling parameters. temperature 0 is greedy; top_k 0, top_p 1.0, min_p 0.0,
    repetition_penalty 1.0 and presence_penalty 0.0 are off. ``logprobs`` (vLLM's meaning): None returns no
    logprobs (and costs nothing per step); N >= 0 returns the chosen token's and the N most likely ones'.
    ``max_tokens``, the stop fields and ``ignore_eos`` are read by the engine, not by the sampler.
    ``structured_output``: what the output must match (a JSON schema...); the engine enforces it by constrained
    decoding, handing the sampler a token mask for the request's row (``Sampler.sample``'s ``token_bitmask``)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    logprobs: int | None = None
    ignore_eos: bool = False
    structured_output: StructuredOutput | None = None

    def __post_init__(self) -> None:
        # Accept lists for the stop fields but store tuples, so the params stay hashable. One string is one stop
        # string: tuple("ab") would silently make each of its characters a stop string.
        stops, stop_ids = self.stop_strings, self.stop_token_ids
        for name, value in (("stop_strings", stops), ("stop_token_ids", stop_ids)):
            if isinstance(value, bytes) or not isinstance(value, Iterable):  # None, a number: not a list
                raise SamplingParamsError(name, f"must be a list (empty: none), got {value!r}")
        object.__setattr__(self, "stop_token_ids", tuple(stop_ids))
        object.__setattr__(self, "stop_strings", (stops,) if isinstance(stops, str) else tuple(stops))

    def validate(self, vocab_size: int, names: Mapping[str, str] | None = None) -> None:
        """Raise ``SamplingParamsError`` naming the first parameter outside its valid range. The one set of
        rules for every backend: the PyTorch reference (``moeforge/verify/generate.py``) validates through it too.
        ``names`` maps a field to the name the caller's user knows it by (a CLI flag, another API's field);
        ``SamplingParamsError.param`` is then that name."""

        def check(ok: bool, param: str, message: str) -> None:
            if not ok:
                param = (names or {}).get(param, param)
                raise SamplingParamsError(param, message)

        def is_int(x: object) -> bool:
            return isinstance(x, int | np.integer) and not isinstance(x, bool)

        def is_real(x: object) -> bool:
            # Checked before any comparison: a str or None would raise TypeError, a bool pass as 0/1.
            return isinstance(x, int | float | np.integer | np.floating) and not isinstance(x, bool)

        t, p, m = self.temperature, self.top_p, self.min_p
        check(is_real(t) and math.isfinite(t) and t >= 0, "temperature",
              f"must be a finite number >= 0 (0 = greedy), got {t!r}")
        check(is_int(self.top_k) and 0 <= self.top_k <= MAX_TOP_K, "top_k",
              f"must be an integer in [0, {MAX_TOP_K}] (0 = off), got {self.top_k!r}")
        check(is_real(p) and 0.0 < p <= 1.0, "top_p", f"must be in (0, 1] (1 = off), got {p!r}")
        check(is_real(m) and 0.0 <= m <= 1.0, "min_p", f"must be in [0, 1] (0 = off), got {m!r}")
        rp, pp = self.repetition_penalty, self.presence_penalty
        check(is_real(rp) and math.isfinite(rp) and 0 < rp <= MAX_PENALTY, "repetition_penalty",
              f"must be a number in (0, {MAX_PENALTY:.4g}] (1 = off), got {rp!r}")
        check(is_real(pp) and -MAX_PRESENCE_PENALTY <= pp <= MAX_PRESENCE_PENALTY, "presence_penalty",
              f"must be in [-{MAX_PRESENCE_PENALTY}, {MAX_PRESENCE_PENALTY}] (0 = off), got {pp!r}")
        check(self.seed is None or (is_int(self.seed) and 0 <= self.seed <= MAX_SEED), "seed",
              f"must be None or an integer in [0, 2**64 - 1], got {self.seed!r}")
        check(is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens",
              f"must be an integer >= 1, got {self.max_tokens!r}")
        check(self.logprobs is None or (is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS), "logprobs",
              f"must be None (none) or an integer in [0, {MAX_LOGPROBS}] (0 = only the chosen token's), "
              f"got {self.logprobs!r}")
        bad = [t for t in self.stop_token_ids if not (is_int(t) and 0 <= t < vocab_size)]
        check(not bad, "stop_token_ids", f"must be token ids in [0, {vocab_size}), got {bad[:5]}")
        check(all(isinstance(s, str) and s for s in self.stop_strings), "stop_strings",
              f"must be non-empty strings, got {list(self.stop_strings)[:5]}")
        check(self.structured_output is None or isinstance(self.structured_output, StructuredOutput),
              "structured_output", f"must be None or a StructuredOutput, got {type(self.structured_output).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def argmax_only(self) -> bool:
        """The token is the argmax of the raw logits and nothing else is read from them: greedy, no penalties,
        no logprobs (a backend may then approximate every other logit, see ``StepInput.argmax_only``)."""
        return (self.temperature == 0.0 and self.repetition_penalty == 1.0 and self.presence_penalty == 0.0
                and self.logprobs is None and self.structured_output is None)

    def make_generator(self) -> np.random.Generator | None:
        """The request's own generator (None without a seed): the same seed gives the same tokens."""
        return None if self.seed is None else np.random.default_rng(self.seed)


@dataclass
class SampleOutput:
    """token_ids [B] int64; logprobs [B] float32: the chosen tokens' raw-distribution logprobs (NaN in rows whose
    ``params.logprobs`` is None: not computed); top_logprobs: per row, the ``params.logprobs`` most likely
    (token, logprob) pairs of the raw distribution, most likely first (ties: lower id first); empty for rows
    that asked for none."""

    token_ids: np.ndarray
    logprobs: np.ndarray
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)


# ---- transforms: logits [R, V] with one parameter per row -> new logits [R, V]; input unchanged ----


def _distinct_positions(token_ids: Sequence[Sequence[int]], vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, token) index pairs of the distinct tokens of each row."""
    lengths = [len(t) for t in token_ids]
    rows = np.repeat(np.arange(len(token_ids), dtype=np.int64), lengths)
    cols = np.fromiter((t for ids in token_ids for t in ids), dtype=np.int64, count=sum(lengths))
    flat = np.unique(rows * vocab_size + cols)
    return flat // vocab_size, flat % vocab_size


def apply_repetition_penalty(logits: np.ndarray, token_ids: Sequence[Sequence[int]], penalty: np.ndarray) -> np.ndarray:
    """HF semantics: each distinct seen token's logit is divided by the penalty if positive, else
    multiplied. ``token_ids``: per row, the prompt and output tokens."""
    out = logits.copy()
    r, c = _distinct_positions(token_ids, logits.shape[-1])
    p = np.asarray(penalty, dtype=logits.dtype)[r]
    seen = out[r, c]
    out[r, c] = np.where(seen > 0, seen / p, seen * p)
    return out


def apply_presence_penalty(logits: np.ndarray, output_ids: Sequence[Sequence[int]], penalty: np.ndarray) -> np.ndarray:
    """Subtract the penalty once from each distinct token already generated (vLLM/OpenAI)."""
    out = logits.copy()
    r, c = _distinct_positions(output_ids, logits.shape[-1])
    out[r, c] -= np.asarray(penalty, dtype=logits.dtype)[r]
    return out


def apply_temperature(logits: np.ndarray, temperature: np.ndarray) -> np.ndarray:
    """(logits - row max) / temperature, temperature > 0. The shift leaves the distribution as is
    and keeps a tiny temperature from overflowing: the max maps to 0, the rest to <= 0 (-inf allowed).
    Divided in float64: a temperature below float32's smallest (~1e-45) would round to 0 and give NaN."""
    shifted = logits.astype(np.float64) - logits.max(axis=-1, keepdims=True)
    with np.errstate(over="ignore"):  # the far tail becomes -inf: probability 0, as intended
        tempered: np.ndarray = (shifted / np.asarray(temperature, dtype=np.float64)[:, None]).astype(logits.dtype)
    return tempered


def apply_top_k(logits: np.ndarray, top_k: np.ndarray) -> np.ndarray:
    """Keep the logits >= the row's k-th largest (ties with it kept); k <= 0 or k >= V is off."""
    vocab = logits.shape[-1]
    k = np.asarray(top_k, dtype=np.int64)
    out = logits.copy()
    rows = np.flatnonzero((k > 0) & (k < vocab))
    if rows.size:
        # One partition puts every needed order statistic in place for all rows at once.
        kth_pos = vocab - k[rows]
        part = np.partition(logits[rows], np.unique(kth_pos), axis=-1)
        kth = part[np.arange(rows.size), kth_pos]
        sub = out[rows]
        sub[sub < kth[:, None]] = -np.inf
        out[rows] = sub
    return out


def apply_top_p(logits: np.ndarray, top_p: np.ndarray) -> np.ndarray:
    """Keep the smallest set of most likely tokens whose probability reaches top_p, plus any token
    tied with the last one of it; top_p >= 1 is off. The most likely token always survives."""
    p = np.asarray(top_p, dtype=np.float64)
    out = logits.copy()
    rows = np.flatnonzero(p < 1.0)
    if rows.size:
        sub = out[rows]
        weights = np.exp(sub - sub.max(axis=-1, keepdims=True))  # unnormalised probabilities
        ordered = -np.sort(-weights, axis=-1)
        cum = np.cumsum(ordered, axis=-1, dtype=np.float64)
        before = np.concatenate([np.zeros((rows.size, 1)), cum[:, :-1]], axis=-1)  # mass above each rank
        # A rank is needed while the mass above it is still short of top_p; rank 0 always is.
        n_keep = (before < p[rows, None] * cum[:, -1:]).sum(axis=-1)
        cutoff = ordered[np.arange(rows.size), n_keep - 1]
        sub[weights < cutoff[:, None]] = -np.inf
        out[rows] = sub
    return out


def apply_min_p(logits: np.ndarray, min_p: np.ndarray) -> np.ndarray:
    """Keep the tokens whose probability is >= min_p times the row's largest; min_p 0 is off."""
    m = np.asarray(min_p, dtype=np.float64)
    out = logits.copy()
    rows = np.flatnonzero(m > 0.0)
    if rows.size:
        sub = out[rows]
        ratio = np.exp(sub - sub.max(axis=-1, keepdims=True))  # p / p_max, no normalisation needed
        sub[ratio < m[rows, None]] = -np.inf
        out[rows] = sub
    return out


def logsumexp(logits: np.ndarray, row_max: np.ndarray) -> np.ndarray:
    """log(sum(exp(logits))) per row of logits [B, V] -> [B] float64, given each row's max [B]: the exponentials
    in float32 (the logits' precision), their sum accumulated in float64."""
    shifted = np.exp(logits - row_max[:, None].astype(logits.dtype))
    result: np.ndarray = row_max.astype(np.float64) + np.log(shifted.sum(axis=-1, dtype=np.float64))
    return result


def raw_logprobs(logits: np.ndarray) -> np.ndarray:
    """log-softmax over the last axis, accumulated in float64."""
    x = logits.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    logprobs: np.ndarray = x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))
    return logprobs


class Sampler:
    """Samples one token per row. Parameters are validated by the engine on admission, not here."""

    def __init__(self, seed: int | None = None) -> None:
        # Shared by rows that have no generator of their own (unseeded requests).
        self._rng = np.random.default_rng(seed)
        self._nan = np.full(0, np.nan, np.float32)  # read-only NaNs: greedy steps' logprobs, sliced per batch

    def _no_logprobs(self, rows: int) -> np.ndarray:
        """[rows] NaN float32, a read-only view of a buffer kept across steps (no allocation per step)."""
        if len(self._nan) < rows:
            self._nan = np.full(max(rows, 2 * len(self._nan)), np.nan, np.float32)
            self._nan.flags.writeable = False
        return self._nan[:rows]

    def process(
        self,
        logits: np.ndarray,
        params: Sequence[SamplingParams],
        output_tokens: Sequence[Sequence[int]],
        prompt_tokens: Sequence[Sequence[int]],
    ) -> np.ndarray:
        """Logits [B, V] -> processed logits [B, V] float32: penalised for every row; for sampled rows
        also tempered and filtered (-inf = removed). A row's distribution is the softmax of its row."""
        if logits.ndim != 2:
            raise ValueError(f"logits must be [B, V], got shape {logits.shape}")
        batch = logits.shape[0]
        for name, seq in (("params", params), ("output_tokens", output_tokens), ("prompt_tokens", prompt_tokens)):
            if len(seq) != batch:
                raise ValueError(f"{name} has {len(seq)} rows, logits has {batch}")
        if np.isnan(logits).any():
            bad = np.flatnonzero(np.isnan(logits).any(axis=-1)).tolist()
            raise ValueError(f"logits rows {bad[:5]} contain NaN")
        x = np.array(logits, dtype=np.float32)  # a copy: the caller's buffer is left alone

        rep = np.array([q.repetition_penalty for q in params], dtype=np.float32)
        if (rows := np.flatnonzero(rep != 1.0)).size:
            seen = [list(prompt_tokens[i]) + list(output_tokens[i]) for i in rows.tolist()]
            x[rows] = apply_repetition_penalty(x[rows], seen, rep[rows])
        presence = np.array([q.presence_penalty for q in params], dtype=np.float32)
        if (rows := np.flatnonzero(presence != 0.0)).size:
            x[rows] = apply_presence_penalty(x[rows], [output_tokens[i] for i in rows.tolist()], presence[rows])

        sampled = [i for i, q in enumerate(params) if not q.greedy]
        rows = np.array(sampled, dtype=np.int64)
        if rows.size:
            sub = apply_temperature(x[rows], np.array([params[i].temperature for i in sampled]))
            sub = apply_top_k(sub, np.array([params[i].top_k for i in sampled]))
            sub = apply_top_p(sub, np.array([params[i].top_p for i in sampled]))
            x[rows] = apply_min_p(sub, np.array([params[i].min_p for i in sampled]))
        return x

    def sample(
        self,
        logits: np.ndarray,
        params: Sequence[SamplingParams],
        generators: Sequence[np.random.Generator | None],
        output_tokens: Sequence[Sequence[int]],
        prompt_tokens: Sequence[Sequence[int]],
        token_bitmask: np.ndarray | None = None,
    ) -> SampleOutput:
        """Pick one token per row of logits [B, V]. ``generators[i]`` is row i's own generator (see
        ``SamplingParams.make_generator``) or None; it is advanced by one draw when row i samples
        and not at all when it is greedy. ``output_tokens``/``prompt_tokens``: tokens so far per row.
        ``token_bitmask`` int32 [B, ceil(V / 32)]: row i may only pick the tokens whose bit is set (bit t of word
        t // 32; all ones: unconstrained), applied before everything else (constrained decoding,
        runtime/grammar.py); logprobs stay those of the raw logits."""
        if len(generators) != len(params):
            raise ValueError(f"generators has {len(generators)} rows, params has {len(params)}")
        if logits.ndim != 2:
            raise ValueError(f"logits must be [B, V], got shape {logits.shape}")
        for name, seq in (("params", params), ("output_tokens", output_tokens), ("prompt_tokens", prompt_tokens)):
            if len(seq) != logits.shape[0]:
                raise ValueError(f"{name} has {len(seq)} rows, logits has {logits.shape[0]}")
        raw = logits
        fast = all(q.greedy and q.repetition_penalty == 1.0 and q.presence_penalty == 0.0 for q in params)
        if token_bitmask is not None and not fast:
            logits = apply_token_bitmask(logits, token_bitmask)
        if fast:
            # The serving hot path: plain greedy needs no processed copy of the logits, only argmax -- which
            # returns a row's first NaN if it holds one (NaN compares as the maximum), so the NaN check reads one
            # value per row. It runs right after the kernels have swept the caches, when each distinct numpy
            # routine costs tens of microseconds, so it uses one (argmax) and scalar reads.
            tokens = logits.argmax(axis=-1)  # [B] intp (int64 here)
            if any(math.isnan(logits[row, token]) for row, token in enumerate(tokens.tolist())):
                _raise_nan(logits)
            if token_bitmask is not None:
                tokens = _masked_argmax(logits, tokens, token_bitmask)
            if all(q.logprobs is None for q in params):
                return SampleOutput(tokens.astype(np.int64, copy=False), self._no_logprobs(len(tokens)),
                                    [[] for _ in params])
        else:
            x = self.process(logits, params, output_tokens, prompt_tokens)
            tokens = x.argmax(axis=-1).astype(np.int64)  # the greedy rows' answer; sampled rows overwritten
            rows = np.array([i for i, q in enumerate(params) if not q.greedy], dtype=np.int64)
            if rows.size:
                u = np.array([(self._rng if generators[i] is None else generators[i]).random() for i in rows])
                tokens[rows] = _inverse_cdf(x[rows], u)

        # Logprobs only for rows that asked: the exponentials over the vocabulary cost more than the rest of a
        # greedy step's host work.
        chosen = np.full(len(tokens), np.nan, np.float32)
        wanted = np.array([i for i, q in enumerate(params) if q.logprobs is not None], dtype=np.int64)
        logits = raw
        if wanted.size:
            rows = logits[wanted]
            picked = rows[np.arange(len(wanted)), tokens[wanted]].astype(np.float64)
            chosen[wanted] = picked - logsumexp(rows, rows.max(axis=-1))
        top = [_top_n(raw_logprobs(logits[i]), q.logprobs) if q.logprobs else [] for i, q in enumerate(params)]
        return SampleOutput(tokens, chosen, top)


def apply_token_bitmask(logits: np.ndarray, bitmask: np.ndarray) -> np.ndarray:
    """logits [B, V] with -inf where ``bitmask`` int32 [B, ceil(V / 32)] has a 0 bit; the input itself when no row is
    constrained (every word -1), else a copy. A row that allows no token is refused (the grammar always allows one)."""
    if bitmask.shape != (logits.shape[0], (logits.shape[1] + 31) // 32):
        raise ValueError(f"token_bitmask must be [{logits.shape[0]}, {(logits.shape[1] + 31) // 32}], got "
                         f"{bitmask.shape}")
    rows = np.flatnonzero((bitmask != -1).any(axis=-1))
    if not rows.size:
        return logits
    bits = np.unpackbits(np.ascontiguousarray(bitmask[rows]).view(np.uint8), axis=-1, bitorder="little")
    allowed = bits[:, :logits.shape[1]].astype(bool)
    if not allowed.any(axis=-1).all():
        raise ValueError(f"token_bitmask rows {rows[~allowed.any(axis=-1)].tolist()[:5]} allow no token")
    out = logits.copy()
    out[rows] = np.where(allowed, logits[rows], -np.inf)
    return out


def _masked_argmax(logits: np.ndarray, tokens: np.ndarray, bitmask: np.ndarray) -> np.ndarray:
    """The argmax of each row of logits [B, V] among the tokens ``bitmask`` allows, given the unmasked argmax
    ``tokens`` [B]: a row whose argmax is allowed keeps it (one bit read, the common case under a grammar the model
    follows), only the others are masked (``apply_token_bitmask``) and searched again."""
    if bitmask.shape != (logits.shape[0], (logits.shape[1] + 31) // 32):
        raise ValueError(f"token_bitmask must be [{logits.shape[0]}, {(logits.shape[1] + 31) // 32}], got "
                         f"{bitmask.shape}")
    words = bitmask[np.arange(len(tokens)), tokens >> 5].astype(np.int64) & 0xFFFFFFFF
    blocked = np.flatnonzero(((words >> (tokens & 31)) & 1) == 0)
    if blocked.size:
        tokens = tokens.copy()
        tokens[blocked] = apply_token_bitmask(logits[blocked], bitmask[blocked]).argmax(axis=-1)
    return tokens


def _raise_nan(logits: np.ndarray) -> None:
    bad = np.flatnonzero(np.isnan(logits).any(axis=-1)).tolist()
    raise ValueError(f"logits rows {bad[:5]} contain NaN")


def _inverse_cdf(logits: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Per row, the first token whose cumulative weight exceeds u * total (u in [0, 1)). A token with
    zero weight never exceeds its predecessor's cumulative weight, so it is never chosen."""
    weights = np.exp(logits - logits.max(axis=-1, keepdims=True))
    cdf = np.cumsum(weights, axis=-1, dtype=np.float64)
    # u < 1 keeps u * total < total (round-to-nearest never lifts it to total), so the index is < V.
    target = u * cdf[:, -1]
    tokens: np.ndarray = (cdf <= target[:, None]).sum(axis=-1).astype(np.int64)
    return tokens


def _top_n(logprobs: np.ndarray, n: int) -> list[tuple[int, float]]:
    """The n largest entries of logprobs [V] as (token, logprob), largest first, ties by lower id."""
    if n <= 0:
        return []
    n = min(n, logprobs.shape[-1])
    # Every token tied with the n-th largest is a candidate, so the tie-break by id is exact.
    nth = -np.partition(-logprobs, n - 1)[n - 1]
    idx = np.flatnonzero(logprobs >= nth)
    idx = idx[np.lexsort((idx, -logprobs[idx]))][:n]
    return [(int(i), float(logprobs[i])) for i in idx]
