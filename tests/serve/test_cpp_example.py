"""examples/cpp: the C++17 program (CMake + g++, onnxruntime-genai C API) generates the engine's greedy tokens."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moeforge.runtime.engine import BackendOptions, EngineConfig, LLMEngine, SchedulingOptions
from moeforge.runtime.sampler import SamplingParams

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "cpp"


@pytest.fixture(scope="module")
def program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    missing = [tool for tool in ("cmake", "g++") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not installed: cannot build examples/cpp")
    if importlib.util.find_spec("onnxruntime_genai") is None:
        pytest.skip("onnxruntime-genai is not installed (the dev extra): its library is what the program links")
    build = tmp_path_factory.mktemp("cpp-build")
    for command in (["cmake", "-S", str(EXAMPLE), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                     "-DCMAKE_CXX_COMPILER=g++", f"-DPython3_EXECUTABLE={sys.executable}"],
                    ["cmake", "--build", str(build)]):
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
    return build / "moeforge_generate"


def test_the_cpp_program_generates_the_engines_greedy_tokens(program: Path, tiny_artifact: Path) -> None:
    engine = LLMEngine.from_artifact(tiny_artifact, EngineConfig(
        scheduling=SchedulingOptions(max_num_seqs=1),
        backend=BackendOptions(threads=1)))
    for prompt, new_tokens in (([1, 2, 3, 4, 5], 20), ([300, 7, 7, 42, 9, 100, 11], 40)):
        want = engine.generate([prompt], SamplingParams(max_tokens=new_tokens, ignore_eos=True))[0].token_ids
        done = subprocess.run([str(program), str(tiny_artifact), "--prompt-ids", ",".join(map(str, prompt)),
                               "--max-new-tokens", str(new_tokens), "--ignore-eos"],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert [int(t) for t in done.stdout.strip().split(",")] == want


def test_the_cpp_program_reports_bad_usage(program: Path) -> None:
    done = subprocess.run([str(program), "--prompt-ids", "1,x"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "usage:" in done.stderr
