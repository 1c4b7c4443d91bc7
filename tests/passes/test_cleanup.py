"""Cleanup's reshape round-trip bypass (equal known shapes are bypassed, anything else is left alone) and its
Reshape-chain collapse."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto, helper

from moeforge.passes.cleanup import drop_reshape_round_trips


def _model(second_shape: list[int]) -> onnx.ModelProto:
    """x [batch, seq, 12] -> Reshape [batch, seq, 3, 4] (from x's shape) -> Reshape second_shape -> Relu."""
    nodes = [
        helper.make_node("Shape", ["x"], ["x_shape"], end=2),
        helper.make_node("Concat", ["x_shape", "heads"], ["four_d"], axis=0),
        helper.make_node("Reshape", ["x", "four_d"], ["x4"]),
        helper.make_node("Reshape", ["x4", "back"], ["x3"]),
        helper.make_node("Relu", ["x3"], ["y"]),
    ]
    inits = [helper.make_tensor("heads", TensorProto.INT64, [2], [3, 4]),
             helper.make_tensor("back", TensorProto.INT64, [len(second_shape)], second_shape)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 12])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=inits)
    # Named dims as the torch exporter records them (ONNX shape inference would invent unk__ names).
    x3_dims = ["batch", "seq", *second_shape[2:]]
    graph.value_info.extend([helper.make_tensor_value_info("x4", TensorProto.FLOAT, ["batch", "seq", 3, 4]),
                             helper.make_tensor_value_info("x3", TensorProto.FLOAT, x3_dims)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def _run(model: ir.Model, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def test_round_trip_is_bypassed_and_numerics_kept():
    x = np.random.default_rng(0).standard_normal((2, 5, 12)).astype(np.float32)
    model = ir.serde.deserialize_model(_model([0, 0, 12]))
    relu = next(n for n in model.graph if n.op_type == "Relu")
    expected = _run(model, x)
    assert drop_reshape_round_trips(model.graph) == 1
    assert relu.inputs[0].name == "x"  # reads the graph input directly
    np.testing.assert_array_equal(_run(model, x), expected)


def test_a_real_reshape_is_kept():
    model = ir.serde.deserialize_model(_model([0, 0, 6, 2]))  # [batch, seq, 6, 2] != x's shape
    assert drop_reshape_round_trips(model.graph) == 0
    assert next(n for n in model.graph if n.op_type == "Relu").inputs[0].name == "x3"


def test_the_ort_pipeline_leaves_no_reshape_round_trip(fresh_model):
    """tiny-llama's export + fusions leave 6 Reshapes per layer around attention that only undo each other."""
    from moeforge.passes.base import PassContext
    from moeforge.passes.pipeline import ort_pipeline, run_passes

    loaded, model = fresh_model("tiny-llama")
    run_passes(model, PassContext(config=loaded.config, max_seq_len=64), ort_pipeline())
    assert [n.op_type for n in model.graph].count("Reshape") == 0


def test_a_graph_output_reshape_is_kept():
    proto = _model([0, 0, 12])
    proto.graph.output.append(helper.make_tensor_value_info("x3", TensorProto.FLOAT, ["batch", "seq", 12]))
    model = ir.serde.deserialize_model(proto)
    assert drop_reshape_round_trips(model.graph) == 0  # x3 is named by the graph's outputs


def test_the_paged_pipeline_leaves_no_reshape_chain(fresh_model):
    """Paged attention's plumbing after the rotary fusion left Reshape -> Reshape pairs (4 per layer on tiny-llama);
    Cleanup collapses each into one Reshape, and the graph still computes the same logits."""
    from moeforge.passes.base import PassContext
    from moeforge.passes.cleanup import Cleanup
    from moeforge.passes.pipeline import ort_pipeline, run_passes

    loaded, model = fresh_model("tiny-llama")
    passes = ort_pipeline("paged")
    run_passes(model, PassContext(config=loaded.config, max_seq_len=64), passes)
    assert _reshape_chains(model) == []
    # Without Cleanup the same pipeline keeps them (so the assertion above is about Cleanup, not the export).
    _, plain = fresh_model("tiny-llama")
    run_passes(plain, PassContext(config=loaded.config, max_seq_len=64),
               [p for p in passes if not isinstance(p, Cleanup)])
    assert _reshape_chains(plain)


def _reshape_chains(model: ir.Model) -> list[ir.Node]:
    """Reshapes whose input is a Reshape's output that nothing else reads (so the pair could be one Reshape)."""
    chains = []
    for node in model.graph:
        producer = node.inputs[0].producer() if node.op_type == "Reshape" and node.inputs[0] is not None else None
        if producer is not None and producer.op_type == "Reshape" and len(producer.outputs[0].uses()) == 1:
            chains.append(node)
    return chains
