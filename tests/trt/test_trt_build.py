"""`moeforge compile --target trt` on CPU: TensorRT-RTX plans for SM89, native layers, manifest, errors."""

import json
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from moeforge.cli import main
from moeforge.cli.inspect import summarize
from moeforge.compile.driver import CompileOptions, compile_model
from moeforge.core.artifact import load_artifact
from moeforge.model.loader import load_model
from moeforge.verify.golden import load_golden

from .conftest import MAX_SEQ_LEN, TRT_PRESETS, needs_trt_rtx

pytestmark = needs_trt_rtx


def _layer_types(manifest) -> Counter:
    return Counter(manifest.engine["layer_types"])


@pytest.mark.parametrize("name", TRT_PRESETS)
def test_plan_and_manifest(trt_artifacts, name):
    artifact = load_artifact(trt_artifacts[name])  # hashes of plan, timing cache and golden files verified
    m = artifact.manifest
    engine = m.engine
    assert m.target == "trt" and m.precision == "fp16"
    plan = artifact.root / engine["plan_file"]
    assert plan.is_file() and plan.stat().st_size == engine["plan_bytes"] > 0
    assert engine["timing_cache_file"] is None and "no-ops" in engine["notes"][0]  # RTX tunes at run time
    assert engine["impl"] == "tensorrt-rtx" and engine["compute_capability"] == "SM89"
    assert engine["tensorrt_version"] == m.tool_versions["tensorrt-rtx"]
    assert [p["name"] for p in engine["profiles"]] == ["decode", "prefill"]
    decode, prefill = engine["profiles"]
    assert decode["tokens"] == [1, 1, 1] and decode["batch"][2] == 8 and prefill["tokens"][2] == 32
    # Engine I/O: half caches with the static cache length, fp32 logits, in the manifest's cache names.
    inputs = {t["name"]: t for t in engine["inputs"]}
    outputs = {t["name"]: t for t in engine["outputs"]}
    assert outputs["logits"]["dtype"] == "float"
    for past, present in zip(m.kv_cache.past_input_names, m.kv_cache.present_output_names, strict=True):
        for name_in, name_out in zip(past, present, strict=True):
            assert inputs[name_in]["dtype"] == "half" and inputs[name_in]["shape"][2] == MAX_SEQ_LEN
            assert outputs[name_out]["shape"] == inputs[name_in]["shape"]
    assert decode["shapes"]["input_ids"] == [[1, 1], [4, 1], [8, 1]]


@pytest.mark.parametrize("name", TRT_PRESETS)
def test_native_layers(trt_artifacts, name):
    """Rotary, KV-cache update and attention are TensorRT's own layers, one per use, no plugins."""
    m = load_artifact(trt_artifacts[name]).manifest
    config = m.config()
    layers = config.num_hidden_layers
    types = _layer_types(m)
    assert types["ROTARY_EMBEDDING"] == 2 * layers
    assert types["KV_CACHE_UPDATE"] == (layers if config.mla else 2 * layers)
    assert types["ATTENTION_INPUT"] == types["ATTENTION_OUTPUT"] == layers
    assert not {"PLUGIN", "PLUGIN_V2", "PLUGIN_V3"} & set(types)
    # TensorRT-RTX 1.7 has no RMS mode in INormalizationLayer and imports RMSNormalization as one
    # reduce (mean of squares) + sqrt + elementwise per norm, fused by its compiler: one REDUCE per norm.
    norms = 2 * layers + 1 + (2 * layers if config.mla else 0)  # + MLA's q_a / kv_a latent norms
    moe_layers = layers - config.moe.first_k_dense_replace if config.moe else 0
    assert types["REDUCE"] == norms + 2 * moe_layers  # MoE routing's local function: 2 ReduceSum per layer
    if config.moe:  # the MoE node's local function is inlined: group/expert top-k
        assert types["TOPK"] == 3 * moe_layers


def test_plan_header_reads_without_gpu(trt_artifacts):
    from moeforge.compile.trt.engine_build import plan_diagnostics
    from moeforge.runtime.backends.trt_adapter import load_tensorrt

    trt = load_tensorrt("tensorrt-rtx")
    plan = (trt_artifacts["tiny-llama"] / "model.plan").read_bytes()
    _, flags = plan_diagnostics(trt, plan)
    assert "MALFORMED_ENGINE" not in flags and "VERSION_MISMATCH" not in flags
    _, broken = plan_diagnostics(trt, b"\0" * len(plan[:64]))
    assert "MALFORMED_ENGINE" in broken


@pytest.mark.parametrize("name", TRT_PRESETS)
def test_golden_logits_match_pytorch(trt_artifacts, name):
    """The saved golden logits (ONNX Runtime on the lowered fp16 graph) agree with PyTorch fp32."""
    feeds, golden = load_golden(trt_artifacts[name])
    loaded = load_model(name, mla_impl="absorb")
    with torch.no_grad():
        ref = loaded.model(torch.tensor(feeds["input_ids"]), torch.tensor(feeds["position_ids"]), None).logits.numpy()
    assert golden.shape == ref.shape
    assert np.abs(golden - ref).max() < 2e-2 * np.abs(ref).max()
    assert (golden.argmax(-1) == ref.argmax(-1)).mean() >= 0.9


def test_inspect_shows_layers_and_why(trt_artifacts, capsys):
    text = summarize(load_artifact(trt_artifacts["tiny-deepseek-v3"]))
    assert "engine     model.plan: tensorrt-rtx" in text and "profile decode" in text
    assert "ROTARY_EMBEDDING" in text and "KV_CACHE_UPDATE" in text
    import torch as _torch

    if not _torch.cuda.is_available():
        assert "network layers parsed from model.onnx (no CUDA GPU visible" in text
    assert main(["inspect", str(trt_artifacts["tiny-llama"])]) == 0
    assert "ATTENTION_INPUT" in capsys.readouterr().out


def test_unsupported_sm_fails_fast(tmp_path, capsys):
    """SM90 is not a TensorRT-RTX target: exit 2 naming the offered SMs, before any export, nothing written."""
    code = main(["compile", "tiny-llama", "-o", str(tmp_path / "out"), "--target", "trt", "--sm", "90",
                 "--trt-impl", "tensorrt-rtx", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "--sm 90 is not offered by tensorrt-rtx" in err and "89" in err and "Hopper" in err
    assert not (tmp_path / "out").exists()


def test_no_tensorrt_installed(monkeypatch, tmp_path):
    import importlib

    from moeforge.runtime.backends.trt_adapter import TensorRTNotInstalled

    real = importlib.import_module

    def fake_import(name, *args, **kwargs):
        if name in ("tensorrt", "tensorrt_rtx_bindings"):
            raise ImportError(f"No module named '{name}'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib, "import_module", fake_import)
    with pytest.raises(TensorRTNotInstalled, match=r'pip install "moeforge\[tensorrt-rtx\]"'):
        compile_model(CompileOptions.from_flags(model="tiny-llama", output_dir=tmp_path / "o", target="trt",
                                                progress=False))
    assert not (tmp_path / "o").exists()


def test_unregistered_plugin_is_named(tmp_path):
    """A node in a custom domain with no local function and no registered plugin: a clear error."""
    from moeforge.compile.trt.engine_build import BuildOptions, PluginNotRegistered, build_engine

    node = helper.make_node("MoERouter", ["x"], ["y"], domain="moeforge", plugin_version="1",
                            plugin_namespace="moeforge", top_k=2)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid("moeforge", 1)])
    onnx.save(model, tmp_path / "m.onnx")
    with pytest.raises(PluginNotRegistered, match="MoERouter"):
        build_engine(Path(tmp_path / "m.onnx"), tmp_path / "m.plan", BuildOptions(impl="tensorrt-rtx"))


def test_bf16_builds(tmp_path):
    result = compile_model(CompileOptions.from_flags(model="tiny-llama", output_dir=tmp_path / "bf16", target="trt",
                                                     dtype="bf16", max_seq_len=32, trt_impl="tensorrt-rtx",
                                                     max_prefill_tokens=16, progress=False))
    engine = result.manifest.engine
    assert result.manifest.precision == "bf16" and result.manifest.kv_cache.dtype == "bfloat16"
    caches = [t for t in engine["inputs"] if t["name"].startswith("past_key_values.")]
    assert caches and {t["dtype"] for t in caches} == {"bf16"}
    assert json.loads((result.output_dir / "manifest.json").read_text())["engine"]["plan_bytes"] > 0
    feeds, golden = load_golden(result.output_dir)  # ORT on the bf16 graph retyped to fp32
    loaded = load_model("tiny-llama")
    with torch.no_grad():
        ref = loaded.model(torch.tensor(feeds["input_ids"]), torch.tensor(feeds["position_ids"]), None).logits.numpy()
    assert np.abs(golden - ref).max() < 0.1 * np.abs(ref).max()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown on a machine without a GPU")
def test_running_an_engine_without_gpu_says_so(trt_artifacts, capsys):
    path = str(trt_artifacts["tiny-llama"])
    assert main(["parity", path, "--backend", "tensorrt"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert main(["run", path, "--prompt-ids", "1,2,3", "--max-new-tokens", "2"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert main(["parity", path]) == 2  # the ONNX Runtime teacher-forced parity is for ORT artifacts
    assert "--backend tensorrt" in capsys.readouterr().err
