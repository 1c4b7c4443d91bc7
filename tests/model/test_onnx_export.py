"""The stateless export: the exporter's optimizer runs without SlicesSplit (same graph, less time), and the graph
keeps nothing alive beyond its own initializers (so released torch weights are freed)."""

from __future__ import annotations

import contextlib
import gc
import weakref

import numpy as np
import onnx_ir as ir

from moeforge.compile import onnx_export
from moeforge.compile.onnx_export import export_stateless
from moeforge.model.loader import load_model, release_weights


def _summary(model: ir.Model) -> tuple[list[tuple[str, str, list[str]]], dict[str, np.ndarray]]:
    nodes = [(n.domain, n.op_type, [v.name or "" if v is not None else "" for v in n.inputs]) for n in model.graph]
    weights = {name: value.const_value.numpy() for name, value in model.graph.initializers.items()
               if value.const_value is not None}
    return nodes, weights


def test_leaving_slices_split_out_changes_nothing(monkeypatch):
    model = load_model("tiny-llama").model
    nodes, weights = _summary(export_stateless(model, mark_layers=True))
    monkeypatch.setattr(onnx_export, "_without_slices_split", contextlib.nullcontext)  # the optimizer's full rule set
    full_nodes, full_weights = _summary(export_stateless(model, mark_layers=True))
    assert nodes == full_nodes and weights.keys() == full_weights.keys()
    for name, value in weights.items():
        np.testing.assert_array_equal(value, full_weights[name], err_msg=name)


def test_the_graph_does_not_pin_released_torch_weights():
    loaded = load_model("tiny-llama")
    param = loaded.model.model.layers[0].self_attn.q_proj.weight
    expected = param.detach().numpy().T.copy()
    gone = weakref.ref(param)
    del param
    graph = export_stateless(loaded.model)
    release_weights(loaded.model)
    gc.collect()
    # The exporter made the parameter a graph input before moving it to the initializers; nothing may still hold it.
    assert gone() is None
    assert all(p.device.type == "meta" for p in loaded.model.parameters())
    # The graph keeps its own view of the data: the transposed q_proj weight is still there.
    assert any(v.const_value is not None and v.const_value.numpy().shape == expected.shape
               and np.array_equal(v.const_value.numpy(), expected) for v in graph.graph.initializers.values())
