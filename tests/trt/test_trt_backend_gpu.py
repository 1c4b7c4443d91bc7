"""The TensorRT backend and engine parity on a GPU (marked gpu; skipped without CUDA, never faked).

The plans come from the same CPU build as the other tests (TensorRT-RTX, SM89); on a GPU host whose
compute capability differs, those are rebuilt for it with --sm.
"""

import numpy as np
import pytest

from moeforge.artifact import load_artifact
from moeforge.runtime.backends.base import RowInput, StepInput
from moeforge.trt.adapter import local_sm

from .conftest import have_cuda, needs_trt_rtx

pytestmark = [pytest.mark.gpu, needs_trt_rtx,
              pytest.mark.skipif(not have_cuda(), reason="needs an NVIDIA GPU (torch.cuda.is_available() is False)")]


@pytest.fixture(scope="module")
def gpu_artifacts(trt_artifacts, tmp_path_factory):
    if local_sm() == 89:
        return trt_artifacts
    from moeforge.compile import CompileOptions, compile_model

    root = tmp_path_factory.mktemp("trt_gpu")
    return {name: compile_model(CompileOptions(model=name, output_dir=root / name, target="trt", max_seq_len=64,
                                               sm=local_sm(), max_prefill_tokens=32, progress=False)).output_dir
            for name in trt_artifacts}


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-deepseek-v3"])
def test_engine_matches_golden(gpu_artifacts, name):
    from moeforge.trt.golden import check_engine

    check, tolerance = check_engine(gpu_artifacts[name])
    assert check.max_abs_err <= tolerance and check.top1_agreement >= 0.9


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_backend_matches_onnxruntime_on_the_same_graph(gpu_artifacts, cuda_graphs):
    """Two sequences in two slots: prefill, then 8 batched greedy decodes with the caches bound in place;
    every step's logits match ONNX Runtime running the same lowered graph teacher-forced on those tokens."""
    from moeforge.runtime.backends.tensorrt import TensorRTBackend
    from moeforge.trt.reference import run_steps

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


def test_cache_is_bound_in_place(gpu_artifacts):
    from moeforge.runtime.backends.tensorrt import TensorRTBackend

    backend = TensorRTBackend.from_artifact(gpu_artifacts["tiny-llama"], num_slots=1)
    buffers = dict(backend._engine.caches)
    pointers = {name: t.data_ptr() for name, t in buffers.items()}
    backend.execute(StepInput((RowInput(0, (1, 2, 3), 0),)))
    assert {name: t.data_ptr() for name, t in backend._engine.caches.items()} == pointers
    assert all(float(t[0, :, :3].abs().sum()) > 0 for t in buffers.values())  # written where bound
    assert all(float(t[0, :, 3:].abs().sum()) == 0 for t in buffers.values())
    assert np.isfinite(backend.execute(StepInput((RowInput(0, (4,), 3),)))).all()
