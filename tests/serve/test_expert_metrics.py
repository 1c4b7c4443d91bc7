"""MoE expert load on /metrics: after serving token-id prompts, ``moeforge:expert_routed_tokens_total`` equals a
count taken from the PyTorch router on the tokens the model ran, and the imbalance gauge is max / mean."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from moeforge.runtime.engine import BackendOptions, EngineConfig, LLMEngine, SchedulingOptions
from moeforge.serve import ServerConfig, create_app
from tests.conftest import pytorch_router_counts

from .conftest import _running

MOE_MODEL = "tiny-deepseek-v3"


@pytest.fixture(scope="module")
def moe_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from moeforge.compile.driver import CompileOptions, compile_model  # the compile stack: only this fixture needs it

    out = tmp_path_factory.mktemp("serve-moe") / MOE_MODEL
    return compile_model(CompileOptions(model=MOE_MODEL, output_dir=out, max_seq_len=64, progress=False)).output_dir


def test_expert_load_metrics_equal_the_pytorch_router(moe_artifact):
    engine = LLMEngine.from_artifact(moe_artifact, EngineConfig(
        scheduling=SchedulingOptions(max_num_seqs=2),
        backend=BackendOptions(track_expert_load=True, threads=1)))
    app = create_app(engine, ServerConfig(model_name=MOE_MODEL))
    prompts = [[5, 17, 200, 3, 99, 41], [7, 7, 300, 12]]
    ran = []
    with _running(app) as url:
        for prompt, n in zip(prompts, (5, 3), strict=True):
            reply = httpx.post(f"{url}/v1/completions", json={"model": MOE_MODEL, "prompt": prompt, "max_tokens": n,
                                                              "temperature": 0, "ignore_eos": True,
                                                              "return_token_ids": True}, timeout=60).json()
            ran.append(prompt + reply["choices"][0]["token_ids"][:-1])  # the last token was sampled, never run
        text = httpx.get(f"{url}/metrics", timeout=30).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    expected = pytorch_router_counts(MOE_MODEL, ran)
    got = np.zeros_like(expected)
    for sample in families["moeforge:expert_routed_tokens"].samples:
        got[int(sample.labels["layer"]), int(sample.labels["expert"])] = sample.value
    np.testing.assert_array_equal(got, expected)
    for sample in families["moeforge:expert_load_imbalance"].samples:
        row = expected[int(sample.labels["layer"])]
        assert sample.value == pytest.approx(row.max() / row.mean())
