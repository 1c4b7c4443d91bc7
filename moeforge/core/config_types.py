"""The parts of a model configuration: the families moeforge builds, RoPE, MLA, DeepSeek Sparse Attention, MoE, and
DeepSeek-V4's compressed attention and hyper-connections.

Frozen dataclasses that ``ModelConfig`` (``moeforge.core.config``) holds; checked by ``ModelConfig.validate``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

Family = Literal["deepseek_v3", "deepseek_v32", "deepseek_v2", "deepseek_v4", "llama", "qwen2", "qwen3", "mistral",
                 "qwen3_moe", "glm4_moe", "mixtral", "olmoe"]
RopeScaling = Literal["default", "linear", "yarn", "llama3"]
# sqrtsoftplus: sqrt(softplus(logit)), DeepSeek-V4's router scores.
ScoringFunc = Literal["softmax", "sigmoid", "sqrtsoftplus"]
TopkMethod = Literal["greedy", "group_limited_greedy", "noaux_tc"]
QKNorm = Literal["none", "head", "projection"]
MLA_FAMILIES: tuple[str, ...] = ("deepseek_v3", "deepseek_v32", "deepseek_v2")
# MLA families whose attention is DeepSeek Sparse Attention (a lightning indexer picks top-k cached tokens).
DSA_FAMILIES: tuple[str, ...] = ("deepseek_v32",)
# GQA attention with routed experts in every MoE layer (a config without experts is refused: use the dense family).
MOE_GQA_FAMILIES: tuple[str, ...] = ("qwen3_moe", "glm4_moe", "mixtral", "olmoe")
DENSE_FAMILIES: tuple[str, ...] = ("llama", "qwen2", "qwen3", "mistral")
# DeepSeek-V4: hyper-connections, shared-KV attention over a sliding window plus compressed entries, MoE everywhere.
V4_FAMILIES: tuple[str, ...] = ("deepseek_v4",)
SUPPORTED_MODEL_TYPES: tuple[str, ...] = (*MLA_FAMILIES, *V4_FAMILIES, *DENSE_FAMILIES, *MOE_GQA_FAMILIES)
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
    # DeepSeek-V4: the MoE layers whose experts a frozen table picks per token id (mlp_layer_types "hash_moe":
    # mlp.gate.tid2eid [vocab, K]); the router's scores still weight them. Ascending.
    hash_layers: tuple[int, ...] = ()
    # DeepSeek-V4: the SwiGLU of every expert (routed and shared) clamps gate to <= limit and up to [-limit, limit].
    swiglu_limit: float | None = None

    @property
    def group_scoring(self) -> Literal["max", "top2_sum"]:
        """How a group of experts is scored for group-limited routing."""
        return "top2_sum" if self.topk_method == "noaux_tc" else "max"

    @property
    def has_correction_bias(self) -> bool:
        return self.topk_method == "noaux_tc"


V4LayerType = Literal["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
V4_LAYER_TYPES: tuple[V4LayerType, ...] = ("sliding_attention", "compressed_sparse_attention",
                                           "heavily_compressed_attention")


@dataclass(frozen=True)
class CompressedAttentionConfig:
    """DeepSeek-V4 attention (``moeforge/model/compressed_attention.py``): shared-KV multi-query attention over the
    last ``sliding_window`` tokens (``ModelConfig.sliding_window``) and, on compressed layers, over compressed entries.

    Every layer: q = q_b(norm(q_a(x))) per head, normalised without weight; one KV head of head_dim read as both K and
    V; RoPE on the trailing ``qk_rope_head_dim`` dims (interleaved pairs), undone on the output; a learned sink per
    head; the output projected per group of heads to ``o_lora_rank`` (``o_groups`` groups), then to hidden.
    ``layer_types[i]``: sliding_attention (the window only, RoPE ``ModelConfig.rope``), compressed_sparse_attention
    (CSA: one entry per ``csa_rate`` tokens, windows overlapping by one, and a lightning indexer (``indexer``) keeping
    its top ``index_topk`` entries per query) or heavily_compressed_attention (HCA: one entry per ``hca_rate`` tokens,
    all of them read); compressed layers use ``compress_rope`` (YaRN over ``compress_rope_theta``).
    """

    q_lora_rank: int
    qk_rope_head_dim: int
    o_groups: int
    o_lora_rank: int
    layer_types: tuple[V4LayerType, ...]
    csa_rate: int
    hca_rate: int
    compress_rope: RopeConfig
    indexer: DSAConfig

    def compress_rate(self, layer: int) -> int | None:
        """Tokens per compressed entry of layer ``layer``; None for a sliding-window layer."""
        kind = self.layer_types[layer]
        if kind == "compressed_sparse_attention":
            return self.csa_rate
        return self.hca_rate if kind == "heavily_compressed_attention" else None


@dataclass(frozen=True)
class HyperConnectionConfig:
    """Manifold-constrained hyper-connections (DeepSeek-V4, ``moeforge/model/hyper_connections.py``): the residual is
    ``hc_mult`` streams; each block reads a weighted sum of them and writes back through a doubly stochastic mixing
    matrix from ``sinkhorn_iters`` Sinkhorn-Knopp iterations (``eps`` keeps its sums away from 0)."""

    hc_mult: int
    sinkhorn_iters: int
    eps: float


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN magnitude correction: 0.1 * mscale * ln(factor) + 1 (1.0 when factor <= 1)."""
    if factor <= 1:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0
