"""benchmarks/eplb.py at its smallest (ep 2, 2 redundant slots per rank): the skewed router does skew the routing,
every replay routes the recorded tokens, and the measured per-rank imbalance agrees with the plan's prediction and
ranks the placements as the table in docs/performance.md (Expert placement) does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.heavy

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "eplb.py"


def test_eplb_benchmark_measures_what_the_plans_predict(tmp_path: Path) -> None:
    out = tmp_path / "eplb.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--eps", "2", "--redundant-per-rank", "2", "--work",
                           str(tmp_path / "work"), "--out", str(out)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["machine"]["logical_cores"] >= 1
    results = result["results"]
    assert min(results["recorded"]["expert_imbalance"]) > 2.5  # the Zipf bias skews the recorded load
    assert results["target_met"] is None  # contiguous stays below 1.43 at ep 2: the target is not judged there
    rows = {row["placement"]: row for row in results["rows"]}
    assert set(rows) == {"contiguous", "round_robin", "eplb"}
    assert all(row["routing_unchanged"] for row in rows.values())
    for row in rows.values():
        assert row["measured_mean"] == pytest.approx(row["predicted_mean"], abs=0.03)
    assert rows["eplb"]["measured_mean"] < rows["round_robin"]["measured_mean"] < rows["contiguous"]["measured_mean"]
    assert rows["eplb"]["measured_mean"] < 1.05
