"""Targets: the compile driver asks a target object for everything target-specific, so a new target is one class
registered in ``TARGETS`` (shown here with a bare ONNX target that writes no extra files)."""

from __future__ import annotations

from pathlib import Path

import pytest

from moeforge.compile.driver import CompileOptions, compile_model
from moeforge.compile.targets import TARGETS, CompileJob, OrtTarget, Target, TrtTarget
from moeforge.core.artifact import load_artifact
from moeforge.core.errors import MoeforgeError
from moeforge.core.manifest import Manifest


class BareOnnx(OrtTarget):
    """The ONNX Runtime graph and nothing else: no golden logits, no genai config, no parity check."""

    name = "bare-onnx"

    def write_payload(self, job: CompileJob, folder: Path, manifest: Manifest) -> None:
        manifest.tool_versions["bare-onnx"] = "1"


def test_the_built_in_targets_follow_the_protocol():
    options = CompileOptions(model="tiny-llama", output_dir=Path("unused"))
    for cls in (OrtTarget, TrtTarget):
        target: Target = cls(options)
        assert TARGETS[target.name] is cls and target.parity is None


def test_a_new_target_is_one_class(tmp_path, monkeypatch):
    monkeypatch.setitem(TARGETS, BareOnnx.name, BareOnnx)
    # No moeforge backend runs it (the registry has none for it): refused unless built for a runtime of one's own.
    with pytest.raises(MoeforgeError, match=r"--target bare-onnx builds an artifact no moeforge backend runs"):
        compile_model(CompileOptions(model="tiny-llama", output_dir=tmp_path / "a", target="bare-onnx",
                                     max_seq_len=64, progress=False))
    result = compile_model(CompileOptions(model="tiny-llama", output_dir=tmp_path / "a", target="bare-onnx",
                                          max_seq_len=64, progress=False, build_only=True))
    manifest = load_artifact(result.output_dir).manifest
    assert manifest.target == "bare-onnx" and manifest.tool_versions["bare-onnx"] == "1"
    assert not (result.output_dir / "golden").exists() and (result.output_dir / "model.onnx").is_file()
    assert [p["name"] for p in manifest.passes][:2] == ["cleanup", "rms_norm"]  # the ORT pipeline it inherits


def test_an_unknown_target_names_the_known_ones(tmp_path):
    with pytest.raises(MoeforgeError, match="targets: ort, trt"):
        compile_model(CompileOptions(model="tiny-llama", output_dir=tmp_path / "a", target="onnx"))
    assert not (tmp_path / "a").exists()
