"""The benchmarks' one timer: every script in benchmarks/ times through it, on one clock (``time.perf_counter``).

* ``Stopwatch``: seconds since it started (``elapsed()``), or of a ``with`` block (``seconds``): one-off timings
  (a compile, an engine load, a generation timed from its first token);
* ``Samples``: repeated timings, in seconds, with ``median()`` and ``percentile(q)``; ``samples.measure()`` times
  one block into them, for loops that prepare each repeat outside the timed part;
* ``repeat(fn, repeats, warmup=...)``: ``fn()`` run ``warmup`` times untimed, then timed ``repeats`` times;
* ``Rounds``: alternating rounds over several systems, each system once per round in an order that changes from
  round to round, so that a machine whose load drifts slows all of them alike.

Scripts import it as a sibling module (``from timer import Samples``), as they import ``peers``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

K = TypeVar("K")
S = TypeVar("S")
T = TypeVar("T")


@dataclass
class Stopwatch:
    """Started when made (``restart()`` starts it again): ``elapsed()`` is the seconds since. As a context manager it
    starts on entry and, on exit, sets ``seconds`` to the block's duration and appends it to ``into`` when given."""

    into: list[float] | None = field(default=None, repr=False)
    started: float = field(default_factory=time.perf_counter)
    seconds: float = 0.0

    def restart(self) -> None:
        self.started = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def __enter__(self) -> Stopwatch:
        self.restart()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.started
        if self.into is not None:
            self.into.append(self.seconds)


@dataclass
class Samples:
    """Seconds of repeated timings, in the order taken."""

    seconds: list[float] = field(default_factory=list)

    def measure(self) -> Stopwatch:
        """``with samples.measure(): ...`` adds the block's seconds."""
        return Stopwatch(into=self.seconds)

    def median(self) -> float:
        return statistics.median(self.seconds)

    def percentile(self, q: float) -> float:
        """The sample at index ``int(q / 100 * n)`` of the sorted samples (the last for q = 100), no interpolation:
        p90 of 30 samples is the 28th smallest."""
        ordered = sorted(self.seconds)
        return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]

    def __len__(self) -> int:
        return len(self.seconds)


def repeat(fn: Callable[[], object], repeats: int, *, warmup: int = 0) -> Samples:
    """``fn()`` ``warmup`` times untimed, then ``repeats`` times, each timed."""
    for _ in range(warmup):
        fn()
    samples = Samples()
    for _ in range(repeats):
        with samples.measure():
            fn()
    return samples


@dataclass(frozen=True)
class Rounds:
    """``count`` alternating rounds: each runs every system once, in an order that changes from round to round.
    By default the order rotates: round r starts at system ``r * stride`` (mod their number) and the others follow
    in turn. ``reverse``: even rounds run the systems in order, odd rounds backwards."""

    count: int
    stride: int = 1
    reverse: bool = False

    def order(self, systems: Iterable[K], index: int) -> list[K]:
        """The systems in round ``index``'s order."""
        items = list(systems)
        if self.reverse:
            return items[::-1] if index % 2 else items
        shift = index * self.stride % len(items) if items else 0
        return items[shift:] + items[:shift]

    def orders(self, systems: Iterable[K]) -> Iterator[tuple[int, list[K]]]:
        """(round index, the systems in its order) for every round."""
        items = list(systems)
        for index in range(self.count):
            yield index, self.order(items, index)

    def run(self, systems: Mapping[K, S], measure: Callable[[S], T],
            after_round: Callable[[int, dict[K, list[T]]], None] | None = None) -> dict[K, list[T]]:
        """``{name: [measure(system) per round]}`` over ``systems`` ({name: system}); ``after_round(index,
        results so far)`` is called at the end of every round (progress lines)."""
        results: dict[K, list[T]] = {name: [] for name in systems}
        for index, order in self.orders(systems):
            for name in order:
                results[name].append(measure(systems[name]))
            if after_round is not None:
                after_round(index, results)
        return results
