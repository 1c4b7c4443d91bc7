"""MoE families beyond DeepSeek, against transformers v5 (code nobody here wrote): Qwen3-MoE, GLM-4.5 MoE,
Mixtral, OLMoE (renormalised and not) and Kimi-K2 (a DeepSeek-V3 checkpoint whose config.json says kimi_k2).

Each case: a seeded tiny HF model (2 layers, hidden 64, 8 experts) saved with save_pretrained, loaded by
``load_model(folder)``; logits within 1e-4 (fp32) over a 64-token prompt and 16 cached decode steps (teacher-
forced on transformers' greedy tokens), greedy generation token-identical. Also: each family's router equals
the transformers router module it stands for, config translation and its errors, presets, ``moeforge config``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from moeforge.cli import main
from moeforge.core.config import ModelConfig
from moeforge.core.errors import CheckpointError, ConfigError
from moeforge.model.loader import load_model
from moeforge.model.model import CausalLM, init_random_weights
from moeforge.model.presets import PRESETS
from moeforge.model.routing import route_tokens
from moeforge.model.safetensors_loader import expected_keys
from moeforge.runtime.sampler import SamplingParams
from moeforge.verify.generate import generate

PROMPT_LEN, STEPS, VOCAB = 64, 16, 320
TINY = {"vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "max_position_embeddings": 512, "tie_word_embeddings": False}


def _qwen3_moe() -> Any:
    # decoder_sparse_step 2: layer 0 dense, layer 1 MoE; attention_bias exercises q/k/v/o biases.
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **TINY, intermediate_size=96, moe_intermediate_size=32, num_key_value_heads=2, head_dim=16, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=2, attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}))


def _qwen3_moe_mlp_only() -> Any:
    # mlp_only_layers [1]: layer 0 MoE, layer 1 dense; no renormalisation.
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **TINY, intermediate_size=96, moe_intermediate_size=32, num_key_value_heads=2, head_dim=16, num_experts=8,
        num_experts_per_tok=3, norm_topk_prob=False, mlp_only_layers=[1]))


def _glm4_moe() -> Any:
    # Partial rotary 0.5 (8 of 16 dims), per-head q/k norm, q/k/v bias, 2 groups of 4 with 1 kept, shared expert.
    return transformers.Glm4MoeForCausalLM(transformers.Glm4MoeConfig(
        **TINY, intermediate_size=96, moe_intermediate_size=32, num_key_value_heads=2, head_dim=16,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
        first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True, use_qk_norm=True,
        attention_bias=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                              "partial_rotary_factor": 0.5}))


def _mixtral() -> Any:
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **TINY, intermediate_size=48, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2))


def _olmoe() -> Any:
    return transformers.OlmoeForCausalLM(transformers.OlmoeConfig(
        **TINY, intermediate_size=48, num_key_value_heads=4, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=False, eos_token_id=None, pad_token_id=None))


def _olmoe_norm_clip() -> Any:
    # Renormalised top-k, GQA 4/2 (k_norm over Hkv*D) and q/k/v clipping that bites (|q| reaches ~3).
    return transformers.OlmoeForCausalLM(transformers.OlmoeConfig(
        **TINY, intermediate_size=48, num_key_value_heads=2, num_experts=8, num_experts_per_tok=3,
        norm_topk_prob=True, clip_qkv=1.5, attention_bias=True, eos_token_id=None, pad_token_id=None))


KIMI_YARN = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 32.0, "original_max_position_embeddings": 16,
             "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}


def _kimi_k2() -> Any:
    # Kimi-K2's keys at tiny sizes: one expert group, one dense layer, routed_scaling_factor 2.827, YaRN beta 1/1.
    return transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        **TINY, intermediate_size=96, moe_intermediate_size=32, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=8, routed_scaling_factor=2.827, kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=8,
        v_head_dim=16, qk_nope_head_dim=16, n_group=1, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1,
        norm_topk_prob=True, rope_parameters=KIMI_YARN))


# Kimi-K2-Instruct's config.json beyond DeepSeek-V3's keys: its own model_type and remote-code keys.
KIMI_CONFIG_KEYS = {"model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"], "num_nextn_predict_layers": 0,
                    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config"}, "moe_layer_freq": 1,
                    "topk_method": "noaux_tc", "scoring_func": "sigmoid", "seq_aux": True, "aux_loss_alpha": 0.001}

# case -> (builder, model_type our config must report)
CASES: dict[str, tuple[Callable[[], Any], str]] = {
    "qwen3_moe": (_qwen3_moe, "qwen3_moe"), "qwen3_moe_mlp_only": (_qwen3_moe_mlp_only, "qwen3_moe"),
    "glm4_moe": (_glm4_moe, "glm4_moe"), "mixtral": (_mixtral, "mixtral"), "olmoe": (_olmoe, "olmoe"),
    "olmoe_norm_clip": (_olmoe_norm_clip, "olmoe"), "kimi_k2": (_kimi_k2, "deepseek_v3"),
}


@torch.no_grad()
def randomise(model: torch.nn.Module, seed: int) -> None:
    """Weights with a real spread (HF's std 0.02 makes near-uniform logits that hide errors); positive correction
    biases (see tests/model/test_hf_parity.py)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        if p.dim() == 1:
            p.copy_((1.0 if "norm" in name else 0.0) + 0.1 * torch.randn(p.shape, generator=gen))
        else:
            p.copy_(torch.randn(p.shape, generator=gen) * (0.7 / p.shape[-1] ** 0.5))
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(torch.rand(b.shape, generator=gen) * 0.2)


def save_hf_model(case: str, folder: Path) -> Any:
    """Build the seeded tiny HF model of ``case``, save it to ``folder`` as its family ships; return it (eval)."""
    torch.manual_seed(0)
    model = CASES[case][0]()
    randomise(model, seed=1)
    model.eval()
    model.save_pretrained(folder)
    if case == "kimi_k2":
        path = folder / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **KIMI_CONFIG_KEYS}))
    return model


@pytest.fixture(scope="module", params=sorted(CASES))
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any, Path]:
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, save_hf_model(request.param, folder), folder


def _prompt(length: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(7))


@torch.no_grad()
def test_prefill_and_cached_decode_match_transformers(saved: tuple[str, Any, Path]) -> None:
    case, hf_model, folder = saved
    ids = _prompt(PROMPT_LEN)
    hf = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=STEPS, do_sample=False,
                           eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    hf_tokens = hf.sequences[0, PROMPT_LEN:].tolist()
    hf_prefill = hf_model(ids).logits[0]  # [P, V]
    hf_decode = torch.cat(hf.logits[1:])  # [STEPS - 1, V]: the logits after feeding generated tokens 0..14
    loaded = load_model(str(folder))
    assert loaded.config.model_type == CASES[case][1]
    model = loaded.model
    prefill, decode = cached_logits(model, ids, hf_tokens[:-1])
    assert hf_prefill.abs().max() > 0.5  # logits with a real spread
    torch.testing.assert_close(prefill, hf_prefill, atol=1e-4, rtol=0)
    torch.testing.assert_close(decode, hf_decode, atol=1e-4, rtol=0)
    ours = generate(model, ids[0].tolist(), SamplingParams(max_tokens=STEPS))
    assert ours.token_ids == hf_tokens
    assert len(set(hf_tokens)) > 2  # not a degenerate repeat that would hide a wrong step


@pytest.mark.parametrize("case", ["mixtral", "glm4_moe"])
@torch.no_grad()
def test_fused_expert_layout_loads(case: str, tmp_path: Path) -> None:
    # transformers v5's in-memory names (mlp.experts.gate_up_proj [E, 2I, H]; Mixtral's block_sparse_moe -> mlp).
    torch.manual_seed(0)
    hf_model = CASES[case][0]()
    randomise(hf_model, seed=1)
    hf_model.eval().save_pretrained(tmp_path, save_original_format=False)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert "model.layers.1.mlp.experts.gate_up_proj" in set(f.keys())
    ids = _prompt(20)
    ours = load_model(str(tmp_path)).model(ids, torch.arange(20)[None]).logits
    torch.testing.assert_close(ours, hf_model(ids).logits, atol=1e-4, rtol=0)


def test_mixtral_names_in_two_schemes_are_refused(tmp_path: Path) -> None:
    save_hf_model("mixtral", tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(str(path))
    tensors["model.layers.0.mlp.gate.weight"] = tensors["model.layers.0.block_sparse_moe.gate.weight"].clone()
    save_file(tensors, str(path))
    with pytest.raises(CheckpointError, match="same tensor"):
        load_model(str(tmp_path))


# ---------------------------------------------------------------------------------------- routers
def _hf_router(case: str) -> tuple[Any, Any]:
    """(our MoEConfig, transformers' router module of that family), same experts and settings."""
    torch.manual_seed(0)
    model = CASES[case][0]()
    router = next(m for n, m in model.named_modules() if n.endswith("mlp.gate") and hasattr(m, "top_k"))
    return ModelConfig.from_hf_dict(model.config.to_dict()).moe, router


@pytest.mark.parametrize("case", ["qwen3_moe", "qwen3_moe_mlp_only", "glm4_moe", "mixtral", "olmoe", "kimi_k2"])
@torch.no_grad()
def test_router_equals_the_transformers_router(case: str) -> None:
    # The same moeforge.MoERouter reference, configured per family, against each family's own router module.
    moe, router = _hf_router(case)
    gen = torch.Generator().manual_seed(3)
    router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
    bias = getattr(router, "e_score_correction_bias", None)
    if bias is not None:
        bias.copy_(torch.rand(bias.shape, generator=gen) * 0.2)
    x = torch.randn(200, router.weight.shape[1], generator=gen)
    _, hf_weights, hf_ids = router(x)
    ids, weights = route_tokens(torch.nn.functional.linear(x, router.weight), bias, moe)
    # Order within a token's k is free (the experts' outputs are summed): compare sorted by expert id.
    hf_order, our_order = hf_ids.sort(-1), ids.sort(-1)
    assert torch.equal(hf_order.values, our_order.values)
    torch.testing.assert_close(weights.gather(1, our_order.indices), hf_weights.gather(1, hf_order.indices),
                               atol=1e-6, rtol=1e-6)


# ---------------------------------------------------------------------------------------- configs
def _translated(case: str, **changes: Any) -> ModelConfig:
    torch.manual_seed(0)
    hf = CASES[case][0]().config.to_dict()
    return ModelConfig.from_hf_dict({**hf, **changes})


def test_config_translation_per_family() -> None:
    qwen = _translated("qwen3_moe")
    assert qwen.qk_norm == "head" and qwen.qkv_bias and qwen.o_proj_bias and qwen.moe is not None
    assert [qwen.is_moe_layer(i) for i in range(2)] == [False, True] and qwen.moe.scoring_func == "softmax"
    assert [_translated("qwen3_moe_mlp_only").is_moe_layer(i) for i in range(2)] == [True, False]
    four = _translated("qwen3_moe", num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3])
    assert [four.is_moe_layer(i) for i in range(4)] == [False, True, False, False]
    glm = _translated("glm4_moe")
    assert (glm.rope_dim, glm.head_dim, glm.qk_norm, glm.qkv_bias, glm.o_proj_bias) == (8, 16, "head", True, False)
    assert glm.moe is not None and glm.moe.has_correction_bias and glm.moe.group_scoring == "top2_sum"
    assert glm.moe.n_shared_experts == 1 and glm.moe.routed_scaling_factor == 2.5
    assert _translated("glm4_moe", use_qk_norm=False).qk_norm == "none"
    mixtral = _translated("mixtral")
    assert mixtral.moe is not None and mixtral.moe.norm_topk_prob and mixtral.moe.moe_intermediate_size == 48
    assert all(mixtral.is_moe_layer(i) for i in range(2)) and mixtral.qk_norm == "none"
    olmoe = _translated("olmoe_norm_clip")
    assert (olmoe.qk_norm, olmoe.clip_qkv, olmoe.o_proj_bias) == ("projection", 1.5, True)
    plain = _translated("olmoe").moe
    assert olmoe.moe is not None and olmoe.moe.norm_topk_prob and plain is not None and not plain.norm_topk_prob
    # Released checkpoints name the expert count their own way (transformers v5 writes num_local_experts).
    released = _translated("qwen3_moe", num_local_experts=None, num_experts=6, num_experts_per_tok=2).moe
    assert released is not None and released.n_routed_experts == 6
    glm_released = _translated("glm4_moe", n_routed_experts=None, num_local_experts=4, n_group=1).moe
    assert glm_released is not None and glm_released.n_routed_experts == 4
    assert ModelConfig.from_dict(qwen.to_dict()) == qwen  # manifests round-trip dense_layers (a JSON list)
    assert ModelConfig.from_dict(json.loads(json.dumps(glm.to_dict()))) == glm


def test_config_values_transformers_would_not_read_are_refused_or_warned(caplog) -> None:
    """Found by an audit: each was read silently as something else."""
    with pytest.raises(ConfigError, match=r"n_group must be >= 1 \(or absent for 1\), got 0"):
        _translated("glm4_moe", n_group=0)
    with pytest.raises(ConfigError, match=r"partial_rotary_factor 0\.01 rotates 0 of head_dim 16 dims"):
        _translated("glm4_moe", rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                 "partial_rotary_factor": 0.01})
    with caplog.at_level("WARNING", logger="moeforge.core.hf_config"):
        glm = _translated("glm4_moe", rope_theta=float("nan"), partial_rotary_factor=2.0)
        mixtral = _translated("mixtral", sliding_window=0)
    assert glm.rope.theta == 1e4 and glm.rope_dim == 8 and mixtral.sliding_window is None  # transformers' reading
    said = caplog.text
    assert "rope_theta=nan at the top level" in said and "partial_rotary_factor=2.0 at the top level" in said
    assert "sliding_window=0: read as no window" in said
    # Errors name the expert count as each family's config.json does.
    with pytest.raises(ConfigError, match=r"1\.\.num_local_experts \(2\)"):
        _translated("mixtral", num_local_experts=2, num_experts_per_tok=4)
    with pytest.raises(ConfigError, match=r"1\.\.num_experts \(2\)"):
        _translated("olmoe", num_experts=2, num_experts_per_tok=4)


def test_kimi_k2_config_reads_as_deepseek_v3() -> None:
    torch.manual_seed(0)
    hf = {**_kimi_k2().config.to_dict(), **KIMI_CONFIG_KEYS}
    config = ModelConfig.from_hf_dict(hf)
    assert config.model_type == "deepseek_v3" and config.mla is not None and config.moe is not None
    assert (config.moe.n_group, config.moe.topk_group, config.moe.routed_scaling_factor) == (1, 1, 2.827)
    assert config.rope.scaling == "yarn" and config.rope.beta_fast == config.rope.beta_slow == 1.0
    assert config.name == "kimi_k2"  # without a folder name or _name_or_path
    assert config == ModelConfig.from_hf_dict({**hf, "model_type": "deepseek_v3"}).replace(name=config.name)


@pytest.mark.parametrize(("case", "changes", "message"), [
    ("qwen3_moe", {"num_local_experts": 0}, "without routed experts"),
    ("qwen3_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step must be >= 1"),
    ("qwen3_moe", {"mlp_only_layers": [5]}, "mlp_only_layers names layer 5"),
    ("qwen3_moe", {"mlp_only_layers": "0"}, "mlp_only_layers must be a list"),
    ("glm4_moe", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.5}},
     "partial_rotary_factor must be in"),
    ("glm4_moe", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.3125}},
     "must be even"),
    ("mixtral", {"num_local_experts": None, "num_experts": None}, "missing the required field 'num_local_experts'"),
    ("olmoe", {"head_dim": 8}, "olmoe needs head_dim"),
    ("olmoe", {"clip_qkv": -1.0}, "clip_qkv must be a finite number > 0"),
    ("olmoe", {"num_experts_per_tok": 9}, "num_experts_per_tok"),
])
def test_bad_family_configs_are_refused(case: str, changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _translated(case, **changes)


def test_model_config_rejects_gqa_options_on_mla() -> None:
    config = PRESETS["tiny-kimi-k2"].config
    with pytest.raises(ConfigError, match="GQA attention only"):
        config.replace(qk_norm="head")
    with pytest.raises(ConfigError, match="needs its routed experts"):
        PRESETS["tiny-mixtral"].config.replace(moe=None)


# ---------------------------------------------------------------------------------------- presets, CLI
FAMILY_PRESETS = ["tiny-qwen3-moe", "tiny-glm4-moe", "tiny-mixtral", "tiny-olmoe", "tiny-kimi-k2"]


@pytest.mark.parametrize("name", FAMILY_PRESETS)
def test_tiny_presets_build_and_count_their_parameters(name: str) -> None:
    preset = PRESETS[name]
    assert preset.seed is not None
    model = CausalLM(preset.config)
    init_random_weights(model, preset.seed)
    state = model.state_dict()  # parameters and the correction-bias buffers (rotary tables are not persistent)
    assert preset.config.num_parameters() == sum(t.numel() for t in state.values())
    assert set(state) == set(expected_keys(preset.config))
    logits = model(torch.arange(8)[None], torch.arange(8)[None]).logits
    assert logits.shape == (1, 8, 512) and torch.isfinite(logits).all()


@pytest.mark.parametrize(("name", "low", "high"), [
    ("kimi-k2", 1.0e12, 1.05e12), ("qwen3-30b-a3b", 30e9, 31e9), ("glm-4.5-air", 106e9, 107.5e9),
    ("mixtral-8x7b", 46e9, 47.5e9), ("olmoe-1b-7b", 6.8e9, 7e9),
])
def test_real_shape_presets(name: str, low: float, high: float, capsys: pytest.CaptureFixture[str]) -> None:
    assert low < PRESETS[name].config.num_parameters() < high
    assert main(["config", name]) == 0
    out = capsys.readouterr().out
    assert name in out and "experts" in out


def test_moeforge_config_shows_an_hf_folder(saved_glm: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", str(saved_glm)]) == 0
    out = capsys.readouterr().out
    assert "glm4_moe" in out and "experts 8 routed + 1 shared, top-2, sigmoid noaux_tc (groups 1/2)" in out


@pytest.fixture(scope="module")
def saved_glm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("glm_cli")
    save_hf_model("glm4_moe", folder)
    return folder


def cached_logits(model: Any, ids: torch.Tensor, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Our model's prefill logits [P, V] for ``ids`` [1, P], then one cached decode step per token of ``tokens``:
    their logits stacked [len(tokens), V]."""
    prompt_len = ids.shape[1]
    out = model(ids, torch.arange(prompt_len)[None])
    past, decode = out.past_key_values, []
    for step, token in enumerate(tokens):
        step_out = model(torch.tensor([[token]]), torch.tensor([[prompt_len + step]]), past)
        past = step_out.past_key_values
        decode.append(step_out.logits[0, 0])
    return out.logits[0], torch.stack(decode)
