"""``moeforge.SparseMLA`` / ``SparseMLACache``: the local functions (standard ops, run by ONNX Runtime) equal the
torch reference, and the cached form writes its buffers in place and attends over rows 0..position only."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from moeforge.ops.sparse_mla import function, reference
from moeforge.ops.sparse_mla.ort_lowering import lower_for_ort, uses_sparse_mla
from moeforge.ops.sparse_mla.schema import (
    CACHED_INPUTS,
    CACHED_OP_TYPE,
    CACHED_OUTPUTS,
    DOMAIN,
    INPUTS,
    OP_TYPE,
    SparseMLAAttrs,
)

# 16 indexer heads: an all-zero ReLU score (an exact tie top-k may break either way) is 2^-16 rare.
B, H, C, R, HI, DI, LMAX = 2, 4, 40, 32, 16, 16, 24
ATTRS = SparseMLAAttrs(topk=5, scale=0.2, index_scale=DI**-0.5, kv_rank=R)


def _session(cached: bool, core: str | None = None) -> ort.InferenceSession:
    """One node carrying its local function; ``core``: through ort_lowering with that step-3 core (inlined: no
    moeforge node left)."""
    names, outs = (CACHED_INPUTS, CACHED_OUTPUTS) if cached else (INPUTS, ("output",))
    node = helper.make_node(CACHED_OP_TYPE if cached else OP_TYPE, list(names), list(outs), domain=DOMAIN,
                            **ATTRS.as_dict())
    ints = ("positions", "attention_mask")
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info(n, TensorProto.INT64 if n in ints else TensorProto.FLOAT, None)
                      for n in names], [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid(DOMAIN, 1)],
                              functions=[function.function_proto(ATTRS, "contiguous" if cached else "stateless")])
    if core is not None:
        model = lower_for_ort(model, core)  # type: ignore[arg-type]
        assert not uses_sparse_mla(model) and not model.functions
        assert any(n.op_type == "Attention" for n in model.graph.node) == (core == "attention")
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _inputs(s: int, length: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, s, C, generator=gen), torch.randn(B, length, C, generator=gen),
            torch.randn(B, s, HI, DI, generator=gen), torch.randn(B, s, HI, generator=gen),
            torch.randn(B, length, DI, generator=gen)]


@pytest.mark.parametrize("core", [None, "matmul", "attention"], ids=["function", "lowered", "attention-core"])
@torch.no_grad()
def test_stateless_function_equals_reference(core: str | None) -> None:
    s = 12
    query, latent, index_q, index_w, index_k = _inputs(s, s, 0)
    positions = torch.arange(s).expand(B, s).contiguous()
    expected = reference.sparse_mla(query, latent, index_q, index_w, index_k, positions, *ATTRS.as_dict().values())
    feeds = dict(zip(INPUTS, (t.numpy() for t in (query, latent, index_q, index_w, index_k, positions)), strict=True))
    np.testing.assert_allclose(_session(False, core).run(None, feeds)[0], expected.numpy(), atol=1e-5)


@pytest.mark.parametrize("core", [None, "matmul", "attention"], ids=["function", "lowered", "attention-core"])
@pytest.mark.parametrize("new", [7, 1], ids=["chunk", "decode"])
@torch.no_grad()
def test_cached_function_writes_in_place_and_equals_reference(new: int, core: str | None) -> None:
    past_len = 9
    total = past_len + new
    query, _, index_q, index_w, _ = _inputs(new, total, 1)
    _, latent_all, _, _, index_all = _inputs(new, total, 2)  # rows 0..total-1: past + new
    positions = (past_len + torch.arange(new)).expand(B, new).contiguous()
    expected = reference.sparse_mla(query, latent_all, index_q, index_w, index_all, positions,
                                    *ATTRS.as_dict().values())
    buffers = [np.full((B, 1, LMAX, w), np.nan, np.float32) for w in (C, DI)]  # rows past total stay unread
    for buffer, rows in zip(buffers, (latent_all, index_all), strict=True):
        buffer[:, 0, :past_len] = rows[:, :past_len].numpy()
    session = _session(True, core)
    io = session.io_binding()
    values = [ort.OrtValue.ortvalue_from_numpy(b) for b in buffers]
    feeds = (query, latent_all[:, past_len:], index_q, index_w, index_all[:, past_len:], positions)
    for name, tensor in zip(INPUTS, feeds, strict=True):
        io.bind_cpu_input(name, np.ascontiguousarray(tensor.numpy()))
    io.bind_cpu_input("attention_mask", np.ones((B, total), np.int64))
    for name, value, out in zip(("past_latent", "past_index"), values, CACHED_OUTPUTS[1:], strict=True):
        io.bind_ortvalue_input(name, value)
        io.bind_ortvalue_output(out, value)  # one buffer: written in place
    io.bind_output("output", "cpu")
    session.run_with_iobinding(io)
    np.testing.assert_allclose(io.get_outputs()[-1].numpy(), expected.numpy(), atol=1e-5)  # bound last
    np.testing.assert_array_equal(buffers[0][:, 0, :total], latent_all.numpy())
    np.testing.assert_array_equal(buffers[1][:, 0, :total], index_all.numpy())
