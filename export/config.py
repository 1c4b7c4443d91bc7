"""One typed model configuration for DeepSeek-V2/V3/V3.2 and Kimi-K2 (MLA + MoE), Qwen3-MoE, GLM-4.5 MoE, Mixtral and
OLMoE (GQA + MoE), and Llama/Qwen2/Mistral (GQA).

Built from a Hugging Face ``config.json`` (``ModelConfig.from_hf_dict``), from GGUF metadata
(``moeforge.export.gguf_loader``) or from a named preset (``moeforge.export.presets``). Every
consumer (model, exporter, artifact manifest) reads this object; nothing is configured elsewhere.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast, overload

from moeforge.errors import ConfigError

log = logging.getLogger(__name__)

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
# What transformers v5 assumes when config.json leaves a field out (configuration_<family>.py's class defaults, and
# default_theta = 1e6 for Mixtral, 1e4 for the rest): moeforge reads a missing key the same way, so both build
# the same model. Families not listed for a key use its "*" entry; the DeepSeekMoE keys are read for DeepSeek only.
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "rms_norm_eps": {"*": 1e-6, "mixtral": 1e-5, "olmoe": 1e-5, "glm4_moe": 1e-5},
    "rope_theta": {"*": 10000.0, "mixtral": 1e6},
    "max_position_embeddings": {"*": 4096, "llama": 2048, "deepseek_v2": 2048, "qwen2": 32768, "qwen3": 32768,
                                "qwen3_moe": 32768, "mistral": 131072, "mixtral": 131072, "glm4_moe": 131072,
                                "deepseek_v32": 163840},
    # None: num_attention_heads
    "num_key_value_heads": {"*": None, "qwen2": 32, "qwen3": 32, "mistral": 8, "mixtral": 8, "qwen3_moe": 4,
                            "glm4_moe": 8},
    # DeepSeekMoE only (GLM-4.5 reads its own defaults in _moe_gqa_fields): V2's and V3's (and V3.2's) differ
    "n_shared_experts": {"*": 1, "deepseek_v2": 2},
    "first_k_dense_replace": {"*": 3, "deepseek_v2": 0},
    "n_group": {"*": 8, "deepseek_v2": 1},
    "topk_group": {"*": 4, "deepseek_v2": 1},
    "routed_scaling_factor": {"*": 2.5, "deepseek_v2": 1.0},
}


def hf_default(key: str, model_type: str) -> Any:
    """transformers' value for ``key`` when a ``model_type`` config.json leaves it out (``HF_DEFAULTS``)."""
    table = HF_DEFAULTS[key]
    return table.get(model_type, table["*"])


# Inclusive bounds for every size in a config. They sit far above any released model (DeepSeek-V3: 61 layers,
# hidden 7168, 128 heads, 256 experts, vocab 129280, 163840 positions) yet low enough that no loop or
# allocation scaled by one of them can hang or exhaust memory before the weights are read (a crafted
# num_hidden_layers of 10^9 would). Integers only: JSON true or 64.5 is refused, never rounded.
SIZE_LIMITS: dict[str, tuple[int, int]] = {
    "vocab_size": (1, 2**22), "hidden_size": (1, 2**17), "intermediate_size": (1, 2**20),
    "num_hidden_layers": (1, 1024), "num_attention_heads": (1, 2**12), "num_key_value_heads": (1, 2**12),
    "head_dim": (1, 2**12), "max_position_embeddings": (1, 2**24), "original_max_position_embeddings": (1, 2**24),
    "sliding_window": (1, 2**24),
    # MLA
    "q_lora_rank": (1, 2**16), "kv_lora_rank": (1, 2**16), "qk_nope_head_dim": (1, 2**12),
    "qk_rope_head_dim": (1, 2**12), "v_head_dim": (1, 2**12),
    # MoE
    "n_routed_experts": (1, 2**14), "n_shared_experts": (0, 2**14), "num_experts_per_tok": (1, 2**14),
    "moe_intermediate_size": (1, 2**20), "first_k_dense_replace": (0, 1024), "n_group": (1, 2**14),
    "topk_group": (1, 2**14),
    # DSA (DeepSeek-V3.2)
    "index_topk": (1, 2**24), "index_head_dim": (1, 2**12), "index_n_heads": (1, 2**12),
    "token_id": (0, 2**31 - 1),
}


def _show(value: object, limit: int = 60) -> str:
    """A short repr for error messages (a crafted value may be huge, or an int too long to print)."""
    try:
        text = repr(value)
    except ValueError:  # int beyond sys.get_int_max_str_digits()
        return f"a {type(value).__name__} too large to print"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_int(value: object, field: str, limits: str | None = None) -> int:
    """``value`` as an int, within ``SIZE_LIMITS[limits]`` when given; else ConfigError naming ``field``."""
    # bool is an int subclass: JSON ``true`` must not pass as 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(
            f"{field} must be an integer, got {_show(value)} ({type(value).__name__}); fix it in the model's config",
            field=field,
        )
    if limits is not None:
        lo, hi = SIZE_LIMITS[limits]
        if not lo <= value <= hi:
            raise ConfigError(
                f"{field} must be in {lo}..{hi}, got {_show(value)}; fix it in the model's config", field=field
            )
    return int(value)


def check_float(value: object, field: str, positive: bool = False) -> float:
    """``value`` as a finite float (> 0 when ``positive``); else ConfigError naming ``field``."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(
            f"{field} must be a number, got {_show(value)} ({type(value).__name__}); fix it in the model's config",
            field=field,
        )
    try:
        number = float(value)
    except OverflowError:  # an int beyond float range
        number = math.inf
    if not math.isfinite(number) or (positive and number <= 0):
        raise ConfigError(
            f"{field} must be a finite number{' > 0' if positive else ''}, got {_show(value)}; "
            "fix it in the model's config",
            field=field,
        )
    return number


def check_bool(value: object, field: str) -> bool:
    """``value`` if it is a bool; else ConfigError (the string "false" must not read as True)."""
    if not isinstance(value, bool):
        raise ConfigError(f"{field} must be true or false, got {_show(value)}", field=field)
    return value


# Integer sizes of ModelConfig itself, each checked against SIZE_LIMITS under its own name.
_SIZE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings")


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


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of one decoder-only model. Frozen: a config is a value, not a switchboard."""

    model_type: Family
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_proj_bias: bool = False
    sliding_window: int | None = None
    # GQA only. q/k RMSNorm before RoPE: "head" over each head's D dims (Qwen3, GLM use_qk_norm), "projection"
    # over the whole q [Hq*D] / k [Hkv*D] projection (OLMoE).
    qk_norm: QKNorm = "none"
    # GQA only: dims of each head RoPE rotates (the first ones, rotate_half within them); None = head_dim.
    # GLM: head_dim * partial_rotary_factor.
    rotary_dim: int | None = None
    # GQA only: q, k, v clamped to [-clip_qkv, clip_qkv] after the projections and q/k norms (OLMoE).
    clip_qkv: float | None = None
    rope: RopeConfig = field(default_factory=RopeConfig)
    mla: MLAConfig | None = None
    moe: MoEConfig | None = None
    # DeepSeek-V3.2 only: the indexer of DeepSeek Sparse Attention.
    dsa: DSAConfig | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ derived facts
    @property
    def attention_kind(self) -> Literal["mla", "gqa"]:
        return "mla" if self.mla is not None else "gqa"

    @property
    def rope_dim(self) -> int:
        """Number of dimensions each rotary embedding rotates."""
        if self.mla is not None:
            return self.mla.qk_rope_head_dim
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (self.moe is not None and layer_idx >= self.moe.first_k_dense_replace
                and layer_idx not in self.moe.dense_layers)

    @property
    def softmax_scale(self) -> float:
        """Attention scale; MLA multiplies by mscale(factor, mscale_all_dim)^2 under any rope scaling that sets
        mscale_all_dim (DeepSeek semantics: transformers' yarn_apply_mscale checks rope_type != "default")."""
        if self.mla is None:
            return float(self.head_dim**-0.5)
        scale = float(self.mla.qk_head_dim**-0.5)
        rope = self.rope
        if rope.scaling != "default" and rope.mscale_all_dim:
            m = yarn_mscale(rope.factor, rope.mscale_all_dim)
            scale = scale * m * m
        return scale

    def kv_cache_values_per_token(self, mla_impl: Literal["absorb", "naive"] = "absorb") -> int:
        """Cached scalars per token per layer (keys + values, or the MLA latent)."""
        if self.mla is not None:
            indexer = self.dsa.index_head_dim if self.dsa is not None else 0  # the indexer's key cache
            if mla_impl == "absorb":
                return self.mla.latent_dim + indexer
            return self.num_attention_heads * (self.mla.qk_head_dim + self.mla.v_head_dim) + indexer
        return 2 * self.num_key_value_heads * self.head_dim

    def num_parameters(self) -> int:
        """Parameter count computed from shapes alone (for planning memory without weights)."""
        h, layers = self.hidden_size, self.num_hidden_layers
        total = self.vocab_size * h * (1 if self.tie_word_embeddings else 2) + h
        for i in range(layers):
            total += 2 * h  # the two norms
            if self.mla is not None:
                m, n = self.mla, self.num_attention_heads
                if m.q_lora_rank is None:
                    total += h * n * m.qk_head_dim
                else:
                    total += h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * n * m.qk_head_dim
                total += h * m.latent_dim + m.kv_lora_rank
                total += m.kv_lora_rank * n * (m.qk_nope_head_dim + m.v_head_dim)
                total += n * m.v_head_dim * h
                if self.dsa is not None:  # indexer: wq_b, wk, k_norm (weight + bias), weights_proj
                    d = self.dsa
                    total += (m.q_lora_rank or 0) * d.index_n_heads * d.index_head_dim
                    total += h * d.index_head_dim + 2 * d.index_head_dim + h * d.index_n_heads
            else:
                q = self.num_attention_heads * self.head_dim
                kv = self.num_key_value_heads * self.head_dim
                total += h * (q + 2 * kv) + q * h
                if self.qkv_bias:
                    total += q + 2 * kv
                if self.o_proj_bias:
                    total += h
                if self.qk_norm != "none":
                    total += 2 * self.head_dim if self.qk_norm == "head" else q + kv
            if self.is_moe_layer(i):
                moe = self.moe
                assert moe is not None
                experts = moe.n_routed_experts + moe.n_shared_experts
                total += 3 * h * moe.moe_intermediate_size * experts + moe.n_routed_experts * h
                if moe.has_correction_bias:
                    total += moe.n_routed_experts
            else:
                total += 3 * h * self.intermediate_size
        return total

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Reject an inconsistent config with an error naming the offending field.

        Types and ``SIZE_LIMITS`` are checked first, so nothing below (nor any consumer) does arithmetic on
        a string, a NaN or a size that would hang a loop.
        """
        if not isinstance(self.model_type, str) or self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"model_type {_show(self.model_type)} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}",
                field="model_type",
            )
        for name in _SIZE_FIELDS:
            check_int(getattr(self, name), name, name)
        if self.sliding_window is not None:
            check_int(self.sliding_window, "sliding_window", "sliding_window")
        check_float(self.rms_norm_eps, "rms_norm_eps", positive=True)
        for name in ("tie_word_embeddings", "qkv_bias", "o_proj_bias"):
            check_bool(getattr(self, name), name)
        if self.bos_token_id is not None:
            check_int(self.bos_token_id, "bos_token_id", "token_id")
        if not isinstance(self.eos_token_ids, tuple):
            raise ConfigError(f"eos_token_ids must be a tuple of ints, got {_show(self.eos_token_ids)}",
                              field="eos_token_id")
        for token in self.eos_token_ids:
            check_int(token, "eos_token_id", "token_id")
        if not isinstance(self.name, str):
            raise ConfigError(f"name must be a string, got {_show(self.name)}", field="name")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})",
                field="num_key_value_heads",
            )
        if self.model_type in MLA_FAMILIES:
            if self.mla is None:
                raise ConfigError(f"{self.model_type} needs MLA dimensions (kv_lora_rank, ...)", field="kv_lora_rank")
        elif self.model_type in MOE_GQA_FAMILIES:
            if self.mla is not None:
                raise ConfigError(f"{self.model_type} is a GQA MoE model; it takes no MLA fields", field="model_type")
            if self.moe is None:
                raise ConfigError(f"{self.model_type} needs its routed experts (num_experts / n_routed_experts >= 1)",
                                  field="num_experts")
        elif self.mla is not None or self.moe is not None:
            raise ConfigError(f"{self.model_type} is a dense GQA model; it takes no MLA/MoE fields", field="model_type")
        self._validate_gqa_options()
        self._validate_dsa()
        if self.mla is not None:
            if not isinstance(self.mla, MLAConfig):
                raise ConfigError(f"mla must be an MLAConfig, got {_show(self.mla)}", field="mla")
            for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                check_int(getattr(self.mla, name), name, name)
            if self.mla.q_lora_rank is not None:
                check_int(self.mla.q_lora_rank, "q_lora_rank", "q_lora_rank")
        if self.rope_dim % 2:
            raise ConfigError(f"the rotary dimension ({self.rope_dim}) must be even", field="head_dim")
        self._validate_rope(self.rope)
        factors = self.rope.frequency_factors
        if factors is not None and len(factors) != self.rope_dim // 2:
            raise ConfigError(f"rope frequency factors: {len(factors)} given, the rotary dimension {self.rope_dim} "
                              f"has {self.rope_dim // 2} frequencies", field="rope_freqs")
        if self.moe is not None:
            if not isinstance(self.moe, MoEConfig):
                raise ConfigError(f"moe must be a MoEConfig, got {_show(self.moe)}", field="moe")
            self._validate_moe(self.moe)

    def _validate_gqa_options(self) -> None:
        """q/k norm, partial rotary and q/k/v clipping: GQA options, each checked for type and range."""
        if not isinstance(self.qk_norm, str) or self.qk_norm not in ("none", "head", "projection"):
            raise ConfigError(f"qk_norm {_show(self.qk_norm)} is not one of none, head, projection", field="qk_norm")
        if self.rotary_dim is not None:
            check_int(self.rotary_dim, "rotary_dim", "head_dim")
            if self.rotary_dim > self.head_dim:
                raise ConfigError(f"the rotary dimension ({self.rotary_dim}) exceeds head_dim ({self.head_dim}); "
                                  "partial_rotary_factor must be <= 1", field="partial_rotary_factor")
        if self.clip_qkv is not None:
            check_float(self.clip_qkv, "clip_qkv", positive=True)
        gqa_only = self.qk_norm != "none" or self.rotary_dim is not None or self.clip_qkv is not None
        if self.mla is not None and gqa_only:
            raise ConfigError(f"{self.model_type}: qk_norm, partial rotary and clip_qkv apply to GQA attention only",
                              field="qk_norm")

    def _validate_dsa(self) -> None:
        """DSA fields: present exactly for deepseek_v32, sizes bounded, the indexer's RoPE fits its head."""
        if self.model_type not in DSA_FAMILIES:
            if self.dsa is not None:
                raise ConfigError(f"{self.model_type} has no sparse attention; index_topk / index_head_dim / "
                                  "index_n_heads belong to deepseek_v32", field="index_topk")
            return
        if not isinstance(self.dsa, DSAConfig):
            raise ConfigError(f"{self.model_type} needs its indexer sizes (index_topk, index_head_dim, "
                              f"index_n_heads), got {_show(self.dsa)}", field="index_topk")
        for name in ("index_topk", "index_head_dim", "index_n_heads"):
            check_int(getattr(self.dsa, name), name, name)
        if self.mla is None or self.mla.q_lora_rank is None:
            raise ConfigError(f"{self.model_type}: the indexer's query reads the q-LoRA residual, so q_lora_rank "
                              "must be set", field="q_lora_rank")
        if self.mla.qk_rope_head_dim > self.dsa.index_head_dim:
            raise ConfigError(f"qk_rope_head_dim ({self.mla.qk_rope_head_dim}) exceeds index_head_dim "
                              f"({self.dsa.index_head_dim}): the indexer rotates its first qk_rope_head_dim dims; "
                              "raise index_head_dim", field="index_head_dim")
        if not self.rope.interleaved:
            raise ConfigError(f"{self.model_type}: MLA's RoPE is interleaved in DeepSeek-V3.2 weights; "
                              "rope_interleave must not be false", field="rope_interleave")

    @staticmethod
    def _validate_rope(rope: RopeConfig) -> None:
        if not isinstance(rope, RopeConfig):
            raise ConfigError(f"rope must be a RopeConfig, got {_show(rope)}", field="rope_scaling")
        check_float(rope.theta, "rope_theta", positive=True)
        if not isinstance(rope.scaling, str) or rope.scaling not in ("default", "linear", "yarn", "llama3"):
            raise ConfigError(
                f"rope_scaling type {_show(rope.scaling)} is not supported (default, linear, yarn, llama3)",
                field="rope_scaling.type",
            )
        for name in ("factor", "beta_fast", "beta_slow", "low_freq_factor", "high_freq_factor"):
            check_float(getattr(rope, name), f"rope_scaling.{name}")
        for name in ("mscale", "mscale_all_dim", "attention_factor"):
            if getattr(rope, name) is not None:
                check_float(getattr(rope, name), f"rope_scaling.{name}")
        check_bool(rope.truncate, "rope_scaling.truncate")
        check_bool(rope.interleaved, "rope_interleave")
        if rope.original_max_position_embeddings is not None:
            check_int(rope.original_max_position_embeddings, "rope_scaling.original_max_position_embeddings",
                      "original_max_position_embeddings")
        if rope.scaling != "default" and rope.factor <= 0:
            raise ConfigError(f"rope_scaling.factor must be > 0, got {rope.factor}", field="rope_scaling.factor")
        if rope.scaling in ("yarn", "llama3") and not rope.original_max_position_embeddings:
            raise ConfigError(
                f"rope_scaling type {rope.scaling} needs original_max_position_embeddings",
                field="rope_scaling.original_max_position_embeddings",
            )
        if rope.scaling == "yarn":
            # YaRN takes log(original / beta) and divides by log(theta).
            if rope.theta == 1.0:
                raise ConfigError("rope_theta must not be 1 with YaRN scaling", field="rope_theta")
            for name in ("beta_fast", "beta_slow"):
                if getattr(rope, name) <= 0:
                    raise ConfigError(f"rope_scaling.{name} must be > 0, got {getattr(rope, name)}",
                                      field=f"rope_scaling.{name}")
        if rope.frequency_factors is not None:
            if not isinstance(rope.frequency_factors, tuple) or not rope.frequency_factors:
                raise ConfigError(f"rope frequency factors must be a non-empty tuple of numbers, got "
                                  f"{_show(rope.frequency_factors)}", field="rope_freqs")
            for i, value in enumerate(rope.frequency_factors):
                check_float(value, f"rope_freqs[{i}]", positive=True)
            if rope.scaling not in ("default", "linear"):
                raise ConfigError(f"rope frequency factors combine with default or linear scaling only, not "
                                  f"{rope.scaling} (which computes its own per-frequency scaling)", field="rope_freqs")
        if rope.scaling == "llama3" and not 0 < rope.low_freq_factor < rope.high_freq_factor:
            # Llama-3 smoothing divides by (high_freq_factor - low_freq_factor) and by each factor.
            raise ConfigError(
                f"rope_scaling needs 0 < low_freq_factor ({rope.low_freq_factor}) < high_freq_factor "
                f"({rope.high_freq_factor})",
                field="rope_scaling.low_freq_factor",
            )

    def _validate_moe(self, moe: MoEConfig) -> None:
        for name in ("n_routed_experts", "n_shared_experts", "num_experts_per_tok", "moe_intermediate_size",
                     "n_group", "topk_group"):
            check_int(getattr(moe, name), name, name)
        check_int(moe.first_k_dense_replace, "first_k_dense_replace", "first_k_dense_replace")
        check_bool(moe.norm_topk_prob, "norm_topk_prob")
        check_float(moe.routed_scaling_factor, "routed_scaling_factor", positive=True)
        if not 0 < moe.num_experts_per_tok <= moe.n_routed_experts:
            raise ConfigError(
                f"num_experts_per_tok ({moe.num_experts_per_tok}) must be in 1..n_routed_experts "
                f"({moe.n_routed_experts})",
                field="num_experts_per_tok",
            )
        if not isinstance(moe.scoring_func, str) or moe.scoring_func not in ("softmax", "sigmoid"):
            raise ConfigError(f"scoring_func {_show(moe.scoring_func)} is not softmax or sigmoid",
                              field="scoring_func")
        if not isinstance(moe.topk_method, str) or moe.topk_method not in (
            "greedy", "group_limited_greedy", "noaux_tc"
        ):
            raise ConfigError(
                f"topk_method {_show(moe.topk_method)} is not one of greedy, group_limited_greedy, noaux_tc",
                field="topk_method",
            )
        if moe.n_routed_experts % moe.n_group:
            raise ConfigError(
                f"n_group ({moe.n_group}) must divide n_routed_experts ({moe.n_routed_experts})", field="n_group"
            )
        if not 0 < moe.topk_group <= moe.n_group:
            raise ConfigError(
                f"topk_group ({moe.topk_group}) must be in 1..n_group ({moe.n_group})", field="topk_group"
            )
        per_group = moe.n_routed_experts // moe.n_group
        if moe.topk_method == "noaux_tc" and moe.n_group > 1 and per_group < 2:
            raise ConfigError("noaux_tc scores groups by their top-2 experts: each group needs >= 2", field="n_group")
        if moe.num_experts_per_tok > moe.topk_group * per_group:
            raise ConfigError(
                f"num_experts_per_tok ({moe.num_experts_per_tok}) exceeds the experts in the kept groups "
                f"(topk_group {moe.topk_group} x {per_group})",
                field="topk_group",
            )
        if not 0 <= moe.first_k_dense_replace <= self.num_hidden_layers:
            raise ConfigError(
                f"first_k_dense_replace ({moe.first_k_dense_replace}) must be in 0..num_hidden_layers",
                field="first_k_dense_replace",
            )
        if not isinstance(moe.dense_layers, tuple):
            raise ConfigError(f"dense_layers must be a tuple of layer indices, got {_show(moe.dense_layers)}",
                              field="mlp_only_layers")
        for layer in moe.dense_layers:
            check_int(layer, "mlp_only_layers", None)
            if not 0 <= layer < self.num_hidden_layers:
                raise ConfigError(f"mlp_only_layers names layer {layer}, outside 0..num_hidden_layers-1 "
                                  f"({self.num_hidden_layers - 1})", field="mlp_only_layers")

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (written into artifact manifests)."""
        out = dataclasses.asdict(self)
        out["eos_token_ids"] = list(self.eos_token_ids)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """Inverse of ``to_dict``."""
        try:
            data = dict(data)
            rope = dict(data.get("rope", {}))
            if rope.get("frequency_factors") is not None:
                rope["frequency_factors"] = tuple(rope["frequency_factors"])  # JSON gives a list
            data["rope"] = RopeConfig(**rope)
            data["mla"] = MLAConfig(**data["mla"]) if data.get("mla") else None
            moe = dict(data["moe"]) if data.get("moe") else None
            if moe is not None and "dense_layers" in moe:
                moe["dense_layers"] = tuple(moe["dense_layers"])  # JSON gives a list
            data["moe"] = MoEConfig(**moe) if moe is not None else None
            data["dsa"] = DSAConfig(**data["dsa"]) if data.get("dsa") else None
            data["eos_token_ids"] = tuple(data.get("eos_token_ids", ()))
            return cls(**data)
        except (TypeError, ValueError, AttributeError) as exc:  # unknown or missing keys, a non-dict section
            raise ConfigError(f"not a moeforge model config: {exc}") from None

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf_json(cls, path: str | Path) -> ModelConfig:
        """Read a Hugging Face ``config.json``."""
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"{path} does not exist: an HF model folder needs a config.json") from None
        except OSError as exc:
            raise ConfigError(f"cannot read {path}: {exc}") from None
        except (ValueError, RecursionError) as exc:  # JSONDecodeError, not UTF-8, a 5000-digit int, deep nesting
            raise ConfigError(f"{path} is not valid JSON: {_show(str(exc), 200)}") from None
        if not isinstance(data, dict):
            raise ConfigError(
                f"{path} holds a JSON {type(data).__name__}, not an object: config.json must be one JSON object "
                "of fields (model_type, hidden_size, ...)",
                field="config.json",
            )
        return cls.from_hf_dict(data, name=path.parent.name)

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], name: str = "") -> ModelConfig:
        """Translate an HF config dict; unknown, unsupported or mistyped settings raise ``ConfigError``."""
        if not isinstance(hf, dict):
            raise ConfigError(f"an HF config must be a JSON object, got {type(hf).__name__}", field="config.json")
        model_type = hf.get("model_type")
        if model_type is None:
            raise ConfigError("config.json has no model_type field", field="model_type")
        declared = model_type  # names the model when nothing else does (kimi_k2, not deepseek_v3)
        if isinstance(model_type, str) and model_type in MODEL_TYPE_ALIASES:
            model_type = MODEL_TYPE_ALIASES[model_type]
        if not isinstance(model_type, str) or model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"model_type {_show(model_type)} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)} "
                f"(and {', '.join(f'{k} as {v}' for k, v in MODEL_TYPE_ALIASES.items())})",
                field="model_type",
            )

        def need(key: str, limits: str | None = None) -> int:
            if hf.get(key) is None:
                raise ConfigError(f"config.json is missing the required field {key!r} ({model_type})", field=key)
            return check_int(hf[key], key, limits)

        # Bounded here already: these two are divided and multiplied before validate() runs.
        hidden = need("hidden_size", "hidden_size")
        heads = need("num_attention_heads", "num_attention_heads")
        act = hf.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ConfigError(f"hidden_act {_show(act)} is not supported (SwiGLU with silu only)", field="hidden_act")
        if _opt_bool(hf, "mlp_bias", False):
            raise ConfigError("mlp_bias=true is not supported", field="mlp_bias")
        eos = hf.get("eos_token_id")
        eos_list = eos if isinstance(eos, list) else ([] if eos is None else [eos])
        eos_ids = tuple(check_int(e, "eos_token_id", "token_id") for e in eos_list)
        bos = _opt_int(hf, "bos_token_id")
        default_name = hf.get("_name_or_path")
        common: dict[str, Any] = dict(
            model_type=model_type,
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            num_hidden_layers=need("num_hidden_layers"),
            num_attention_heads=heads,
            # transformers' class default when the key is absent; null (and MLA, which has no kv heads) -> heads
            num_key_value_heads=_opt_int(hf, "num_key_value_heads") or (
                None if "num_key_value_heads" in hf or model_type in MLA_FAMILIES
                else hf_default("num_key_value_heads", model_type)) or heads,
            rms_norm_eps=_opt_float(hf, "rms_norm_eps", hf_default("rms_norm_eps", model_type), positive=True),
            max_position_embeddings=_opt_int(hf, "max_position_embeddings",
                                             hf_default("max_position_embeddings", model_type),
                                             "max_position_embeddings"),
            tie_word_embeddings=_opt_bool(hf, "tie_word_embeddings", False),
            bos_token_id=bos,
            eos_token_ids=eos_ids,
            name=name or (default_name if isinstance(default_name, str) else "") or declared,
        )
        deepseek = model_type in MLA_FAMILIES
        common["rope"] = _rope_from_hf(hf, common["max_position_embeddings"], model_type)
        attention_bias = _opt_bool(hf, "attention_bias", False)
        if deepseek:
            mla = MLAConfig(
                q_lora_rank=_opt_int(hf, "q_lora_rank"),
                kv_lora_rank=need("kv_lora_rank"),
                qk_nope_head_dim=need("qk_nope_head_dim"),
                qk_rope_head_dim=need("qk_rope_head_dim"),
                v_head_dim=need("v_head_dim"),
            )
            moe = None
            n_experts = _opt_int(hf, "n_routed_experts")
            if n_experts:
                moe = _deepseek_moe(hf, model_type, n_experts, need)
            return cls(
                **common,
                intermediate_size=need("intermediate_size"),
                head_dim=mla.qk_rope_head_dim,
                qkv_bias=attention_bias,
                o_proj_bias=attention_bias,
                mla=mla,
                moe=moe,
                dsa=_dsa_from_hf(hf, need) if model_type in DSA_FAMILIES else None,
            )

        # Qwen3Config's head_dim defaults to 128 (the others: hidden / heads)
        head_dim = _opt_int(hf, "head_dim") or (128 if model_type == "qwen3" else hidden // heads)
        if model_type in MOE_GQA_FAMILIES:
            return cls(**common, **_moe_gqa_fields(hf, model_type, head_dim, need))
        qk_norm: QKNorm = "none"
        if model_type == "qwen2":
            qkv_bias, o_bias = True, False  # Qwen2 always has q/k/v biases and no o_proj bias
            window = _qwen_sliding_window(hf, common["num_hidden_layers"], need)
        elif model_type == "qwen3":  # Qwen3: RMSNorm per head on q and k before RoPE; biases per attention_bias
            qkv_bias = o_bias = attention_bias
            qk_norm = "head"
            window = _qwen_sliding_window(hf, common["num_hidden_layers"], need)
        else:
            qkv_bias = o_bias = attention_bias
            # MistralConfig's sliding_window defaults to 4096 when the key is missing; null means none
            default_window = 4096 if model_type == "mistral" and "sliding_window" not in hf else None
            window = _opt_int(hf, "sliding_window", default_window) or None
        return cls(
            **common,
            intermediate_size=need("intermediate_size"),
            head_dim=head_dim,
            qkv_bias=qkv_bias,
            o_proj_bias=o_bias,
            sliding_window=window,
            qk_norm=qk_norm,
        )


def _deepseek_moe(hf: dict[str, Any], model_type: str, n_experts: int, need: Callable[..., int]) -> MoEConfig:
    """DeepSeekMoE as transformers v5 runs each family. V2's router is always softmax (greedy or group-limited per
    topk_method); V3's and V3.2's always sigmoid + correction bias, groups scored by their top-2 (noaux_tc): a
    scoring_func / topk_method that says otherwise is ignored there, with a warning. Missing keys take the family's
    class defaults (``HF_DEFAULTS``). V3.2's ``mlp_layer_types`` ("dense" / "sparse" per layer) wins over
    first_k_dense_replace, as in transformers; a first_k_dense_replace beyond the last layer makes every layer dense."""
    v3 = model_type in ("deepseek_v3", "deepseek_v32")
    scoring, method = ("sigmoid", "noaux_tc") if v3 else ("softmax", hf.get("topk_method") or "greedy")
    for key, used in (("scoring_func", scoring), *((("topk_method", method),) if v3 else ())):
        given = hf.get(key)
        if given is not None and given != used:
            log.warning("%s config sets %s=%r: transformers' %s router ignores it and uses %s, and so does "
                        "moeforge, to match it", model_type, key, given, model_type, used)
    if hf.get("moe_layer_freq", 1) != 1:
        raise ConfigError("moe_layer_freq != 1 is not supported", field="moe_layer_freq")
    layers = need("num_hidden_layers", "num_hidden_layers")

    def default(key: str) -> Any:
        return hf_default(key, model_type)

    first_dense = min(_opt_int(hf, "first_k_dense_replace", default("first_k_dense_replace")), layers)
    dense_layers: tuple[int, ...] = ()
    types = hf.get("mlp_layer_types") if model_type == "deepseek_v32" else None
    if types is not None:
        if not isinstance(types, list) or len(types) != layers or not set(types) <= {"dense", "sparse"}:
            raise ConfigError(f"mlp_layer_types must list 'dense' or 'sparse' for each of the {layers} layers, got "
                              f"{_show(types)}", field="mlp_layer_types")
        first_dense, dense_layers = 0, tuple(i for i, kind in enumerate(types) if kind == "dense")
    return MoEConfig(
        n_routed_experts=n_experts,
        n_shared_experts=_opt_int(hf, "n_shared_experts", default("n_shared_experts")),
        num_experts_per_tok=need("num_experts_per_tok"),
        moe_intermediate_size=need("moe_intermediate_size"),
        first_k_dense_replace=first_dense,
        # Checked by ModelConfig.validate(), with a message naming the field.
        scoring_func=cast(ScoringFunc, scoring),
        topk_method=cast(TopkMethod, method),
        n_group=_opt_int(hf, "n_group", default("n_group")),
        topk_group=_opt_int(hf, "topk_group", default("topk_group")),
        norm_topk_prob=_deepseek_norm_topk_prob(hf, v3),
        routed_scaling_factor=_opt_float(hf, "routed_scaling_factor", default("routed_scaling_factor")),
        dense_layers=dense_layers,
    )


def _deepseek_norm_topk_prob(hf: dict[str, Any], v3: bool) -> bool:
    """``norm_topk_prob`` as transformers v5 applies it: V3 (and V3.2) renormalise the top-k weights when it is set;
    V2's router never does (DeepseekV2TopkRouter: softmax, top-k, times routed_scaling_factor), whatever the config
    says -- released V2 checkpoints all say false. A V2 config that says true is followed as transformers runs it,
    with a warning, since DeepSeek's own V2 code would renormalise (and then not scale)."""
    value = _opt_bool(hf, "norm_topk_prob", v3)  # transformers' defaults: V3 True, V2 False
    if value and not v3:
        log.warning("deepseek_v2 config sets norm_topk_prob=true: transformers' DeepSeek-V2 router ignores it (the "
                    "top-k softmax weights are not renormalised), and so does moeforge, to match it")
    return value and v3


def _qwen_sliding_window(hf: dict[str, Any], layers: int, need: Callable[..., int]) -> int | None:
    """Qwen2's sliding window as transformers v5 applies it: the window exists only with ``use_sliding_window``, and
    then applies to the layers ``layer_types`` marks "sliding_attention" (default: layers i >= ``max_window_layers``);
    so the window is None when no layer slides, and a mix of sliding and full layers is refused by name."""
    if not _opt_bool(hf, "use_sliding_window", False):
        return None
    window = need("sliding_window")
    types = hf.get("layer_types")
    if types is None:
        first = _opt_int(hf, "max_window_layers")
        first = 28 if first is None else first  # transformers' default
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or not set(types) <= {"sliding_attention",
                                                                                  "full_attention"}:
        raise ConfigError(f"layer_types must list 'sliding_attention' or 'full_attention' for each of the {layers} "
                          f"layers, got {_show(types)}", field="layer_types")
    sliding = [i for i, kind in enumerate(types) if kind == "sliding_attention"]
    if not sliding:
        return None  # use_sliding_window, but max_window_layers >= num_hidden_layers: every layer attends fully
    if len(sliding) < layers:
        raise ConfigError(f"a sliding window on some layers only (layers {sliding[0]}..{sliding[-1]} of {layers}, from "
                          "max_window_layers / layer_types) is not supported: moeforge applies one window to every "
                          "layer or to none", field="max_window_layers")
    return window


# ---------------------------------------------------------------------------------------- GQA + MoE families
def _moe_gqa_fields(hf: dict[str, Any], model_type: str, head_dim: int, need: Callable[..., int]) -> dict[str, Any]:
    """The ModelConfig fields (beyond ``common``) of Qwen3-MoE, GLM-4.5 MoE, Mixtral and OLMoE, as transformers v5
    builds each (modeling_<family>.py): biases, q/k norm, partial rotary, clipping, sliding window, experts."""
    layers = need("num_hidden_layers", "num_hidden_layers")  # bounded: the dense-layer scan loops over it
    attention_bias = _opt_bool(hf, "attention_bias", False)
    fields: dict[str, Any] = {"head_dim": head_dim, "intermediate_size": need("intermediate_size")}
    experts = _expert_count(hf, model_type)
    moe: dict[str, Any] = {"n_routed_experts": experts, "num_experts_per_tok": need("num_experts_per_tok"),
                           "n_shared_experts": 0, "scoring_func": "softmax", "topk_method": "greedy"}
    if model_type == "qwen3_moe":
        fields.update(qkv_bias=attention_bias, o_proj_bias=attention_bias, qk_norm="head")
        if _opt_bool(hf, "use_sliding_window", False):
            fields["sliding_window"] = need("sliding_window")  # every layer, as transformers v5 does
        step = _opt_int(hf, "decoder_sparse_step", 1)
        if step < 1:
            raise ConfigError(f"decoder_sparse_step must be >= 1, got {step}", field="decoder_sparse_step")
        only = hf.get("mlp_only_layers") or []
        if not isinstance(only, list):
            raise ConfigError(f"mlp_only_layers must be a list of layer indices, got {_show(only)}",
                              field="mlp_only_layers")
        # A layer is MoE iff it is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0.
        dense = {check_int(i, "mlp_only_layers") for i in only} | {i for i in range(layers) if (i + 1) % step}
        moe.update(moe_intermediate_size=need("moe_intermediate_size"), dense_layers=tuple(sorted(dense)),
                   norm_topk_prob=_opt_bool(hf, "norm_topk_prob", False))
    elif model_type == "glm4_moe":
        # q/k/v carry attention_bias, o_proj never does; RoPE rotates the first head_dim * partial_rotary_factor
        # dims (0.5 when absent: transformers' default); sigmoid + correction bias routing as DeepSeek-V3's.
        fields.update(qkv_bias=attention_bias, o_proj_bias=False,
                      qk_norm="head" if _opt_bool(hf, "use_qk_norm", False) else "none")
        params, prefix = _rope_dict(hf)
        factor = _opt_float(params, "partial_rotary_factor", None, prefix)
        if factor is None:
            factor = _opt_float(hf, "partial_rotary_factor", 0.5)
        if not 0 < factor <= 1:
            raise ConfigError(f"partial_rotary_factor must be in (0, 1], got {factor}", field="partial_rotary_factor")
        rotary = int(head_dim * factor)
        fields["rotary_dim"] = None if rotary == head_dim else rotary
        moe.update(moe_intermediate_size=need("moe_intermediate_size"),
                   n_shared_experts=_opt_int(hf, "n_shared_experts", 1),
                   first_k_dense_replace=_opt_int(hf, "first_k_dense_replace", 1),
                   scoring_func="sigmoid", topk_method="noaux_tc",
                   n_group=_opt_int(hf, "n_group") or 1, topk_group=_opt_int(hf, "topk_group") or 1,
                   norm_topk_prob=_opt_bool(hf, "norm_topk_prob", True),
                   routed_scaling_factor=_opt_float(hf, "routed_scaling_factor", 1.0))
    elif model_type == "mixtral":
        # softmax over all experts, top-k, renormalised (= softmax over the top-k logits); experts sized
        # intermediate_size; no attention biases.
        fields.update(qkv_bias=False, o_proj_bias=False, sliding_window=_opt_int(hf, "sliding_window") or None)
        moe.update(moe_intermediate_size=fields["intermediate_size"], norm_topk_prob=True)
    else:  # olmoe
        # q_norm / k_norm are RMSNorms over the whole projections [Hq*D], [Hkv*D] (transformers sizes q_norm by
        # hidden_size, so D must be hidden / heads); q, k, v clamped to clip_qkv after them.
        heads = need("num_attention_heads")
        if head_dim * heads != need("hidden_size"):
            raise ConfigError(f"olmoe needs head_dim * num_attention_heads == hidden_size (its q_norm spans "
                              f"hidden_size), got head_dim {head_dim}", field="head_dim")
        # transformers' OLMoE mask never slides (modeling_olmoe: "no sliding"), whatever sliding_window says
        if _opt_int(hf, "sliding_window"):
            log.warning("olmoe config sets sliding_window=%s: transformers' OLMoE attends to the whole context "
                        "(its causal mask has no window), and so does moeforge, to match it", hf["sliding_window"])
        fields.update(qkv_bias=attention_bias, o_proj_bias=attention_bias, qk_norm="projection",
                      clip_qkv=_opt_float(hf, "clip_qkv", None, positive=True))
        moe.update(moe_intermediate_size=fields["intermediate_size"],
                   norm_topk_prob=_opt_bool(hf, "norm_topk_prob", False))
    fields["moe"] = MoEConfig(**moe)  # checked by ModelConfig.validate(), with messages naming the fields
    return fields


def _dsa_from_hf(hf: dict[str, Any], need: Callable[..., int]) -> DSAConfig:
    """DeepSeek-V3.2's indexer sizes (config.json: index_topk, index_head_dim, index_n_heads; all required)."""
    return DSAConfig(index_topk=need("index_topk", "index_topk"),
                     index_head_dim=need("index_head_dim", "index_head_dim"),
                     index_n_heads=need("index_n_heads", "index_n_heads"))


# Where each family's config.json keeps its routed-expert count (transformers v5 writes num_local_experts for
# every one of them; released checkpoints use the family's own key).
_EXPERT_KEYS: dict[str, tuple[str, ...]] = {
    "qwen3_moe": ("num_experts", "num_local_experts"), "olmoe": ("num_experts", "num_local_experts"),
    "glm4_moe": ("n_routed_experts", "num_local_experts"), "mixtral": ("num_local_experts", "num_experts"),
}


def _expert_count(hf: dict[str, Any], model_type: str) -> int:
    keys = _EXPERT_KEYS[model_type]
    for key in keys:
        if hf.get(key) is not None:
            count = check_int(hf[key], key)
            if count < 1:
                raise ConfigError(f"{key} is {count}: a {model_type} config without routed experts has no MoE "
                                  "layers; this family needs >= 1 (a dense model is another model_type)", field=key)
            return count
    raise ConfigError(f"config.json is missing the required field {keys[0]!r} ({model_type})", field=keys[0])


# ---------------------------------------------------------------------------------------- typed HF reads
# A JSON null reads as absent (HF writes null for unset optional fields); any other wrong type is refused.
@overload
def _opt_int(d: dict[str, Any], key: str, default: int, limits: str | None = None, prefix: str = "") -> int: ...
@overload
def _opt_int(
    d: dict[str, Any], key: str, default: None = None, limits: str | None = None, prefix: str = ""
) -> int | None: ...
def _opt_int(
    d: dict[str, Any], key: str, default: int | None = None, limits: str | None = None, prefix: str = ""
) -> int | None:
    value = d.get(key)
    return default if value is None else check_int(value, prefix + key, limits)


@overload
def _opt_float(d: dict[str, Any], key: str, default: float, prefix: str = "", positive: bool = False) -> float: ...
@overload
def _opt_float(
    d: dict[str, Any], key: str, default: None = None, prefix: str = "", positive: bool = False
) -> float | None: ...
def _opt_float(
    d: dict[str, Any], key: str, default: float | None = None, prefix: str = "", positive: bool = False
) -> float | None:
    value = d.get(key)
    return default if value is None else check_float(value, prefix + key, positive)


def _opt_bool(d: dict[str, Any], key: str, default: bool, prefix: str = "") -> bool:
    value = d.get(key)
    return default if value is None else check_bool(value, prefix + key)


def _opt_dict(d: dict[str, Any], key: str) -> dict[str, Any]:
    value = d.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(
            f"{key} must be a JSON object (e.g. {{\"rope_type\": \"yarn\", \"factor\": 4.0, ...}}), "
            f"got {_show(value)}",
            field=key,
        )
    return value


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN magnitude correction: 0.1 * mscale * ln(factor) + 1 (1.0 when factor <= 1)."""
    if factor <= 1:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


def _rope_dict(hf: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The rope dict transformers v5 reads (a non-empty ``rope_scaling`` replaces ``rope_parameters`` whole) and
    the prefix its fields are named by in errors."""
    scaling = _opt_dict(hf, "rope_scaling")
    return (scaling, "rope_scaling.") if scaling else (_opt_dict(hf, "rope_parameters"), "rope_parameters.")


def _rope_from_hf(hf: dict[str, Any], max_positions: int, model_type: str) -> RopeConfig:
    """RoPE as transformers v5 reads it (convert_rope_params_to_dict): older files write rope_theta + rope_scaling,
    v5 writes rope_parameters (theta inside); a non-empty rope_scaling replaces rope_parameters whole; theta comes
    from the rope dict, else the top-level rope_theta, else the family's default. Interleaved (DeepSeek's pairwise)
    rotation: DeepSeek-V3 per rope_interleave (default true); V2's and V3.2's MLA always interleave; the other
    families never do (transformers does not read the key there)."""
    merged, prefix = _rope_dict(hf)
    theta = _opt_float(merged, "rope_theta", None, prefix, positive=True)
    if theta is None:
        theta = _opt_float(hf, "rope_theta", hf_default("rope_theta", model_type), positive=True)
    kind = merged.get("rope_type", merged.get("type", "default")) or "default"
    if not isinstance(kind, str) or kind not in ("default", "linear", "yarn", "llama3"):
        raise ConfigError(
            f"rope_scaling type {_show(kind)} is not supported (default, linear, yarn, llama3)",
            field="rope_scaling.type",
        )
    interleaved = model_type in MLA_FAMILIES
    given = _opt_bool(hf, "rope_interleave", interleaved)
    if model_type == "deepseek_v3":
        interleaved = given
    elif given != interleaved:
        log.warning("%s config sets rope_interleave=%s: transformers' %s ignores it (%s), and so does moeforge",
                    model_type, given, model_type, "always interleaved" if interleaved else "rotate_half")
    if kind == "default":
        return RopeConfig(theta=theta, interleaved=interleaved)
    factor = _opt_float(merged, "factor", None, prefix)
    original = _opt_int(merged, "original_max_position_embeddings", None, "original_max_position_embeddings",
                        prefix)
    if kind in ("yarn", "llama3"):
        # As transformers' standardize_rope_params: a top-level original_max_position_embeddings (Phi-3 style) wins
        # over the one inside the rope dict, and without either the pretraining length is max_position_embeddings.
        top = _opt_int(hf, "original_max_position_embeddings", None, "original_max_position_embeddings")
        original = top or original or max_positions
    if factor is None and kind == "yarn" and original:
        factor = max_positions / original
    if factor is None:
        raise ConfigError(f"rope_scaling ({kind}) is missing 'factor'", field="rope_scaling.factor")
    return RopeConfig(
        theta=theta,
        scaling=cast(RopeScaling, kind),  # checked above
        factor=factor,
        original_max_position_embeddings=original,
        beta_fast=_opt_float(merged, "beta_fast", None, prefix) or 32.0,
        beta_slow=_opt_float(merged, "beta_slow", None, prefix) or 1.0,
        mscale=_opt_float(merged, "mscale", None, prefix),
        mscale_all_dim=_opt_float(merged, "mscale_all_dim", None, prefix),
        attention_factor=_opt_float(merged, "attention_factor", None, prefix),
        truncate=_opt_bool(merged, "truncate", True, prefix),
        low_freq_factor=_opt_float(merged, "low_freq_factor", 1.0, prefix),
        high_freq_factor=_opt_float(merged, "high_freq_factor", 4.0, prefix),
        interleaved=interleaved,
    )
