"""A hostile trial of the file surfaces (after issue 48), with new inputs: each test is a defect the trial found, now a
``MoeforgeError`` (the CLI's one line, exit 2) or a safe fallback instead of a traceback, a hang or a wrong answer.
Cheap: the readers, writers and removers are called directly; no model is built."""

from __future__ import annotations

import json
import logging
import os
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from moeforge.compile import partial_compile
from moeforge.compile.options import CompileOptions
from moeforge.compile.partial_compile import compile_fingerprint
from moeforge.core import bandwidth
from moeforge.core.errors import MoeforgeError
from moeforge.core.host_memory import parse_size
from moeforge.core.safe_paths import (
    OWNED_MARKER,
    UnsafePathError,
    check_output_file,
    create_owned_dir,
    expand_user,
    remove_owned_dir,
    remove_tree,
    write_output_file,
)
from moeforge.core.strict_json import JsonFileError, parse_json_text, read_json_file, read_regular_file
from moeforge.model.expert_slots import PlacementError, load_plan
from moeforge.parallel.eplb import METRIC, EplbError, Placement, parse_stats, rebalance
from moeforge.runtime.kv_tiers import disk_tier
from moeforge.runtime.kv_tiers.disk_tier import DiskTier

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/: the deep folder chains
from deep_tree import add_file, deep_tree

NO_USER = "~moeforge-no-such-user-4c1d"  # Path.expanduser raises RuntimeError on it


def _deep_tree(root: Path, depth: int, outside: Path) -> None:
    """``root`` holding a chain of ``depth`` folders, with a link to ``outside`` at the bottom and at the top."""

    def bottom(fd: int) -> None:
        os.symlink(outside, "bottom-link", dir_fd=fd)
        add_file("file")(fd)

    deep_tree(root, depth, bottom)
    (root / "top-link").symlink_to(outside)


# ----------------------------------------------------------------------------------------------- safe_paths
def test_an_unknown_users_home_is_a_refusal_not_a_traceback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert expand_user(f"{NO_USER}/x.json") == Path(f"{NO_USER}/x.json")  # as a shell leaves it
    with pytest.raises(UnsafePathError, match="does not exist"):  # a relative folder that is not there
        check_output_file(f"{NO_USER}/x.json", flag="--expert-load-out")
    with pytest.raises(UnsafePathError):
        write_output_file(f"{NO_USER}/plan.json", "{}", flag="-o")
    assert list(tmp_path.iterdir()) == []


def test_an_output_path_ending_in_a_slash_names_a_folder(tmp_path: Path) -> None:
    for text in (f"{tmp_path}/stats.json/", "", "/"):
        with pytest.raises(UnsafePathError, match="names a folder"):
            write_output_file(text, "{}", flag="--expert-load-out")
    assert list(tmp_path.iterdir()) == []


def test_a_link_loop_on_the_way_names_the_flag(tmp_path: Path) -> None:
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    with pytest.raises(UnsafePathError, match=r"--expert-load-out .*link loop"):
        check_output_file(tmp_path / "loop" / "x.json", flag="--expert-load-out")


def test_a_tree_thousands_of_folders_deep_is_removed_and_links_are_not_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "thesis.tex").write_text("keep")
    _deep_tree(tmp_path / "deep", max(3000, sys.getrecursionlimit() + 100), outside)  # shutil.rmtree recursed here
    remove_tree(tmp_path / "deep")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outside"]
    assert (outside / "thesis.tex").read_text() == "keep"
    owned = create_owned_dir(tmp_path / "owned")
    _deep_tree(owned / "junk", 2000, outside)
    assert remove_owned_dir(owned) and not owned.exists()
    assert (outside / "thesis.tex").read_text() == "keep"
    (tmp_path / "link").symlink_to(outside)  # a link at the path itself: the link goes, never its target
    remove_tree(tmp_path / "link")
    assert not os.path.lexists(tmp_path / "link") and (outside / "thesis.tex").read_text() == "keep"


def test_a_killed_compiles_partial_dir_with_a_deep_junk_folder_is_cleared(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("keep")
    root = create_owned_dir(tmp_path / ".out.moeforge-partial")
    _deep_tree(root / "junk", 3000, outside)
    (root / "rank0").symlink_to(outside)
    assert partial_compile._resumable(root, "f" * 64, 2) == set()
    assert sorted(p.name for p in root.iterdir()) == [OWNED_MARKER]
    assert [p.name for p in outside.iterdir()] == ["keep"]


def _swap_for_link(root: Path, user: Path) -> Path:
    """Move the partial directory ``root`` away and put a link to the user's folder ``user`` at its name."""
    moved = root.with_name("moved-away")
    os.rename(root, moved)
    root.symlink_to(user)
    return moved


def test_a_partial_dir_swapped_for_a_link_after_the_lock_is_never_cleared_through_it(tmp_path: Path) -> None:
    user = tmp_path / "user"
    user.mkdir()
    for name in ("thesis.tex", "resume.json", OWNED_MARKER, "rank0"):
        (user / name).write_text("the user's")
    root = create_owned_dir(tmp_path / ".out.moeforge-partial")
    (root / "junk").mkdir()
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        moved = _swap_for_link(root, user)
        assert partial_compile._resumable(root, "f" * 64, 2, fd) == set()  # cleared through the descriptor
        assert sorted(p.name for p in moved.iterdir()) == [OWNED_MARKER]
        partial_compile._write_resume(fd, "{}\n")
        assert (moved / partial_compile.RESUME_FILE).read_text() == "{}\n"
        with pytest.raises(MoeforgeError, match="was replaced while the compile wrote it"):
            partial_compile.PartialCompile(root, set(), fd).seal()
    finally:
        os.close(fd)
    assert all((user / name).read_text() == "the user's" for name in ("thesis.tex", "resume.json", OWNED_MARKER))


def test_the_fingerprint_reads_the_placement_as_a_plan_is_read(tmp_path: Path) -> None:
    huge = tmp_path / "plan.json"
    with open(huge, "wb") as handle:
        handle.truncate(100 * 2**30)  # swapped in after the plan was checked: never read into memory
    options = CompileOptions(model="tiny-llama", output_dir=tmp_path / "out", placement=huge)
    with pytest.raises(MoeforgeError, match="over the"):
        compile_fingerprint(options)
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    with pytest.raises(MoeforgeError, match="not a regular file"):
        compile_fingerprint(CompileOptions(model="tiny-llama", output_dir=tmp_path / "out", placement=fifo))


# ----------------------------------------------------------------------------------------------- strict_json
@pytest.mark.parametrize(("text", "why"), [
    ('{"ep": 2, "ep": 4}', "appears twice"),
    ('{"a": {"x": 1, "x": 1}}', "appears twice"),
    ('{"source": "\\ud800"}', "surrogate"),
    ('["ok", ["\\udfff"]]', "surrogate"),
    ('{"\\udc00": 1}', "surrogate"),
])
def test_duplicate_keys_and_lone_surrogates_are_refused(text: str, why: str) -> None:
    with pytest.raises(JsonFileError, match=why):
        parse_json_text(text, source="sharded manifest x")


def test_a_surrogate_pair_is_text() -> None:
    assert parse_json_text('["\\ud83d\\ude00"]', source="x") == ["\U0001f600"]


def test_pseudo_files_are_not_read(tmp_path: Path) -> None:
    for path in ("/proc/self/status", "/sys/kernel/mm/transparent_hugepage/enabled"):
        with pytest.raises(JsonFileError, match="pseudo file"):
            read_regular_file(path, what="statistics")
    link = tmp_path / "plan.json"
    link.symlink_to("/proc/self/environ")
    with pytest.raises(JsonFileError, match="pseudo file"):
        read_json_file(link, what="placement plan")


# ----------------------------------------------------------------------------------------------- eplb
def _scrape(rows: list[list[Any]], layer: str = "", value: str = "") -> str:
    lines = [f'{METRIC}{{layer="{i}",expert="{e}"}} {v}' for i, row in enumerate(rows) for e, v in enumerate(row)]
    if layer:
        lines[0] = f'{METRIC}{{layer="{layer}",expert="0"}} 1'
    if value:
        lines[0] = f'{METRIC}{{layer="0",expert="0"}} {value}'
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(("layer", "value"), [
    ("0_1", ""), ("+0", ""), (" 0", ""), ("\u0660", ""), ("9" * 30, ""),
    ("", "1_000"), ("", "\u0662"), ("", "0x10"), ("", "1" * 65),
])
def test_a_scrape_holds_ascii_integers_and_prometheus_numbers_only(layer: str, value: str) -> None:
    with pytest.raises(EplbError, match="sample without integer layer/expert labels or a number"):
        parse_stats(_scrape([[1, 2], [3, 4]], layer, value))


def test_a_scrape_still_takes_what_prometheus_writes() -> None:
    load, _ = parse_stats(_scrape([[1, 2.5], [3e2, 0]]).replace(" 0\n", " -0\n"))
    assert load.tolist() == [[1, 2.5], [300, 0]]
    with pytest.raises(EplbError, match="NaN or inf"):
        parse_stats(_scrape([[1, 2], [3, 4]], value="+Inf"))


def test_statistics_with_a_byte_order_mark_are_read() -> None:
    for text in ("\ufeff" + json.dumps({"layers": [[1, 2], [3, 4]]}), "\ufeff" + _scrape([[1, 2], [3, 4]])):
        assert parse_stats(text.encode())[0].tolist() == [[1, 2], [3, 4]]


def test_statistics_with_a_key_twice_are_refused() -> None:
    with pytest.raises(EplbError, match="appears twice"):
        parse_stats('{"layers": [[1, 2]], "layers": [[1, 2], [3, 4]]}')


@pytest.mark.parametrize("change", [{"ep": 2.9}, {"ep": "2"}, {"ep": float("inf")}, {"ep": True},
                                    {"redundant": 10**400}, {"mode": ["global"]}, {"artifact_sha256": [1]}])
def test_a_plan_dict_is_read_strictly(change: dict[str, Any]) -> None:
    data = rebalance(np.array([[5.0, 1, 1, 1], [1, 1, 1, 5]]), 2, 0).to_dict()
    assert Placement.from_dict(data).to_dict() == data
    with pytest.raises(EplbError):
        Placement.from_dict({**data, **change})


def test_a_plan_path_of_an_unknown_users_home_is_a_refusal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(PlacementError, match="does not exist"):
        load_plan(f"{NO_USER}/plan.json")


# ----------------------------------------------------------------------------------------------- bandwidth cache
def _cache_entry(threads: int, measured: str) -> dict[str, Any]:
    return {"best_gb_s": 30.0, "median_gb_s": 28.0, "threads": threads, "probe_bytes": 2**29, "rounds": 7,
            "cpu": "x", "measured_utc": measured, "load_1min": 0.1}


@pytest.mark.parametrize("measured", [
    (datetime.now(UTC) + timedelta(days=30)).isoformat(timespec="seconds"),
    "9999-12-31T23:59:59-23:59", "2026-01-01T00:00:00", "yesterday",
])
def test_a_cached_bandwidth_from_the_future_or_of_no_time_is_measured_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, measured: str) -> None:
    probed = bandwidth.Bandwidth(9.0, 8.0, 1, 64, 1, "cpu", datetime.now(UTC).isoformat(timespec="seconds"))
    monkeypatch.setattr(bandwidth, "probe_read_bandwidth", lambda threads=None, *a, **k: probed)
    (tmp_path / bandwidth.CACHE_FILE).write_text(json.dumps({bandwidth._cache_key(1): _cache_entry(1, measured)}))
    with caplog.at_level(logging.WARNING):
        got = bandwidth.read_bandwidth(1, folder=tmp_path)
    assert not got.cached and got.best_gb_s == 9.0
    assert "measured_utc" in caplog.text


def test_a_cached_bandwidth_of_a_past_time_is_used(tmp_path: Path) -> None:
    past = (datetime.now(UTC) - timedelta(days=3)).isoformat(timespec="seconds")
    (tmp_path / bandwidth.CACHE_FILE).write_text(json.dumps({bandwidth._cache_key(1): _cache_entry(1, past)}))
    assert bandwidth.read_bandwidth(1, folder=tmp_path).cached


def test_the_cache_folder_expands_a_tilde_for_reads_and_writes_alike(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("MOEFORGE_CACHE_DIR", "~/cache")
    assert bandwidth.cache_dir() == tmp_path / "cache"
    monkeypatch.setenv("MOEFORGE_CACHE_DIR", f"{NO_USER}/cache")
    assert bandwidth.cache_dir() == Path(f"{NO_USER}/cache")  # as written, never a RuntimeError


# ----------------------------------------------------------------------------------------------- KV disk tier
def test_a_key_path_pathlib_cannot_resolve_turns_the_tier_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    def loop(directory: Path) -> bytes:
        raise RuntimeError(f"Symlink loop from {directory!r}")  # Path.resolve before Python 3.13

    monkeypatch.setattr(disk_tier, "load_disk_key", loop)
    with caplog.at_level(logging.WARNING):
        tier = DiskTier(tmp_path / "kv", 1 << 20, "ns")
    assert not tier.usable and "KV disk tier off" in caplog.text
    assert tier.put(b"k" * 16, b"x") is False and tier.get(b"k" * 16) is None


def test_a_kv_disk_dir_that_is_a_link_loop_turns_the_tier_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOEFORGE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("MOEFORGE_KV_DISK_KEY", raising=False)
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    assert not DiskTier(tmp_path / "loop" / "sub", 1 << 20, "ns").usable
    assert not DiskTier(tmp_path / "loop", 1 << 20, "ns").usable


# ----------------------------------------------------------------------------------------------- sizes
def test_a_zero_padded_size_says_how_long_it_is_not_that_it_is_too_large() -> None:
    with pytest.raises(ValueError, match="42 characters"):
        parse_size("0" * 41 + "1")


def test_an_unknown_users_home_in_an_artifact_path_is_a_refusal(capsys: pytest.CaptureFixture[str]) -> None:
    """``~nosuchuser/x`` (pathlib's expanduser raises RuntimeError on it) stays a path that does not exist."""
    from moeforge.cli import main

    for argv in (["inspect", "~nosuchuser-moeforge/art"], ["run", "~nosuchuser-moeforge/art", "--prompt-ids", "1"]):
        assert main(argv) == 2
        assert "Traceback" not in capsys.readouterr().err

