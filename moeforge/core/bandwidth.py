"""This machine's memory read bandwidth: a STREAM-like probe, and a per-machine cache of its full measurement.

A decode step of a large model streams its weights once, so its floor is ``bytes read / read bandwidth``: the
memory roofline that ``moeforge bench --roofline`` compares a step against. The probe reads a buffer much larger
than any last-level cache with ``threads`` workers at once (numpy reductions release the GIL), each summing its own
contiguous slice, several times, and keeps the best round (STREAM reports the best too: the others were disturbed)
and the median (how steady the machine was). It records the load average it ran under.

The bandwidth is a property of the machine *and its load at the time*: ``bench --roofline`` probes it in the run,
before and after the timed steps (``core/run_bandwidth.py``: a short probe, ``run_probe_bytes()`` beyond the
last-level cache, ``RUN_PROBE_ROUNDS`` rounds). The full probe (``DEFAULT_PROBE_BYTES``, ``DEFAULT_ROUNDS``) is
cached in ``~/.cache/moeforge/bandwidth.json`` (``MOEFORGE_CACHE_DIR`` overrides the folder), one entry per key of
probe version, CPU model name, usable cores and thread count: a fallback for ``bench --cached-bandwidth``, which
reports its age and conditions. What holds of the cache:

- An entry whose key matches is what ``read_bandwidth`` returns, whatever the machine's load is now; a roofline
  fraction above 1 against it makes the run probe again (``runtime/roofline_fraction.py``), and
  ``--remeasure-bandwidth`` replaces it (a new ``PROBE_VERSION`` changes every key).
- The file is read strictly (``core.strict_json``): one that is missing is measured over; one that cannot be read,
  is not a regular file, is over 64 MiB, is not JSON, nests deeper than 32 levels or is not an object is ignored
  with a warning (its other entries dropped) and measured over, with ``--remeasure-bandwidth`` too.
- An entry is used only if it is valid (``_entry``): every field of ``Bandwidth`` with its JSON type (``load_1min``
  may be absent or null: entries written before it was recorded), the rates finite numbers in ``MIN_GB_S..MAX_GB_S``
  with the median at most the best, the thread count the one asked for, ``measured_utc`` an ISO 8601 time with
  its zone and not in the future; an invalid entry is ignored with a warning and measured over.
- The file is written under ``core.safe_paths``' rule: atomically, never through a link or over a special file at
  the cache file's path. A cache folder that cannot be created or takes no new file (a read-only home) skips the
  caching with a warning; the measured number is still used.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from moeforge.core.errors import MoeforgeError
from moeforge.core.safe_paths import UnsafePathError, write_output_file
from moeforge.core.strict_json import (
    JsonFileError,
    dumps_strict,
    json_int,
    json_number,
    json_object,
    json_str,
    read_json_file,
)

log = logging.getLogger(__name__)

CACHE_FILE = "bandwidth.json"
PROBE_VERSION = 1  # bump when the probe's method changes: older cached numbers are measured again
DEFAULT_PROBE_BYTES = 512 * 2**20  # far above any CPU's last-level cache today
DEFAULT_ROUNDS = 7
# The short probe a run takes before and after its timed steps: a few times the last-level cache, so it reads memory,
# not cache (``run_probe_bytes``), and fewer rounds: about 0.1 s at 128 MiB and 20 GB/s, page faults included.
RUN_PROBE_ROUNDS = 5
RUN_PROBE_MIN_BYTES = 64 * 2**20
RUN_PROBE_LLC_MULTIPLE = 4
# A cached rate outside these is not a measurement of a machine: 10 MB/s is below any memory since the 1990s, and
# 10,000 GB/s is above any today (an H200's HBM3e reads 4,800 GB/s, a CPU socket's DDR5 well under 1,000).
MIN_GB_S = 0.01
MAX_GB_S = 10_000.0
MAX_CLOCK_SKEW_S = 86400.0  # how far in the future a cached entry's time may lie: a clock set wrong by a day
MAX_THREADS = 4096  # probe threads: above any machine's cores today (a thread per core is what the probe wants)


class BandwidthError(MoeforgeError):
    """A bandwidth probe that cannot run as asked (its thread count); the message names the flag."""


@dataclass(frozen=True)
class Bandwidth:
    """Measured read bandwidth. ``best_gb_s`` is the roofline's (bytes / 1e9 per second); ``median_gb_s`` shows
    how steady the machine was."""

    best_gb_s: float
    median_gb_s: float
    threads: int
    probe_bytes: int
    rounds: int
    cpu: str
    measured_utc: str
    load_1min: float | None = None  # the load average while it ran: what else the machine did (None: unknown)
    cached: bool = False

    def __post_init__(self) -> None:
        # A rate of 0 would divide by zero in the roofline, a negative one print a negative fraction of it.
        for name in ("best_gb_s", "median_gb_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"Bandwidth.{name} must be a finite number > 0, got {value!r}")

    @property
    def bytes_per_s(self) -> float:
        return self.best_gb_s * 1e9


def cache_dir() -> Path:
    """Where moeforge caches per-machine measurements: ``$MOEFORGE_CACHE_DIR``, else ``~/.cache/moeforge``. A ``~``
    in the variable is expanded as the shell does (one naming no known user stays as written), the same for the
    cache's reads and its writes."""
    folder = os.environ.get("MOEFORGE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "moeforge")
    return Path(os.path.expanduser(folder))


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo ("" where unknown)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask), else the logical core count."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def last_level_cache_bytes() -> int | None:
    """The last-level cache this process's cores share, in bytes: the sum over the distinct caches of the highest
    level in /sys (two sockets: two L3s); None where /sys does not say."""
    caches: dict[tuple[int, str], int] = {}  # (level, cores sharing it) -> bytes
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    for core in cores:
        for index in Path(f"/sys/devices/system/cpu/cpu{core}/cache").glob("index*"):
            try:
                if (index / "type").read_text().strip() == "Instruction":
                    continue
                level = int((index / "level").read_text())
                size = (index / "size").read_text().strip()
                shared = (index / "shared_cpu_list").read_text().strip()
            except (OSError, ValueError):
                continue
            unit = {"K": 2**10, "M": 2**20, "G": 2**30}.get(size[-1:], 1)
            digits = size.rstrip("KMG")
            if digits.isdigit():
                caches[(level, shared)] = int(digits) * unit
    if not caches:
        return None
    top = max(level for level, _ in caches)
    return sum(size for (level, _), size in caches.items() if level == top)


def run_probe_bytes() -> int:
    """The buffer of the short probe a run takes: ``RUN_PROBE_LLC_MULTIPLE`` times the last-level cache, at least
    ``RUN_PROBE_MIN_BYTES`` and at most the full probe's ``DEFAULT_PROBE_BYTES`` (that, too, where the cache is
    unknown)."""
    llc = last_level_cache_bytes()
    if llc is None:
        return DEFAULT_PROBE_BYTES
    return min(max(RUN_PROBE_LLC_MULTIPLE * llc, RUN_PROBE_MIN_BYTES), DEFAULT_PROBE_BYTES)


def load_average() -> float | None:
    """The 1-minute load average (runnable threads), None where the OS does not say."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def age_seconds(measured_utc: str, now: datetime | None = None) -> float | None:
    """Seconds since ``measured_utc`` (an ISO 8601 time with its zone); None if it is not one."""
    try:
        then = datetime.fromisoformat(measured_utc)
        return None if then.tzinfo is None else ((now or datetime.now(UTC)) - then).total_seconds()
    except (ValueError, OverflowError):  # not a time; one whose zone moves it out of datetime's years
        return None


def probe_threads(threads: int | None) -> int:
    """The probe's thread count for ``--threads`` (None or 0: the usable cores, as ``--threads 0`` leaves ONNX
    Runtime its own choice); ``BandwidthError`` outside ``1..MAX_THREADS``."""
    threads = min(usable_cores(), MAX_THREADS) if threads is None or threads == 0 else threads
    if isinstance(threads, bool) or not 1 <= threads <= MAX_THREADS:
        raise BandwidthError(f"--threads must be in 1..{MAX_THREADS} to probe the read bandwidth, got {threads}")
    return threads


def probe_read_bandwidth(threads: int | None = None, probe_bytes: int = DEFAULT_PROBE_BYTES,
                         rounds: int = DEFAULT_ROUNDS) -> Bandwidth:
    """Measure the read bandwidth with ``threads`` (default: the usable cores) reading ``probe_bytes`` at once."""
    threads = usable_cores() if threads is None else threads
    if threads < 1 or probe_bytes < threads * 8 or rounds < 1:
        raise ValueError(f"need threads >= 1, probe_bytes >= 8 per thread and rounds >= 1 (got {threads}, "
                         f"{probe_bytes}, {rounds})")
    data = np.ones(probe_bytes // 8, dtype=np.float64)  # written once: every page is resident before timing
    slices = np.array_split(data, threads)
    seconds: list[float] = []
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(rounds + 1):  # the first round warms the pool and the TLB: not counted
            start = time.perf_counter()
            sums = list(pool.map(np.sum, slices))
            seconds.append(time.perf_counter() - start)
            if sum(sums) != data.size:  # keeps the reads from being optimised away, and checks them
                raise RuntimeError("bandwidth probe read wrong values")
    timed = sorted(seconds[1:])
    return Bandwidth(best_gb_s=round(data.nbytes / timed[0] / 1e9, 2),
                     median_gb_s=round(data.nbytes / timed[len(timed) // 2] / 1e9, 2),
                     threads=threads, probe_bytes=int(data.nbytes), rounds=rounds, cpu=cpu_model(),
                     measured_utc=datetime.now(UTC).isoformat(timespec="seconds"), load_1min=load_average())


def _cache_key(threads: int) -> str:
    return f"v{PROBE_VERSION}|{cpu_model()}|cores={usable_cores()}|threads={threads}"


def read_bandwidth(threads: int | None = None, remeasure: bool = False, folder: Path | None = None) -> Bandwidth:
    """The cached read bandwidth of this machine at ``threads`` (``probe_threads``), probed in full (and cached) when
    absent, invalid or ``remeasure`` (see the module docstring for what the cache holds)."""
    threads = probe_threads(threads)
    path = (folder or cache_dir()) / CACHE_FILE
    key = _cache_key(threads)
    entries = _read_cache(path)
    if not remeasure and key in entries:
        cached = _entry(entries[key], source=f"bandwidth cache {path}", field=key, threads=threads)
        if cached is not None:
            return cached
    measured = probe_read_bandwidth(threads)
    entries[key] = {k: v for k, v in asdict(measured).items() if k != "cached"}
    _write_cache(path, entries)
    return measured


def _read_cache(path: Path) -> dict[str, Any]:
    """The cache file's entries by key; {} when it is missing, and (with a warning) when it is not valid."""
    if not os.path.lexists(path):
        return {}
    fix = "it is ignored and the bandwidth measured again"
    try:
        return dict(json_object(read_json_file(path, what="bandwidth cache", fix=fix), source=f"bandwidth cache {path}",
                                fix=fix))
    except JsonFileError as exc:
        log.warning("%s", exc)
        return {}


def _entry(value: Any, *, source: str, field: str, threads: int) -> Bandwidth | None:
    """The cached measurement ``value`` (the entry ``field`` of ``source``) if it is valid, else None with a
    warning: every field typed, the rates finite in ``MIN_GB_S..MAX_GB_S`` (median <= best), ``threads`` as asked."""
    fix = "it is ignored and the bandwidth measured again"
    try:
        entry: Mapping[str, Any] = json_object(value, source=source, field=field, fix=fix)

        def where(name: str) -> str:
            return f"{field}.{name}"

        best, median = (json_number(entry.get(name), source=source, field=where(name), lo=MIN_GB_S, hi=MAX_GB_S,
                                    fix=fix) for name in ("best_gb_s", "median_gb_s"))
        if median > best:
            raise JsonFileError(f"{source}: {field!r} has a median {median} GB/s above its best {best} GB/s; {fix}")
        return Bandwidth(
            best_gb_s=best, median_gb_s=median,
            threads=json_int(entry.get("threads"), source=source, field=where("threads"), lo=threads, hi=threads,
                             fix=fix),
            probe_bytes=json_int(entry.get("probe_bytes"), source=source, field=where("probe_bytes"), lo=8,
                                 hi=2**50, fix=fix),
            rounds=json_int(entry.get("rounds"), source=source, field=where("rounds"), lo=1, hi=10_000, fix=fix),
            cpu=json_str(entry.get("cpu"), source=source, field=where("cpu"), max_len=512, fix=fix),
            measured_utc=_measured_utc(entry.get("measured_utc"), source=source, field=where("measured_utc"), fix=fix),
            load_1min=None if entry.get("load_1min") is None else json_number(
                entry.get("load_1min"), source=source, field=where("load_1min"), lo=0.0, hi=1e6, fix=fix),
            cached=True)
    except JsonFileError as exc:
        log.warning("%s", exc)
        return None


def _measured_utc(value: Any, *, source: str, field: str, fix: str) -> str:
    """``value`` as an entry's time: an ISO 8601 time with its zone, not later than now (a clock may be off by
    ``MAX_CLOCK_SKEW_S``); a time from the future would be reported as a fresh measurement ("0 s old")."""
    text = json_str(value, source=source, field=field, max_len=64, fix=fix)
    age = age_seconds(text)
    if age is None or age < -MAX_CLOCK_SKEW_S:
        raise JsonFileError(f"{source}: {field!r} must be the ISO 8601 time (with its zone, not in the future) the "
                            f"probe ran, got {text!r}; {fix}")
    return text


def _write_cache(path: Path, entries: dict[str, Any]) -> None:
    """Rewrite the cache under the safe-path rule; a folder that takes no file (or a link at the file) skips it."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_output_file(path, dumps_strict(entries, indent=2) + "\n", force=True, flag="bandwidth cache")
    except (OSError, UnsafePathError) as exc:
        log.warning("bandwidth cache not written (%s): the number is used, and measured again next time", exc)
