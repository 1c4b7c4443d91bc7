"""Issue 48, the eplb side: the statistics reader, the plan flags and the plan file under a hostile trial. Every bad
input ends in one ``EplbError`` (exit code 2 from the CLI) that names the problem, at once and before any work:
never a RecursionError, OverflowError or numpy ValueError, never minutes of planning, never a replaced file."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moeforge.cli import main
from moeforge.parallel.eplb import (
    MAX_LAYERS,
    MAX_LOAD,
    MAX_SLOTS,
    EplbError,
    check_plan_args,
    parse_stats,
    read_stats,
    rebalance,
)

GOOD = json.dumps({"artifact_sha256": "0" * 64, "groups": 2, "layers": [[4, 1, 2, 9], [3, 3, 0, 1]]})


def _eplb(capsys: pytest.CaptureFixture[str], *args: object) -> tuple[int, str]:
    code = main(["eplb", *(str(a) for a in args)])
    return code, capsys.readouterr().err


# ------------------------------------------------------------------------------------------ the statistics reader
@pytest.mark.parametrize(("text", "message"), [
    pytest.param("[" * 200_000, "nests deeper", id="nesting-bomb"),  # was RecursionError
    ('{"layers": ' + "[" * 100 + "]" * 100 + "}", "nests deeper"),
    ("[[1e308, 1e308, 1, 2]]", "over the 9007199254740992"),  # was a numpy broadcast ValueError
    pytest.param(f"[[{10**400}, 1, 2, 3]]", "integer of 401 digits", id="10**400"),  # was OverflowError
    ("[[1e400, 1, 2, 3]]", "out of a double's range"),
    ("[[1, Infinity, 2, 3]]", "not a JSON number"),
    ("[[1, -Infinity, 2, 3]]", "not a JSON number"),
    ("[[1, NaN, 2, 3]]", "NaN or inf"),
    ("[[1, 2, 3, 4], [1, 2]]", "layer 1 has 2 loads but layer 0 has 4"),
    ('{"layers": [[1, 2], [3]]}', "layer 1 has 1 loads"),
    ("[[1, 2, -3, 4]]", "negative"),
    ("[[1, true, 2, 3]]", "must be a number"),
    ('[[1, "2", 2, 3]]', "must be a number"),
    ("[[1, null, 2, 3]]", "must be a number"),
    ("[[]]", "non-empty"),
    ("[]", "2-D list"),
    ("[[1, 2], 3]", "2-D list"),
    ('{"layers": {"0": [1, 2]}}', "must be a JSON array"),
    ('{"load": [[1, 2]]}', 'needs a "layers" list'),
    ('{"layers": [[1, 2]], "groups": 0}', "'groups' must be an integer in 1..4096"),
    ('{"layers": [[1, 2]], "groups": 2.5}', "'groups' must be an integer"),
    ('{"layers": [[1, 2]], "artifact_sha256": 7}', "'artifact_sha256' must be a string"),
    pytest.param(json.dumps([[1] * (MAX_SLOTS + 1)]), "over the 4096 allowed", id="too-many-experts"),
    pytest.param(json.dumps([[1, 2]] * (MAX_LAYERS + 1)), "over the 256 allowed", id="too-many-layers"),
    ('{"layers": [[1, 2]]', "not valid JSON"),
])
def test_bad_statistics_end_in_one_eplb_error(text: str, message: str) -> None:
    with pytest.raises(EplbError, match=re.escape(message)):
        parse_stats(text)


@pytest.mark.parametrize(("line", "message"), [
    ('moeforge:expert_routed_tokens_total{layer="0",expert="99999"} 1', "beyond the 256 MoE layers x 4096 experts"),
    ('moeforge:expert_routed_tokens_total{layer="0",expert="0"} +Inf', "NaN or inf"),
    ('moeforge:expert_routed_tokens_total{layer="0",expert="0"} 1e300', "over the 9007199254740992"),
    pytest.param('moeforge:expert_routed_tokens_total{layer="' + "9" * 5000 + '",expert="0"} 1', "without integer",
                 id="5000-digit-label"),
])
def test_bad_scrapes_end_in_one_eplb_error(line: str, message: str) -> None:
    with pytest.raises(EplbError, match=re.escape(message)):
        parse_stats(line + "\n")


def test_the_reader_keeps_what_moeforge_writes() -> None:
    load, sha = parse_stats(GOOD)
    np.testing.assert_array_equal(load, [[4, 1, 2, 9], [3, 3, 0, 1]])
    assert sha == "0" * 64
    limit, _ = parse_stats(json.dumps([[MAX_LOAD, 0]]))  # the bound itself is a count
    assert limit[0, 0] == MAX_LOAD


def test_special_files_are_refused_not_read(tmp_path: Path) -> None:
    fifo = tmp_path / "stats.fifo"
    os.mkfifo(fifo)  # a reader that opened it plainly would block forever
    with pytest.raises(EplbError, match="not a regular file"):
        read_stats(fifo)
    with pytest.raises(EplbError, match="is a directory"):
        read_stats(tmp_path)
    (tmp_path / "bytes.json").write_bytes(b"[[1, 2]]\xff\xfe")
    with pytest.raises(EplbError, match="not UTF-8"):
        read_stats(tmp_path / "bytes.json")


# A JSON value of any shape, written as Python writes it (NaN / Infinity included), or near-valid statistics.
_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(10**45), 10**45), st.floats(), st.text(max_size=4))
_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=4)
                       | st.dictionaries(st.sampled_from(["layers", "groups", "artifact_sha256", "x"]), inner,
                                         max_size=4), max_leaves=24)
_tables = st.lists(st.lists(_scalars, min_size=1, max_size=5), min_size=1, max_size=4)
_records = st.fixed_dictionaries({"layers": _tables}, optional={"groups": _scalars, "artifact_sha256": _scalars})


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=st.one_of(_values, _tables, _records))
def test_fuzz_the_statistics_reader_returns_a_valid_table_or_one_eplb_error(value: object) -> None:
    try:
        load, sha = parse_stats(json.dumps(value))
    except EplbError:
        return
    assert load.ndim == 2 and load.size and np.isfinite(load).all() and (load >= 0).all() and (load <= MAX_LOAD).all()
    assert sha is None or isinstance(sha, str)


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=200) | st.binary(max_size=200))
def test_fuzz_the_statistics_reader_on_any_text(text: str | bytes) -> None:
    try:
        load, _ = parse_stats(text)
    except EplbError:
        return
    assert np.isfinite(load).all() and (load >= 0).all()


# ------------------------------------------------------------------------------------------ the plan's flags
@pytest.mark.parametrize(("args", "message"), [
    ((2, 10_000_000), "--redundant must be in 0..4096"),  # was minutes of greedy replication
    ((2, -1), "--redundant must be in 0..4096"),
    ((0, 0), "--ep must be in 1..4096"),
    ((10**9, 0), "--ep must be in 1..4096"),
    ((2, 0, 0), "--nodes must be in 1..--ep"),
    ((2, 0, 4), "--nodes must be in 1..--ep"),
    ((2, 0, 1, 0), "--groups must be in 1..4096"),
    ((2, 0, 1, -3), "--groups must be in 1..4096"),
    ((2, 0, 1, 10**9), "--groups must be in 1..4096"),
])
def test_plan_flags_are_bounded_before_any_work(args: tuple[int, ...], message: str) -> None:
    with pytest.raises(EplbError, match=re.escape(message)):
        check_plan_args(*args)


def test_slots_over_the_bound_are_refused_at_once() -> None:
    start = time.perf_counter()
    with pytest.raises(EplbError, match="over the 4096 a plan may have"):
        rebalance([[1.0] * 8], ep=8, redundant=10_000_000 - 8)
    assert time.perf_counter() - start < 1.0


def test_cli_checks_flags_and_output_before_reading_the_statistics(capsys: pytest.CaptureFixture[str],
                                                                   tmp_path: Path) -> None:
    """Flags first (the statistics file does not even exist), then the plan path, both before any planning."""
    missing = tmp_path / "missing.json"
    start = time.perf_counter()
    code, err = _eplb(capsys, missing, "-o", tmp_path / "plan.json", "--ep", 2, "--redundant", 10_000_000)
    assert code == 2 and "--redundant must be in 0..4096" in err and err.startswith("moeforge eplb: error:")
    assert time.perf_counter() - start < 5.0
    code, err = _eplb(capsys, missing, "-o", tmp_path / "plan.json", "--ep", 2, "--redundant", 0, "--groups", 0)
    assert code == 2 and "--groups must be in 1..4096" in err
    code, err = _eplb(capsys, missing, "-o", tmp_path / "no" / "plan.json", "--ep", 2, "--redundant", 0)
    assert code == 2 and "does not exist" in err and "create it first" in err
    bomb = tmp_path / "bomb.json"
    bomb.write_text("[" * 200_000)
    code, err = _eplb(capsys, bomb, "-o", tmp_path / "plan.json", "--ep", 2, "--redundant", 0)
    assert code == 2 and "nests deeper than 32 levels" in err and "Traceback" not in err
    assert not (tmp_path / "plan.json").exists()


def test_cli_never_replaces_a_file_without_force_nor_writes_through_a_link(capsys: pytest.CaptureFixture[str],
                                                                          tmp_path: Path) -> None:
    stats = tmp_path / "stats.json"
    stats.write_text(GOOD)
    plan = tmp_path / "plan.json"
    plan.write_text("the user's file\n")
    code, err = _eplb(capsys, stats, "-o", plan, "--ep", 2, "--redundant", 0)
    assert code == 2 and "exists: pass --force" in err
    assert plan.read_text() == "the user's file\n"
    assert _eplb(capsys, stats, "-o", plan, "--ep", 2, "--redundant", 0, "--force")[0] == 0
    assert json.loads(plan.read_text())["groups"] == 2  # the statistics' groups
    outside = tmp_path / "outside.txt"
    outside.write_text("keep\n")
    link = tmp_path / "link.json"
    link.symlink_to(outside)
    code, err = _eplb(capsys, stats, "-o", link, "--ep", 2, "--redundant", 0, "--force")
    assert code == 2 and "symbolic link" in err
    assert outside.read_text() == "keep\n" and link.is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.json", "outside.txt", "plan.json", "stats.json"]
