"""llama.cpp's ``deepseek2`` GGUFs (DeepSeek-V2, V2-Lite, V3, Kimi-K2) read as our DeepSeek models.

What llama.cpp's converter (convert_hf_to_gguf.py, DeepseekV2Model) changes, and how it is undone:
- MLA is written as MQA over the latent: ``head_count_kv`` 1, ``key_length`` = kv_lora_rank + rope dims and
  ``value_length`` = kv_lora_rank; the real head sizes are ``key_length_mla`` / ``value_length_mla``. Older files
  (before llama.cpp's MLA rewrite) state the real sizes in ``key_length`` / ``value_length`` instead.
- ``kv_b_proj`` [H * (nope + v), kv_lora] is split per head into ``attn_k_b`` [H, kv_lora, nope] (transposed) and
  ``attn_v_b`` [H, v, kv_lora]; older files keep ``attn_kv_b``. ``join_kv_b`` puts them back together.
- Routing: ``expert_gating_func`` 2 (sigmoid, with the correction bias ``exp_probs_b``) is DeepSeek-V3's
  ``noaux_tc``; 1 (softmax) is V2's, group-limited when ``expert_group_count`` > 1. ``expert_weights_norm`` and
  ``expert_weights_scale`` are ``norm_topk_prob`` and ``routed_scaling_factor``.
- YaRN: ``rope.scaling.yarn_log_multiplier`` is 0.1 * mscale_all_dim; released DeepSeek configs have mscale equal to
  mscale_all_dim, which is what is assumed. Rotary pairs stay adjacent (the converter does not permute DeepSeek).
Dense first layers (``leading_dense_block_count``) and shared experts (``ffn_*_shexp``) map one to one.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from moeforge.core.config import MLAConfig, ModelConfig, MoEConfig, RopeConfig
from moeforge.core.errors import ConfigError
from moeforge.model.gguf_metadata import ArchMetadata

# llama.cpp block tensor -> ours (HF DeepSeek names), beyond the Llama ones.
DEEPSEEK2_BLOCK_NAMES = {
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
}
SPLIT_KV_B = ("attn_k_b.weight", "attn_v_b.weight")  # joined into self_attn.kv_b_proj.weight
_SOFTMAX, _SIGMOID = 1, 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE


def join_kv_b(k_b: np.ndarray, v_b: np.ndarray) -> np.ndarray:
    """attn_k_b [H, kv_lora, nope] + attn_v_b [H, v, kv_lora] -> kv_b_proj [H * (nope + v), kv_lora]."""
    heads, latent = k_b.shape[0], k_b.shape[1]
    joined = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1)  # [H, nope + v, kv_lora]
    return np.ascontiguousarray(joined.reshape(-1, latent)) if heads else joined.reshape(0, latent)


def deepseek2_config(m: ArchMetadata, common: dict[str, Any], rope: RopeConfig,
                     tensor_names: set[str]) -> ModelConfig:
    """Our DeepSeek-V2 / V3 config from ``deepseek2`` metadata (``common``: the fields every architecture shares)."""
    rope_dim = m.need_int("rope.dimension_count", "qk_rope_head_dim")
    if m.has("attention.key_length_mla"):  # llama.cpp's MLA layout: MQA over the latent, real sizes in *_mla
        qk_head = m.need_int("attention.key_length_mla", "head_dim")
        v_head = m.need_int("attention.value_length_mla", "v_head_dim")
    else:
        qk_head = m.need_int("attention.key_length", "head_dim")
        v_head = m.need_int("attention.value_length", "v_head_dim")
    if qk_head <= rope_dim:
        raise ConfigError(f"the MLA key length ({qk_head}) must exceed rope.dimension_count ({rope_dim})",
                          field=m.key("attention.key_length_mla"))
    q_lora = m.get_int("attention.q_lora_rank", 0, None)
    mla = MLAConfig(q_lora_rank=q_lora or None, kv_lora_rank=m.need_int("attention.kv_lora_rank", "kv_lora_rank"),
                    qk_nope_head_dim=qk_head - rope_dim, qk_rope_head_dim=rope_dim, v_head_dim=v_head)

    gating = m.get_int("expert_gating_func", _SOFTMAX, None)
    if gating not in (_SOFTMAX, _SIGMOID):
        raise ConfigError(f"expert_gating_func {gating} is not softmax (1) or sigmoid (2)",
                          field=m.key("expert_gating_func"))
    v3 = gating == _SIGMOID
    moe = None
    experts = m.get_int("expert_count", 0, "n_routed_experts")
    if experts:
        groups = m.get_int("expert_group_count", 1, "n_group") or 1
        moe = MoEConfig(
            n_routed_experts=experts,
            n_shared_experts=m.get_int("expert_shared_count", 0, "n_shared_experts"),
            num_experts_per_tok=m.need_int("expert_used_count", "num_experts_per_tok"),
            moe_intermediate_size=m.need_int("expert_feed_forward_length", "moe_intermediate_size"),
            first_k_dense_replace=m.get_int("leading_dense_block_count", 0, "first_k_dense_replace"),
            scoring_func="sigmoid" if v3 else "softmax",
            topk_method="noaux_tc" if v3 else ("group_limited_greedy" if groups > 1 else "greedy"),
            n_group=groups,
            topk_group=m.get_int("expert_group_used_count", groups, "topk_group"),
            norm_topk_prob=m.get_bool("expert_weights_norm", False),
            routed_scaling_factor=m.get_float("expert_weights_scale", 1.0, positive=True) or 1.0,
        )
    rope = dataclasses.replace(rope, interleaved=True)
    log_mul = m.get_float("rope.scaling.yarn_log_multiplier", None)
    if rope.scaling == "yarn" and log_mul:
        rope = dataclasses.replace(rope, mscale=log_mul / 0.1, mscale_all_dim=log_mul / 0.1)
    return ModelConfig(
        **common,
        model_type="deepseek_v3" if v3 else "deepseek_v2",
        intermediate_size=m.need_int("feed_forward_length", "intermediate_size"),
        num_key_value_heads=common["num_attention_heads"],
        head_dim=rope_dim,
        qkv_bias=False,
        o_proj_bias=False,
        mla=mla,
        moe=moe,
        rope=rope,
    )
