"""Expert load: the engine's routed-token counts per MoE layer and expert equal a count taken from the PyTorch
router on the same tokens, for contiguous (idle decode rows must not count) and paged artifacts."""

from pathlib import Path

import numpy as np
import pytest

from moeforge.compile.driver import CompileOptions, compile_model
from moeforge.model.loader import load_model
from moeforge.runtime.engine import BackendOptions, EngineConfig, LLMEngine, SchedulingOptions
from moeforge.runtime.sampler import SamplingParams
from tests.conftest import pytorch_router_counts


@pytest.fixture(scope="module", params=["contiguous", "paged"])
def artifact(request, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp(f"ds3-{request.param}") / "artifact"
    compile_model(CompileOptions.from_flags(model="tiny-deepseek-v3", output_dir=out, max_seq_len=64,
                                            kv_cache=request.param, progress=False))
    return out


def test_expert_load_equals_the_pytorch_router(artifact):
    engine = LLMEngine.from_artifact(artifact, EngineConfig(
        scheduling=SchedulingOptions(max_num_seqs=3),
        backend=BackendOptions(track_expert_load=True)))
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 512, n).tolist() for n in (9, 4, 13)]
    # Different lengths: once the middle request ends, slots 0 and 2 decode with slot 1 idle in the run.
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (7, 2, 6)]
    outputs = engine.generate(prompts, params)
    # The model ran every prompt token and every sampled token but the last.
    ran = [p + o.token_ids[:-1] for p, o in zip(prompts, outputs, strict=True)]
    got = engine.expert_load()
    assert got is not None
    np.testing.assert_array_equal(got, pytorch_router_counts("tiny-deepseek-v3", ran))
    top_k = load_model("tiny-deepseek-v3").config.moe.num_experts_per_tok
    assert (got.sum(axis=1) == top_k * sum(len(r) for r in ran)).all()  # every real token once per layer


def test_expert_load_is_off_by_default(artifact):
    one_seq = EngineConfig(scheduling=SchedulingOptions(max_num_seqs=1))
    assert LLMEngine.from_artifact(artifact, one_seq).expert_load() is None
