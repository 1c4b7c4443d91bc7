"""Prompt-lookup speculative decoding: draft tokens copied from earlier in the sequence itself.

vLLM's ``ngram`` speculative method, TensorRT-LLM's and transformers' prompt-lookup decoding: when a sequence's last
n tokens (n from ``max_ngram`` down to ``min_ngram``) occurred before, the tokens that followed their latest earlier
occurrence are proposed as the next ones. The engine feeds them after the last sampled token in one model run; the
logits of every fed position give the greedy token after it, so draft i is accepted while it equals the token the
model picks after draft i - 1, and the run yields the accepted drafts plus one more token. Greedy output is exactly
what plain decoding gives; a run whose drafts are all rejected still yields its one token. It pays where text
repeats itself (code, quoting the prompt, lists, the loops small models fall into) because a run over k + 1 tokens
costs much less than k + 1 one-token steps when decoding is bound by streaming the weights
(docs/performance.md measures both halves).

``NgramIndex`` keeps the latest end of every n-gram of one sequence, updated as tokens arrive, so proposing costs
O(max_ngram) dictionary lookups per step, not a scan of the sequence.
"""

from __future__ import annotations

from collections.abc import Iterable


class NgramIndex:
    """The latest occurrence of every n-gram (``min_ngram`` <= n <= ``max_ngram``) of one growing sequence.

    ``latest[n][gram]`` is the end (exclusive) of the latest occurrence of ``gram`` that ends before the sequence's
    last token, so the tokens from there on can be proposed to follow a tail equal to ``gram``.
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_ngram ({min_ngram}) <= max_ngram ({max_ngram})")
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.tokens: list[int] = []
        self._latest: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_ngram, max_ngram + 1)}

    def extend(self, tokens: Iterable[int]) -> None:
        """Append tokens to the sequence and index the n-grams that now end before its last token."""
        old = len(self.tokens)
        self.tokens.extend(tokens)
        seq = self.tokens
        # Ends old .. len - 1 become indexable (end len is the tail itself: it must not propose itself).
        for end in range(max(old, 1), len(seq)):
            for n, latest in self._latest.items():
                if end >= n:
                    latest[tuple(seq[end - n:end])] = end

    def propose(self, num_tokens: int) -> list[int]:
        """Up to ``num_tokens`` tokens that followed the latest earlier occurrence of the longest matching tail
        (longest n first); [] when no tail of ``min_ngram`` or more tokens occurred before."""
        seq = self.tokens
        if num_tokens < 1:
            return []
        for n in range(min(self.max_ngram, len(seq) - 1), self.min_ngram - 1, -1):
            end = self._latest[n].get(tuple(seq[len(seq) - n:]))
            if end is not None:
                return seq[end:end + num_tokens]
        return []


class Drafter:
    """One request's drafting: its ``NgramIndex`` and how many tokens to draft next.

    A verification run costs more per fed token than it saves when its drafts are rejected, so the draft length
    follows the acceptance (as transformers' "heuristic" assistant schedule does): all drafts accepted -> 2 more
    next time (up to ``max_tokens``); some -> one more than were accepted; none -> half as many, and no drafts for
    the next 1, 3, 7, 15 steps as misses repeat (reset by an accepted draft). Text that does not repeat itself thus
    decodes at plain speed, and text that does gets long drafts.
    """

    MAX_PAUSE = 15

    def __init__(self, max_tokens: int, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.index = NgramIndex(max_ngram, min_ngram)
        self.max_tokens = self.limit = max_tokens
        self.pause = self.misses = 0

    def propose(self, new_tokens: Iterable[int]) -> list[int]:
        """Take the sequence's tokens since the last call; return the drafts for its next decode ([] when paused
        or when no tail occurred before)."""
        self.index.extend(new_tokens)
        if self.pause:
            self.pause -= 1
            return []
        return self.index.propose(self.limit)

    def record(self, drafted: int, accepted: int) -> None:
        """The verification of ``drafted`` draft tokens accepted the first ``accepted``."""
        if drafted == 0:
            return
        if accepted == drafted:
            self.limit, self.misses = min(self.max_tokens, self.limit + 2), 0
        elif accepted:
            self.limit, self.misses = accepted + 1, 0
        else:
            self.limit, self.misses = max(1, self.limit // 2), self.misses + 1
            self.pause = min(2 ** self.misses - 1, self.MAX_PAUSE)
