"""A fraction of the memory roofline, given as a result only when it can be one.

A step (or a kernel) that reads B bytes in t seconds reaches ``(B / t) / bandwidth`` of the memory roofline. Above 1
it would have read faster than memory can: not a result, but a sign that one of its two inputs is wrong:

- the bandwidth: measured at another time or load than the steps (a stale cached number, or a machine whose load
  changed during the run), or
- the byte count: the step reads fewer bytes from memory than were counted (they fit in the last-level cache and are
  read from there, or a weight was counted that the step does not read).

``roofline_fraction`` is the one rule ``bench --roofline``, ``benchmarks/moe_speed.py`` and
``benchmarks/kernel_ceiling.py`` apply. Against the highest bandwidth the run has measured (``RunBandwidth.used``),
a rate above it makes the run probe once more (``RunBandwidth.reprobe``), and the fraction is judged again. If the
rate is still above, no fraction is given, and the reason names the likely culprit, with the numbers: the bandwidth
when the run's probes disagree among themselves (lowest median to highest best) by more than the rate exceeds their
best (the machine moved under the run, by more than the gap), else the byte count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moeforge.core.bandwidth import Bandwidth, age_seconds, last_level_cache_bytes
from moeforge.core.run_bandwidth import RunBandwidth, format_age

BANDWIDTH, BYTES = "bandwidth", "bytes"


@dataclass(frozen=True)
class RooflineFraction:
    """``value``: the fraction of the roofline, in (0, 1], or None when it came out above 1 twice (``suspect``: the
    input that is likely wrong, ``BANDWIDTH`` or ``BYTES``). ``reason`` says why there is no value, or how it was
    reached (a re-probe replaced a lower number); empty otherwise."""

    value: float | None
    bandwidth: Bandwidth  # the one ``value`` is against
    achieved_gb_s: float
    reason: str = ""
    suspect: str | None = None

    def to_dict(self) -> dict[str, Any]:
        # three significant digits: a tiny model's 0.0004 stays above 0, and nothing at most 1 rounds above it
        return {"fraction": None if self.value is None else float(f"{self.value:.3g}"),
                "fraction_reason": self.reason or None, "fraction_suspect": self.suspect}


def roofline_fraction(read_bytes: float, seconds: float, bandwidth: RunBandwidth) -> RooflineFraction:
    """The fraction of the roofline reached by reading ``read_bytes`` in ``seconds``, against ``bandwidth`` (re-probed
    once when the rate comes out above it; see the module docstring)."""
    if read_bytes < 0 or seconds <= 0:
        raise ValueError(f"need bytes >= 0 and a positive time (got {read_bytes}, {seconds})")
    achieved = read_bytes / seconds / 1e9
    first = bandwidth.used
    if achieved <= first.best_gb_s:
        return RooflineFraction(achieved / first.best_gb_s, first, achieved)
    bandwidth.reprobe()
    used = bandwidth.used
    if achieved <= used.best_gb_s:
        return RooflineFraction(achieved / used.best_gb_s, used, achieved, reason=(
            f"{achieved:.2f} GB/s read was above the {first.best_gb_s:.2f} GB/s {_named(first)}; re-probed: "
            f"{used.best_gb_s:.2f} GB/s, so that number was stale (the machine busier when it was measured)"))
    suspect, why = _culprit(achieved, read_bytes, used, bandwidth)
    return RooflineFraction(None, used, achieved, suspect=suspect, reason=(
        f"no fraction: {achieved:.2f} GB/s read is {achieved / used.best_gb_s:.2f}x the highest read bandwidth "
        f"measured ({used.best_gb_s:.2f} GB/s {_named(used)}; re-probed once, and it persists): {why}"))


def _named(b: Bandwidth) -> str:
    return f"of the cache, {format_age(age_seconds(b.measured_utc))}" if b.cached else "probed in this run"


def _culprit(achieved: float, read_bytes: float, used: Bandwidth, bandwidth: RunBandwidth) -> tuple[str, str]:
    """Which input a persisting rate above the bandwidth points to, and why, in words with the numbers."""
    probes = [b for _, b in bandwidth.probes]
    low, high = min(b.median_gb_s for b in probes), max(b.best_gb_s for b in probes)
    spread, excess = high / low, achieved / used.best_gb_s
    if spread >= excess:
        return BANDWIDTH, (f"likely the bandwidth: this run's probes read {low:.2f} to {high:.2f} GB/s (median to "
                           f"best, {spread:.2f}x apart), more than the {excess:.2f}x the step exceeds their best, so "
                           "the machine's load changed under the run; rerun it on a quieter machine")
    llc = last_level_cache_bytes()
    where = (f"its {_size(read_bytes)} fit in the {_size(llc)} last-level cache, so they are read from cache, not "
             "memory" if llc is not None and read_bytes <= llc else
             f"the {_size(read_bytes)} counted include bytes it does not read from memory")
    return BYTES, (f"likely the byte count: this run's probes agree ({low:.2f} to {high:.2f} GB/s, {spread:.2f}x "
                   f"apart) and the step exceeds their best by {excess:.2f}x; {where}")


def _size(n: float) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"
