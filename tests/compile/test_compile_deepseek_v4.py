"""`moeforge compile` of DeepSeek-V4 from seeded transformers checkpoints (HF folders), against transformers itself.

Two configs between them have every layer type (sliding, CSA with its indexer's top-k, HCA), hash-routed and top-k
MoE layers, mHC with 4 and 2 streams, YaRN and plain RoPE on the compressed layers, and tied embeddings. A 40-token
prompt and 12 greedy steps cross the sliding window and many compression boundaries. Each artifact must generate
transformers' greedy tokens: contiguous (default options), paged (default block size), tp 2 and tp 2 / ep 2; the
paged engine must serve a batch of prompts and a prefix-cache hit that ends inside a compressed window exactly; a
pp 2 artifact passes the mHC streams and the token ids from stage to stage.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
import torch

from moeforge.cli import main
from moeforge.compile.driver import CompileOptions, compile_model
from moeforge.compile.sharded_compile import read_sharded
from moeforge.core.artifact import load_artifact
from moeforge.core.errors import MoeforgeError
from moeforge.model.expert_slots import load_plan
from moeforge.parallel.eplb import Placement, write_plan
from moeforge.runtime.engine import CacheOptions, EngineConfig, EngineConfigError, LLMEngine, SpeculativeOptions
from moeforge.runtime.sampler import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the seeded transformers V4 models
from v4_hf_models import CSA, HCA, SLIDING, VOCAB, hf_greedy, hf_model

PROMPT_LEN, STEPS = 40, 12
CASES: dict[str, tuple[dict[str, Any], int]] = {
    "every_layer": (dict(
        num_hidden_layers=4, layer_types=[SLIDING, CSA, HCA, CSA], compress_rates={CSA: 4, HCA: 8},
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"], sliding_window=6, index_topk=3, index_n_heads=8, hc_mult=4,
        hc_sinkhorn_iters=6, scoring_func="sqrtsoftplus",
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}), 1),
    "hca_first": (dict(
        num_hidden_layers=3, layer_types=[HCA, CSA, SLIDING], compress_rates={CSA: 2, HCA: 16},
        mlp_layer_types=["moe", "hash_moe", "moe"], sliding_window=12, index_topk=64, index_n_heads=4, hc_mult=2,
        hc_sinkhorn_iters=3, scoring_func="sigmoid", tie_word_embeddings=True, compress_rope_theta=50000.0), 5),
}


def _prompt(seed: int, length: int = PROMPT_LEN) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB, length).tolist()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Any, Path]]:
    """case -> (the transformers model, its saved HF folder), made once per module."""
    made: dict[str, tuple[Any, Path]] = {}

    def get(case: str) -> tuple[Any, Path]:
        if case not in made:
            fields, seed = CASES[case]
            model = hf_model(fields, seed)
            folder = tmp_path_factory.mktemp(f"hf-{case}")
            model.save_pretrained(folder)
            made[case] = model, folder
        return made[case]

    return get


@pytest.fixture(scope="module")
def compiled(checkpoint: Callable[[str], tuple[Any, Path]],
             tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """(case, **flags) -> the artifact compiled from the case's HF folder with ``flags``, once per module."""
    made: dict[tuple[str, tuple[tuple[str, object], ...]], Path] = {}

    def get(case: str, **flags: object) -> Path:
        key = (case, tuple(sorted(flags.items())))
        if key not in made:
            out = tmp_path_factory.mktemp(f"{case}-artifact") / "out"
            options = CompileOptions.from_flags(model=str(checkpoint(case)[1]), output_dir=out, progress=False,
                                                **flags)
            made[key] = compile_model(options).output_dir
        return made[key]

    return get


def _engine_tokens(artifact: Path, prompts: list[list[int]], config: EngineConfig | None = None) -> list[list[int]]:
    engine = LLMEngine.from_artifact(artifact, config)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=STEPS, ignore_eos=True))
    return [list(o.token_ids) for o in outputs]


def _run_ranks(artifact: Path, prompt: list[int], *flags: str) -> list[int]:
    """The greedy tokens ``moeforge run`` generates from a sharded artifact, in its own process (it starts one process
    per rank from its own command line)."""
    command = [sys.executable, "-P", "-m", "moeforge.cli", "run", str(artifact), "--prompt-ids",
               ",".join(map(str, prompt)), "--max-new-tokens", str(STEPS), "--ignore-eos", "--json", "--quiet", *flags]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    tokens: list[int] = json.loads(done.stdout.strip().splitlines()[-1])["token_ids"]
    return tokens


@pytest.mark.parametrize("case", sorted(CASES))
def test_default_compile_generates_transformers_tokens(case: str, checkpoint: Callable[[str], tuple[Any, Path]],
                                                       compiled: Callable[..., Path]) -> None:
    model, _ = checkpoint(case)
    out = compiled(case)
    kv = load_artifact(out).manifest.kv_cache
    assert kv.layout == "v4_hybrid" and not kv.paged
    # Contiguous buffers hold rings whatever the length and entries per compressed window: the window's ring is
    # sliding_window rows, not max_seq_len.
    window = model.config.sliding_window
    assert [layer[0].ring for layer in kv.layer_buffers or []] == [window] * model.config.num_hidden_layers
    prompts = [_prompt(3), _prompt(4, 17), _prompt(5, 1)]
    assert _engine_tokens(out, prompts) == [hf_greedy(model, p, STEPS) for p in prompts]


@pytest.mark.parametrize("case", sorted(CASES))
def test_paged_compile_default_block_size(case: str, checkpoint: Callable[[str], tuple[Any, Path]],
                                          compiled: Callable[..., Path]) -> None:
    model, _ = checkpoint(case)
    out = compiled(case, kv_cache="paged")
    kv = load_artifact(out).manifest.kv_cache
    # Whole windows of every rate in a block, and at least twice the sliding window (rings cost <= half a row a token)
    quantum = math.lcm(16, *model.config.compress_rates.values())
    assert kv.block_size == quantum * max(1, math.ceil(2 * model.config.sliding_window / quantum))
    prompts = [_prompt(s, n) for s, n in ((3, 40), (6, 23), (7, 5), (8, 33))]
    expected = [hf_greedy(model, p, STEPS) for p in prompts]
    assert _engine_tokens(out, prompts) == expected


def test_paged_prefix_cache_hit_across_compression_boundaries(checkpoint: Callable[[str], tuple[Any, Path]],
                                                              compiled: Callable[..., Path]) -> None:
    # Blocks of 16 tokens: the second request shares 2 blocks (32 tokens: 8 CSA windows of 4, 4 HCA windows of 8 and
    # the 6-token sliding window at the block edge) and diverges inside the next windows.
    model, _ = checkpoint("every_layer")
    out = compiled("every_layer", kv_cache="paged")
    first = _prompt(11)
    second = [*first[:35], *_prompt(12, 6)]
    engine = LLMEngine.from_artifact(out, EngineConfig(cache=CacheOptions(kv_blocks=32)))
    engine.generate([first], SamplingParams(max_tokens=STEPS, ignore_eos=True))
    hits = engine.stats().kv.hits
    (again,) = engine.generate([second], SamplingParams(max_tokens=STEPS, ignore_eos=True))
    assert engine.stats().kv.hits - hits == 2  # both shared blocks came from the prefix cache
    assert list(again.token_ids) == hf_greedy(model, second, STEPS)


def test_host_tier_keeps_a_prefix_the_pool_evicted(checkpoint: Callable[[str], tuple[Any, Path]],
                                                   compiled: Callable[..., Path]) -> None:
    # A 5-block pool: the second prompt evicts the first one's blocks (rings and entries) to host memory; the third
    # request shares the first's two full blocks, which come back from there and must be exact.
    model, _ = checkpoint("every_layer")
    out = compiled("every_layer", kv_cache="paged")
    first, other = _prompt(11), _prompt(13)
    engine = LLMEngine.from_artifact(out, EngineConfig(cache=CacheOptions(kv_blocks=5, host_bytes=64 << 20)))
    engine.generate([first], SamplingParams(max_tokens=STEPS, ignore_eos=True))
    engine.generate([other], SamplingParams(max_tokens=STEPS, ignore_eos=True))
    third = [*first[:35], *_prompt(12, 6)]
    (again,) = engine.generate([third], SamplingParams(max_tokens=STEPS, ignore_eos=True))
    tiers = engine.stats().kv_tiers
    assert tiers is not None and tiers.demotions > 0 and tiers.host_hits >= 1  # (the other may still be in L1)
    assert list(again.token_ids) == hf_greedy(model, third, STEPS)


@pytest.mark.parametrize("flags", [dict(tp=2), dict(tp=2, ep=2, kv_cache="paged")], ids=["tp2", "tp2-ep2-paged"])
def test_sharded_compile_generates_transformers_tokens(flags: dict[str, object],
                                                       checkpoint: Callable[[str], tuple[Any, Path]],
                                                       compiled: Callable[..., Path]) -> None:
    model, _ = checkpoint("every_layer")
    out = compiled("every_layer", **flags)
    prompt = _prompt(3)
    assert _run_ranks(out, prompt) == hf_greedy(model, prompt, STEPS)


def test_pipeline_stages_pass_the_streams_and_token_ids(checkpoint: Callable[[str], tuple[Any, Path]],
                                                        compiled: Callable[..., Path]) -> None:
    # --pp 2 with the hash-routed layer (layer 1) on stage 1: that stage needs the token ids as well as stage 0's
    # mHC streams; stage 0 holds the embedding and one HCA layer, stage 1 the rest and its own copy of the tied table.
    model, _ = checkpoint("hca_first")
    out = compiled("hca_first", pp=2, pp_layers="0-0,1-2", kv_cache="paged")
    sharded = json.loads((out / "sharded.json").read_text())
    assert sharded["pp"] == 2 and [stage["layers"] for stage in sharded["stages"]] == [[0, 1], [1, 3]]
    width = model.config.hc_mult * model.config.hidden_size
    for rank, layers in ((0, 1), (1, 2)):
        artifact = load_artifact(out / f"rank{rank}")
        assert len(artifact.manifest.kv_cache.layer_buffers or []) == layers  # each stage caches its own layers
        inputs = {i.name: i.shape for i in ort.InferenceSession(str(artifact.model_path)).get_inputs()}
        assert "input_ids" in inputs and (rank == 0 or inputs["hidden_states_in"][1] == width)
    prompt = _prompt(3)
    assert _run_ranks(out, prompt) == hf_greedy(model, prompt, STEPS)


def _hf_router_counts(model: Any, tokens: list[int]) -> np.ndarray:
    """[L, E]: the experts transformers' routers (top-k and hash) pick for ``tokens``, counted per layer."""
    routers = [m for m in model.modules() if type(m).__name__.endswith("Router")]
    counts = np.zeros((len(routers), model.config.n_routed_experts), np.int64)

    def record(index: int) -> Any:
        def hook(_module: Any, _inputs: Any, output: Any) -> None:
            counts[index] += np.bincount(output[2].reshape(-1).numpy(), minlength=counts.shape[1])
        return hook

    handles = [router.register_forward_hook(record(i)) for i, router in enumerate(routers)]
    with torch.no_grad():
        model(torch.tensor([tokens]))
    for handle in handles:
        handle.remove()
    return counts


def test_placed_compile_generates_transformers_tokens_and_measures_the_load(
        checkpoint: Callable[[str], tuple[Any, Path]], compiled: Callable[..., Path], tmp_path: Path) -> None:
    """``--tp 2 --ep 2 --placement``: each rank holds its half of the experts plus a replica of the other half's
    most loaded one, in every layer (the hash-routed one too). The ranks generate transformers' tokens, and the run's
    ``--expert-load-out`` (read from the graph's expert loops, slots summed back to logical experts) equals
    transformers' routers on the tokens run, a load ``moeforge eplb`` plans from."""
    model, _ = checkpoint("every_layer")
    prompt = _prompt(3)
    expected = hf_greedy(model, prompt, STEPS)
    load = _hf_router_counts(model, prompt + expected[:-1])  # [L, E]: the tokens the run feeds
    experts, half = load.shape[1], load.shape[1] // 2
    rows = [[*range(half - 1, -1, -1), half + int(np.argmax(row[half:])),
             *range(experts - 1, half - 1, -1), int(np.argmax(row[:half]))] for row in load]
    counts = np.stack([np.bincount(row, minlength=experts) for row in rows])
    plan = write_plan(Placement("global", 2, 2, 1, 1, load, np.array(rows), counts), tmp_path / "plan.json")
    out = compiled("every_layer", tp=2, ep=2, placement=str(plan))
    assert read_sharded(out).placement is not None
    stats = tmp_path / "stats.json"
    assert _run_ranks(out, prompt, "--expert-load-out", str(stats)) == expected
    record = json.loads(stats.read_text())
    np.testing.assert_array_equal(np.array(record["layers"]), load)
    assert np.array(record["rank_load"]).sum() == load.sum()  # each choice computed by exactly one rank
    again = tmp_path / "again.json"
    assert main(["eplb", str(stats), "-o", str(again), "--ep", "2", "--redundant", "2"]) == 0
    load_plan(again).check(len(load), experts, 2, "every_layer")


def test_compile_refuses_a_block_size_that_splits_windows(checkpoint: Callable[[str], tuple[Any, Path]],
                                                          tmp_path: Path) -> None:
    _, folder = checkpoint("hca_first")  # HCA windows of 16 tokens
    options = CompileOptions.from_flags(model=str(folder), output_dir=tmp_path / "out", progress=False,
                                        kv_cache="paged", kv_block_size=8)
    with pytest.raises(MoeforgeError, match="multiple of 16"):
        compile_model(options)
    assert not (tmp_path / "out").exists()


def test_speculative_decoding_is_refused_not_wrong(compiled: Callable[..., Path]) -> None:
    out = compiled("every_layer")
    with pytest.raises(EngineConfigError, match="DeepSeek-V4"):
        LLMEngine.from_artifact(out, EngineConfig(speculative=SpeculativeOptions(tokens=3)))


@torch.no_grad()
def test_parity_against_pytorch_passes(compiled: Callable[..., Path], capsys: pytest.CaptureFixture[str]) -> None:
    out = compiled("every_layer", kv_cache="paged")
    assert main(["parity", str(out), "--json"]) == 0, capsys.readouterr().out


def test_parity_per_layer_compares_every_layers_streams(checkpoint: Callable[[str], tuple[Any, Path]],
                                                        compiled: Callable[..., Path],
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    # The contiguous step graph keeps each layer's mHC streams [T, N, H] as a named value: --per-layer compares them
    # with the PyTorch model's, layer by layer.
    model, _ = checkpoint("every_layer")
    out = compiled("every_layer")
    assert len(load_artifact(out).manifest.layer_outputs) == model.config.num_hidden_layers
    assert main(["parity", str(out), "--per-layer", "--json", "--quiet"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["layers"]) == model.config.num_hidden_layers and report["first_diverging_layer"] is None
    assert max(row["max_abs_err"] for row in report["layers"]) < 1e-4
