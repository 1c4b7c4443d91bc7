"""`moeforge compile` of DeepSeek-V3.2 (DSA) artifacts, contiguous and paged: tiny-deepseek-v3.2 (top-16 of up to
80 tokens, so the selection is sparse) against PyTorch teacher-forced over a 64-token prompt and 16 decode steps
(max |logits diff| < 1e-4, greedy identical; tests/model/test_dsa_parity.py ties the PyTorch model to
transformers), the cache layout in the manifest, the engine (prefix caching on the paged one), quantised
artifacts through `moeforge parity`, and the target not supported.

Each compile takes ~15-20 s on 2 cores: the paged artifact runs by default, the contiguous one under heavy.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest

from moeforge.cli import main
from moeforge.compile.driver import CompileOptions, compile_model
from moeforge.core.artifact import load_artifact
from moeforge.model.loader import load_model
from moeforge.runtime.engine import CacheOptions, EngineConfig, LLMEngine, SchedulingOptions
from moeforge.runtime.sampler import SamplingParams
from moeforge.verify.generate import generate
from moeforge.verify.parity import default_prompt, run_parity

MODEL, PROMPT_LEN, STEPS = "tiny-deepseek-v3.2", 64, 16


def _compile(out: Path, **flags: object) -> Path:
    options = CompileOptions.from_flags(model=MODEL, output_dir=out / "artifact", max_seq_len=128, progress=False,
                                        **flags)
    return compile_model(options).output_dir


@pytest.fixture(scope="session")
def dsa_artifact(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """kv layout -> tiny-deepseek-v3.2 compiled with it (fp32), once per session."""
    cache: dict[str, Path] = {}

    def get(kv: str) -> Path:
        if kv not in cache:
            cache[kv] = _compile(tmp_path_factory.mktemp(f"dsa-{kv}"), kv_cache=kv)
        return cache[kv]

    return get


LAYOUTS = ["paged", pytest.param("contiguous", marks=pytest.mark.heavy)]


@pytest.mark.parametrize("kv", LAYOUTS)
def test_compiled_v32_matches_pytorch(dsa_artifact: Callable[[str], Path], kv: str) -> None:
    out = dsa_artifact(kv)
    artifact = load_artifact(out)
    manifest, loaded = artifact.manifest, load_model(MODEL)
    config = loaded.config
    assert config.dsa is not None and config.mla is not None
    assert config.dsa.index_topk < PROMPT_LEN  # sparse: each query past 16 tokens attends to 16 of them
    layers = config.num_hidden_layers
    paged = kv == "paged"
    assert {p["name"]: p["matches"] for p in manifest.passes}["paged_kv" if paged else "kv_cache"] == layers
    spec = manifest.kv_cache
    latent, index = config.mla.latent_dim, config.dsa.index_head_dim
    assert spec.layout == "mla_dsa" and spec.buffer_widths == [latent, index] and spec.paged == paged
    prefix = "kv_pool.0." if paged else "past_key_values.0."
    assert spec.past_input_names[0] == [prefix + "latent", prefix + "index"]
    assert spec.bytes_per_token == (latent + index) * layers * 4  # the indexer cache counted, fp32
    nodes = onnx.load(str(out / "model.onnx"), load_external_data=False)
    ops = [n.op_type for n in nodes.graph.node]
    op = "SparseMLAPaged" if paged else "SparseMLACache"
    assert ops.count(op) == layers and not {"Attention", "GroupQueryAttention", "PagedAttention"} & set(ops)
    body = {n.op_type for f in nodes.functions if f.name == op for n in f.node}
    assert {"TopK", "Gather", "ScatterND"} <= body  # the selected latent rows are gathered, not masked

    report = run_parity(artifact.model_path, spec, loaded.model, default_prompt(config.vocab_size, PROMPT_LEN),
                        decode_steps=STEPS)
    assert report.passed and report.greedy_match, report.table()
    assert report.max_abs_err < 1e-4, report.table()


@pytest.mark.parametrize("kv", LAYOUTS)
def test_engine_on_v32_generates_what_pytorch_does(dsa_artifact: Callable[[str], Path], kv: str) -> None:
    # Batched decodes of rows of different lengths, chunked prefills (32-token budget); paged: two prompts share
    # a two-block prefix, a prefix-cache hit (the indexer pool's blocks are shared with the latent pool's).
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 256, int(n)).tolist() for n in rng.integers(1, 40, 5)]
    shared = rng.integers(0, 256, 37).tolist()
    prompts += [[*shared, 1, 2], [*shared, 3]]
    model = load_model(MODEL).model
    expected = [generate(model, p, SamplingParams(max_tokens=8)).token_ids for p in prompts]
    engine = LLMEngine.from_artifact(
        dsa_artifact(kv), EngineConfig(scheduling=SchedulingOptions(max_num_seqs=4, max_num_batched_tokens=32)))
    outputs = engine.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    assert [o.token_ids for o in outputs] == expected


@pytest.mark.heavy
@pytest.mark.parametrize("quant", ["int8", "int4-asym"])
def test_quantised_v32_passes_moeforge_parity(tmp_path: Path, quant: str, capsys: pytest.CaptureFixture[str]) -> None:
    out = _compile(tmp_path, quant=quant)
    assert load_artifact(out).manifest.precision == quant
    code = main(["parity", str(out), "--json"])
    assert code == 0, capsys.readouterr().out  # within the scheme's thresholds (top-1 agreement, KL)



def test_engine_preempts_v32_and_recomputes_what_pytorch_does(dsa_artifact: Callable[[str], Path]) -> None:
    """A third of the blocks all requests need at once: sequences are preempted (their latent and indexer blocks
    freed together) and recomputed, and every output is still PyTorch's."""
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 256, int(n)).tolist() for n in rng.integers(12, 40, 8)]
    model = load_model(MODEL).model
    expected = [generate(model, p, SamplingParams(max_tokens=10)).token_ids for p in prompts]
    artifact = dsa_artifact("paged")
    block = load_artifact(artifact).manifest.kv_cache.block_size
    assert block is not None
    need = sum(-(-(len(p) + 10) // block) for p in prompts)
    engine = LLMEngine.from_artifact(artifact, EngineConfig(
        scheduling=SchedulingOptions(max_num_seqs=8, max_num_batched_tokens=64),
        cache=CacheOptions(kv_blocks=max(need // 3, 4))))
    outputs = engine.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))
    assert [o.token_ids for o in outputs] == expected
    assert engine.metrics.preemptions > 0 and engine.kv.stats().blocks_in_use == 0
