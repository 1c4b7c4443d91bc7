"""Named model presets.

Tiny presets carry a seed: their weights are generated (reproducibly) and they run anywhere in
milliseconds, for tests and examples. Full-size presets have no weights: they describe real
shapes for planning memory (parameters, KV bytes per token) without downloading anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moeforge.errors import ConfigError
from moeforge.export.config import Family, MLAConfig, ModelConfig, MoEConfig, RopeConfig

# Byte-level tokenizer of the tiny presets: bytes are ids 0..255, then the special tokens.
TINY_BOS, TINY_EOS = 256, 257


@dataclass(frozen=True)
class Preset:
    """A named config; ``seed`` is set when the preset can generate its own weights."""

    config: ModelConfig
    seed: int | None
    description: str


def _deepseek_yarn(factor: float, original: int, mscale: float) -> RopeConfig:
    """DeepSeek's YaRN: interleaved rotary pairs, beta 32/1, one mscale for both terms."""
    return RopeConfig(theta=10000.0, scaling="yarn", factor=factor, original_max_position_embeddings=original,
                      mscale=mscale, mscale_all_dim=mscale, interleaved=True)


def _tiny(model_type: Family, name: str, **fields: Any) -> ModelConfig:
    """A tiny preset: 512-token byte-level vocabulary, hidden 64, 1024 positions; ``fields`` the rest."""
    return ModelConfig(model_type=model_type, name=name, vocab_size=512, hidden_size=64,
                       max_position_embeddings=1024, bos_token_id=TINY_BOS, eos_token_ids=(TINY_EOS,), **fields)


def _tiny_deepseek_v3() -> ModelConfig:
    return _tiny(
        "deepseek_v3", "tiny-deepseek-v3", intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, head_dim=8, rope=_deepseek_yarn(4.0, 256, 1.0),
        mla=MLAConfig(q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
        moe=MoEConfig(n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32,
                      first_k_dense_replace=1, scoring_func="sigmoid", topk_method="noaux_tc", n_group=4,
                      topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5),
    )


def _tiny_deepseek_v2() -> ModelConfig:
    return _tiny(
        "deepseek_v2", "tiny-deepseek-v2", intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, head_dim=8, rope=_deepseek_yarn(2.0, 512, 0.707),
        mla=MLAConfig(q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
        moe=MoEConfig(n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=3, moe_intermediate_size=32,
                      first_k_dense_replace=1, scoring_func="softmax", topk_method="group_limited_greedy",
                      n_group=4, topk_group=2, norm_topk_prob=False, routed_scaling_factor=1.0),
    )


def _tiny_llama() -> ModelConfig:
    return _tiny("llama", "tiny-llama", intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, rope=RopeConfig(theta=10000.0), rms_norm_eps=1e-5)


def _deepseek(model_type: Family, name: str, **fields: Any) -> ModelConfig:
    """A full-size DeepSeek shape (no weights): YaRN x40 over 4096 positions, head_dim 64 for the rope part."""
    return ModelConfig(model_type=model_type, name=name, head_dim=64, max_position_embeddings=163840, **fields)


def _deepseek_v2_lite() -> ModelConfig:
    return _deepseek(
        "deepseek_v2", "deepseek-v2-lite", vocab_size=102400, hidden_size=2048, intermediate_size=10944,
        num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, bos_token_id=100000,
        eos_token_ids=(100001,), rope=_deepseek_yarn(40.0, 4096, 0.707),
        mla=MLAConfig(q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
        moe=MoEConfig(n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, moe_intermediate_size=1408,
                      first_k_dense_replace=1, scoring_func="softmax", topk_method="greedy", n_group=1, topk_group=1,
                      norm_topk_prob=False, routed_scaling_factor=1.0),
    )


def _deepseek_v3() -> ModelConfig:
    return _deepseek(
        "deepseek_v3", "deepseek-v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
        num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, bos_token_id=0, eos_token_ids=(1,),
        rope=_deepseek_yarn(40.0, 4096, 1.0),
        mla=MLAConfig(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
        moe=MoEConfig(n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, moe_intermediate_size=2048,
                      first_k_dense_replace=3, scoring_func="sigmoid", topk_method="noaux_tc", n_group=8,
                      topk_group=4, norm_topk_prob=True, routed_scaling_factor=2.5),
    )


PRESETS: dict[str, Preset] = {
    "tiny-deepseek-v3": Preset(_tiny_deepseek_v3(), 3, "3 layers, MLA with q_lora, sigmoid noaux_tc routing"),
    "tiny-deepseek-v2": Preset(_tiny_deepseek_v2(), 2, "3 layers, MLA without q_lora, softmax group-limited"),
    "tiny-llama": Preset(_tiny_llama(), 1, "2 layers, GQA 4/2 heads"),
    "deepseek-v2-lite": Preset(_deepseek_v2_lite(), None, "DeepSeek-V2-Lite 16B shapes, no weights"),
    "deepseek-v3": Preset(_deepseek_v3(), None, "DeepSeek-V3 671B shapes, no weights"),
}


def get_preset(name: str) -> Preset:
    """Look a preset up by name; an unknown name lists the known ones."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}", field="preset") from None
