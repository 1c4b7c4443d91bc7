"""`moeforge compile` streams DeepSeek-V4 checkpoints as DeepSeek publishes them, against transformers reading the same
folder.

The folders (``v4_hf_models.write_published``): published names, FP8 projections with ue8m0 block scales, routed experts
FP4 (e2m1 pairs, a scale per 32 values) or FP8, a hash-routed layer's int64 table, an MTP module. The compile streams
them by default (the model on the meta device, each weight read when the artifact is written: FP8 and FP4 dequantised
per tensor, experts one at a time, the int64 table as int64, the MTP tensors never read). Each artifact must generate
the greedy tokens of transformers' model loaded from the same folder (it dequantises on CPU): contiguous, paged and
tp 2 (each expert's FP4 rows and groups of 32 split between the ranks); the streamed artifact holds the in-memory
compile's weights.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch
import transformers
from onnx import numpy_helper
from safetensors.torch import load_file, save_file

from moeforge.compile import stages
from moeforge.compile.driver import CompileOptions, compile_model
from moeforge.runtime.engine import LLMEngine
from moeforge.runtime.sampler import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the seeded transformers V4 models
from v4_hf_models import CSA, HCA, VOCAB, hf_greedy, hf_model, write_published

STEPS = 10
# CSA (with its indexer's top-k) and HCA layers, a hash-routed layer; K = 64 for down_proj: two FP4 groups of 32, one
# per rank at tp 2.
FIELDS = dict(num_hidden_layers=2, layer_types=[CSA, HCA], compress_rates={CSA: 4, HCA: 8},
              mlp_layer_types=["hash_moe", "moe"], sliding_window=6, index_topk=3, index_n_heads=4, hc_mult=2,
              hc_sinkhorn_iters=3, moe_intermediate_size=64)


def _prompt(seed: int, length: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB, length).tolist()


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Any, Path]]:
    """experts ("fp4" or "fp8") -> (transformers' model loaded from the published folder, the folder)."""
    made: dict[str, tuple[Any, Path]] = {}

    def get(experts: str) -> tuple[Any, Path]:
        if experts not in made:
            folder = tmp_path_factory.mktemp(f"v4-{experts}")
            write_published(hf_model(FIELDS, 3), folder, experts=experts)
            tensors = load_file(str(folder / "model.safetensors"))
            mtp = {"mtp.0.ffn.experts.0.w1.weight": tensors["layers.1.ffn.experts.0.w1.weight"].clone(),
                   "mtp.0.ffn.experts.0.w1.scale": tensors["layers.1.ffn.experts.0.w1.scale"].clone(),
                   "mtp.0.enorm.weight": torch.ones(32)}
            save_file({**tensors, **mtp}, str(folder / "model.safetensors"))
            reference = transformers.DeepseekV4ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
            made[experts] = reference, folder
        return made[experts]

    return get


def _compile(folder: Path, out: Path, **flags: object) -> Path:
    options = CompileOptions.from_flags(model=str(folder), output_dir=out, progress=False, **flags)
    return compile_model(options).output_dir


def _weights(artifact: Path) -> dict[str, np.ndarray]:
    """The artifact's weights by name (the exporter's own constants, ``val_N``, are named in trace order: left out)."""
    graph = onnx.load(str(artifact / "model.onnx")).graph
    return {t.name: numpy_helper.to_array(t) for t in graph.initializer if not t.name.startswith("val_")}


def _ops(artifact: Path) -> Counter[str]:
    graph = onnx.load(str(artifact / "model.onnx"), load_external_data=False).graph
    return Counter(node.op_type for node in graph.node)


def _engine_tokens(artifact: Path, prompts: list[list[int]]) -> list[list[int]]:
    outputs = LLMEngine.from_artifact(artifact).generate(prompts, SamplingParams(max_tokens=STEPS, ignore_eos=True))
    return [list(o.token_ids) for o in outputs]


def test_fp4_experts_stream_by_default_and_generate_transformers_tokens(
        published: Callable[[str], tuple[Any, Path]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reference, folder = published("fp4")
    with monkeypatch.context() as patch:  # a whole load would fail: the default compile of an HF folder streams
        patch.setattr(stages, "load_model", lambda *a, **k: pytest.fail("the V4 folder was loaded whole"))
        streamed = _compile(folder, tmp_path / "stream")
    prompts = [_prompt(1, 3), _prompt(2, 21)]
    tokens = _engine_tokens(streamed, prompts)
    assert tokens == [hf_greedy(reference, p, STEPS) for p in prompts]
    assert len(set(tokens[1])) > 2
    eager = _compile(folder, tmp_path / "eager", stream=False)
    weights = [_weights(artifact) for artifact in (eager, streamed)]
    assert len(weights[0]) > 50 and weights[0].keys() == weights[1].keys()
    for name, value in weights[0].items():  # the in-memory compile's weights, bit for bit
        np.testing.assert_array_equal(weights[1][name], value, err_msg=name)
    assert _ops(eager) == _ops(streamed)


def test_fp8_experts_streamed_paged_generate_transformers_tokens(published: Callable[[str], tuple[Any, Path]],
                                                                 tmp_path: Path) -> None:
    reference, folder = published("fp8")
    out = _compile(folder, tmp_path / "paged", kv_cache="paged", stream=True)
    prompts = [_prompt(s, n) for s, n in ((3, 30), (4, 9), (5, 17))]
    assert _engine_tokens(out, prompts) == [hf_greedy(reference, p, STEPS) for p in prompts]


@pytest.mark.heavy
def test_fp4_experts_streamed_tp2_generate_transformers_tokens(published: Callable[[str], tuple[Any, Path]],
                                                               tmp_path: Path) -> None:
    reference, folder = published("fp4")
    out = _compile(folder, tmp_path / "tp2", tp=2, stream=True)
    prompt = _prompt(6, 13)
    # In its own process: `moeforge run` starts one process per rank from its own command line.
    command = [sys.executable, "-P", "-m", "moeforge.cli", "run", str(out), "--prompt-ids", ",".join(map(str, prompt)),
               "--max-new-tokens", str(STEPS), "--ignore-eos", "--json", "--quiet"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["token_ids"] == hf_greedy(reference, prompt, STEPS)
