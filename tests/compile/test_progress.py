"""Progress for the long waits (``moeforge/core/progress.py``): the compile's stage bar names each stage as it starts
and its clocks keep moving through a long stage; the other commands' stage lines go to stderr; ``--quiet`` and
``progress=False`` print nothing; no ticker thread outlives its display."""

from __future__ import annotations

import io
import json
import queue
import re
import threading
import time
from pathlib import Path

import pytest

from moeforge.cli import main
from moeforge.compile import sharded_compile, stages
from moeforge.compile.driver import CompileOptions, compile_model
from moeforge.compile.stages import ARTIFACT_STAGES
from moeforge.core.progress import StageBar, StageLog

TICK_S = 0.1


def _ticker_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "moeforge-progress"]


def _postfixes(text: str) -> list[str]:
    """The stage names a stage bar drew, in order, each once, without their clocks: "compile: 2/6 stages [00:03],
    export to ONNX (3.1 s)" -> "export to ONNX"."""
    names: list[str] = []
    for frame in re.split(r"[\r\n]", text):
        found = re.search(r"stages \[[\d:]+\], (.*?)(?: \([\d.]+ s\))?\s*$", frame)
        if found and found.group(1) not in names:
            names.append(found.group(1))
    return names


def test_the_clocks_move_during_a_long_stage() -> None:
    """tqdm redraws only on an update; the ticker redraws a stage that sleeps: its elapsed time and the stage's own
    seconds both take several values."""
    out = io.StringIO()
    with StageBar(2, "compile", True, file=out, interval=TICK_S) as bar:
        bar.stage("export to ONNX")
        time.sleep(1.5)
        during = out.getvalue()  # before the stage ends: what only the ticker drew
        bar.advance()
    frames = [f for f in during.split("\r") if "export to ONNX" in f]
    elapsed = {re.search(r"\[(\d\d:\d\d)\]", f).group(1) for f in frames}  # type: ignore[union-attr]
    stage_seconds = {m.group(1) for f in frames if (m := re.search(r"export to ONNX \(([\d.]+) s\)", f))}
    assert {"00:00", "00:01"} <= elapsed, frames
    assert len(stage_seconds) >= 2, frames
    assert bar.ticker is not None and not bar.ticker.alive


def test_the_ticker_stops_on_an_exception() -> None:
    before = len(_ticker_threads())
    with pytest.raises(ValueError, match="export failed"), StageBar(2, "compile", True, file=io.StringIO(),
                                                                      interval=TICK_S) as bar:
        bar.stage("export to ONNX")
        assert len(_ticker_threads()) == before + 1
        raise ValueError("export failed")
    assert bar.ticker is not None and not bar.ticker.alive and len(_ticker_threads()) == before


def test_a_disabled_bar_writes_nothing_and_starts_no_thread() -> None:
    out = io.StringIO()
    with StageBar(2, "compile", False, file=out, interval=TICK_S) as bar:
        bar.stage("export to ONNX")
        assert bar.ticker is None and not _ticker_threads()
        time.sleep(3 * TICK_S)
        bar.advance()
    assert out.getvalue() == ""


def test_stage_lines_tick_end_with_their_time_and_say_how_they_failed() -> None:
    out = io.StringIO()
    log = StageLog(True, file=out, interval=TICK_S)
    with log.stage("loading /a/dir"):
        time.sleep(0.5)
    with log.stage("measuring transformers") as line:
        line.outcome = "skipped: transformers is not installed"
    with pytest.raises(KeyboardInterrupt), log.stage("running the reference"):
        raise KeyboardInterrupt
    with pytest.raises(RuntimeError), log.stage("comparing"):
        raise RuntimeError
    lines = out.getvalue().split("\n")
    assert len({frame for frame in lines[0].split("\r") if frame}) >= 3, lines[0]  # "...", then a moving clock
    last_frames = [line.split("\r")[-1].rstrip() for line in lines]
    patterns = [r"loading /a/dir \.\.\. (0\.[5-9]|\d+(\.\d)?) s",
                r"measuring transformers \.\.\. skipped: transformers is not installed \([\d.]+ s\)",
                r"running the reference \.\.\. interrupted after [\d.]+ s",
                r"comparing \.\.\. failed after [\d.]+ s", ""]
    assert len(last_frames) == len(patterns), last_frames
    for frame, pattern in zip(last_frames, patterns, strict=True):
        assert re.fullmatch(pattern, frame), (frame, pattern)
    assert not _ticker_threads()
    quiet = io.StringIO()
    with StageLog(False, file=quiet, interval=TICK_S).stage("loading"):
        time.sleep(2 * TICK_S)
    assert quiet.getvalue() == ""


def test_the_compile_names_its_stages_in_order(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    compile_model(CompileOptions.from_flags(model="tiny-llama", output_dir=tmp_path / "out", max_seq_len=64,
                                            check=True))
    names = _postfixes(capsys.readouterr().err)
    expected = ["load checkpoint", "export to ONNX", "plan the passes", "check: PyTorch reference", "pass 1/13 cleanup",
                "pass 13/13 argmax_head", "save graph and weights", "golden logits", "check: ONNX Runtime vs PyTorch",
                "hash and install"]
    assert [name for name in names if name in expected] == expected, names
    assert names.index("pass 1/13 cleanup") < names.index("pass 2/13 rms_norm") < names.index("pass 13/13 argmax_head")
    assert not _ticker_threads()


def test_nothing_is_printed_with_progress_off_or_quiet(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    compile_model(CompileOptions.from_flags(model="tiny-llama", output_dir=out, max_seq_len=64, progress=False))
    assert capsys.readouterr().err == ""
    for argv in (["run", str(out), "--prompt-ids", "1,2,3", "--max-new-tokens", "3", "--json"],
                 ["parity", str(out), "--prompt-len", "4", "--steps", "2", "--json"],
                 ["bench", str(out), "--prompt-len", "4", "--new-tokens", "2", "--no-compare", "--json"]):
        assert main([*argv, "--quiet"]) == 0
        captured = capsys.readouterr()
        assert captured.err == "" and json.loads(captured.out), argv
    # Without --quiet: stage lines on stderr, stdout still one JSON document.
    assert main(["parity", str(out), "--prompt-len", "4", "--steps", "2", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["passed"]
    assert [line.split(" ... ")[0] for line in captured.err.splitlines()] == [
        f"verifying {out}", "loading tiny-llama (PyTorch)", "running the PyTorch reference (4 + 2 tokens)",
        "running the artifact and comparing"]
    assert main(["run", str(out), "--prompt-ids", "1,2,3", "--max-new-tokens", "3"]) == 0
    assert [line.split(" ... ")[0] for line in capsys.readouterr().err.splitlines()] == [
        f"loading {out}", "generating up to 3 tokens"]


def test_a_failed_compile_leaves_no_ticker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    def fail(*_args: object, **_kwargs: object) -> None:
        time.sleep(0.2)
        raise RuntimeError("the exporter gave up")

    monkeypatch.setattr(stages, "export_stateless", fail)
    with pytest.raises(RuntimeError, match="gave up"):
        compile_model(CompileOptions.from_flags(model="tiny-llama", output_dir=tmp_path / "out", max_seq_len=64))
    assert "export to ONNX" in capsys.readouterr().err
    assert not _ticker_threads() and not (tmp_path / "out").exists()


def test_a_sharded_compile_names_each_rank(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    compile_model(CompileOptions.from_flags(model="tiny-llama", output_dir=tmp_path / "out", max_seq_len=64, tp=2))
    names = _postfixes(capsys.readouterr().err)
    expected = ["load checkpoint", "rank 0/2: export to ONNX", "rank 0/2: hash and install",
                "rank 1/2: export to ONNX", "rank 1/2: hash and install", "sharded.json"]
    assert [name for name in names if name in expected] == expected, names


def test_workers_stages_reach_the_parents_bar() -> None:
    """``--workers``: each worker's stages travel over a queue (``_QueueStages``); the parent names every running
    rank's stage and counts each rank's stages once, however many of its messages arrive after it is written."""
    out, messages = io.StringIO(), queue.Queue[tuple[int, str, object]]()
    with StageBar(2 * ARTIFACT_STAGES, "compile tp2", True, file=out, interval=60) as bar:
        board = sharded_compile._WorkerBoard(bar, [0, 1])
        rank0, rank1 = sharded_compile._QueueStages(messages, 0), sharded_compile._QueueStages(messages, 1)
        rank0.stage("export to ONNX")
        rank1.stage("pass 2/13 rms_norm")
        rank0.advance()
        board.drain(messages)
        assert "rank 0: export to ONNX, rank 1: pass 2/13 rms_norm" in out.getvalue()
        board.written(0)  # rank 0's other stages' messages are still in flight
        rank0.advance(3)
        rank0.stage("hash and install")
        rank1.advance(2)
        board.drain(messages)
        assert bar.stages_done == ARTIFACT_STAGES + 2
        assert "rank 1: pass 2/13 rms_norm" in out.getvalue().rsplit("\r", 1)[-1]  # rank 0's late stage dropped
        board.written(1)
        assert bar.stages_done == 2 * ARTIFACT_STAGES


def test_transformers_bars_are_off_while_a_reference_loads(capsys: pytest.CaptureFixture[str]) -> None:
    """Its "Loading weights" bar (transformers.utils.logging.tqdm) and the GGUF reader's own tqdm: silent inside
    ``quiet_transformers``, as they were after."""
    pytest.importorskip("transformers")
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    from moeforge.verify.transformers_reference import quiet_transformers

    gguf_tqdm, enabled = gguf_utils.tqdm, hf_logging.is_progress_bar_enabled()
    with quiet_transformers():
        list(hf_logging.tqdm(range(3), desc="Loading weights"))
        list(gguf_utils.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."))
    assert capsys.readouterr().err == ""
    assert gguf_utils.tqdm is gguf_tqdm and hf_logging.is_progress_bar_enabled() == enabled
