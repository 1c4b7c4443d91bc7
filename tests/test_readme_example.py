"""The README's Python example runs as a user runs it, from the repository root (where the source folder
``moeforge/`` is the package Python finds first) and from another directory, and prints the generated text."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.heavy, pytest.mark.smollm2]


def readme_example() -> str:
    """The first ```python block after the README's "In Python" paragraph."""
    readme = (ROOT / "README.md").read_text()
    start = readme.index("In Python")
    match = re.search(r"```python\n(.*?)```", readme[start:], re.S)
    assert match is not None, "the README lost its Python example"
    return match.group(1)


@pytest.mark.parametrize("where", ["repository root", "elsewhere"])
def test_the_readme_example_prints_text(where, smollm2_artifact, tmp_path):
    # ``python -c`` puts the working directory first on sys.path, as ``python example.py`` run there does.
    cwd = ROOT if where == "repository root" else tmp_path
    proc = subprocess.run([sys.executable, "-c", readme_example(), str(smollm2_artifact)], cwd=cwd,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    # Two generated texts (printed with repr) and their finish reasons, then the streamed text.
    assert len(lines) >= 3 and all(re.fullmatch(r"'.+' (stop|length)", line) for line in lines[:2]), proc.stdout
    assert "Paris" in lines[0]  # SmolLM2 greedy: "The capital of France is" -> " Paris."
    assert "".join(lines[2:]).strip()
