"""The TensorRT plugin of ``moeforge.SparseMLACache`` / ``SparseMLAPaged`` (moeforge/ops/sparse_mla/tensorrt.py).

CPU: its torch kernels against the reference over whole sequences (top-k smaller than the context, so the
selection matters), the pool / buffer writes, the paged ONNX Runtime lowering against the same kernel, and the
plugin objects (serialisation, types, aliasing) with TensorRT-RTX's bindings. GPU (marked, skipped without CUDA and
full TensorRT): the plugin inside an engine against the kernel on CPU.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from moeforge.ops.sparse_mla import function, reference
from moeforge.ops.sparse_mla import tensorrt as sparse_plugin
from moeforge.ops.sparse_mla.function import Core
from moeforge.ops.sparse_mla.ort_lowering import lower_for_ort
from moeforge.ops.sparse_mla.schema import (
    CACHED_OP_TYPE,
    DOMAIN,
    PAGED_INPUTS,
    PAGED_OP_TYPE,
    PAGED_OUTPUTS,
    SparseMLAAttrs,
)
from moeforge.ops.sparse_mla.tensorrt import sparse_mla_cached, sparse_mla_paged

from .conftest import full_tensorrt_with_gpu, needs_trt_rtx

# 16 indexer heads: an all-zero ReLU score (an exact tie top-k may break either way) is 2^-16 rare.
H, C, R, HI, DI, BS = 4, 40, 32, 16, 16, 4
ATTRS = SparseMLAAttrs(topk=3, scale=0.2, index_scale=DI**-0.5, kv_rank=R)


def _token_inputs(n: int, gen: torch.Generator) -> list[torch.Tensor]:
    """query [n, H, C], latent [n, C], index_q [n, Hi, Di], index_w [n, Hi], index_k [n, Di] of n tokens."""
    return [torch.randn(n, H, C, generator=gen), torch.randn(n, C, generator=gen),
            torch.randn(n, HI, DI, generator=gen), torch.randn(n, HI, generator=gen),
            torch.randn(n, DI, generator=gen)]


@torch.no_grad()
def test_cached_kernel_writes_rows_and_matches_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    batch, past, new, lmax = 2, 6, 3, 16
    total = past + new
    query, latent, index_q, index_w, index_k = (t.reshape(batch, total, *t.shape[1:])
                                                for t in _token_inputs(batch * total, gen))
    past_latent = torch.full((batch, 1, lmax, C), float("nan"))  # rows >= total are never read
    past_index = torch.full((batch, 1, lmax, DI), float("nan"))
    past_latent[:, 0, :past], past_index[:, 0, :past] = latent[:, :past], index_k[:, :past]
    positions = (past + torch.arange(new)).expand(batch, new).contiguous()
    q = query[:, past:].permute(0, 2, 1, 3)  # [B, H, S, C]
    out = sparse_mla_cached(q, latent[:, past:], index_q[:, past:], index_w[:, past:], index_k[:, past:], positions,
                            past_latent, past_index, total, ATTRS)
    expected = reference.sparse_mla(q, latent, index_q[:, past:], index_w[:, past:], index_k, positions,
                                    *ATTRS.as_dict().values())
    assert out.shape == (batch, H, new, R)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(past_latent[:, 0, :total], latent) and torch.equal(past_index[:, 0, :total], index_k)
    assert past_latent[:, 0, total:].isnan().all()  # nothing else written


def _paged_steps() -> list[tuple[list[int], list[int]]]:
    """(new tokens per sequence, tokens after the step): a prefill of 6 and 4 tokens, then 2 decode steps."""
    return [([6, 4], [6, 4]), ([1, 1], [7, 5]), ([1, 1], [8, 6])]


def _paged_session(core: Core) -> ort.InferenceSession:
    """One SparseMLAPaged node through the ONNX Runtime lowering (``core``, inlined)."""
    node = helper.make_node(PAGED_OP_TYPE, list(PAGED_INPUTS), list(PAGED_OUTPUTS), domain=DOMAIN,
                            **ATTRS.as_dict())
    types = {"positions": TensorProto.INT64, "block_tables": TensorProto.INT32, "seq_lens": TensorProto.INT32,
             "query_start_loc": TensorProto.INT32}
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, types.get(n, TensorProto.FLOAT), None)
                                            for n in PAGED_INPUTS],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in PAGED_OUTPUTS])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid(DOMAIN, 1)],
                              functions=[function.function_proto(ATTRS, "paged")])
    lowered = lower_for_ort(model, core)
    assert all(n.domain != DOMAIN for n in lowered.graph.node)
    return ort.InferenceSession(lowered.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("core", ["matmul", "attention"])
@torch.no_grad()
def test_paged_kernel_matches_reference_and_the_ort_lowering(core: Core) -> None:
    """Two sequences in scattered blocks: each step's output equals the reference over the sequence's whole
    history (dense rows), the pools hold every row at its slot, and the lowered graph computes the same."""
    gen = torch.Generator().manual_seed(1)
    tables = torch.tensor([[5, 2, 7], [1, 6, 0]], dtype=torch.int32)
    pools = [torch.zeros(8, BS, 1, C), torch.zeros(8, BS, 1, DI)]
    ort_pools = [p.numpy().copy() for p in pools]
    session = _paged_session(core)
    history: dict[int, list[list[torch.Tensor]]] = {0: [[], []], 1: [[], []]}
    for lengths, totals in _paged_steps():
        tokens = sum(lengths)
        query, latent, index_q, index_w, index_k = _token_inputs(tokens, gen)
        starts = torch.tensor([0, lengths[0], tokens], dtype=torch.int32)
        positions = torch.cat([torch.arange(t - n, t) for n, t in zip(lengths, totals, strict=True)])[:, None]
        inputs = [query[:, :, None], latent[:, None], index_q[:, None], index_w[:, None], index_k[:, None], positions]
        steps = [tables, torch.tensor(totals, dtype=torch.int32), starts]
        out = sparse_mla_paged(*inputs, *pools, *steps, ATTRS)  # [T, H, 1, R]
        feeds = dict(zip(PAGED_INPUTS, [*(t.numpy() for t in inputs), *ort_pools, *(t.numpy() for t in steps)],
                         strict=True))
        ort_out, *ort_pools = session.run(None, feeds)
        np.testing.assert_allclose(ort_out, out.numpy(), atol=1e-5)
        for b in range(2):
            lo, hi = int(starts[b]), int(starts[b + 1])
            history[b][0].append(latent[lo:hi])
            history[b][1].append(index_k[lo:hi])
            rows, keys = torch.cat(history[b][0]), torch.cat(history[b][1])
            assert rows.shape[0] > ATTRS.topk  # the selection is exercised
            expected = reference.sparse_mla(query[lo:hi].transpose(0, 1)[None], rows[None], index_q[lo:hi][None],
                                            index_w[lo:hi][None], keys[None], positions[lo:hi, 0][None],
                                            *ATTRS.as_dict().values())  # [1, H, n, R]
            torch.testing.assert_close(out[lo:hi, :, 0], expected[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
            for p in range(rows.shape[0]):
                slot = (tables[b, p // BS], p % BS, 0)
                assert torch.equal(pools[0][slot], rows[p]) and torch.equal(pools[1][slot], keys[p])
        for ours, theirs in zip(pools, ort_pools, strict=True):
            np.testing.assert_array_equal(ours.numpy(), theirs)


@needs_trt_rtx
@pytest.mark.parametrize("op_type", [CACHED_OP_TYPE, PAGED_OP_TYPE])
def test_plugin_objects_serialise_type_and_alias(op_type: str) -> None:
    import tensorrt_rtx_bindings as trt

    plugin_cls, creator_cls = sparse_plugin.plugin_classes(trt, op_type)
    attrs = SparseMLAAttrs(topk=2048, scale=0.1352, index_scale=0.0884, kv_rank=512)
    plugin = plugin_cls(attrs)
    assert (plugin.plugin_name, plugin.plugin_version, plugin.plugin_namespace) == (op_type, "1", "moeforge")
    creator = creator_cls()
    again = creator.create_plugin("s", plugin.get_fields_to_serialize(), trt.TensorRTPhase.RUNTIME)
    assert again.attrs.topk == 2048 and again.attrs.kv_rank == 512
    assert abs(again.attrs.scale - 0.1352) < 1e-6 and abs(again.attrs.index_scale - 0.0884) < 1e-6
    half = trt.DataType.HALF
    types = [half] * 5 + [trt.DataType.INT64, half, half] + [trt.DataType.INT32] * 3
    assert plugin.get_output_data_types(types) == [half] * 3
    assert [plugin.get_aliased_input(i) for i in range(3)] == [-1, 6, 7]  # caches written in place
    bad = plugin_cls(SparseMLAAttrs(topk=0, scale=1.0, index_scale=1.0, kv_rank=8)).get_fields_to_serialize()
    with pytest.raises(ValueError, match="topk"):  # the creator validates what it deserialises
        creator.create_plugin("s", bad, trt.TensorRTPhase.RUNTIME)


class _Desc:
    def __init__(self, dtype: object, fmt: object) -> None:
        self.type, self.format = dtype, fmt


class _InOut:
    def __init__(self, dtype: object, fmt: object) -> None:
        self.desc = _Desc(dtype, fmt)


@needs_trt_rtx
@pytest.mark.parametrize("op_type", [CACHED_OP_TYPE, PAGED_OP_TYPE])
def test_plugin_formats_take_one_float_type_and_the_contract_integers(op_type: str) -> None:
    import tensorrt_rtx_bindings as trt

    plugin = sparse_plugin.plugin_classes(trt, op_type)[0](ATTRS)
    dt, linear = trt.DataType, trt.TensorFormat.LINEAR
    integers = {5: dt.INT64, **({8: dt.INT32, 9: dt.INT32, 10: dt.INT32} if op_type == PAGED_OP_TYPE
                                else {8: dt.INT64})}
    for floats in (dt.FLOAT, dt.HALF, dt.BF16):
        types = [floats] * 5 + [dt.INT64, floats, floats] + [integers[8]] * (3 if op_type == PAGED_OP_TYPE else 1)
        types += [floats] * 3  # outputs
        in_out = [_InOut(t, linear) for t in types]
        assert all(plugin.supports_format_combination(pos, in_out, len(types) - 3) for pos in range(len(types)))
        for pos, wrong in ((5, dt.INT32), (8, dt.INT32 if integers[8] == dt.INT64 else dt.INT64), (6, dt.INT8),
                           (1, dt.FLOAT if floats != dt.FLOAT else dt.HALF)):
            bad = list(in_out)
            bad[pos] = _InOut(wrong, linear)
            assert not plugin.supports_format_combination(pos, bad, len(types) - 3), (pos, wrong)
        bad = list(in_out)
        bad[0] = _InOut(floats, trt.TensorFormat.CHW32)
        assert not plugin.supports_format_combination(0, bad, len(types) - 3)


@needs_trt_rtx
def test_plugin_creator_names_missing_fields() -> None:
    import tensorrt_rtx_bindings as trt

    plugin_cls, creator_cls = sparse_plugin.plugin_classes(trt, CACHED_OP_TYPE)
    fields = [f for f in plugin_cls(ATTRS).get_fields_to_serialize() if f.name != "index_scale"]
    with pytest.raises(ValueError, match=r"no index_scale field.*re-export"):
        creator_cls().create_plugin("s", trt.PluginFieldCollection(fields), trt.TensorRTPhase.RUNTIME)


@needs_trt_rtx
def test_sparse_mla_plugin_refuses_tensorrt_rtx() -> None:
    import tensorrt_rtx_bindings as trt

    from moeforge.core.errors import MoeforgeError

    with pytest.raises(MoeforgeError, match="aborts the process"):
        sparse_plugin.register(trt)
    assert not {CACHED_OP_TYPE, PAGED_OP_TYPE} & {c.name for c in trt.get_plugin_registry().all_creators}


@pytest.mark.gpu
@pytest.mark.skipif(not full_tensorrt_with_gpu(), reason="needs an NVIDIA GPU and full TensorRT (TensorRT-RTX 1.7 "
                    "aborts when its parser imports a Python plugin)")
@torch.no_grad()
def test_cached_plugin_runs_in_engine(tmp_path) -> None:
    """One SparseMLACache node, static shapes (one decode token over 7 cached rows), built with the plugin: its
    output equals the kernel's on CPU and its present buffers hold the new rows (aliased, written in place)."""
    import tensorrt as trt
    from polygraphy.backend.trt import EngineFromNetwork, NetworkFromOnnxPath, TrtRunner

    sparse_plugin.register(trt)
    gen = torch.Generator().manual_seed(2)
    batch, past, lmax = 1, 7, 16
    query, latent, index_q, index_w, index_k = (t[None] for t in _token_inputs(past + 1, gen))
    buffers = [torch.zeros(batch, 1, lmax, C), torch.zeros(batch, 1, lmax, DI)]
    buffers[0][:, 0, :past], buffers[1][:, 0, :past] = latent[:, :past], index_k[:, :past]
    feeds = {"query": query[:, past:].permute(0, 2, 1, 3).contiguous(), "latent": latent[:, past:],
             "index_q": index_q[:, past:], "index_w": index_w[:, past:], "index_k": index_k[:, past:],
             "positions": torch.tensor([[past]]), "past_latent": buffers[0], "past_index": buffers[1],
             "attention_mask": torch.ones(batch, past + 1, dtype=torch.int64)}
    outputs = {"output": [batch, H, 1, R], "present_latent": list(buffers[0].shape),
               "present_index": list(buffers[1].shape)}
    node = helper.make_node(CACHED_OP_TYPE, list(feeds), list(outputs), domain=DOMAIN, plugin_version="1",
                            plugin_namespace="moeforge", **ATTRS.as_dict())
    graph = helper.make_graph(
        [node], "s",
        [helper.make_tensor_value_info(n, TensorProto.INT64 if t.dtype == torch.int64 else TensorProto.FLOAT,
                                       list(t.shape)) for n, t in feeds.items()],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n, shape in outputs.items()])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid(DOMAIN, 1)]),
              tmp_path / "s.onnx")
    with TrtRunner(EngineFromNetwork(NetworkFromOnnxPath(str(tmp_path / "s.onnx")))) as runner:
        got = runner.infer({k: v.numpy() for k, v in feeds.items()})
    want_buffers = [b.clone() for b in buffers]
    expected = sparse_mla_cached(*[t.clone() for t in list(feeds.values())[:6]], *want_buffers, past + 1, ATTRS)
    np.testing.assert_allclose(got["output"], expected.numpy(), atol=1e-4)
    np.testing.assert_allclose(got["present_latent"][:, 0, :past + 1], latent[:, : past + 1].numpy(), atol=0)
    np.testing.assert_allclose(got["present_index"][:, 0, :past + 1], index_k[:, : past + 1].numpy(), atol=0)
