"""Byte counts as people read them (one formatter for inspect, bench and ``compile --plan``)."""

from __future__ import annotations


def format_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'; below 1 KiB whole bytes."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
