"""Benchmark helpers: a description of the machine, and writing results as JSON."""

from __future__ import annotations

import json
import os
import platform
import resource
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from moeforge.artifact import tool_versions


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on: CPU model, cores, memory, OS, Python and library versions."""
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory_gib = None
    try:
        pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        memory_gib = round(pages * page_size / 2**30, 1)
    except (ValueError, OSError):
        pass
    return {
        "cpu": cpu,
        "logical_cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_gib": memory_gib,
        "os": f"{platform.system()} {platform.release()}",
        "machine": platform.machine(),
        "gpu": None,
        "versions": tool_versions(),
    }


def peak_rss_mib(children: bool = False) -> float:
    """Peak resident set size of this process (or of its finished children), MiB."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN if children else resource.RUSAGE_SELF)
    return usage.ru_maxrss / 1024  # Linux reports KiB


def write_result(path: str | Path, name: str, results: dict[str, Any]) -> Path:
    """Write ``{"benchmark", "date_utc", "machine", "command", "results"}`` as indented JSON."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": name,
        "date_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "results": results,
    }
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path
