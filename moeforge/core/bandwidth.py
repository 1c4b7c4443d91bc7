"""This machine's memory read bandwidth: a short STREAM-like probe, cached per machine.

A decode step of a large model streams its weights once, so its floor is ``bytes read / read bandwidth``: the
memory roofline that ``moeforge bench --roofline`` compares a step against. The probe reads a buffer much larger
than any last-level cache with ``threads`` workers at once (numpy reductions release the GIL), each summing its own
contiguous slice, several times, and keeps the best round (STREAM reports the best too: the others were disturbed).

The result is cached in ``~/.cache/moeforge/bandwidth.json`` (``MOEFORGE_CACHE_DIR`` overrides the folder), keyed by
the CPU model, the usable cores and the thread count, so a second ``bench`` does not pay the probe again; a stale or
unreadable cache file is measured over.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

CACHE_FILE = "bandwidth.json"
PROBE_VERSION = 1  # bump when the probe's method changes: older cached numbers are measured again
DEFAULT_PROBE_BYTES = 512 * 2**20  # far above any CPU's last-level cache today
DEFAULT_ROUNDS = 7


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
    cached: bool = False

    @property
    def bytes_per_s(self) -> float:
        return self.best_gb_s * 1e9


def cache_dir() -> Path:
    """Where moeforge caches per-machine measurements: ``$MOEFORGE_CACHE_DIR``, else ``~/.cache/moeforge``."""
    return Path(os.environ.get("MOEFORGE_CACHE_DIR") or Path.home() / ".cache" / "moeforge")


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
                     measured_utc=datetime.now(UTC).isoformat(timespec="seconds"))


def _cache_key(threads: int) -> str:
    return f"v{PROBE_VERSION}|{cpu_model()}|cores={usable_cores()}|threads={threads}"


def read_bandwidth(threads: int | None = None, remeasure: bool = False, folder: Path | None = None) -> Bandwidth:
    """The cached read bandwidth of this machine at ``threads``, probed (and cached) when absent or ``remeasure``."""
    threads = usable_cores() if threads is None else threads
    path = (folder or cache_dir()) / CACHE_FILE
    key = _cache_key(threads)
    entries: dict[str, dict[str, object]] = {}
    try:
        loaded = json.loads(path.read_text())
        entries = loaded if isinstance(loaded, dict) else {}
    except (OSError, ValueError):
        pass  # absent or unreadable: measured again and rewritten
    if not remeasure and isinstance(entries.get(key), dict):
        try:
            return Bandwidth(**{**entries[key], "cached": True})  # type: ignore[arg-type]
        except TypeError:
            pass  # an entry of another shape: measured again
    measured = probe_read_bandwidth(threads)
    entries[key] = {k: v for k, v in asdict(measured).items() if k != "cached"}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(entries, indent=2) + "\n")
        tmp.replace(path)  # atomic: a concurrent bench reads the old file or the new one, never half of one
    except OSError:
        pass  # a read-only home: the number is still returned, just not kept
    return measured
