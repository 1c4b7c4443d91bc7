"""absorbed_einsum (moeforge/passes/absorbed_einsum.py): MLA's two absorbed Einsums over views of kv_b_proj become
MatMuls over constants made once; the outputs are unchanged and no view is computed at run time any more."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx import TensorProto, helper, numpy_helper

from moeforge.model.presets import get_preset
from moeforge.passes.absorbed_einsum import AbsorbedEinsum
from moeforge.passes.base import PassContext
from tests.passes.conftest import run_ort

HEADS, NOPE, V, RANK = 4, 8, 6, 16


def _model(extra_consumer: bool = False) -> ir.Model:
    """q_nope [b, s, h, d] and latent [b, h, s, r] -> the two absorbed Einsums over views of kv_b [H*(d+v), r]."""
    kv_b = np.random.default_rng(0).standard_normal((HEADS * (NOPE + V), RANK)).astype(np.float32)
    consts = {"shape": np.array([HEADS, NOPE + V, RANK], np.int64), "zero": np.array([0], np.int64),
              "nope": np.array([NOPE], np.int64), "end": np.array([2**62], np.int64), "axis": np.array([1], np.int64)}
    nodes = [
        helper.make_node("Reshape", ["kv_b", "shape"], ["view"]),
        helper.make_node("Slice", ["view", "zero", "nope", "axis"], ["w_uk"]),
        helper.make_node("Slice", ["view", "nope", "end", "axis"], ["w_uv"]),
        helper.make_node("Einsum", ["q_nope", "w_uk"], ["q_latent"], equation="bshd,hdr->bhsr", name="einsum_k"),
        helper.make_node("Einsum", ["latent", "w_uv"], ["out"], equation="bhsr,hvr->bshv", name="einsum_v"),
    ]
    outputs = [helper.make_tensor_value_info("q_latent", TensorProto.FLOAT, None),
               helper.make_tensor_value_info("out", TensorProto.FLOAT, None)]
    if extra_consumer:  # a weight that is not a constant view: a graph input
        nodes.append(helper.make_node("Einsum", ["q_nope", "w_in"], ["other"], equation="bshd,hdr->bhsr"))
        outputs.append(helper.make_tensor_value_info("other", TensorProto.FLOAT, None))
    inputs = [helper.make_tensor_value_info("q_nope", TensorProto.FLOAT, ["b", "s", HEADS, NOPE]),
              helper.make_tensor_value_info("latent", TensorProto.FLOAT, ["b", HEADS, "s", RANK])]
    if extra_consumer:
        inputs.append(helper.make_tensor_value_info("w_in", TensorProto.FLOAT, [HEADS, NOPE, RANK]))
    graph = helper.make_graph(nodes, "mla", inputs, outputs,
                              [numpy_helper.from_array(kv_b, "kv_b"),
                               *(numpy_helper.from_array(v, k) for k, v in consts.items())])
    model = ir.serde.deserialize_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)],
                                                         ir_version=10))
    # static weight shapes, as the exporter leaves them
    model.graph.node(3).inputs[1].shape = ir.Shape([HEADS, NOPE, RANK])
    model.graph.node(4).inputs[1].shape = ir.Shape([HEADS, V, RANK])
    return model


def _feeds(extra: bool = False) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    feeds = {"q_nope": rng.standard_normal((2, 3, HEADS, NOPE)).astype(np.float32),
             "latent": rng.standard_normal((2, HEADS, 3, RANK)).astype(np.float32)}
    if extra:
        feeds["w_in"] = rng.standard_normal((HEADS, NOPE, RANK)).astype(np.float32)
    return feeds


def test_einsums_become_matmuls_over_constants_with_the_same_outputs() -> None:
    before = run_ort(_model(), _feeds())
    model = _model()
    ctx = PassContext(config=get_preset("tiny-deepseek-v3").config, max_seq_len=16)
    assert AbsorbedEinsum().apply(model, ctx) == 2
    ops = [n.op_type for n in model.graph]
    assert "Einsum" not in ops and ops.count("MatMul") == 2
    assert ops.count("Slice") == ops.count("Reshape") == 0 and "kv_b" not in model.graph.initializers  # one copy
    after = run_ort(model, _feeds())
    for a, b in zip(after, before, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
    weights = [n.inputs[1] for n in model.graph if n.op_type == "MatMul"]
    assert [list(w.const_value.shape.numpy()) for w in weights] == [[HEADS, NOPE, RANK], [HEADS, RANK, V]]


def test_an_einsum_over_a_computed_weight_is_left_alone() -> None:
    model = _model(extra_consumer=True)
    ctx = PassContext(config=get_preset("tiny-deepseek-v3").config, max_seq_len=16)
    assert AbsorbedEinsum().apply(model, ctx) == 2
    assert [n.op_type for n in model.graph].count("Einsum") == 1
    np.testing.assert_allclose(run_ort(model, _feeds(True))[2], run_ort(_model(True), _feeds(True))[2], atol=1e-6)
