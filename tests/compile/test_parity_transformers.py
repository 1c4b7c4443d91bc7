"""``moeforge parity DIR --reference transformers``: the artifact against transformers running its source checkpoint
(an implementation nobody here wrote). It passes for a faithful compile, fails when the checkpoint differs from the
artifact's, and refuses a source transformers cannot load (a preset) or a check it cannot do (--per-layer)."""

import json
import sys
from pathlib import Path

import pytest
import torch

from moeforge.cli.commands import EXIT_CHECK_FAILED, EXIT_OK, main
from moeforge.compile.driver import CompileOptions, compile_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from test_hf_parity import _qwen3, _randomise  # the tiny transformers builders of the HF parity tests


def _save(folder: Path, seed: int) -> Path:
    torch.manual_seed(0)
    model = _qwen3()
    _randomise(model, seed=seed)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def qwen3_artifact(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("qwen3")
    source = _save(root / "hf", seed=1)
    artifact = root / "artifact"
    compile_model(CompileOptions(model=str(source), output_dir=artifact, max_seq_len=64, progress=False))
    return source, artifact


def _parity(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict]:
    code = main(["parity", *args, "--reference", "transformers", "--prompt-len", "24", "--steps", "8", "--json"])
    out = capsys.readouterr().out
    return code, json.loads(out[out.index("{"):]) if "{" in out else {}


def test_artifact_matches_transformers_on_its_source(qwen3_artifact, capsys):
    _, artifact = qwen3_artifact
    code, result = _parity(capsys, str(artifact))
    assert code == EXIT_OK, result
    assert result["reference"] == "transformers" and result["greedy_match"]
    assert result["max_abs_err"] < 1e-4 and result["decode_steps"] == 8


def test_another_checkpoint_fails_the_check(qwen3_artifact, capsys, tmp_path):
    _, artifact = qwen3_artifact
    other = _save(tmp_path / "other", seed=2)  # same config, other weights
    code, result = _parity(capsys, str(artifact), "--model", str(other))
    assert code == EXIT_CHECK_FAILED
    assert result["max_abs_err"] > 0.1 and not result["passed"]


def test_what_transformers_cannot_check_is_refused_by_name(qwen3_artifact, capsys, tmp_path):
    _, artifact = qwen3_artifact
    assert main(["parity", str(artifact), "--reference", "transformers", "--per-layer"]) != EXIT_OK
    assert "--per-layer compares each layer with moeforge's PyTorch model" in capsys.readouterr().err
    assert main(["parity", str(artifact), "--reference", "transformers", "--model", "tiny-llama"]) != EXIT_OK
    assert "preset with random weights" in capsys.readouterr().err
