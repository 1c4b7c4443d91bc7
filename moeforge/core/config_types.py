"""The parts of a model configuration: the families moeforge builds, RoPE, MLA, DeepSeek Sparse Attention and MoE.

Frozen dataclasses that ``ModelConfig`` (``moeforge.core.config``) holds; checked by ``ModelConfig.validate``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

Family = Literal["deepseek_v3", "deepseek_v32", "deepseek_v2", "llama", "qwen2", "qwen3", "mistral", "qwen3_moe",
                 "glm4_moe", "mixtral", "olmoe"]
RopeScaling = Literal["default", "linear", "yarn", "llama3"]
ScoringFunc = Literal["softmax", "sigmoid"]
TopkMethod = Literal["greedy", "group_limited_greedy", "noaux_tc"]
QKNorm = Literal["none", "head", "projection"]
MLA_FAMILIES: tuple[str, ...] = ("deepseek_v3", "deepseek_v32", "deepseek_v2")
# MLA families whose attention is DeepSeek Sparse Attention (a lightning indexer picks top-k cached tokens).
DSA_FAMILIES: tuple[str, ...] = ("deepseek_v32",)
# GQA attention with routed experts in every MoE layer (a config without experts is refused: use the dense family).
MOE_GQA_FAMILIES: tuple[str, ...] = ("qwen3_moe", "glm4_moe", "mixtral", "olmoe")
DENSE_FAMILIES: tuple[str, ...] = ("llama", "qwen2", "qwen3", "mistral")
SUPPORTED_MODEL_TYPES: tuple[str, ...] = (*MLA_FAMILIES, *DENSE_FAMILIES, *MOE_GQA_FAMILIES)
# config.json model_type values that name one of our families under another name. Kimi-K2 ships
# "kimi_k2" with the DeepSeek-V3 architecture and DeepSeek-V3's keys (transformers maps it the same way).
MODEL_TYPE_ALIASES: dict[str, Family] = {"kimi_k2": "deepseek_v3"}


@dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding.

    ``scaling`` is one of default | linear | yarn | llama3. ``interleaved`` says how rotary pairs
    are laid out in the checkpoint's weights: adjacent (x0, x1), (x2, x3) ... (DeepSeek) or halves
    (x_i, x_{i+d/2}) (HF Llama, "rotate_half").
    """

    theta: float = 10000.0
    scaling: RopeScaling = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    interleaved: bool = False
    # Per-frequency divisors of inv_freq [D/2] (llama.cpp's rope_freqs.weight: a GGUF of a Llama-3.x model carries
    # its llama3 scaling as these factors, not as parameters). With default or linear scaling only.
    frequency_factors: tuple[float, ...] | None = None


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention dimensions (DeepSeek-V2/V3)."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values cached per token per layer by absorbed MLA: c_kv plus the shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class DSAConfig:
    """DeepSeek Sparse Attention (V3.2): the lightning indexer's sizes and how many tokens MLA attends to."""

    index_topk: int
    index_head_dim: int
    index_n_heads: int


@dataclass(frozen=True)
class MoEConfig:
    """Routed (+ shared) SwiGLU experts with (group-limited) top-k routing: DeepSeekMoE, and the softmax
    top-k routers of Qwen3-MoE / Mixtral / OLMoE (greedy, one group, no shared experts)."""

    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    first_k_dense_replace: int = 0
    scoring_func: ScoringFunc = "softmax"
    topk_method: TopkMethod = "greedy"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    # Layers >= first_k_dense_replace that still use the dense MLP (Qwen3-MoE's mlp_only_layers and the layers
    # decoder_sparse_step skips; DeepSeek-V3.2's mlp_layer_types "dense"), ascending.
    dense_layers: tuple[int, ...] = ()

    @property
    def group_scoring(self) -> Literal["max", "top2_sum"]:
        """How a group of experts is scored for group-limited routing."""
        return "top2_sum" if self.topk_method == "noaux_tc" else "max"

    @property
    def has_correction_bias(self) -> bool:
        return self.topk_method == "noaux_tc"


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN magnitude correction: 0.1 * mscale * ln(factor) + 1 (1.0 when factor <= 1)."""
    if factor <= 1:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0
