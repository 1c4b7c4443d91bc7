"""The TensorRT backend: its CPU half (cache bindings from the KV spec, slot batching within the engine's
profiles, against a stand-in engine), and on a GPU (marked gpu; skipped without CUDA, never faked) the
engine's parity with the golden logits and with ONNX Runtime.

The plans come from the same CPU build as the other tests (TensorRT-RTX, SM89); on a GPU host whose
compute capability differs, those are rebuilt for it with --sm.
"""

import re
from dataclasses import dataclass, field, replace

import numpy as np
import pytest

from moeforge.core.artifact import load_artifact
from moeforge.core.errors import MoeforgeError
from moeforge.core.manifest import KVCacheSpec
from moeforge.runtime.backends.base import RowInput, StepInput
from moeforge.runtime.backends.kv_bindings import CacheBinding
from moeforge.runtime.backends.tensorrt import TensorRTBackend, engine_cache_bindings
from moeforge.runtime.backends.trt_adapter import local_sm

from .conftest import have_cuda, needs_trt_rtx

needs_gpu = pytest.mark.skipif(not have_cuda(), reason="needs an NVIDIA GPU (torch.cuda.is_available() is False)")


def _static_spec() -> KVCacheSpec:
    """A TensorRT engine's GQA cache: 2 layers of [B, Hkv 2, L 16, D 8] float16."""
    return KVCacheSpec(layout="gqa", num_layers=2, shape=["batch_size", 2, 16, 8], dtype="float16",
                       past_input_names=[[f"past_key_values.{i}.key", f"past_key_values.{i}.value"] for i in range(2)],
                       present_output_names=[[f"present.{i}.key", f"present.{i}.value"] for i in range(2)],
                       values_per_token_per_layer=32, bytes_per_token=128, max_seq_len=16)


def _engine_info(kv: KVCacheSpec, dtype: str = "half") -> dict:
    """The EngineInfo I/O of a contiguous engine built for ``kv`` (dynamic batch)."""
    caches = [n for layer in kv.past_input_names for n in layer]
    presents = [n for layer in kv.present_output_names for n in layer]
    return {"plan_file": "model.plan",
            "inputs": [{"name": n, "dtype": dtype, "shape": [-1, *kv.shape[1:]]} for n in caches],
            "outputs": [{"name": "logits", "dtype": "float", "shape": [-1, -1, 32]}]
            + [{"name": n, "dtype": dtype, "shape": [-1, *kv.shape[1:]]} for n in presents]}


def test_engine_caches_are_the_kv_specs_and_a_contradicting_engine_is_refused():
    kv = _static_spec()
    bindings = engine_cache_bindings(kv, _engine_info(kv))
    assert bindings[:2] == [CacheBinding("past_key_values.0.key", ("present.0.key",), 2, 8, "float16"),
                            CacheBinding("past_key_values.0.value", ("present.0.value",), 2, 8, "float16")]
    assert len(bindings) == 4
    with pytest.raises(MoeforgeError, match=re.escape("'past_key_values.0.key' is bfloat16 in the graph, float16")):
        engine_cache_bindings(kv, _engine_info(kv, "bf16"))
    shorter = replace(kv, shape=[kv.shape[0], 2, 8, 8])
    with pytest.raises(MoeforgeError, match=re.escape("'past_key_values.0.key' has shape [-1, 2, 16, 8]")):
        engine_cache_bindings(shorter, _engine_info(kv))
    paged = replace(kv, block_size=4, shape=["num_blocks", 4, 2, 8])
    with pytest.raises(MoeforgeError, match="paged"):
        engine_cache_bindings(paged, _engine_info(kv))


@dataclass
class _StandInEngine:
    """TrtEngine's interface to the backend, recording runs; logits[b, s, 0] = the token fed there."""

    kv_cache: KVCacheSpec
    num_slots: int = 4
    max_prefill_tokens: int = 3
    max_decode_batch: int = 3
    runs: list = field(default_factory=list)

    def run(self, lo, hi, ids, positions, past_lengths):
        self.runs.append((lo, hi, ids.tolist(), positions.tolist(), past_lengths.tolist()))
        logits = np.zeros((*ids.shape, 8), np.float32)
        logits[..., 0] = ids
        return logits


def test_backend_runs_prefills_and_decodes_within_the_engine_profiles():
    """A 7-token prefill runs as 3 + 3 + 1 (prefill profile); decodes on slots 0, 2, 3 run as [0, 3), idle slot 1
    with a dummy token at its next position, and [3, 4) (decode batch 3); each row gets its last token's logits."""
    engine = _StandInEngine(_static_spec())
    backend = TensorRTBackend(engine, vocab_size=8)
    assert (backend.num_slots, backend.max_seq_len, backend.kv_pool) == (4, 16, None)
    out = backend.execute(StepInput((RowInput(2, (1, 2, 3, 4, 5, 6, 7), 0), RowInput(0, (9, 8), 0))))
    assert out[:, 0].tolist() == [7, 8]
    assert [run[:2] for run in engine.runs] == [(2, 3), (2, 3), (2, 3), (0, 1)]
    assert engine.runs[2][3:] == ([[6]], [6])  # the third piece starts at position 6, 6 tokens cached
    engine.runs.clear()
    backend.execute(StepInput((RowInput(1, (5, 6), 0),)))
    engine.runs.clear()
    out = backend.execute(StepInput((RowInput(3, (11,), 0), RowInput(0, (12,), 2), RowInput(2, (13,), 7))))
    assert out[:, 0].tolist() == [11, 12, 13]
    assert engine.runs == [(0, 3, [[12], [0], [13]], [[2], [2], [7]], [2, 2, 7]), (3, 4, [[11]], [[0]], [0])]
    assert backend.lengths == [3, 2, 8, 1]
    with pytest.raises(ValueError, match="starts at 0"):
        backend.execute(StepInput((RowInput(2, (1,), 0),)))


@pytest.fixture(scope="module")
def gpu_artifacts(trt_artifacts, tmp_path_factory):
    if local_sm() == 89:
        return trt_artifacts
    from moeforge.compile.driver import CompileOptions, compile_model

    root = tmp_path_factory.mktemp("trt_gpu")
    return {name: compile_model(CompileOptions(model=name, output_dir=root / name, target="trt", max_seq_len=64,
                                               sm=local_sm(), max_prefill_tokens=32, progress=False)).output_dir
            for name in trt_artifacts}


@pytest.mark.gpu
@needs_trt_rtx
@needs_gpu
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-deepseek-v3"])
def test_engine_matches_golden(gpu_artifacts, name):
    from moeforge.verify.golden import check_engine

    check, tolerance = check_engine(gpu_artifacts[name])
    assert check.max_abs_err <= tolerance and check.top1_agreement >= 0.9


@pytest.mark.gpu
@needs_trt_rtx
@needs_gpu
@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_backend_matches_onnxruntime_on_the_same_graph(gpu_artifacts, cuda_graphs):
    """Two sequences in two slots: prefill, then 8 batched greedy decodes with the caches bound in place;
    every step's logits match ONNX Runtime running the same lowered graph teacher-forced on those tokens."""
    from moeforge.compile.trt.lowering_check import run_steps

    artifact = load_artifact(gpu_artifacts["tiny-llama"])
    backend = TensorRTBackend.from_artifact(artifact.root, num_slots=2, cuda_graphs=cuda_graphs)
    prompts = [[5, 9, 13, 2, 7], [11, 3, 8]]
    tokens = [list(p) for p in prompts]
    seen = [[], []]
    logits = backend.execute(StepInput(tuple(RowInput(s, tuple(p), 0) for s, p in enumerate(prompts))))
    for _ in range(8):
        for s in range(2):
            seen[s].append(logits[s])
            tokens[s].append(int(logits[s].argmax()))
        logits = backend.execute(StepInput(tuple(RowInput(s, (tokens[s][-1],), len(tokens[s]) - 1)
                                                 for s in range(2))))
    for s, prompt in enumerate(prompts):
        ids = np.array([tokens[s][:-1]])
        boundaries = [0, len(prompt), *range(len(prompt) + 1, ids.shape[1] + 1)]
        want = run_steps(artifact.model_path, ids, boundaries)[0, len(prompt) - 1:]
        got = np.stack(seen[s])
        assert np.abs(got - want).max() < 5e-2 * max(1.0, np.abs(want).max())


@pytest.mark.gpu
@needs_trt_rtx
@needs_gpu
def test_cache_is_bound_in_place(gpu_artifacts):
    backend = TensorRTBackend.from_artifact(gpu_artifacts["tiny-llama"], num_slots=1)
    buffers = dict(backend._engine.caches)
    pointers = {name: t.data_ptr() for name, t in buffers.items()}
    backend.execute(StepInput((RowInput(0, (1, 2, 3), 0),)))
    assert {name: t.data_ptr() for name, t in backend._engine.caches.items()} == pointers
    assert all(float(t[0, :, :3].abs().sum()) > 0 for t in buffers.values())  # written where bound
    assert all(float(t[0, :, 3:].abs().sum()) == 0 for t in buffers.values())
    assert np.isfinite(backend.execute(StepInput((RowInput(0, (4,), 3),)))).all()
