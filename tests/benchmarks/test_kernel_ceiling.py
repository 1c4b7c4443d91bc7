"""benchmarks/kernel_ceiling.py under the roofline's rule: each kind of kernel gets its fraction of the bandwidth probed
around the kernels, never above 1; a kind that reads faster than a stale probe makes the run re-probe, and the kinds
judged before the re-probe are judged again against it. The kernels' timings and the probe are fixed numbers here."""

import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import kernel_ceiling as kc

from moeforge.core import bandwidth as bandwidth_mod
from moeforge.core.bandwidth import Bandwidth
from moeforge.core.run_bandwidth import RunBandwidth

GB = 10**9
# bytes and seconds of each kind: 5 GB/s, 20 GB/s and 4 GB/s read
TIMED = {"routed expert": (GB, 0.2), "lm head": (2 * GB, 0.1), "other MatMulNBits": (GB, 0.25)}


@pytest.fixture
def fixed(monkeypatch: pytest.MonkeyPatch) -> list[tuple[float, float]]:
    """Kernels that read at TIMED's rates; a probe that returns the listed (best, median) GB/s in order."""
    rates: list[tuple[float, float]] = []

    def probe(threads: int | None = None, probe_bytes: int = 1, rounds: int = 1) -> Bandwidth:
        best, median = rates.pop(0)
        return Bandwidth(best_gb_s=best, median_gb_s=median, threads=threads or 1, probe_bytes=probe_bytes,
                         rounds=rounds, cpu="test", measured_utc=datetime.now(UTC).isoformat(timespec="seconds"))

    def time_kernels(shapes: list[dict[str, Any]], rows: int, threads: int, copies: int = 1,
                     repeats: int = 15) -> dict[str, Any]:
        total, seconds = TIMED[shapes[0]["kind"]]
        return {"rows": rows, "bytes": total, "seconds": seconds, "ms": seconds * 1e3, "gb_s": total / seconds / GB}

    monkeypatch.setattr(bandwidth_mod, "probe_read_bandwidth", probe)
    monkeypatch.setattr(kc, "kernel_shapes", lambda artifact: {k: [{"kind": k, "weight": [8, 8]}] for k in TIMED})
    monkeypatch.setattr(kc, "time_kernels", time_kernels)
    return rates


def test_each_kind_is_a_fraction_of_the_bandwidth_probed_around_the_kernels(fixed):
    fixed[:] = [(25.0, 24.0), (24.0, 23.0)]
    out = kc.kernel_ceiling("unused", rows=1, threads=2, bandwidth=RunBandwidth.probed(2))
    assert [out[k]["fraction"] for k in TIMED] == [0.2, 0.8, 0.16]  # against the higher probe, 25 GB/s
    assert all(out[k]["fraction_reason"] is None for k in TIMED)
    assert [p["when"] for p in out["bandwidth"]["bandwidth_probes"]] == ["before kernels", "after kernels"]
    assert out["bandwidth"]["bandwidth_source"] == "probed in this run" and fixed == []


def test_a_stale_probe_is_re_probed_and_the_kinds_before_it_judged_again(fixed):
    """The probes read 10 GB/s (the machine busy then); the head reads 20: re-probed at 40, every kind's fraction is
    of 40, the routed experts' too (judged at 0.5 of 10 before the re-probe)."""
    fixed[:] = [(10.0, 9.0), (10.0, 9.0), (40.0, 38.0)]
    out = kc.kernel_ceiling("unused", rows=1, threads=2, bandwidth=RunBandwidth.probed(2))
    assert [out[k]["fraction"] for k in TIMED] == [0.125, 0.5, 0.1]
    assert "stale" in out["lm head"]["fraction_reason"] and out["routed expert"]["fraction_reason"] is None
    assert out["bandwidth"]["bandwidth_gb_s"] == 40.0
    assert [p["when"] for p in out["bandwidth"]["bandwidth_probes"]] == ["before kernels", "after kernels",
                                                                         "re-probe"]


def test_a_rate_above_every_probe_gives_no_fraction_but_the_reason(fixed, monkeypatch):
    monkeypatch.setattr("moeforge.runtime.roofline_fraction.last_level_cache_bytes", lambda: 2**20)
    fixed[:] = [(10.0, 9.8), (10.0, 9.9), (10.1, 9.9)]  # probes that agree: the head's 20 GB/s is the byte count's
    out = kc.kernel_ceiling("unused", rows=1, threads=2, bandwidth=RunBandwidth.probed(2))
    head = out["lm head"]
    assert head["fraction"] is None and head["fraction_suspect"] == "bytes"
    assert "likely the byte count" in head["fraction_reason"]
    assert all(0 < out[k]["fraction"] <= 1 for k in ("routed expert", "other MatMulNBits"))


def test_without_a_bandwidth_there_are_no_probes_and_no_fractions(fixed):
    out = kc.kernel_ceiling("unused", rows=1, threads=2, active_expert_bytes=GB)
    assert "bandwidth" not in out and all("fraction" not in out[k] for k in TIMED)
    assert out["floor_step_ms"] == 200.0 + 100.0 + 250.0  # the routed bytes at their rate + the other kinds' times
