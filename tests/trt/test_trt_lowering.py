"""The TensorRT lowering (moeforge/passes/trt_lowering.py) checked without TensorRT: ONNX Runtime runs the
lowered graph teacher-forced against PyTorch, and its structure is what the TensorRT parser needs."""

from collections import Counter

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch

from moeforge.compile.onnx_export import export_stateless
from moeforge.compile.trt.lowering_check import run_steps
from moeforge.model.loader import load_model
from moeforge.passes.base import PassContext
from moeforge.passes.pipeline import run_passes
from moeforge.passes.trt_lowering import trt_pipeline

from .conftest import TRT_PRESETS

MAX_SEQ_LEN = 64
STEPS = [0, 6, 7, 9, 10]  # prefill 6, decode 1, a chunk of 2, decode 1


@pytest.fixture(scope="module", params=["tiny-llama", pytest.param("tiny-deepseek-v3", marks=pytest.mark.heavy)])
def model(request):
    return request.param, load_model(request.param, mla_impl="absorb")


def _lower(loaded, dtype, path):
    model = export_stateless(loaded.model)
    reports = run_passes(model, PassContext(config=loaded.config, max_seq_len=MAX_SEQ_LEN),
                         trt_pipeline(dtype))
    ir.save(model, path, external_data=path.name + ".data")
    return {r.name: r.matches for r in reports}


def _reference(loaded, ids):
    with torch.no_grad():
        positions = torch.arange(ids.shape[1])[None].repeat(ids.shape[0], 1)
        return loaded.model(torch.tensor(ids), positions, None).logits.numpy()


def test_fp32_lowering_matches_pytorch(model, tmp_path):
    name, loaded = model
    counts = _lower(loaded, "fp32", tmp_path / "model.onnx")
    layers = loaded.config.num_hidden_layers
    assert counts["trt_kv_cache"] == layers and counts["onnx_rotary"] == 2 * layers
    ids = np.random.default_rng(0).integers(0, loaded.config.vocab_size, size=(2, STEPS[-1]))
    got = run_steps(tmp_path / "model.onnx", ids, STEPS)
    want = _reference(loaded, ids)
    assert np.abs(got - want).max() < 1e-4, name
    assert (got.argmax(-1) == want.argmax(-1)).all()


@pytest.mark.parametrize("name", TRT_PRESETS)
def test_fp16_lowering_structure_and_parity(trt_artifacts, name):
    """The compiled artifact's model.onnx (what the engine is built from): no ORT-only ops, half caches,
    fp32 logits and norms, and ONNX Runtime on it stays within fp16 error of PyTorch."""
    loaded = load_model(name, mla_impl="absorb")
    path = trt_artifacts[name] / "model.onnx"
    proto = onnx.load(str(path), load_external_data=False)
    ops = Counter((n.domain, n.op_type) for n in proto.graph.node)
    assert not [op for op in ops if op[0] == "com.microsoft"], "ORT-only ops must not reach TensorRT"
    layers = loaded.config.num_hidden_layers
    assert ops[("", "TensorScatter")] == (layers if loaded.config.mla else 2 * layers)
    assert ops[("", "Attention")] == layers and ops[("", "RotaryEmbedding")] == 2 * layers
    types = {v.name: v.type.tensor_type.elem_type for v in [*proto.graph.input, *proto.graph.output]}
    assert types["logits"] == onnx.TensorProto.FLOAT
    assert {t for n, t in types.items() if "past_key_values" in n or "present" in n} == {onnx.TensorProto.FLOAT16}
    # Norms in fp32: every RMSNormalization input comes out of a Cast to float.
    producers = {o: n for n in proto.graph.node for o in n.output}
    for node in proto.graph.node:
        if node.op_type == "RMSNormalization":
            cast = producers[node.input[0]]
            assert cast.op_type == "Cast" and cast.attribute[0].i == onnx.TensorProto.FLOAT
    ids = np.random.default_rng(1).integers(0, loaded.config.vocab_size, size=(2, STEPS[-1]))
    got, want = run_steps(path, ids, STEPS), _reference(loaded, ids)
    assert np.abs(got - want).max() < 2e-2 * np.abs(want).max(), name


def test_sliding_window_mask(tmp_path):
    """Mistral-style window: a window shorter than the sequence changes logits, and matches PyTorch."""
    loaded = load_model("tiny-llama")
    config = loaded.config
    object.__setattr__(config, "sliding_window", 4)  # the model reads its config at forward time
    assert loaded.model.config.sliding_window == 4
    _lower(loaded, "fp32", tmp_path / "model.onnx")
    ids = np.random.default_rng(2).integers(0, config.vocab_size, size=(1, STEPS[-1]))
    got, want = run_steps(tmp_path / "model.onnx", ids, STEPS), _reference(loaded, ids)
    assert np.abs(got - want).max() < 1e-4


def test_nothing_imports_tensorrt_unless_used(tmp_path):
    import subprocess
    import sys

    code = ("import sys, moeforge.cli.commands, moeforge.compile.driver, moeforge.cli.inspect, "
            "moeforge.runtime.engine, moeforge.runtime.backends.tensorrt, moeforge.compile.trt.engine_build, "
            "moeforge.compile.targets.trt, moeforge.verify.golden, "
            "moeforge.ops.moe_router.tensorrt, moeforge.ops.paged_attention.tensorrt, "
            "moeforge.ops.sparse_mla.tensorrt; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('tensorrt', 'tensorrt_rtx_bindings')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=tmp_path).stdout
    assert out.strip() == "[]"
