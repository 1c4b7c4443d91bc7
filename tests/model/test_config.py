"""Config: presets, HF translation, validation errors that name the field."""

import dataclasses
import json

import pytest

from moeforge.core.config import MLAConfig, ModelConfig, MoEConfig
from moeforge.core.errors import ConfigError
from moeforge.model.presets import PRESETS, get_preset


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_round_trip_through_dict(name):
    config = get_preset(name).config
    assert ModelConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


def test_full_size_presets_have_real_shapes():
    v3 = get_preset("deepseek-v3").config
    # 671B total parameters (the MTP module excluded), absorbed cache 576 values per token per layer.
    assert 660e9 < v3.num_parameters() < 680e9
    assert v3.kv_cache_values_per_token("absorb") == 576
    lite = get_preset("deepseek-v2-lite").config
    assert 15e9 < lite.num_parameters() < 16.5e9
    # Naive MLA caches 16 heads x (192 + 128): ~9x the latent.
    assert lite.kv_cache_values_per_token("naive") / lite.kv_cache_values_per_token("absorb") > 8.5
    assert get_preset("deepseek-v2-lite").seed is None


def test_unknown_preset_lists_known_ones():
    with pytest.raises(ConfigError, match="tiny-deepseek-v3"):
        get_preset("tiny-gpt")


def _hf_v3() -> dict:
    return {
        "model_type": "deepseek_v3", "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
        "moe_intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 2, "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
        "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1, "q_lora_rank": 16, "kv_lora_rank": 16,
        "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8, "norm_topk_prob": True,
        "routed_scaling_factor": 2.5, "rope_theta": 10000.0,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                         "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1},
    }


def test_hf_deepseek_v3_translation():
    config = ModelConfig.from_hf_dict(_hf_v3())
    assert config.moe.topk_method == "noaux_tc" and config.moe.scoring_func == "sigmoid"
    assert config.moe.group_scoring == "top2_sum" and config.moe.has_correction_bias
    assert config.rope.scaling == "yarn" and config.rope.interleaved
    # Softmax scale: (8 + 4)^-0.5 * mscale(4, 1)^2.
    mscale = 0.1 * 1.0 * __import__("math").log(4.0) + 1.0
    assert config.softmax_scale == pytest.approx(12**-0.5 * mscale**2)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"model_type": "gpt2"}, "model_type"),
        ({"hidden_size": None}, "hidden_size"),
        ({"kv_lora_rank": None}, "kv_lora_rank"),
        ({"n_group": 3}, "n_group"),
        ({"topk_group": 5}, "topk_group"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ({"num_attention_heads": 3, "num_key_value_heads": 2}, "num_key_value_heads"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling.type"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"first_k_dense_replace": -1}, "first_k_dense_replace"),
    ],
)
def test_bad_hf_config_names_the_field(change, field):
    hf = {**_hf_v3(), **change}
    hf = {k: v for k, v in hf.items() if v is not None}
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_hf_dict(hf)
    assert info.value.field == field
    assert field.split(".")[0] in str(info.value)


def test_missing_config_json_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match=r"config\.json"):
        ModelConfig.from_hf_json(tmp_path / "config.json")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_hf_json(tmp_path / "config.json")


def test_dense_models_take_no_mla_or_moe():
    base = get_preset("tiny-llama").config
    mla = MLAConfig(q_lora_rank=None, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
    with pytest.raises(ConfigError, match="dense GQA"):
        dataclasses.replace(base, mla=mla)
    moe = MoEConfig(n_routed_experts=4, n_shared_experts=0, num_experts_per_tok=2, moe_intermediate_size=8)
    with pytest.raises(ConfigError, match="dense GQA"):
        dataclasses.replace(base, moe=moe)


def test_qwen2_always_has_qkv_bias_and_mistral_keeps_its_window():
    common = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2}
    qwen = ModelConfig.from_hf_dict({"model_type": "qwen2", **common})
    assert qwen.qkv_bias and not qwen.o_proj_bias and qwen.sliding_window is None
    mistral = ModelConfig.from_hf_dict({"model_type": "mistral", "sliding_window": 16, **common})
    assert mistral.sliding_window == 16 and not mistral.qkv_bias


QWEN_COMMON = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
               "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
@pytest.mark.parametrize(("fields", "window"), [
    ({}, None),
    ({"sliding_window": 16}, None),  # the window exists only with use_sliding_window
    ({"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 0}, 16),  # layers i >= 0: all
    ({"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 4}, None),  # none
    ({"use_sliding_window": True, "sliding_window": 16}, None),  # transformers' default max_window_layers 28
    ({"use_sliding_window": True, "sliding_window": 16, "layer_types": ["sliding_attention"] * 4}, 16),
    ({"use_sliding_window": False, "sliding_window": 16, "layer_types": ["sliding_attention"] * 4}, None),
])
def test_qwen_sliding_window_follows_transformers_layer_types(model_type, fields, window):
    config = ModelConfig.from_hf_dict({"model_type": model_type, **QWEN_COMMON, **fields})
    assert config.sliding_window == window


@pytest.mark.parametrize("fields", [
    {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 2},
    {"use_sliding_window": True, "sliding_window": 16, "layer_types": ["full_attention", "sliding_attention"] * 2},
])
def test_qwen_sliding_window_on_some_layers_is_refused_by_name(fields):
    with pytest.raises(ConfigError, match=r"some layers only \(layers [0-9]+\.\.3 of 4") as caught:
        ModelConfig.from_hf_dict({"model_type": "qwen2", **QWEN_COMMON, **fields})
    assert caught.value.field == "max_window_layers"
    with pytest.raises(ConfigError, match="layer_types must list"):
        ModelConfig.from_hf_dict({"model_type": "qwen2", **QWEN_COMMON, "use_sliding_window": True,
                                  "sliding_window": 16, "layer_types": ["sliding_attention"]})


def test_qwen3_dense_has_head_qk_norm_and_transformers_head_dim_default():
    config = ModelConfig.from_hf_dict({"model_type": "qwen3", **QWEN_COMMON})
    assert config.qk_norm == "head" and config.head_dim == 128 and not config.qkv_bias and config.moe is None
    biased = ModelConfig.from_hf_dict({"model_type": "qwen3", **QWEN_COMMON, "head_dim": 8, "attention_bias": True})
    assert biased.head_dim == 8 and biased.qkv_bias and biased.o_proj_bias


def test_deepseek_v2_norm_topk_prob_is_ignored_as_transformers_does(caplog):
    v2 = {"model_type": "deepseek_v2", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 16,
          "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8, "n_routed_experts": 4,
          "num_experts_per_tok": 2, "moe_intermediate_size": 16, "norm_topk_prob": True}
    with caplog.at_level("WARNING", logger="moeforge.core.hf_config"):
        config = ModelConfig.from_hf_dict(v2)
    assert config.moe is not None and config.moe.norm_topk_prob is False
    assert any("norm_topk_prob" in r.getMessage() and "ignores" in r.getMessage() for r in caplog.records)
    v3 = ModelConfig.from_hf_dict({**v2, "model_type": "deepseek_v3", "n_group": 1, "topk_group": 1})
    assert v3.moe is not None and v3.moe.norm_topk_prob is True


@pytest.mark.parametrize("kind", ["yarn", "llama3"])
def test_rope_pretraining_length_defaults_as_transformers(kind):
    """transformers' standardize_rope_params: a top-level original_max_position_embeddings (Phi-3 style) wins over
    the rope dict's; without either, the pretraining length is max_position_embeddings."""
    rope = {"rope_type": kind, "rope_theta": 10000.0, "factor": 4.0}
    base = {"model_type": "llama", **QWEN_COMMON, "max_position_embeddings": 256}
    assert ModelConfig.from_hf_dict({**base, "rope_parameters": rope}).rope.original_max_position_embeddings == 256
    inside = {**rope, "original_max_position_embeddings": 64}
    assert ModelConfig.from_hf_dict({**base, "rope_parameters": inside}).rope.original_max_position_embeddings == 64
    top = {**base, "rope_parameters": inside, "original_max_position_embeddings": 32}
    assert ModelConfig.from_hf_dict(top).rope.original_max_position_embeddings == 32
