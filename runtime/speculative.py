"""Prompt-lookup speculative decoding: draft tokens copied from earlier in the sequence itself.

vLLM's ``ngram`` speculative method, TensorRT-LLM's and transformers' prompt-lookup decoding: when a sequence's last
n tokens (n from ``max_ngram`` down to ``min_ngram``) occurred before, the tokens that followed their latest earlier
occurrence are proposed as the next ones. The engine feeds them after the last sampled token in one model run; the
logits of every fed position give the greedy token after it, so draft i is accepted while it equals the token the
model picks after draft i - 1, and the run yields the accepted drafts plus one more token. Greedy output is exactly
what plain decoding gives; a run whose drafts are all rejected still yields its one token. It pays where text
repeats itself (code, quoting the prompt, lists, the loops small models fall into) because a run over k + 1 tokens
costs much less than k + 1 one-token steps when decoding is bound by streaming the weights
(benchmarks/speculative_potential.py measures both halves).

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
