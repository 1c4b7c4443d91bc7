"""The one host-memory estimator: what a container lets this process allocate, and what an engine's buffers need.

The engine refuses a configuration before allocating it (``runtime/engine_config.check_host_memory``), ``moeforge
bench`` refuses a batch in its own flags' terms, and ``moeforge config`` prints the same numbers; all of them count
with ``host_bytes`` against ``available_memory``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

from moeforge.core.kv_layout import KVCacheSpec

# (limit, usage) files of a container's memory cgroup: v2, then v1 (v1 says "no limit" with a huge number).
CGROUP_MEMORY_FILES = ((Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory.current")),
                       (Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
                        Path("/sys/fs/cgroup/memory/memory.usage_in_bytes")))
LOGIT_BYTES = 4  # float32 logits


def available_memory() -> int | None:
    """Bytes of host memory this process can still allocate, None where unknown: Linux's MemAvailable (free
    plus reclaimable cache), else the free pages (``SC_AVPHYS_PAGES``), lowered to what a cgroup limit (a
    container's, v2 or v1) leaves."""
    found = []
    try:
        meminfo = Path("/proc/meminfo").read_text()
    except OSError:
        meminfo = ""
    found += [int(line.split()[1]) * 1024 for line in meminfo.splitlines() if line.startswith("MemAvailable:")]
    if not found:
        try:
            found.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (ValueError, OSError):  # not every platform has these names
            pass
    for limit_file, usage_file in CGROUP_MEMORY_FILES:
        try:
            limit = limit_file.read_text().strip()
            if limit != "max":
                found.append(int(limit) - int(usage_file.read_text()))
        except (OSError, ValueError):  # no such cgroup, or no limit
            pass
    return min(found) if found else None


def memory_limit() -> int | None:
    """The memory this process may use in all: a container's cgroup limit (v2, then v1), else the physical memory;
    None where neither is known."""
    for limit_file, _ in CGROUP_MEMORY_FILES:
        try:
            limit = limit_file.read_text().strip()
        except OSError:
            continue
        if limit.isdigit() and int(limit) < 1 << 60:  # v1 writes a huge number for "no limit"
            return int(limit)
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


_SIZE_UNITS = {"": 1, "B": 1, "K": 2**10, "KB": 10**3, "KIB": 2**10, "M": 2**20, "MB": 10**6, "MIB": 2**20,
               "G": 2**30, "GB": 10**9, "GIB": 2**30, "T": 2**40, "TB": 10**12, "TIB": 2**40, "P": 2**50,
               "PB": 10**15, "PIB": 2**50}
MAX_SIZE = 2**50  # 1 PiB: far above any memory or disk a size budgets; a larger number is a typo
MAX_SIZE_CHARS = 40  # of the number: 1 PiB in bytes has 16 digits


def parse_size(text: str) -> int:
    """Bytes of a size as people write it: ``3GiB``, ``3G`` (binary), ``3GB`` (decimal), ``1500M``, ``123``.

    The result is a whole number of bytes in ``1..MAX_SIZE`` (1 PiB) once the unit is applied: a fraction is
    allowed where it makes whole bytes (``1.5G`` is 1,610,612,736 bytes), never rounded (``0.5`` or ``0.1K``,
    102.4 bytes, is refused: rounding would turn ``0.5`` into 0, which means "none"). Anything else raises
    ``ValueError`` saying what to write."""
    shown = repr(text) if len(text) <= 40 else f"{text[:37]!r}..."
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in _SIZE_UNITS:
        raise ValueError(f"{shown} is not a size: write a positive number with an optional unit, e.g. 3GiB, 3G, "
                         "3000MB")
    too_large = f"{shown} is not a size moeforge takes: over the largest, 1 PiB ({MAX_SIZE:,} bytes)"
    if len(match.group(1)) > MAX_SIZE_CHARS:  # 1 PiB has 16 digits: more is a typo (or zeros padding one)
        raise ValueError(f"{shown} is not a size moeforge takes: its number has {len(match.group(1))} characters, "
                         f"over the {MAX_SIZE_CHARS} any size up to 1 PiB needs")
    size = Fraction(match.group(1)) * _SIZE_UNITS[unit]  # exact: no float rounding, no overflow
    if size.denominator != 1:
        raise ValueError(f"{shown} is not a size: it is {float(size):g} bytes, not a whole number; write whole "
                         "bytes, e.g. 512K or 1.5G")
    if size < 1:
        raise ValueError(f"{shown} is not a size: write a positive number with an optional unit, e.g. 3GiB, 3G, "
                         "3000MB")
    if size > MAX_SIZE:
        raise ValueError(too_large)
    return int(size)


@dataclass(frozen=True)
class HostBytes:
    """The host buffers an engine allocates at least (weights and other activations come on top).

    ``cache``: the KV cache; ``logits``: the float32 logits of one full step; ``cache_what``: how the cache was
    counted, for messages; ``step_tokens``: the tokens of that step."""

    cache: int
    logits: int
    cache_what: str
    step_tokens: int

    @property
    def total(self) -> int:
        return self.cache + self.logits


def host_bytes(kv: KVCacheSpec, vocab_size: int, *, num_seqs: int, step_tokens: int,
               num_blocks: int | None = None) -> HostBytes:
    """The KV cache of ``num_blocks`` pool blocks (a paged artifact) or of ``num_seqs`` contiguous rows of
    ``max_seq_len`` tokens, plus the float32 logits of a step of ``step_tokens`` tokens."""
    if num_blocks is not None:
        cache = num_blocks * kv.bytes_per_block
        what = f"KV cache {num_blocks:,} blocks x {kv.bytes_per_block:,} bytes"
    else:
        cache = kv.bytes_for(kv.max_seq_len, num_seqs)
        what = f"KV cache {num_seqs:,} sequences x {kv.max_seq_len} tokens x {kv.bytes_per_token:,} bytes"
    return HostBytes(cache=cache, logits=step_tokens * vocab_size * LOGIT_BYTES, cache_what=what,
                     step_tokens=step_tokens)


def gib(num_bytes: int) -> str:
    """``1.50 GiB``: how memory numbers are printed in messages."""
    return f"{num_bytes / 2**30:,.2f} GiB"
