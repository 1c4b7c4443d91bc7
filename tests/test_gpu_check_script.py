"""scripts/gpu_check.sh --dry-run: the GPU checks' plan (one line per check) is consistent with the installed CLI
and the test suite, and a flag the CLI does not accept, planted through GPU_CHECK_COMPILE_ARGS, fails the dry run."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.sh"
CHECKS = ["gpu-tests", "ort-nccl-tp2", "trt-plugins", "trt-smollm2"]


def _dry_run(tmp: Path, **env: str) -> "subprocess.Popen[str]":
    tmp.mkdir()
    # GPU_CHECK_PYTHON: the dry run checks the moeforge installed for this interpreter; TMPDIR: where its scratch
    # folder goes (and must be gone from afterwards).
    return subprocess.Popen(["bash", str(SCRIPT), "--dry-run"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "GPU_CHECK_PYTHON": sys.executable, "TMPDIR": str(tmp),
                                            "GPU_CHECK_WORKDIR": str(tmp / "work"), **env})


@pytest.mark.heavy
def test_dry_run_plans_each_check_once_and_fails_on_a_planted_flag(tmp_path: Path) -> None:
    # Side by side: each run imports moeforge and collects the test suite (~20 s of CPU).
    good = _dry_run(tmp_path / "good")
    planted = _dry_run(tmp_path / "planted", GPU_CHECK_COMPILE_ARGS="--no-such-flag --dtype fp64")
    out, _ = good.communicate(timeout=600)
    planted_out, _ = planted.communicate(timeout=600)

    assert good.returncode == 0, out
    plans = [m.group(1) for m in (re.match(r"PLAN ([\w-]+)", line) for line in out.splitlines()) if m]
    assert sorted(plans) == CHECKS, out
    assert "ok cli:" in out and "ok gpu-tests:" in out and out.rstrip().splitlines()[-1].startswith("dry run OK")
    assert not any(line.startswith("BAD ") for line in out.splitlines()), out

    assert planted.returncode != 0, planted_out
    bad = [line for line in planted_out.splitlines() if line.startswith("BAD ")]
    assert any("--no-such-flag" in line for line in bad), planted_out
    assert any("fp64" in line for line in bad), planted_out  # a value outside the flag's choices
    assert planted_out.rstrip().splitlines()[-1].startswith("dry run FAILED")

    # Side-effect free: the scratch folders are gone and nothing was made where a real run would work.
    for run in ("good", "planted"):
        assert list((tmp_path / run).iterdir()) == []
