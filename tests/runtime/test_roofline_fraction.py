"""The roofline's rule (moeforge/runtime/roofline_fraction.py) and a run's bandwidth (moeforge/core/run_bandwidth.py),
with the probe replaced by a script of numbers: a fraction is at most 1; above 1 the run re-probes once; a rate that
stays above names the bandwidth when the run's probes disagree by more than the gap, else the byte count; the cache as
a fallback says its age; ``--remeasure-bandwidth``'s full probe replaces the cached number."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest

from moeforge.core import bandwidth as bandwidth_mod
from moeforge.core.bandwidth import CACHE_FILE, DEFAULT_PROBE_BYTES, Bandwidth
from moeforge.core.run_bandwidth import RunBandwidth, describe_bandwidth
from moeforge.runtime import roofline_fraction as rule
from moeforge.runtime.roofline_fraction import BANDWIDTH, BYTES, roofline_fraction

GB = 1e9
MIB = 2**20


def _measured(best: float, median: float, probe_bytes: int = 128 * MIB, rounds: int = 5,
              when: datetime | None = None, cached: bool = False) -> Bandwidth:
    return Bandwidth(best_gb_s=best, median_gb_s=median, threads=2, probe_bytes=probe_bytes, rounds=rounds, cpu="test",
                     measured_utc=(when or datetime.now(UTC)).isoformat(timespec="seconds"), load_1min=1.5,
                     cached=cached)


@pytest.fixture
def script(monkeypatch: pytest.MonkeyPatch) -> list[tuple[float, float]]:
    """The probe returns the (best, median) GB/s pairs of the list, in order; what is left shows what was not probed."""
    rates: list[tuple[float, float]] = []

    def probe(threads: int | None = None, probe_bytes: int = DEFAULT_PROBE_BYTES, rounds: int = 7) -> Bandwidth:
        best, median = rates.pop(0)
        return _measured(best, median, probe_bytes, rounds)

    monkeypatch.setattr(bandwidth_mod, "probe_read_bandwidth", probe)
    monkeypatch.setattr(rule, "last_level_cache_bytes", lambda: 32 * MIB)
    return rates


def _run(script: list[tuple[float, float]], *rates: tuple[float, float]) -> RunBandwidth:
    """A run that probed ``rates[0]`` before and ``rates[1]`` after its steps; the rest are left for a re-probe."""
    script[:] = list(rates)
    run = RunBandwidth.probed(2)
    run.sample("before")
    run.sample("after")
    return run


def test_a_rate_within_the_bandwidth_is_its_fraction_of_the_best_probe(script):
    run = _run(script, (20.0, 18.0), (24.0, 22.0), (99.0, 99.0))
    got = roofline_fraction(12 * GB, 1.0, run)
    assert got.value == pytest.approx(0.5) and got.bandwidth.best_gb_s == 24.0 and got.reason == ""
    assert script == [(99.0, 99.0)]  # no re-probe
    assert got.to_dict() == {"fraction": 0.5, "fraction_reason": None, "fraction_suspect": None}


def test_a_rate_above_a_stale_number_is_judged_against_the_re_probe(script):
    run = _run(script, (10.0, 9.0), (11.0, 9.0), (25.0, 24.0))
    got = roofline_fraction(20 * GB, 1.0, run)
    assert got.value == pytest.approx(0.8) and got.bandwidth.best_gb_s == 25.0
    assert "above the 11.00 GB/s probed in this run; re-probed: 25.00 GB/s" in got.reason and "stale" in got.reason
    assert [when for when, _ in run.probes] == ["before", "after", "re-probe"]
    roofline_fraction(30 * GB, 1.0, run)  # above again: the run re-probes once, not again
    assert len(run.probes) == 3


def test_a_rate_that_stays_above_probes_that_disagree_points_to_the_bandwidth(script):
    run = _run(script, (10.0, 6.0), (20.0, 18.0), (19.0, 17.0))
    got = roofline_fraction(22 * GB, 1.0, run)
    assert got.value is None and got.suspect == BANDWIDTH
    assert got.to_dict()["fraction"] is None
    assert "22.00 GB/s read is 1.10x the highest read bandwidth measured (20.00 GB/s" in got.reason
    assert "6.00 to 20.00 GB/s" in got.reason and "3.33x apart" in got.reason and "likely the bandwidth" in got.reason


@pytest.mark.parametrize(("read_bytes", "words"), [
    (8 * MIB, "its 8.0 MiB fit in the 32.0 MiB last-level cache"),
    (400 * MIB, "the 400.0 MiB counted include bytes it does not read from memory"),
])
def test_a_rate_that_stays_above_probes_that_agree_points_to_the_byte_count(script, read_bytes, words):
    run = _run(script, (20.0, 19.0), (20.5, 19.5), (20.2, 19.0))
    got = roofline_fraction(read_bytes, read_bytes / (30 * GB), run)  # 30 GB/s: 1.46x the best, the probes 1.08x
    assert got.value is None and got.suspect == BYTES
    assert "likely the byte count" in got.reason and "1.08x apart" in got.reason and words in got.reason


def test_the_cache_as_a_fallback_says_its_age_and_conditions(script, tmp_path):
    threads = 2
    entry = {"best_gb_s": 13.3, "median_gb_s": 9.5, "threads": threads, "probe_bytes": 2**29, "rounds": 7,
             "cpu": "test", "load_1min": 3.5,
             "measured_utc": (datetime.now(UTC) - timedelta(days=3)).isoformat(timespec="seconds")}
    (tmp_path / CACHE_FILE).write_text(json.dumps({bandwidth_mod._cache_key(threads): entry}))
    run = RunBandwidth.from_cache(threads, folder=tmp_path)
    assert run.sample("before") is None and run.probes == []  # the cached number: no probe
    got = roofline_fraction(6.65 * GB, 1.0, run)
    assert got.value == pytest.approx(0.5) and got.bandwidth.cached
    report = run.to_dict()
    assert report["bandwidth_source"] == "cache"
    assert report["bandwidth_cache"]["age_s"] == pytest.approx(3 * 86400, abs=600)
    assert report["bandwidth_cache"]["load_1min"] == 3.5 and report["bandwidth_probes"] == []
    words = describe_bandwidth(report)
    assert words.startswith("read bandwidth 13.3 GB/s (2 threads; the cached number 13.3 / 9.5, 3.0 days old")
    assert "512 MiB x 7 rounds, load 3.5" in words and "--remeasure-bandwidth replaces it" in words


def test_nothing_cached_the_fallback_probes_in_full_and_caches(script, tmp_path):
    script[:] = [(30.0, 28.0)]
    run = RunBandwidth.from_cache(2, folder=tmp_path)
    assert run.cached is None and run.to_dict()["bandwidth_source"] == "probed in this run"
    assert run.probes[0][0].startswith("before (full probe") and run.probes[0][1].probe_bytes == DEFAULT_PROBE_BYTES
    assert (tmp_path / CACHE_FILE).is_file()


def test_remeasure_takes_the_full_probe_first_and_replaces_the_cached_number(script, tmp_path):
    script[:] = [(30.0, 28.0), (29.0, 27.0)]
    run = RunBandwidth.probed(2, refresh_cache=True, folder=tmp_path)
    run.sample("before")
    run.sample("after")
    (before, full), (after, short) = run.probes
    assert before == "before (full probe, now cached)" and full.probe_bytes == DEFAULT_PROBE_BYTES
    assert after == "after" and short.probe_bytes == bandwidth_mod.run_probe_bytes()
    assert short.rounds == bandwidth_mod.RUN_PROBE_ROUNDS
    assert RunBandwidth.from_cache(2, folder=tmp_path).cached.best_gb_s == 30.0  # type: ignore[union-attr]
    words = describe_bandwidth(run.to_dict())
    assert "before (full probe, now cached) 30.0 / 28.0, after 29.0 / 27.0" in words


@pytest.mark.parametrize(("llc", "probe"), [(None, DEFAULT_PROBE_BYTES), (MIB, 64 * MIB), (32 * MIB, 128 * MIB),
                                            (2**30, DEFAULT_PROBE_BYTES)])
def test_the_short_probe_reads_a_few_times_the_last_level_cache(monkeypatch, llc, probe):
    monkeypatch.setattr(bandwidth_mod, "last_level_cache_bytes", lambda: llc)
    assert bandwidth_mod.run_probe_bytes() == probe


def test_no_bandwidth_yet_is_an_error_not_a_fraction():
    with pytest.raises(ValueError, match="sample"):
        roofline_fraction(1.0, 1.0, RunBandwidth(threads=1))
