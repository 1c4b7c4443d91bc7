"""Back the memory a session allocated for its weights with transparent huge pages (Linux).

A decode step streams every weight once (SmolLM2-135M: 540 MB at fp32, ~100 MB at int4), and with 4 KiB pages that
is one TLB miss and page walk every 4 KiB, and the hardware prefetchers stop at each page boundary. ONNX Runtime
allocates its prepacked weights with plain ``malloc``, which this machine's kernel backs with 4 KiB pages unless
the memory is ``madvise``d (``/sys/kernel/mm/transparent_hugepage/enabled`` = ``madvise``, the usual default). So
after a session is built, the anonymous memory regions that appeared while building it (the prepacked weights,
initializers, arenas) are advised ``MADV_HUGEPAGE`` and collapsed into 2 MiB pages at once with ``MADV_COLLAPSE``
(Linux 6.1+; on older kernels khugepaged collapses them later). ``benchmarks/huge_pages.py`` measures the effect.

Only memory the session allocated is touched, never file mappings or the rest of the process: regions that
appeared, the part a region grew by, and regions whose resident memory grew. Memory the allocator hands out again
from earlier frees without it leaving RAM (glibc's heap in a process that loaded and dropped models before) is not
seen, and stays on the pages it had; a fresh process, as a deployment starts, gets all of it. Where the kernel has
no transparent huge pages, or the platform is not Linux, nothing is done and the result says why.
"""

from __future__ import annotations

import ctypes
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

HUGE_PAGE = 2 << 20  # bytes of an x86-64 / arm64 (4 KiB base) transparent huge page
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25  # Linux 6.1+
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@dataclass
class HugePageReport:
    """What ``session_memory_on_huge_pages`` did: regions and bytes advised, bytes the process holds in huge pages
    before and after (``AnonHugePages``), seconds spent; ``skipped`` says why nothing was done (else None)."""

    regions: int = 0
    bytes_advised: int = 0
    huge_bytes_before: int = 0
    huge_bytes_after: int = 0
    seconds: float = 0.0
    collapsed: bool = False  # MADV_COLLAPSE ran (else the kernel collapses in the background, if at all)
    skipped: str | None = None
    errors: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Region:
    """One private anonymous mapping: [start, end) and the bytes of it resident in memory."""

    start: int
    end: int
    resident: int


def anonymous_regions(smaps: Path = Path("/proc/self/smaps")) -> dict[int, Region]:
    """{start: Region} of the process's private, writable, anonymous mappings (heap included), with their
    resident bytes."""
    regions: dict[int, Region] = {}
    current: tuple[int, int] | None = None
    for line in smaps.read_text().splitlines():
        parts = line.split(maxsplit=5)
        if "-" in parts[0] and len(parts) >= 5 and not parts[0].endswith(":"):  # a mapping's header line
            perms, inode = parts[1], parts[4]
            name = parts[5].strip() if len(parts) > 5 else ""
            current = None
            if perms.startswith("rw") and perms.endswith("p") and inode == "0" and name in ("", "[heap]"):
                start, end = (int(x, 16) for x in parts[0].split("-"))
                current = (start, end)
        elif parts[0] == "Rss:" and current is not None:
            regions[current[0]] = Region(current[0], current[1], int(parts[1]) * 1024)
            current = None
    return regions


def new_memory(before: dict[int, Region], after: dict[int, Region],
               min_growth: int = 8 * HUGE_PAGE) -> list[tuple[int, int]]:
    """[start, end) ranges of ``after`` holding memory allocated since ``before``: regions that appeared, the part a
    region grew by, and whole regions whose resident memory grew by ``min_growth`` or more (an allocator that
    reused address space it had already mapped, e.g. glibc's heap after earlier frees)."""
    ranges = []
    for start, region in sorted(after.items()):
        old = before.get(start)
        if old is None:
            ranges.append((start, region.end))
        elif region.resident - old.resident >= min_growth:
            ranges.append((start, region.end))
        elif region.end > old.end:
            ranges.append((old.end, region.end))
    return ranges


def huge_bytes(rollup: Path = Path("/proc/self/smaps_rollup")) -> int:
    """Bytes of this process's anonymous memory in transparent huge pages (0 where unreadable)."""
    try:
        for line in rollup.read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def unavailable() -> str | None:
    """Why transparent huge pages cannot be used here, or None."""
    if not sys.platform.startswith("linux"):
        return f"transparent huge pages are a Linux feature (platform {sys.platform})"
    try:
        mode = THP_ENABLED.read_text()
    except OSError:
        return f"{THP_ENABLED} is not readable: the kernel has no transparent huge pages"
    if "[never]" in mode:
        return f"transparent huge pages are disabled ({THP_ENABLED}: never)"
    return None


def _madvise() -> Callable[[int, int, int], int]:
    libc = ctypes.CDLL(None, use_errno=True)
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def advise(ranges: list[tuple[int, int]], report: HugePageReport, *, min_bytes: int = 4 * HUGE_PAGE) -> None:
    """``MADV_HUGEPAGE`` then ``MADV_COLLAPSE`` the whole huge pages inside each range of at least ``min_bytes``."""
    madvise = _madvise()
    start_time = time.perf_counter()
    report.huge_bytes_before = huge_bytes()
    collapse = True
    for start, end in ranges:
        start = -(-start // HUGE_PAGE) * HUGE_PAGE  # whole huge pages inside the range only
        end = end // HUGE_PAGE * HUGE_PAGE
        if end - start < min_bytes:
            continue
        if madvise(start, end - start, MADV_HUGEPAGE) != 0:
            report.errors.append(f"MADV_HUGEPAGE: {os.strerror(ctypes.get_errno())}")
            continue
        report.regions += 1
        report.bytes_advised += end - start
        if collapse and madvise(start, end - start, MADV_COLLAPSE) != 0:
            errno = ctypes.get_errno()
            if errno == 22:  # EINVAL: a kernel before 6.1 -- khugepaged collapses advised memory over time
                collapse = False
            elif errno != 11:  # EAGAIN: some pages could not be collapsed now (the others were)
                report.errors.append(f"MADV_COLLAPSE: {os.strerror(errno)}")
    report.collapsed = collapse and report.regions > 0
    report.huge_bytes_after = huge_bytes()
    report.seconds = time.perf_counter() - start_time


@contextmanager
def session_memory_on_huge_pages(enabled: bool = True) -> Iterator[HugePageReport]:
    """Around building a session: the anonymous memory that appears inside the block goes on huge pages at its
    end. Yields the report, filled in on exit (``skipped`` says why nothing was done)."""
    report = HugePageReport()
    reason = None if enabled else "huge_pages=False"
    reason = reason or unavailable()
    if reason is not None:
        report.skipped = reason
        yield report
        return
    before = anonymous_regions()
    yield report
    advise(new_memory(before, anonymous_regions()), report)
