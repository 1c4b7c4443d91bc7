"""The read bandwidth of one run, as its roofline uses it: probed in the run, or the cache's number as a fallback.

A machine's read bandwidth depends on its load at the time, so a roofline fraction is only as good as a bandwidth
measured next to the steps it judges: a probe taken once on a busy machine and cached made a quiet machine's steps
read "1.218 of the roofline" (issue 55). So:

- ``RunBandwidth.probed`` (``bench --roofline``) takes a short probe each time ``sample`` is called, before and after
  the timed steps (``bandwidth.run_probe_bytes()``: a few times the last-level cache; ``RUN_PROBE_ROUNDS`` rounds),
  and keeps them all: the roofline uses their highest best, the report shows each one's best and median (the
  spread). With ``refresh_cache`` (``--remeasure-bandwidth``) the first probe is the full one, and it replaces the
  cached number.
- ``RunBandwidth.from_cache`` (``bench --cached-bandwidth``) uses the cached number instead (probed in full and
  cached first when there is none); ``sample`` takes no probe then, and the report gives the number's age and
  conditions (when, probe size and rounds, median, load average then and now).
- Either way ``reprobe`` takes one more short probe, once a run: what ``runtime/roofline_fraction.py`` does when a
  fraction comes out above 1.

The probe is looked up on ``core.bandwidth`` at each call, so a test that replaces ``bandwidth.probe_read_bandwidth``
replaces it here too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moeforge.core import bandwidth as machine
from moeforge.core.bandwidth import Bandwidth

REPROBE = "re-probe"


@dataclass
class RunBandwidth:
    """The bandwidth measurements of one run: ``probes`` taken in it, ``(when, measurement)`` in order, and the
    ``cached`` fallback (None: the run probes)."""

    threads: int
    cached: Bandwidth | None = None
    probes: list[tuple[str, Bandwidth]] = field(default_factory=list)
    refresh_cache: bool = False  # the first probe is the full one and replaces the cached number
    folder: Path | None = None  # the cache's folder (None: bandwidth.cache_dir())

    @classmethod
    def probed(cls, threads: int | None, refresh_cache: bool = False, folder: Path | None = None) -> RunBandwidth:
        """A run that probes (``sample``) at ``threads`` (``bandwidth.probe_threads``: None or 0 are the usable
        cores)."""
        return cls(threads=machine.probe_threads(threads), refresh_cache=refresh_cache, folder=folder)

    @classmethod
    def from_cache(cls, threads: int | None, folder: Path | None = None) -> RunBandwidth:
        """A run that uses the cached number (read strictly; probed in full and cached when there is none)."""
        found = machine.read_bandwidth(threads, folder=folder)
        if found.cached:
            return cls(threads=found.threads, cached=found, folder=folder)
        return cls(threads=found.threads, probes=[("before (full probe: nothing cached yet; now cached)", found)],
                   folder=folder)

    def sample(self, when: str) -> Bandwidth | None:
        """Probe now (``when``: "before", "after" the timed steps), unless this run uses the cached number."""
        return None if self.cached is not None else self._probe(when)

    def reprobe(self) -> Bandwidth | None:
        """One more probe, the first time it is asked in this run (None after)."""
        return None if self.reprobed else self._probe(REPROBE)

    @property
    def reprobed(self) -> bool:
        return any(when == REPROBE for when, _ in self.probes)

    def _probe(self, when: str) -> Bandwidth:
        if self.refresh_cache and not self.probes:
            measured = machine.read_bandwidth(self.threads, remeasure=True, folder=self.folder)
            when = f"{when} (full probe, now cached)"
        else:
            measured = machine.probe_read_bandwidth(self.threads, machine.run_probe_bytes(), machine.RUN_PROBE_ROUNDS)
        self.probes.append((when, measured))
        return measured

    @property
    def used(self) -> Bandwidth:
        """The roofline's bandwidth: the highest best of this run's probes and the cached number (the most this
        machine was seen to read, so the fraction is the lowest these measurements allow)."""
        known = [b for _, b in self.probes] + ([self.cached] if self.cached is not None else [])
        if not known:
            raise ValueError("no bandwidth measured yet: sample() before the roofline asks for it")
        return max(known, key=lambda b: b.best_gb_s)

    @property
    def from_this_run(self) -> bool:
        """Whether ``used`` was measured in this run (not the cache's number)."""
        return self.cached is None or self.used is not self.cached

    def to_dict(self) -> dict[str, Any]:
        """The report's bandwidth fields: the one used, where it comes from, every probe, and the cached number with
        its age (seconds, None where its time is not one) and the load average now."""
        used = self.used
        return {
            "bandwidth_gb_s": used.best_gb_s,
            "bandwidth_median_gb_s": used.median_gb_s,
            "bandwidth_threads": used.threads,
            "bandwidth_source": "probed in this run" if self.from_this_run else "cache",
            "bandwidth_probes": [{"when": when, **_measurement(b)} for when, b in self.probes],
            **({"bandwidth_cache": {**_measurement(self.cached), "cpu": self.cached.cpu,
                                    "age_s": _round(machine.age_seconds(self.cached.measured_utc)),
                                    "load_1min_now": machine.load_average()}}
               if self.cached is not None else {}),
        }


def _measurement(b: Bandwidth) -> dict[str, Any]:
    return {"best_gb_s": b.best_gb_s, "median_gb_s": b.median_gb_s, "probe_bytes": b.probe_bytes, "rounds": b.rounds,
            "measured_utc": b.measured_utc, "load_1min": b.load_1min}


def _round(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 1)


def format_age(seconds: float | None) -> str:
    """``3.2 days``, ``5.0 h``, ``12 min``, ``40 s``; ``of unknown age`` for None."""
    if seconds is None:
        return "of unknown age"
    if seconds >= 2 * 86400:
        return f"{seconds / 86400:.1f} days old"
    if seconds >= 2 * 3600:
        return f"{seconds / 3600:.1f} h old"
    if seconds >= 120:
        return f"{seconds / 60:.0f} min old"
    return f"{max(seconds, 0):.0f} s old"


def describe_bandwidth(report: dict[str, Any]) -> str:
    """Human words from ``RunBandwidth.to_dict()``'s fields: the bandwidth used and where it comes from, each probe's
    best / median (the spread), and a cached number's age and conditions."""
    head = f"read bandwidth {report['bandwidth_gb_s']:.1f} GB/s ({report['bandwidth_threads']} threads"
    parts = []
    probes = report.get("bandwidth_probes") or []
    if probes:
        sizes = {(p["probe_bytes"], p["rounds"]) for p in probes}
        each = "" if len(sizes) > 1 else f" ({_size(*sizes.pop())} each)"  # else the full probe's words say so
        parts.append(f"probed in this run{each}, best / median GB/s: "
                     + ", ".join(f"{p['when']} {p['best_gb_s']:.1f} / {p['median_gb_s']:.1f}" for p in probes))
    cache = report.get("bandwidth_cache")
    if cache is not None:
        load = "" if cache.get("load_1min") is None else f", load {cache['load_1min']:.1f}"
        now = "" if cache.get("load_1min_now") is None else f" (now {cache['load_1min_now']:.1f})"
        parts.append(f"{'the cached number' if report['bandwidth_source'] == 'cache' else 'cached'} "
                     f"{cache['best_gb_s']:.1f} / {cache['median_gb_s']:.1f}, {format_age(cache.get('age_s'))}: "
                     f"measured {cache['measured_utc']}, {_size(cache['probe_bytes'], cache['rounds'])}{load}{now}; "
                     "--remeasure-bandwidth replaces it")
    return head + "".join(f"; {part}" for part in parts) + ")"


def _size(probe_bytes: int, rounds: int) -> str:
    return f"{probe_bytes / 2**20:.0f} MiB x {rounds} rounds"
