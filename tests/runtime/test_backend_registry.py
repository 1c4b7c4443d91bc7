"""The backend registry is the one place that says which backend runs an artifact: the engine, the CLI and the
compiler ask it, and a combination no backend runs is refused at compile time (unless built for another runtime)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from moeforge.cli import main
from moeforge.compile.driver import CompileOptions, compile_model
from moeforge.core.artifact import load_artifact
from moeforge.core.errors import ArtifactError, MoeforgeError
from moeforge.runtime.backends.onnxruntime import OrtBackend
from moeforge.runtime.backends.onnxruntime_paged import PagedOrtBackend
from moeforge.runtime.backends.registry import BACKENDS, backend_for, open_backend, refusal
from moeforge.runtime.engine import BackendOptions, EngineConfig, LLMEngine, SchedulingOptions


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("registry")
    return {layout: compile_model(CompileOptions.from_flags(model="tiny-llama", output_dir=root / layout,
                                                            kv_cache=layout, max_seq_len=32, progress=False)).output_dir
            for layout in ("contiguous", "paged")}


def test_every_target_has_one_backend_and_an_unknown_one_is_refused(artifacts):
    manifest = load_artifact(artifacts["contiguous"]).manifest
    assert backend_for(manifest).name == "onnxruntime"
    assert backend_for(dataclasses.replace(manifest, target="trt")).name == "tensorrt"
    with pytest.raises(ArtifactError, match=r"target 'xla' has no backend here.*ort, trt"):
        backend_for(dataclasses.replace(manifest, target="xla"))
    assert {spec.target for spec in BACKENDS.values()} == {"ort", "trt"}


def test_what_each_backend_runs():
    assert refusal("ort", paged=True, sharded=True) is None
    assert "contiguous-cache engines only" in (refusal("trt", paged=True, sharded=False) or "")
    assert "NCCL" in (refusal("trt", paged=False, sharded=True) or "")
    assert refusal("trt", paged=False, sharded=False) is None
    assert refusal("xla", paged=False, sharded=False) == "no backend runs target 'xla'"


def test_the_engine_opens_the_backend_the_registry_names(artifacts):
    config = EngineConfig(scheduling=SchedulingOptions(max_num_seqs=2), backend=BackendOptions(threads=1))
    contiguous = LLMEngine.from_artifact(artifacts["contiguous"], config)
    paged = LLMEngine.from_artifact(artifacts["paged"], config)
    assert type(contiguous.backend) is OrtBackend and type(paged.backend) is PagedOrtBackend
    assert paged.backend.kv_pool is not None and contiguous.backend.num_slots == 2
    with pytest.raises(AssertionError, match="block count"):  # a paged artifact is opened with its pool's size
        open_backend(load_artifact(artifacts["paged"]), BackendOptions(), num_slots=1)


def test_a_backend_that_cannot_run_here_is_refused_with_the_reason(artifacts, monkeypatch):
    artifact = load_artifact(artifacts["contiguous"])
    trt = dataclasses.replace(artifact, manifest=dataclasses.replace(artifact.manifest, target="trt"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a CPU host, also where a GPU is
    with pytest.raises(ArtifactError, match=r"tensorrt artifact.*cannot run here: it needs a CUDA GPU"):
        open_backend(trt, BackendOptions(), num_slots=1)


@pytest.mark.parametrize("flags", [{"kv_cache": "paged"}, {"tp": 2}])
def test_compile_refuses_a_tensorrt_artifact_no_backend_runs(tmp_path, flags):
    out = tmp_path / "trt"
    options = CompileOptions.from_flags(model="tiny-llama", output_dir=out, target="trt", progress=False, **flags)
    with pytest.raises(MoeforgeError, match=r"no moeforge backend runs.*--build-only"):
        compile_model(options)
    assert not out.exists()


def test_the_cli_refuses_it_too_and_names_the_flag(tmp_path, capsys):
    out = tmp_path / "trt"
    assert main(["compile", "tiny-llama", "-o", str(out), "--target", "trt", "--tp", "2", "--quiet"]) == 2
    assert "--build-only" in capsys.readouterr().err and not out.exists()
