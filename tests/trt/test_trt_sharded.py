"""`moeforge compile --target trt --tp 2`: one TensorRT-RTX plan per rank, built on CPU, whose AllReduce / AllGather
nodes became TensorRT distributed collective layers (NCCL at run time). Running them needs GPUs: refused here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import onnx
import pytest

from moeforge.compile.driver import CompileOptions, compile_model
from moeforge.model.loader import load_config
from tests.trt.conftest import needs_trt_rtx

pytestmark = [needs_trt_rtx, pytest.mark.heavy]


@pytest.mark.parametrize(("preset", "ep"), [("tiny-llama", 1), ("tiny-deepseek-v3", 2)])
def test_each_rank_gets_a_plan_with_distributed_collectives(preset: str, ep: int, tmp_path: Path) -> None:
    out = compile_model(CompileOptions.from_flags(model=preset, output_dir=tmp_path / "trt", target="trt", tp=2, ep=ep,
                                                  build_only=True,  # no moeforge backend runs sharded plans yet
                                                  max_seq_len=64, trt_impl="tensorrt-rtx", sm=89,
                                                  max_prefill_tokens=32, progress=False)).output_dir
    layers = load_config(preset).num_hidden_layers
    for rank in range(2):
        manifest = json.loads((out / f"rank{rank}" / "manifest.json").read_text())
        engine = manifest["engine"]
        assert (out / f"rank{rank}" / engine["plan_file"]).stat().st_size == engine["plan_bytes"] > 0
        # the embedding's AllReduce, two per layer (attention, MLP/MoE), the logits' AllGather
        assert engine["layer_types"]["DIST_COLLECTIVE"] == 2 * layers + 2
        assert any("DistCollective layers over 2 ranks" in note for note in engine["notes"])
        graph = onnx.load(str(out / f"rank{rank}" / "model.onnx"), load_external_data=False)
        ops = [n.op_type for n in graph.graph.node if n.domain == "com.microsoft"]
        assert ops.count("AllReduce") == 2 * layers + 1 and ops.count("AllGather") == 1  # the artifact keeps them
    run = subprocess.run([sys.executable, "-P", "-m", "moeforge.cli", "run", str(out), "--prompt-ids", "1,2,3"],
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 2
    assert "holds TensorRT plans" in run.stderr and "--target ort" in run.stderr


def test_each_pipeline_stage_gets_a_plan(tmp_path: Path) -> None:
    """``--pp 2 --tp 2``: four plans; stage 0's engine takes token ids and returns the hidden state, stage 1's takes
    the hidden state and returns logits; its collectives stay within the stage (2 ranks)."""
    out = compile_model(CompileOptions.from_flags(model="tiny-deepseek-v3", output_dir=tmp_path / "trt", target="trt",
                                                  pp=2, tp=2, kv_cache="paged", build_only=True, max_seq_len=64,
                                                  trt_impl="tensorrt-rtx", sm=89, max_prefill_tokens=32,
                                                  progress=False)).output_dir
    for rank in range(4):
        manifest = json.loads((out / f"rank{rank}" / "manifest.json").read_text())
        engine = manifest["engine"]
        assert (out / f"rank{rank}" / engine["plan_file"]).stat().st_size == engine["plan_bytes"] > 0
        assert any("DistCollective layers over 2 ranks" in note for note in engine["notes"])
        inputs = [t["name"] for t in manifest["inputs"]]
        outputs = [t["name"] for t in manifest["outputs"]]
        if rank < 2:
            assert "input_ids" in inputs and "hidden_states" in outputs and "logits" not in outputs
        else:
            assert "hidden_states_in" in inputs and "logits" in outputs
