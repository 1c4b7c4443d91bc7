"""Named model presets.

Tiny presets carry a seed: their weights are generated (reproducibly) and they run anywhere in
milliseconds, for tests and examples. Full-size presets have no weights: they describe real
shapes for planning memory (parameters, KV bytes per token) without downloading anything.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from moeforge.core.config import (
    CompressedAttentionConfig,
    DSAConfig,
    Family,
    HyperConnectionConfig,
    MLAConfig,
    ModelConfig,
    MoEConfig,
    RopeConfig,
)
from moeforge.core.errors import ConfigError

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


def _tiny_deepseek_v32() -> ModelConfig:
    """tiny-deepseek-v3 plus DSA: a 16-head indexer of 16 dims (its first 8 rotated) keeping the top 16 tokens.

    16 heads: a token whose ReLU scores are all 0 (an exact tie that top-k may break either way) is 2^-16 rare."""
    return _tiny_deepseek_v3().replace(model_type="deepseek_v32", name="tiny-deepseek-v3.2",
                                       dsa=DSAConfig(index_topk=16, index_head_dim=16, index_n_heads=16))


def _tiny_deepseek_v4() -> ModelConfig:
    """Every DeepSeek-V4 part at tiny sizes: sliding, CSA (entries of 4 tokens, the indexer's top 4) and HCA (entries of
    16) layers over an 8-token window, a hash-routed layer then routed ones, 4 hyper-connection streams."""
    return _tiny(
        "deepseek_v4", "tiny-deepseek-v4", intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, sliding_window=8, rope=RopeConfig(theta=10000.0, interleaved=True),
        compressed_attention=CompressedAttentionConfig(
            q_lora_rank=32, qk_rope_head_dim=8, o_groups=2, o_lora_rank=16,
            layer_types=("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                         "compressed_sparse_attention"),
            csa_rate=4, hca_rate=16,
            compress_rope=RopeConfig(theta=160000.0, scaling="yarn", factor=4.0, original_max_position_embeddings=256,
                                     attention_factor=1.0, interleaved=True),
            indexer=DSAConfig(index_topk=4, index_head_dim=16, index_n_heads=16)),
        hyper_connections=HyperConnectionConfig(hc_mult=4, sinkhorn_iters=20, eps=1e-6),
        moe=MoEConfig(n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32,
                      scoring_func="sqrtsoftplus", topk_method="noaux_tc", norm_topk_prob=True,
                      routed_scaling_factor=1.5, hash_layers=(0,), swiglu_limit=10.0),
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


def _tiny_kimi_k2() -> ModelConfig:
    """Kimi-K2's routing in miniature: tiny-deepseek-v3 (MLA + sigmoid noaux_tc) with one group, 2 layers (one dense),
    its own YaRN and scaling factor."""
    v3 = _tiny_deepseek_v3()
    assert v3.moe is not None
    return v3.replace(name="tiny-kimi-k2", num_hidden_layers=2, rope=_deepseek_yarn(8.0, 128, 1.0),
                      moe=dataclasses.replace(v3.moe, n_group=1, topk_group=1, routed_scaling_factor=2.827))


def _tiny_qwen3_moe() -> ModelConfig:
    return _tiny(
        "qwen3_moe", "tiny-qwen3-moe", intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rope=RopeConfig(theta=1e6), qk_norm="head",
        moe=MoEConfig(n_routed_experts=8, n_shared_experts=0, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=True, dense_layers=(0,)),
    )


def _tiny_glm4_moe() -> ModelConfig:
    return _tiny(
        "glm4_moe", "tiny-glm4-moe", intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rotary_dim=8, rope=RopeConfig(theta=1e6), qk_norm="head", qkv_bias=True,
        rms_norm_eps=1e-5,
        moe=MoEConfig(n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32,
                      first_k_dense_replace=1, scoring_func="sigmoid", topk_method="noaux_tc", n_group=2,
                      topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5),
    )


def _tiny_mixtral() -> ModelConfig:
    return _tiny(
        "mixtral", "tiny-mixtral", intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rope=RopeConfig(theta=1e6), rms_norm_eps=1e-5,
        moe=MoEConfig(n_routed_experts=8, n_shared_experts=0, num_experts_per_tok=2, moe_intermediate_size=48,
                      norm_topk_prob=True),
    )


def _tiny_olmoe() -> ModelConfig:
    return _tiny(
        "olmoe", "tiny-olmoe", intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, head_dim=16, rope=RopeConfig(theta=10000.0), rms_norm_eps=1e-5, qk_norm="projection",
        moe=MoEConfig(n_routed_experts=8, n_shared_experts=0, num_experts_per_tok=2, moe_intermediate_size=48,
                      norm_topk_prob=False),
    )


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


def _deepseek_v32() -> ModelConfig:
    """DeepSeek-V3.2(-Exp): V3's shapes plus the indexer (64 heads of 128, top 2048 tokens)."""
    return _deepseek_v3().replace(model_type="deepseek_v32", name="deepseek-v3.2",
                                  dsa=DSAConfig(index_topk=2048, index_head_dim=128, index_n_heads=64))


def _deepseek_v4(name: str, **fields: Any) -> ModelConfig:
    """A released DeepSeek-V4's shapes, read as its config.json would be (``ModelConfig.from_hf_dict``): transformers'
    DeepseekV4Config defaults are V4-Flash's; ``fields`` override them."""
    hf: dict[str, Any] = {"model_type": "deepseek_v4", "vocab_size": 129280, "max_position_embeddings": 1048576,
                          "bos_token_id": 0, "eos_token_id": 1, "rms_norm_eps": 1e-6, **fields}
    return ModelConfig.from_hf_dict(hf, name=name)


def _v4_layer_types(layers: int, first_hca: int) -> list[str]:
    """``first_hca`` HCA layers, then CSA and HCA alternating (the released V4s' pattern)."""
    rest = ["compressed_sparse_attention", "heavily_compressed_attention"]
    return ["heavily_compressed_attention"] * first_hca + [rest[i % 2] for i in range(layers - first_hca)]


def _deepseek_v4_flash() -> ModelConfig:
    # deepseek-ai/DeepSeek-V4-Flash (284 B, 13 B active): transformers' DeepseekV4Config defaults: 43 layers of 4096,
    # 64 heads of 512 over one KV head, 256 experts top-6, CSA every 4 tokens (top 512), HCA every 128.
    return _deepseek_v4("deepseek-v4-flash", hidden_size=4096, num_hidden_layers=43, num_attention_heads=64,
                        layer_types=_v4_layer_types(43, 3))


def _deepseek_v4_pro() -> ModelConfig:
    # deepseek-ai/DeepSeek-V4-Pro (1.6 T, 49 B active), as its model card describes it: 61 layers of 7168, 128 heads
    # of 512 (q_lora_rank 1536, 16 output groups of 1024), 384 experts top-6 of 3072, the indexer's top 1024.
    return _deepseek_v4("deepseek-v4-pro", hidden_size=7168, num_hidden_layers=61, num_attention_heads=128,
                        q_lora_rank=1536, o_groups=16, o_lora_rank=1024, n_routed_experts=384,
                        moe_intermediate_size=3072, index_topk=1024, layer_types=_v4_layer_types(61, 2))


def _kimi_k2() -> ModelConfig:
    # moonshotai/Kimi-K2-Instruct config.json (model_type kimi_k2, the DeepSeek-V3 architecture): 64 heads,
    # 384 experts in one group, 1 dense layer, YaRN x32 with beta 1/1 over rope_theta 50000.
    return ModelConfig(
        model_type="deepseek_v3", name="kimi-k2", vocab_size=163840, hidden_size=7168, intermediate_size=18432,
        num_hidden_layers=61, num_attention_heads=64, num_key_value_heads=64, head_dim=64,
        max_position_embeddings=131072, bos_token_id=163584, eos_token_ids=(163585,),
        rope=RopeConfig(theta=50000.0, scaling="yarn", factor=32.0, original_max_position_embeddings=4096,
                        beta_fast=1.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0, interleaved=True),
        mla=MLAConfig(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
        moe=MoEConfig(n_routed_experts=384, n_shared_experts=1, num_experts_per_tok=8, moe_intermediate_size=2048,
                      first_k_dense_replace=1, scoring_func="sigmoid", topk_method="noaux_tc", n_group=1,
                      topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.827),
    )


def _qwen3_30b_a3b() -> ModelConfig:
    return ModelConfig(
        model_type="qwen3_moe", name="qwen3-30b-a3b", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        max_position_embeddings=40960, bos_token_id=151643, eos_token_ids=(151645,), qk_norm="head",
        rope=RopeConfig(theta=1e6),
        moe=MoEConfig(n_routed_experts=128, n_shared_experts=0, num_experts_per_tok=8, moe_intermediate_size=768,
                      norm_topk_prob=True),
    )


def _glm45_air() -> ModelConfig:
    return ModelConfig(
        model_type="glm4_moe", name="glm-4.5-air", vocab_size=151552, hidden_size=4096, intermediate_size=10944,
        num_hidden_layers=46, num_attention_heads=96, num_key_value_heads=8, head_dim=128, rotary_dim=64,
        max_position_embeddings=131072, rms_norm_eps=1e-5, eos_token_ids=(151329, 151336, 151338), qkv_bias=True,
        rope=RopeConfig(theta=1e6),
        moe=MoEConfig(n_routed_experts=128, n_shared_experts=1, num_experts_per_tok=8, moe_intermediate_size=1408,
                      first_k_dense_replace=1, scoring_func="sigmoid", topk_method="noaux_tc",
                      norm_topk_prob=True, routed_scaling_factor=1.0),
    )


def _mixtral_8x7b() -> ModelConfig:
    return ModelConfig(
        model_type="mixtral", name="mixtral-8x7b", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=32768, rms_norm_eps=1e-5, bos_token_id=1, eos_token_ids=(2,),
        rope=RopeConfig(theta=1e6),
        moe=MoEConfig(n_routed_experts=8, n_shared_experts=0, num_experts_per_tok=2, moe_intermediate_size=14336,
                      norm_topk_prob=True),
    )


def _olmoe_1b_7b() -> ModelConfig:
    return ModelConfig(
        model_type="olmoe", name="olmoe-1b-7b", vocab_size=50304, hidden_size=2048, intermediate_size=1024,
        num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16, head_dim=128,
        max_position_embeddings=4096, rms_norm_eps=1e-5, eos_token_ids=(50279,), qk_norm="projection",
        rope=RopeConfig(theta=10000.0),
        moe=MoEConfig(n_routed_experts=64, n_shared_experts=0, num_experts_per_tok=8, moe_intermediate_size=1024,
                      norm_topk_prob=False),
    )


PRESETS: dict[str, Preset] = {
    "tiny-deepseek-v3": Preset(_tiny_deepseek_v3(), 3, "3 layers, MLA with q_lora, sigmoid noaux_tc routing"),
    "tiny-deepseek-v3.2": Preset(_tiny_deepseek_v32(), 9, "tiny-deepseek-v3 + DSA indexer (16 heads x 16, top-16)"),
    "tiny-deepseek-v2": Preset(_tiny_deepseek_v2(), 2, "3 layers, MLA without q_lora, softmax group-limited"),
    "tiny-deepseek-v4": Preset(_tiny_deepseek_v4(), 10, "4 layers: sliding, CSA, HCA, CSA; hash then routed MoE; mHC"),
    "tiny-llama": Preset(_tiny_llama(), 1, "2 layers, GQA 4/2 heads"),
    "tiny-kimi-k2": Preset(_tiny_kimi_k2(), 4, "2 layers, Kimi-K2 routing: MLA, sigmoid noaux_tc in one group"),
    "tiny-qwen3-moe": Preset(_tiny_qwen3_moe(), 5, "2 layers (layer 0 dense), per-head q/k norm, softmax top-2"),
    "tiny-glm4-moe": Preset(_tiny_glm4_moe(), 6, "2 layers, partial rotary, q/k norm, qkv bias, sigmoid groups"),
    "tiny-mixtral": Preset(_tiny_mixtral(), 7, "2 MoE layers, softmax top-2 renormalised"),
    "tiny-olmoe": Preset(_tiny_olmoe(), 8, "2 MoE layers, q/k norm over the projection, softmax top-2"),
    "deepseek-v2-lite": Preset(_deepseek_v2_lite(), None, "DeepSeek-V2-Lite 16B shapes, no weights"),
    "deepseek-v3": Preset(_deepseek_v3(), None, "DeepSeek-V3 671B shapes, no weights"),
    "deepseek-v3.2": Preset(_deepseek_v32(), None, "DeepSeek-V3.2 671B shapes (+ DSA indexer), no weights"),
    "deepseek-v4-flash": Preset(_deepseek_v4_flash(), None, "DeepSeek-V4-Flash 284B shapes (CSA/HCA, mHC), no weights"),
    "deepseek-v4-pro": Preset(_deepseek_v4_pro(), None, "DeepSeek-V4-Pro 1.6T shapes (CSA/HCA, mHC), no weights"),
    "kimi-k2": Preset(_kimi_k2(), None, "Kimi-K2 1T shapes (DeepSeek-V3 architecture), no weights"),
    "qwen3-30b-a3b": Preset(_qwen3_30b_a3b(), None, "Qwen3-30B-A3B shapes, no weights"),
    "glm-4.5-air": Preset(_glm45_air(), None, "GLM-4.5-Air 106B shapes, no weights"),
    "mixtral-8x7b": Preset(_mixtral_8x7b(), None, "Mixtral-8x7B shapes, no weights"),
    "olmoe-1b-7b": Preset(_olmoe_1b_7b(), None, "OLMoE-1B-7B shapes, no weights"),
}


def get_preset(name: str) -> Preset:
    """Look a preset up by name; an unknown name lists the known ones."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}", field="preset") from None
