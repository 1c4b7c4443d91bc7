"""Issue 48, the runtime side: the files a run writes and reads besides its artifact. ``--expert-load-out`` (run, serve,
bench) follows the safe-path rule, checked before any model loads; the bandwidth cache is read strictly, an invalid
entry measured over, and written without following a link. Every failure is a user error (exit code 2) or a
warning, never a traceback or a silently wrong number."""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moeforge.cli import commands, main
from moeforge.cli.bench import _expert_load
from moeforge.compile.driver import CompileOptions, compile_model
from moeforge.core import bandwidth as bandwidth_mod
from moeforge.core.bandwidth import CACHE_FILE, MAX_GB_S, MIN_GB_S, Bandwidth, BandwidthError, read_bandwidth
from moeforge.core.errors import MoeforgeError
from moeforge.runtime.engine import LLMEngine
from moeforge.runtime.expert_stats import FORMAT, save_expert_load
from moeforge.serve.runner import ServeOptions, _save_expert_load

PROMPT = ["--prompt-ids", "5,17,200,3", "--max-new-tokens", "2", "--ignore-eos"]


@pytest.fixture(scope="module")
def moe_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-deepseek-v3, the tiniest MoE preset, at max_seq_len 32: never mutated."""
    out = tmp_path_factory.mktemp("ds3") / "artifact"
    return compile_model(CompileOptions.from_flags(model="tiny-deepseek-v3", output_dir=out, max_seq_len=32,
                                                   progress=False)).output_dir


@pytest.fixture
def no_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any model load fails the test: the refusals must come before one."""
    def loaded(*_args: Any, **_kwargs: Any) -> None:
        raise AssertionError("a model was loaded before the refusal")

    monkeypatch.setattr(LLMEngine, "from_artifact", staticmethod(loaded))


@pytest.fixture(autouse=True)
def _no_user_cache(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    """No test here reads or writes the user's own ~/.cache/moeforge."""
    monkeypatch.setenv("MOEFORGE_CACHE_DIR", str(tmp_path_factory.mktemp("user-cache")))


def _cli(capsys: pytest.CaptureFixture[str], *args: object) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# ------------------------------------------------------------------------------------------ --expert-load-out
def _target(kind: str, tmp_path: Path) -> tuple[Path, Callable[[], object]]:
    """A path of ``kind`` and a snapshot of what must not change there."""
    path = tmp_path / "stats.json"
    if kind == "file":
        path.write_text("the user's file\n")
        return path, path.read_text
    if kind in ("link", "proc_link"):
        outside = tmp_path / "outside.txt"
        outside.write_text("keep\n")
        path.symlink_to(outside if kind == "link" else Path("/proc/self/fd/1"))
        return path, lambda: (os.readlink(path), outside.read_text())
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        try:
            os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))  # /dev/null's numbers
        except PermissionError:
            pytest.skip("creating a device node needs CAP_MKNOD")
    elif kind == "directory":
        path.mkdir()
    elif kind == "proc":
        return Path("/proc/self/status"), lambda: None
    elif kind == "no_folder":
        return tmp_path / "missing" / "stats.json", lambda: (tmp_path / "missing").exists()
    return path, lambda: (stat.S_IFMT(os.lstat(path).st_mode), sorted(os.listdir(tmp_path)))


@pytest.mark.parametrize(("kind", "force", "message"), [
    ("file", False, "exists: pass --force"),  # was silently replaced
    ("link", True, "is a symbolic link"),  # was renamed over: the link gone, a regular file in its place
    ("proc_link", True, "is a symbolic link"),
    ("fifo", True, "is a FIFO"),
    ("device", True, "is a device node"),
    ("directory", True, "is a directory"),  # was IsADirectoryError after the generation
    ("proc", True, "does not write under /proc"),  # was FileNotFoundError after the generation
    ("no_folder", False, "does not exist"),
])
def test_run_refuses_the_path_before_the_model_loads(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                     moe_artifact: Path, no_model: None, kind: str, force: bool,
                                                     message: str) -> None:
    path, snapshot = _target(kind, tmp_path)
    before = snapshot()
    code, _, err = _cli(capsys, "run", moe_artifact, *PROMPT, "--expert-load-out", path, *(["--force"] * force))
    assert code == 2 and message in err and err.startswith("moeforge run: error: --expert-load-out")
    assert "Traceback" not in err
    assert snapshot() == before


def test_a_dense_artifact_is_refused_from_its_manifest(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                       moe_artifact: Path, no_model: None) -> None:
    """Was refused only after the whole generation; now from the manifest, before the model loads."""
    dense = Path(shutil.copytree(moe_artifact, tmp_path / "dense"))
    manifest = json.loads((dense / "manifest.json").read_text())
    manifest["model_config"]["moe"] = None  # what a dense model's manifest records
    (dense / "manifest.json").write_text(json.dumps(manifest))
    for command in (["run", dense, *PROMPT], ["serve", dense], ["bench", dense, "--no-compare"]):
        code, _, err = _cli(capsys, *command, "--expert-load-out", tmp_path / "stats.json")
        assert code == 2 and "routes no experts (not a MoE model)" in err, (command, err)
    assert not (tmp_path / "stats.json").exists()


def test_serve_and_bench_refuse_an_existing_file_before_the_model_loads(capsys: pytest.CaptureFixture[str],
                                                                        tmp_path: Path, moe_artifact: Path,
                                                                        no_model: None) -> None:
    stats = tmp_path / "stats.json"
    stats.write_text("the user's file\n")
    for command in (["serve", moe_artifact], ["bench", moe_artifact, "--no-compare"]):
        code, _, err = _cli(capsys, *command, "--expert-load-out", stats)
        assert code == 2 and "exists: pass --force" in err, (command, err)
    code, _, err = _cli(capsys, "bench", moe_artifact, "--multi-turn", "--expert-load-out", tmp_path / "new.json")
    assert code == 2 and "--multi-turn does not write it" in err  # was silently never written
    assert stats.read_text() == "the user's file\n"


def test_force_replaces_a_file_with_the_runs_statistics(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                        moe_artifact: Path) -> None:
    stats = tmp_path / "stats.json"
    stats.write_text("the user's file\n")
    code, _, err = _cli(capsys, "run", moe_artifact, *PROMPT, "--expert-load-out", stats, "--force")
    assert code == 0, err
    record = json.loads(stats.read_text())
    assert record["format"] == FORMAT and np.asarray(record["layers"]).sum() > 0
    assert os.listdir(tmp_path) == ["stats.json"]  # no temporary or probe file left


def test_a_write_failing_at_the_end_is_a_clean_error(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                     moe_artifact: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The path passed the early check, then became a directory while the model generated: exit 2 with a message,
    the generated tokens printed, no traceback (was IsADirectoryError, exit 1)."""
    stats = tmp_path / "stats.json"
    done = commands._Printer.done

    def done_then_block(printer: Any, token_ids: list[int]) -> None:
        done(printer, token_ids)
        stats.mkdir()

    monkeypatch.setattr(commands._Printer, "done", done_then_block)
    code, out, err = _cli(capsys, "run", moe_artifact, *PROMPT, "--expert-load-out", stats, "--force")
    assert code == 2 and "--expert-load-out" in err and "is a directory" in err and "Traceback" not in err
    assert out.strip()  # the generation itself was printed


def test_serve_and_bench_writes_at_the_end_raise_user_errors(tmp_path: Path, moe_artifact: Path) -> None:
    """``serve`` writes at SIGTERM and ``bench`` after its timed run: a path gone bad by then is a MoeforgeError (the
    CLI's exit code 2), never an OSError."""
    load = np.arange(2 * 8).reshape(2, 8)
    blocked = tmp_path / "now-a-directory.json"
    blocked.mkdir()
    state: Any = SimpleNamespace(engine=SimpleNamespace(served_expert_load=lambda: (load, None)))
    with pytest.raises(MoeforgeError, match="is a directory"):  # was IsADirectoryError at SIGTERM
        _save_expert_load(ServeOptions(artifact=moe_artifact, expert_load_out=blocked), state)
    engine: Any = SimpleNamespace(expert_load=lambda: load, rank_expert_load=lambda: None)
    with pytest.raises(MoeforgeError, match="is a directory"):
        _expert_load(engine, None, None, blocked, moe_artifact, "m")
    with pytest.raises(MoeforgeError, match="does not exist"):
        save_expert_load(tmp_path / "gone" / "stats.json", load, None, moe_artifact, "m")
    written = save_expert_load(tmp_path / "stats.json", load, None, moe_artifact, "m")
    assert json.loads(written.read_text())["layers"] == load.tolist()
    with pytest.raises(MoeforgeError, match="exists: pass --force"):
        save_expert_load(written, load, None, moe_artifact, "m")


# ------------------------------------------------------------------------------------------ the bandwidth cache
THREADS = 2
MEASURED = Bandwidth(best_gb_s=12.5, median_gb_s=11.0, threads=THREADS, probe_bytes=2**20, rounds=2, cpu="test",
                     measured_utc="2026-12-07T00:00:00+00:00")


def _fake_probe(calls: list[int | None]) -> Callable[..., Bandwidth]:
    def probe(threads: int | None = None, *_args: Any, **_kwargs: Any) -> Bandwidth:
        calls.append(threads)
        return MEASURED
    return probe


@pytest.fixture
def probes(monkeypatch: pytest.MonkeyPatch) -> list[int | None]:
    """The probe replaced by a fixed measurement (the real one reads 512 MiB); the list records its calls."""
    calls: list[int | None] = []
    monkeypatch.setattr(bandwidth_mod, "probe_read_bandwidth", _fake_probe(calls))
    return calls


def _entry(**changes: Any) -> dict[str, Any]:
    entry = {"best_gb_s": 20.0, "median_gb_s": 19.0, "threads": THREADS, "probe_bytes": 2**29, "rounds": 7,
             "cpu": "test", "measured_utc": "2026-12-01T00:00:00+00:00", **changes}
    return {k: v for k, v in entry.items() if v is not ...}


def _write_cache(folder: Path, entry: Any) -> Path:
    path = folder / CACHE_FILE
    path.write_text(json.dumps({bandwidth_mod._cache_key(THREADS): entry}))
    return path


def test_a_valid_entry_is_used(tmp_path: Path, probes: list[int | None]) -> None:
    _write_cache(tmp_path, _entry())
    cached = read_bandwidth(THREADS, folder=tmp_path)
    assert cached.cached and cached.best_gb_s == 20.0 and probes == []


@pytest.mark.parametrize(("entry", "field"), [
    (_entry(best_gb_s=0), "best_gb_s"),  # was ZeroDivisionError in the roofline
    (_entry(best_gb_s="fast"), "best_gb_s"),  # was TypeError
    (_entry(best_gb_s=-5), "best_gb_s"),  # was used: "-0.19 of the roofline", exit 0
    (_entry(best_gb_s=MAX_GB_S * 10), "best_gb_s"),  # implausible: above any machine's memory
    (_entry(median_gb_s=True), "median_gb_s"),
    (_entry(median_gb_s=30.0), "median"),  # the median above the best: not one probe's numbers
    (_entry(threads=THREADS + 1), "threads"),
    (_entry(threads=2.0), "threads"),
    (_entry(rounds=...), "rounds"),
    (_entry(cpu=["x"]), "cpu"),
    (_entry(load_1min="busy"), "load_1min"),  # optional (older entries lack it), but a number where given
    (_entry(load_1min=-1.0), "load_1min"),
    ("fast", ""),
    ([20.0], ""),
])
def test_an_invalid_entry_is_ignored_with_a_warning_and_measured_over(tmp_path: Path, probes: list[int | None],
                                                                      caplog: pytest.LogCaptureFixture, entry: Any,
                                                                      field: str) -> None:
    path = _write_cache(tmp_path, entry)
    with caplog.at_level(logging.WARNING, logger="moeforge.core.bandwidth"):
        got = read_bandwidth(THREADS, folder=tmp_path)
    assert got == MEASURED and probes == [THREADS]
    assert str(path) in caplog.text and field in caplog.text and "measured again" in caplog.text
    assert read_bandwidth(THREADS, folder=tmp_path).cached  # rewritten with the measurement
    assert probes == [THREADS]


@pytest.mark.parametrize("content", [
    pytest.param("[" * 200_000, id="nesting-bomb"),  # was RecursionError, with --remeasure-bandwidth too
    '{"k": NaN}',
    "[1, 2]",
    "\xff\xfe not json",
])
@pytest.mark.parametrize("remeasure", [False, True])
def test_an_invalid_cache_file_is_ignored_with_a_warning(tmp_path: Path, probes: list[int | None],
                                                         caplog: pytest.LogCaptureFixture, content: str,
                                                         remeasure: bool) -> None:
    (tmp_path / CACHE_FILE).write_text(content, errors="surrogateescape")
    with caplog.at_level(logging.WARNING, logger="moeforge.core.bandwidth"):
        assert read_bandwidth(THREADS, remeasure=remeasure, folder=tmp_path) == MEASURED
    assert "bandwidth cache" in caplog.text and len(probes) == 1
    assert set(json.loads((tmp_path / CACHE_FILE).read_text())) == {bandwidth_mod._cache_key(THREADS)}


def test_the_cache_is_never_written_through_a_link(tmp_path: Path, probes: list[int | None],
                                                   caplog: pytest.LogCaptureFixture) -> None:
    outside = tmp_path / "outside.json"
    outside.write_text("{}")
    folder = tmp_path / "cache"
    folder.mkdir()
    (folder / CACHE_FILE).symlink_to(outside)
    with caplog.at_level(logging.WARNING, logger="moeforge.core.bandwidth"):
        assert read_bandwidth(THREADS, folder=folder) == MEASURED
    assert "not written" in caplog.text and "symbolic link" in caplog.text
    assert outside.read_text() == "{}" and (folder / CACHE_FILE).is_symlink()


@pytest.mark.parametrize("where", ["under_a_file", "proc"])
def test_a_cache_folder_that_takes_no_file_skips_caching(tmp_path: Path, probes: list[int | None],
                                                         caplog: pytest.LogCaptureFixture, where: str) -> None:
    (tmp_path / "file").write_text("")
    folder = tmp_path / "file" / "cache" if where == "under_a_file" else Path("/proc/self")
    with caplog.at_level(logging.WARNING, logger="moeforge.core.bandwidth"):
        assert read_bandwidth(THREADS, folder=folder) == MEASURED
    assert "not written" in caplog.text


def test_bad_thread_counts_and_rates_are_refused(tmp_path: Path, probes: list[int | None]) -> None:
    for threads in (-1, 10**6):
        with pytest.raises(BandwidthError, match=r"--threads must be in 1\.\.4096"):  # was the probe's ValueError
            read_bandwidth(threads, folder=tmp_path)
    read_bandwidth(0, folder=tmp_path)  # --threads 0: ONNX Runtime's own choice, the probe on the usable cores
    assert probes == [min(bandwidth_mod.usable_cores(), bandwidth_mod.MAX_THREADS)]
    with pytest.raises(ValueError, match="finite number > 0"):
        Bandwidth(best_gb_s=-5.0, median_gb_s=1.0, threads=1, probe_bytes=8, rounds=1, cpu="", measured_utc="")


_json = st.recursive(st.none() | st.booleans() | st.integers(-(10**30), 10**30) | st.floats() | st.text(max_size=6),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=12), inner,
                                                                                 max_size=3), max_leaves=12)
_near_entries = st.fixed_dictionaries({}, optional={name: _json | st.floats(-1e5, 1e5) | st.integers(-3, 10**10)
                                                    for name in _entry()})


_one_field_off = st.sampled_from(list(_entry())).flatmap(lambda name: _json.map(lambda v: _entry(**{name: v})))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(entry=_json | _near_entries | _one_field_off, whole_file=st.booleans())
def test_fuzz_the_bandwidth_cache_reader_returns_a_plausible_rate(entry: Any, whole_file: bool) -> None:
    calls: list[int | None] = []
    logging.getLogger("moeforge.core.bandwidth").disabled = True
    try:
        with tempfile.TemporaryDirectory() as folder, \
                mock.patch.object(bandwidth_mod, "probe_read_bandwidth", _fake_probe(calls)):
            path = Path(folder) / CACHE_FILE
            path.write_text(json.dumps(entry) if whole_file else json.dumps({bandwidth_mod._cache_key(THREADS): entry}))
            got = read_bandwidth(THREADS, folder=Path(folder))
            assert MIN_GB_S <= got.median_gb_s <= got.best_gb_s <= MAX_GB_S and got.threads == THREADS
            assert got.cached != bool(calls)
            assert read_bandwidth(THREADS, folder=Path(folder)).cached  # what it wrote reads back
    finally:
        logging.getLogger("moeforge.core.bandwidth").disabled = False

