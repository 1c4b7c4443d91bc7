"""DeepSeek-V3.2 sparse attention (DSA) against transformers' DeepseekV32ForCausalLM (eager, fp32).

Seeded tiny HF models saved with save_pretrained and read by ``load_model(folder)``: index_topk 8 < the 64-token
prompt (sparsity exercised) and index_topk 128 >= every context (dense); both MLA forms. Logits within 1e-4 over
the prompt and 16 cached decode steps (teacher-forced on transformers' greedy tokens), greedy tokens identical,
and every query's selected token set identical to transformers' (with a score margin at the top-k boundary, so
the agreement is not a tie broken the same way by chance).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from moeforge.core.config import ModelConfig
from moeforge.core.errors import ConfigError
from moeforge.model.dsa import Indexer
from moeforge.model.fp8 import dequantize_fp8_blockwise, quantize_fp8_blockwise
from moeforge.model.loader import load_model
from moeforge.model.presets import PRESETS
from moeforge.model.safetensors_loader import expected_keys
from moeforge.runtime.sampler import SamplingParams
from moeforge.verify.generate import generate
from tests.model.test_moe_families import KIMI_YARN, PROMPT_LEN, STEPS, TINY, VOCAB, cached_logits, randomise

# The smallest score gap at the top-k boundary we accept as a real (not tie-broken) selection.
MIN_MARGIN = 1e-5


def hf_v32(index_topk: int) -> Any:
    """A seeded tiny DeepseekV32ForCausalLM: 2 layers (1 dense), 8 experts in 2 groups, a 16-head indexer of 16 dims
    (16 heads: a token whose ReLU scores are all 0, an exact tie, is 2^-16 rare)."""
    torch.manual_seed(0)
    config = transformers.DeepseekV32Config(
        **TINY, intermediate_size=96, moe_intermediate_size=32, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=8,
        v_head_dim=16, qk_nope_head_dim=16, n_group=2, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1,
        norm_topk_prob=True, rope_parameters=KIMI_YARN, index_topk=index_topk, index_head_dim=16, index_n_heads=16,
        eos_token_id=None, pad_token_id=None)
    config._attn_implementation = "eager"
    model = transformers.DeepseekV32ForCausalLM(config)
    randomise(model, seed=1)
    return model.eval()


@pytest.fixture(scope="module", params=[8, 128], ids=["sparse-top8", "dense-top128"])
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, Any, Path]:
    folder = tmp_path_factory.mktemp(f"v32_top{request.param}")
    model = hf_v32(request.param)
    model.save_pretrained(folder)
    return request.param, model, folder


def _record(modules: list[torch.nn.Module]) -> tuple[list[Any], list[Any]]:
    """Forward hooks appending (module index, inputs, output) of each call; returns (records, handles)."""
    records: list[Any] = []

    def hook(index: int) -> Any:
        return lambda _m, args, out: records.append((index, args, out))

    return records, [m.register_forward_hook(hook(i)) for i, m in enumerate(modules)]


def _selected_sets(rows: torch.Tensor, allowed: torch.Tensor) -> list[set[int]]:
    """rows / allowed [1, S, K] -> per query the set of allowed selected tokens."""
    return [set(r[a].tolist()) for r, a in zip(rows[0], allowed[0], strict=True)]


def _boundary_margin(indexer: Indexer, args: tuple[Any, ...]) -> float:
    """Smallest gap between the K-th and (K+1)-th allowed index score over the queries of one indexer call."""
    x, q_resid, cos, sin, keys, positions = args
    b, s, _ = x.shape
    q = indexer._rotate(indexer.wq_b(q_resid).view(b, s, indexer.n_heads, indexer.head_dim), cos, sin)
    scores = torch.relu(torch.einsum("bshd,btd->bsht", q, keys)) * indexer.scale
    index = torch.einsum("bsh,bsht->bst", indexer.weights_proj(x) * indexer.n_heads**-0.5, scores)[0]  # [S, L]
    margin = float("inf")
    for query, pos in zip(index, positions[0].tolist(), strict=True):
        allowed = query[: pos + 1]
        if allowed.numel() > indexer.topk:
            top = allowed.topk(indexer.topk + 1).values
            margin = min(margin, float(top[-2] - top[-1]))
    return margin


@pytest.mark.parametrize("impl", ["absorb", "naive"])
@torch.no_grad()
def test_v32_matches_transformers(saved: tuple[int, Any, Path], impl: str) -> None:
    topk, hf_model, folder = saved
    ids = torch.randint(0, VOCAB, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(7))
    hf_records, handles = _record([layer.self_attn.indexer for layer in hf_model.model.layers])
    hf = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=STEPS, do_sample=False,
                           eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    for h in handles:
        h.remove()
    hf_tokens = hf.sequences[0, PROMPT_LEN:].tolist()
    hf_prefill = hf_model(ids).logits[0]  # [P, V]
    hf_decode = torch.cat(hf.logits[1:])  # [STEPS - 1, V]

    loaded = load_model(str(folder), mla_impl=impl)
    assert loaded.config.model_type == "deepseek_v32" and loaded.config.dsa is not None
    model = loaded.model
    indexers = [layer.self_attn.indexer for layer in model.model.layers]
    records, handles = _record(indexers)
    prefill, decode = cached_logits(model, ids, hf_tokens[:-1])
    for h in handles:
        h.remove()

    # The same tokens selected for every query of every layer, prefill and decode, with a real score margin.
    assert len(records) == len(hf_records) == 2 * STEPS
    margin = float("inf")
    for (layer, args, (rows, allowed)), (hf_layer, _, hf_rows) in zip(records, hf_records, strict=True):
        assert layer == hf_layer
        positions = args[5][0]
        hf_sets = [{t for t in r.tolist() if t <= p} for r, p in zip(hf_rows[0], positions.tolist(), strict=True)]
        assert _selected_sets(rows, allowed) == hf_sets
        margin = min(margin, _boundary_margin(indexers[layer], args))
    if topk < PROMPT_LEN:
        assert margin > MIN_MARGIN, f"near-tie at the top-k boundary ({margin:.2e}): pick another seed"
        assert allowed.sum() == topk  # the last decode step really attends to only top-k of 79 tokens
    else:
        assert margin == float("inf")  # never more tokens than top-k: dense

    assert hf_prefill.abs().max() > 0.5
    torch.testing.assert_close(prefill, hf_prefill, atol=1e-4, rtol=0)
    torch.testing.assert_close(decode, hf_decode, atol=1e-4, rtol=0)
    assert generate(model, ids[0].tolist(), SamplingParams(max_tokens=STEPS)).token_ids == hf_tokens
    assert len(set(hf_tokens)) > 2


def test_v32_checkpoint_names_are_transformers_names(saved: tuple[int, Any, Path]) -> None:
    # transformers writes model.layers.N.self_attn.indexer.{wq_b,wk,weights_proj}.weight, k_norm.{weight,bias}
    _, _, folder = saved
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        written = set(f.keys())
    assert "model.layers.1.self_attn.indexer.k_norm.bias" in written
    ours = set(expected_keys(load_model(str(folder)).config))
    assert {k for k in ours if ".self_attn." in k} == {k for k in written if ".self_attn." in k}


def test_v32_fp8_indexer_weights_are_dequantised(saved: tuple[int, Any, Path], tmp_path: Path) -> None:
    # As released: the indexer's wq_b and wk in FP8 e4m3 blocks with weight_scale_inv, weights_proj unquantised.
    _, _, folder = saved
    tensors = load_file(str(folder / "model.safetensors"))
    fp8 = [k for k in tensors if k.endswith(("indexer.wq_b.weight", "indexer.wk.weight"))]
    for key in fp8:
        tensors[key], tensors[key + "_scale_inv"] = quantize_fp8_blockwise(tensors[key])
    for name in ("config.json", "generation_config.json"):
        if (folder / name).exists():
            shutil.copy(folder / name, tmp_path / name)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    loaded = dict(load_model(str(tmp_path)).model.named_parameters())
    assert len(fp8) == 4
    for key in fp8:
        torch.testing.assert_close(loaded[key], dequantize_fp8_blockwise(tensors[key], tensors[key + "_scale_inv"]),
                                   atol=0, rtol=0)
    assert loaded["model.layers.0.self_attn.indexer.weights_proj.weight"].dtype == torch.float32


def _hf_dict() -> dict[str, Any]:
    return hf_v32(8).config.to_dict()


@pytest.mark.parametrize(("change", "match"), [
    ({"index_topk": None}, "missing the required field 'index_topk'"),
    ({"index_head_dim": 0}, "index_head_dim must be in"),
    ({"index_n_heads": 1.5}, "index_n_heads must be an integer"),
    ({"index_head_dim": 4}, "qk_rope_head_dim .8. exceeds index_head_dim .4."),
    ({"q_lora_rank": None}, "q_lora_rank must be set"),
])
def test_v32_config_errors(change: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_hf_dict({**_hf_dict(), **change})


def test_v32_presets() -> None:
    real, tiny, v3 = (PRESETS[n].config for n in ("deepseek-v3.2", "tiny-deepseek-v3.2", "deepseek-v3"))
    assert real.dsa is not None and (real.dsa.index_topk, real.dsa.index_head_dim, real.dsa.index_n_heads) == (
        2048, 128, 64)
    assert real.replace(model_type="deepseek_v3", dsa=None) == v3.replace(name="deepseek-v3.2")
    # cache per token per layer: V3's latent (512 + 64) plus the indexer's 128 keys
    assert real.kv_cache_values_per_token() == 576 + 128
    assert tiny.dsa is not None and tiny.mla is not None and tiny.mla.qk_rope_head_dim <= tiny.dsa.index_head_dim
    model = load_model("tiny-deepseek-v3.2").model
    n = sum(p.numel() for p in model.parameters()) + sum(
        b.numel() for name, b in model.named_buffers() if name.endswith("e_score_correction_bias"))
    assert tiny.num_parameters() == n
