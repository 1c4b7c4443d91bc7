"""benchmarks/decode_breakdown.py's cut copies: each runs, and lacks exactly the part it is named after."""

import sys
from pathlib import Path

import numpy as np
import pytest

from moeforge.compile.driver import CompileOptions, compile_model
from moeforge.runtime.backends.onnxruntime import make_session

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import decode_breakdown as breakdown


@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> Path:
    """tiny-llama int4-asym: a MatMulNBits head, block offsets and GroupQueryAttention."""
    out = tmp_path_factory.mktemp("breakdown") / "int4-asym"
    return compile_model(CompileOptions.from_flags(model="tiny-llama", output_dir=out, max_seq_len=64,
                                                   progress=False, quant="int4-asym")).output_dir


def _run(model: breakdown.Model, graph, batch: int = 2) -> dict[str, np.ndarray]:
    session = make_session(model.path, graph=graph, threads=1)
    step = breakdown.Step(model, session, batch, past=8, kv_len=64)
    step.time(1)
    return {o.name: v.numpy() for o, v in zip(session.get_outputs(), step.binding.get_outputs(), strict=True)}


def test_every_cut_runs_and_removes_its_part(artifact):
    model = breakdown.describe_model("tiny", artifact)
    copies = breakdown.variants(model)
    assert set(copies) == {breakdown.FULL, breakdown.HEAD, breakdown.ATTENTION, breakdown.REST}
    outputs = {name: _run(model, graph) for name, graph in copies.items()}
    vocab = outputs[breakdown.FULL]["logits"].shape[-1]
    hidden = outputs[breakdown.HEAD]["logits"].shape[-1]
    assert hidden < vocab  # the head's copy returns the final norm's output [B, 1, H]
    ops = {name: [n.op_type for n in graph.graph.node] for name, graph in copies.items() if graph is not None}
    full = [n.op_type for n in breakdown.onnx.load(str(model.path), load_external_data=False).graph.node]
    assert ops[breakdown.HEAD].count("MatMulNBits") == full.count("MatMulNBits") - 1
    assert ops[breakdown.HEAD].count("GroupQueryAttention") == full.count("GroupQueryAttention") > 0
    assert "GroupQueryAttention" not in ops[breakdown.ATTENTION]
    assert ops[breakdown.ATTENTION].count("MatMulNBits") == full.count("MatMulNBits")
    assert not any(o.startswith("present") for o in outputs[breakdown.ATTENTION])
    rest = ops[breakdown.REST]
    assert "GroupQueryAttention" not in rest and rest.count("MatMulNBits") == full.count("MatMulNBits") - 1
    assert rest.count("ReduceSum") >= 1  # the int4-asym offsets stay: cutting them would time garbage values
    assert outputs[breakdown.REST]["logits"].shape[-1] == hidden


def test_parts_add_up_and_offsets_come_from_the_symmetric_pair():
    times = {("m", breakdown.FULL): [10.0, 10.2], ("m", breakdown.HEAD): [8.0, 8.2], ("m", breakdown.ATTENTION): [9.0],
             ("m", breakdown.REST): [6.5]}
    row = breakdown.parts("m", times)
    assert row["parts_ms"] == {breakdown.HEAD: 2.0, breakdown.ATTENTION: 1.1}
    assert row["rest_ms"] == 6.5 and row["interaction_ms"] == pytest.approx(10.1 - 6.5 - 3.1)
    rows = {"moeforge int4-asym": {"step_ms": 6.0}, "moeforge int4": {"step_ms": 4.5}}
    assert breakdown.offsets_ms(rows, "moeforge int4-asym") == 1.5
    assert breakdown.offsets_ms(rows, "moeforge int4") is None
    assert breakdown.offsets_ms({"moeforge int4-asym": {"step_ms": 6.0}}, "moeforge int4-asym") is None
