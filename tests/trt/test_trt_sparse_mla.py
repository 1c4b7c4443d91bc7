"""DeepSeek-V3.2's ``moeforge.SparseMLA`` (stateless, contiguous-cache and paged forms) through TensorRT-RTX on
CPU: with no plugin registered the parser inlines each local function (TopK with a dynamic K, Gather, ScatterND
into the buffers) and an SM89 plan builds. The TensorRT target compiles tiny-deepseek-v3.2 end to end (static
buffers of max_seq_len rows, past_lengths; or block pools): its lowered graph run by ONNX Runtime matches
PyTorch, and the plans build."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import onnx
import pytest
from onnx import TensorProto, helper

from moeforge.ops.sparse_mla import function
from moeforge.ops.sparse_mla.schema import (
    CACHED_INPUTS,
    CACHED_OP_TYPE,
    CACHED_OUTPUTS,
    DOMAIN,
    INPUTS,
    OP_TYPE,
    OUTPUTS,
    PAGED_INPUTS,
    PAGED_OP_TYPE,
    PAGED_OUTPUTS,
    Mode,
    SparseMLAAttrs,
)

from .conftest import needs_trt_rtx

H, C, R, HI, DI, LMAX, N, BS = 4, 40, 32, 4, 16, 64, 8, 4
ATTRS = SparseMLAAttrs(topk=8, scale=0.2, index_scale=DI**-0.5, kv_rank=R)
FORMS = {"stateless": (OP_TYPE, INPUTS, OUTPUTS), "contiguous": (CACHED_OP_TYPE, CACHED_INPUTS, CACHED_OUTPUTS),
         "paged": (PAGED_OP_TYPE, PAGED_INPUTS, PAGED_OUTPUTS)}


def _shapes(form: str) -> dict[str, tuple[list[Any], int]]:
    f32, i64, i32 = TensorProto.FLOAT, TensorProto.INT64, TensorProto.INT32
    b, s = ("T", 1) if form == "paged" else ("B", "S")
    shapes: dict[str, tuple[list[Any], int]] = {
        "query": ([b, H, s, C], f32), "latent": ([b, s, C], f32), "index_q": ([b, s, HI, DI], f32),
        "index_w": ([b, s, HI], f32), "index_k": ([b, s, DI], f32), "positions": ([b, s], i64),
        "past_latent": ([b, 1, LMAX, C], f32), "past_index": ([b, 1, LMAX, DI], f32), "attention_mask": ([b, "L"], i64),
        "latent_pool": ([N, BS, 1, C], f32), "index_pool": ([N, BS, 1, DI], f32), "block_tables": (["Q", 4], i32),
        "seq_lens": (["Q"], i32), "query_start_loc": (["Q1"], i32)}
    return shapes


@needs_trt_rtx
@pytest.mark.parametrize("form", sorted(FORMS))
def test_sparse_mla_builds_with_tensorrt_rtx_on_cpu(form: str, tmp_path: Path) -> None:
    from moeforge.compile.trt.engine_build import ParsedNetwork
    from moeforge.runtime.backends.trt_adapter import load_tensorrt

    op, inputs, outputs = FORMS[form]
    shapes = _shapes(form)
    node = helper.make_node(op, list(inputs), list(outputs), domain=DOMAIN, **ATTRS.as_dict(), plugin_version="1",
                            plugin_namespace="moeforge")
    graph = helper.make_graph(
        [node], "sparse_mla", [helper.make_tensor_value_info(n, shapes[n][1], shapes[n][0]) for n in inputs],
        [helper.make_tensor_value_info(outputs[0], TensorProto.FLOAT, [None, H, None, R])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid(DOMAIN, 1)],
                              functions=[function.function_proto(ATTRS, cast(Mode, form))])
    path = tmp_path / f"{form}.onnx"
    onnx.save(model, path)
    trt = load_tensorrt("tensorrt-rtx")
    parsed = ParsedNetwork(trt, path)
    types = parsed.layer_types()
    assert types.get("TOPK") == 1 and "GATHER" in types and not {"PLUGIN", "PLUGIN_V2", "PLUGIN_V3"} & set(types)
    config = parsed.builder.create_builder_config()
    trt.set_target(config, 89)
    profile = parsed.builder.create_optimization_profile()
    dims = {"B": (1, 1, 2), "S": (1, 4, 16), "T": (1, 4, 16), "L": (1, 16, LMAX), "Q": (1, 1, 2), "Q1": (2, 2, 3)}
    for name in inputs:
        shape = shapes[name][0]
        if any(isinstance(d, str) for d in shape):
            profile.set_shape(name, *[tuple(dims[d][i] if isinstance(d, str) else d for d in shape) for i in range(3)])
    config.add_optimization_profile(profile)
    plan = parsed.builder.build_serialized_network(parsed.network, config)
    assert plan is not None and plan.nbytes > 0


@pytest.mark.heavy
@needs_trt_rtx
def test_v32_tensorrt_target_matches_pytorch_and_builds(tmp_path: Path) -> None:
    """The fp32 TensorRT lowering of tiny-deepseek-v3.2 (top-16; a 24-token prefill, then decodes and a chunk) run
    by ONNX Runtime equals PyTorch; ``compile --target trt`` builds contiguous and paged plans, and its fp16 graph
    stays within half-precision error."""
    import numpy as np

    from moeforge.compile.driver import CompileOptions, compile_model
    from moeforge.compile.trt.lowering_check import run_steps
    from moeforge.model.loader import load_model
    from tests.trt.test_trt_lowering import _lower, _reference

    loaded = load_model("tiny-deepseek-v3.2", mla_impl="absorb")
    assert loaded.config.dsa is not None and loaded.config.dsa.index_topk < 24
    counts = _lower(loaded, "fp32", tmp_path / "model.onnx")
    assert counts["trt_kv_cache"] == loaded.config.num_hidden_layers
    ids = np.random.default_rng(0).integers(0, loaded.config.vocab_size, size=(2, 40))
    steps = [0, 24, 25, 27, 28, 40]
    want = _reference(loaded, ids)
    got = run_steps(tmp_path / "model.onnx", ids, steps)
    assert np.abs(got - want).max() < 1e-4
    assert (got.argmax(-1) == want.argmax(-1)).all()
    for layout in ("contiguous", "paged"):
        out = compile_model(CompileOptions.from_flags(model="tiny-deepseek-v3.2", output_dir=tmp_path / layout,
                                                      target="trt", kv_cache=layout, max_seq_len=64,
                                                      build_only=layout == "paged",
                                                      trt_impl="tensorrt-rtx", sm=89, max_prefill_tokens=32,
                                                      progress=False))
        engine = out.manifest.engine
        assert engine is not None and (out.output_dir / engine["plan_file"]).stat().st_size > 0
        assert out.manifest.kv_cache.layout == "mla_dsa"
        if layout == "contiguous":
            half = run_steps(out.output_dir / "model.onnx", ids, steps)
            assert np.abs(half - want).max() < 2e-2 * np.abs(want).max()
