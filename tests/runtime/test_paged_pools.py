"""Paged-backend pool helpers: pools take the dtype of the session's pool inputs (fp16 binds as fp16), packed
feeds pad short block tables with the row's own block; pool bindings come from the KV spec, which is
cross-checked with the session."""

from __future__ import annotations

import mmap
import re
import sys

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from moeforge.core.errors import ArtifactError
from moeforge.core.manifest import KVCacheSpec
from moeforge.runtime.backends.base import RowInput
from moeforge.runtime.backends.kv_bindings import CacheBinding, cache_bindings, resident_zeros
from moeforge.runtime.backends.onnxruntime import check_session
from moeforge.runtime.backends.onnxruntime_paged import BlockPools, packed_feeds, pool_dtype


def _pool_session(elem_type: int) -> ort.InferenceSession:
    """pool [N, 4, 1, 8] -> the same pool (aliased output) and logits = Cast(pool, float32)."""
    pool = helper.make_tensor_value_info("kv_pool.0.key", elem_type, ["N", 4, 1, 8])
    graph = helper.make_graph(
        [helper.make_node("Identity", ["kv_pool.0.key"], ["kv_pool_out.0.key"]),
         helper.make_node("Cast", ["kv_pool.0.key"], ["logits"], to=TensorProto.FLOAT)],
        "pools", [pool], [helper.make_tensor_value_info("kv_pool_out.0.key", elem_type, ["N", 4, 1, 8]),
                          helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 4, 1, 8])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize(("elem_type", "dtype"), [(TensorProto.FLOAT16, np.float16), (TensorProto.FLOAT, np.float32)])
def test_pools_take_the_session_dtype_and_bind(elem_type, dtype):
    session = _pool_session(elem_type)
    pools = BlockPools(session, {"kv_pool.0.key": ("kv_pool_out.0.key",)}, num_blocks=3)
    array = pools.arrays["kv_pool.0.key"]
    assert array.dtype == dtype and array.shape == (3, 4, 1, 8)
    array[1] = 2.0
    io = session.io_binding()
    pools.bind(io)  # a float32 buffer on a float16 input would be refused here or at run
    io.bind_output("logits", "cpu")
    session.run_with_iobinding(io)
    logits = io.get_outputs()[-1].numpy()
    assert logits[1].min() == logits[1].max() == 2.0 and not logits[[0, 2]].any()
    pools.zero_blocks([1])
    assert not array.any()


def test_unsupported_pool_types_are_refused():
    assert pool_dtype("tensor(float16)") is np.float16
    with pytest.raises(ValueError, match="bfloat16"):
        pool_dtype("tensor(bfloat16)", "kv_pool.0.key")


def test_packed_feeds_pad_with_the_rows_own_block():
    rows = [RowInput(0, (1, 2, 3), 14, (5, 6)), RowInput(1, (7,), 2, (9,))]
    feeds = packed_feeds(rows)
    assert feeds["block_tables"].tolist() == [[5, 6], [9, 9]]
    assert feeds["input_ids"].tolist() == [1, 2, 3, 7] and feeds["position_ids"].tolist() == [14, 15, 16, 2]
    assert feeds["seq_lens"].tolist() == [17, 3] and feeds["query_start_loc"].tolist() == [0, 3, 4]
    assert feeds["logits_indices"].tolist() == [2, 3]
    assert packed_feeds(rows, all_logits=True)["logits_indices"].tolist() == [0, 1, 2, 3]


def _latent_spec(dtype: str = "float32", **names: list[list[str]]) -> KVCacheSpec:
    """The spec of ``_pool_session``'s graph: one layer, one latent-like pool [N, 4, 1, 8]."""
    fields = {"past_input_names": [["kv_pool.0.key"]], "present_output_names": [["kv_pool_out.0.key"]], **names}
    return KVCacheSpec(layout="mla_latent", num_layers=1, shape=["num_blocks", 4, 1, 8], dtype=dtype,
                       values_per_token_per_layer=8, bytes_per_token=32, max_seq_len=16, block_size=4, **fields)


def test_pool_bindings_come_from_the_spec_and_are_checked_against_the_session():
    session = _pool_session(TensorProto.FLOAT16)
    assert cache_bindings(_latent_spec("float16")) == [
        CacheBinding("kv_pool.0.key", ("kv_pool_out.0.key",), heads=1, head_dim=8, dtype="float16")]
    check_session(session, _latent_spec("float16"), "pools.onnx")
    mismatch = re.escape("'kv_pool.0.key' is float16 in the graph, float32 in the manifest")
    with pytest.raises(ArtifactError, match=mismatch):
        check_session(session, _latent_spec("float32"), "pools.onnx")
    with pytest.raises(ArtifactError, match=re.escape("pools.onnx has no output 'kv_pool_out.0.latent'")):
        check_session(session, _latent_spec("float16", present_output_names=[["kv_pool_out.0.latent"]]), "pools.onnx")


def _resident_share(buffer: np.ndarray) -> float:
    """Share of the whole pages inside ``buffer`` that are in memory now (Linux mincore)."""
    import ctypes
    import os

    page = os.sysconf("SC_PAGE_SIZE")
    begin = -(-buffer.ctypes.data // page) * page
    pages = (buffer.ctypes.data + buffer.nbytes - begin) // page
    vector = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(ctypes.c_void_p(begin), pages * page, vector) == 0, os.strerror(ctypes.get_errno())
    return sum(v & 1 for v in vector) / pages


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore")
def test_cache_buffers_are_mapped_at_allocation():
    """resident_zeros maps every page now (np.zeros from fresh memory maps them on first touch, inside the kernels)."""
    buffer = resident_zeros((64 << 20 >> 2,), np.float32)
    assert not buffer.any() and buffer.dtype == np.float32
    assert _resident_share(buffer) == 1.0
    fresh = mmap.mmap(-1, buffer.nbytes)  # anonymous memory never touched: what np.zeros gets from a fresh mapping
    assert _resident_share(np.frombuffer(fresh, np.float32)) < 0.5  # the check itself tells the two apart
