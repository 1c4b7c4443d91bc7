"""One typed model configuration for DeepSeek-V2/V3/V3.2 and Kimi-K2 (MLA + MoE), DeepSeek-V4 (compressed attention,
hyper-connections, MoE), Qwen3-MoE, GLM-4.5 MoE, Mixtral and OLMoE (GQA + MoE), and Llama/Qwen2/Mistral (GQA).

Built from a Hugging Face ``config.json`` (``ModelConfig.from_hf_dict``), from GGUF metadata
(``moeforge.model.gguf_loader``) or from a named preset (``moeforge.model.presets``). Every
consumer (model, exporter, artifact manifest) reads this object; nothing is configured elsewhere.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from moeforge.core.config_fields import (
    SIZE_LIMITS,
    check_bool,
    check_float,
    check_int,
    opt_bool,
    opt_float,
    opt_int,
    show,
)
from moeforge.core.config_types import (
    DENSE_FAMILIES,
    DSA_FAMILIES,
    MLA_FAMILIES,
    MODEL_TYPE_ALIASES,
    MOE_GQA_FAMILIES,
    SUPPORTED_MODEL_TYPES,
    V4_FAMILIES,
    CompressedAttentionConfig,
    DSAConfig,
    Family,
    HyperConnectionConfig,
    MLAConfig,
    MoEConfig,
    QKNorm,
    RopeConfig,
    RopeScaling,
    ScoringFunc,
    TopkMethod,
    yarn_mscale,
)
from moeforge.core.config_v4 import (
    v4_fields_from_hf,
    v4_head_parameters,
    v4_kv_values_per_token,
    v4_layer_parameters,
    validate_v4,
)
from moeforge.core.errors import ConfigError
from moeforge.core.hf_config import (
    EXPERT_KEYS,
    deepseek_moe,
    dsa_from_hf,
    hf_default,
    moe_gqa_fields,
    qwen_sliding_window,
    rope_from_hf,
)
from moeforge.core.strict_json import JsonFileError, read_regular_file

# The names other modules import from here: the config's parts and the typed checks live beside it.
__all__ = [
    "DENSE_FAMILIES",
    "DSA_FAMILIES",
    "MLA_FAMILIES",
    "MODEL_TYPE_ALIASES",
    "MOE_GQA_FAMILIES",
    "SIZE_LIMITS",
    "SUPPORTED_MODEL_TYPES",
    "V4_FAMILIES",
    "CompressedAttentionConfig",
    "DSAConfig",
    "Family",
    "HyperConnectionConfig",
    "MLAConfig",
    "MoEConfig",
    "ModelConfig",
    "QKNorm",
    "RopeConfig",
    "RopeScaling",
    "ScoringFunc",
    "TopkMethod",
    "check_bool",
    "check_float",
    "check_int",
    "yarn_mscale",
]

log = logging.getLogger(__name__)

# Integer sizes of ModelConfig itself, each checked against SIZE_LIMITS under its own name.
_SIZE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings")


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
    # DeepSeek-V4 only: sliding-window / compressed attention per layer, and the hyper-connected residual streams.
    compressed_attention: CompressedAttentionConfig | None = None
    hyper_connections: HyperConnectionConfig | None = None
    # Multi-token-prediction modules the checkpoint ships (DeepSeek-V4 loads and keeps them; none runs them yet).
    num_nextn_predict_layers: int = 0
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ derived facts
    @property
    def attention_kind(self) -> Literal["mla", "gqa", "csa/hca"]:
        """mla (DeepSeek-V2/V3), csa/hca (DeepSeek-V4's sliding + compressed attention) or gqa."""
        if self.compressed_attention is not None:
            return "csa/hca"
        return "mla" if self.mla is not None else "gqa"

    @property
    def rope_dim(self) -> int:
        """Number of dimensions each rotary embedding rotates."""
        if self.mla is not None:
            return self.mla.qk_rope_head_dim
        if self.compressed_attention is not None:
            return self.compressed_attention.qk_rope_head_dim  # the trailing dims of each head
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
        """Cached scalars per token per layer (keys + values, or the MLA latent; DeepSeek-V4: the average over its
        layers of what a token adds, ``v4_kv_values_per_token``)."""
        if self.compressed_attention is not None:
            return v4_kv_values_per_token(self)
        if self.mla is not None:
            indexer = self.dsa.index_head_dim if self.dsa is not None else 0  # the indexer's key cache
            if mla_impl == "absorb":
                return self.mla.latent_dim + indexer
            return self.num_attention_heads * (self.mla.qk_head_dim + self.mla.v_head_dim) + indexer
        return 2 * self.num_key_value_heads * self.head_dim

    def num_parameters(self) -> int:
        """Parameter count computed from shapes alone (for planning memory without weights)."""
        head = v4_head_parameters(self) if self.hyper_connections is not None else 0  # V4's HyperHead
        return (self.embedding_parameters() * (1 if self.tie_word_embeddings else 2) + self.hidden_size + head
                + sum(self.layer_parameters(i) for i in range(self.num_hidden_layers)))

    def embedding_parameters(self) -> int:
        """Parameters of the embedding table (the untied LM head has as many)."""
        return self.vocab_size * self.hidden_size

    def layer_parameters(self, i: int) -> int:
        """Parameters of decoder layer ``i`` (its norms, attention and MLP or MoE), from shapes alone."""
        if self.compressed_attention is not None:
            return v4_layer_parameters(self, i)
        h = self.hidden_size
        total = 2 * h  # the two norms
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
                f"model_type {show(self.model_type)} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}",
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
            raise ConfigError(f"eos_token_ids must be a tuple of ints, got {show(self.eos_token_ids)}",
                              field="eos_token_id")
        for token in self.eos_token_ids:
            check_int(token, "eos_token_id", "token_id")
        if not isinstance(self.name, str):
            raise ConfigError(f"name must be a string, got {show(self.name)}", field="name")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})",
                field="num_key_value_heads",
            )
        if self.model_type in MLA_FAMILIES:
            if self.mla is None:
                raise ConfigError(f"{self.model_type} needs MLA dimensions (kv_lora_rank, ...)", field="kv_lora_rank")
        elif self.model_type in V4_FAMILIES:
            pass  # validate_v4 below
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
        validate_v4(self)
        if self.compressed_attention is not None:
            self._validate_rope(self.compressed_attention.compress_rope)  # DeepSeek-V4's second RoPE setting
        if self.mla is not None:
            if not isinstance(self.mla, MLAConfig):
                raise ConfigError(f"mla must be an MLAConfig, got {show(self.mla)}", field="mla")
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
                raise ConfigError(f"moe must be a MoEConfig, got {show(self.moe)}", field="moe")
            self._validate_moe(self.moe)

    def _validate_gqa_options(self) -> None:
        """q/k norm, partial rotary and q/k/v clipping: GQA options, each checked for type and range."""
        if not isinstance(self.qk_norm, str) or self.qk_norm not in ("none", "head", "projection"):
            raise ConfigError(f"qk_norm {show(self.qk_norm)} is not one of none, head, projection", field="qk_norm")
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
                              f"index_n_heads), got {show(self.dsa)}", field="index_topk")
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
            raise ConfigError(f"rope must be a RopeConfig, got {show(rope)}", field="rope_scaling")
        check_float(rope.theta, "rope_theta", positive=True)
        if not isinstance(rope.scaling, str) or rope.scaling not in ("default", "linear", "yarn", "llama3"):
            raise ConfigError(
                f"rope_scaling type {show(rope.scaling)} is not supported (default, linear, yarn, llama3)",
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
                                  f"{show(rope.frequency_factors)}", field="rope_freqs")
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
        scorings = ("softmax", "sigmoid", "sqrtsoftplus") if self.model_type in V4_FAMILIES else ("softmax", "sigmoid")
        if not isinstance(moe.scoring_func, str) or moe.scoring_func not in scorings:
            raise ConfigError(f"scoring_func {show(moe.scoring_func)} is not {' or '.join(scorings)}",
                              field="scoring_func")
        if not isinstance(moe.topk_method, str) or moe.topk_method not in (
            "greedy", "group_limited_greedy", "noaux_tc"
        ):
            raise ConfigError(
                f"topk_method {show(moe.topk_method)} is not one of greedy, group_limited_greedy, noaux_tc",
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
            raise ConfigError(f"dense_layers must be a tuple of layer indices, got {show(moe.dense_layers)}",
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
            for key in ("dense_layers", "hash_layers"):
                if moe is not None and key in moe:
                    moe[key] = tuple(moe[key])  # JSON gives a list
            data["moe"] = MoEConfig(**moe) if moe is not None else None
            data["dsa"] = DSAConfig(**data["dsa"]) if data.get("dsa") else None
            attn = dict(data["compressed_attention"]) if data.get("compressed_attention") else None
            if attn is not None:
                attn["layer_types"] = tuple(attn["layer_types"])
                attn["compress_rope"] = RopeConfig(**attn["compress_rope"])
                attn["indexer"] = DSAConfig(**attn["indexer"])
            data["compressed_attention"] = CompressedAttentionConfig(**attn) if attn is not None else None
            data["hyper_connections"] = (HyperConnectionConfig(**data["hyper_connections"])
                                         if data.get("hyper_connections") else None)
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
        try:  # a regular file of bounded size: a FIFO or device would block, a huge file fill memory
            data = json.loads(read_regular_file(path, what="HF config", fix="an HF model folder needs a "
                                                "config.json, a regular JSON file").decode("utf-8"))
        except JsonFileError as exc:
            raise ConfigError(str(exc)) from None
        except (ValueError, RecursionError) as exc:  # JSONDecodeError, not UTF-8, a 5000-digit int, deep nesting
            raise ConfigError(f"{path} is not valid JSON: {show(str(exc), 200)}") from None
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
                f"model_type {show(model_type)} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)} "
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
            raise ConfigError(f"hidden_act {show(act)} is not supported (SwiGLU with silu only)", field="hidden_act")
        if opt_bool(hf, "mlp_bias", False):
            raise ConfigError("mlp_bias=true is not supported", field="mlp_bias")
        eos = hf.get("eos_token_id")
        eos_list = eos if isinstance(eos, list) else ([] if eos is None else [eos])
        eos_ids = tuple(check_int(e, "eos_token_id", "token_id") for e in eos_list)
        bos = opt_int(hf, "bos_token_id")
        default_name = hf.get("_name_or_path")
        common: dict[str, Any] = dict(
            model_type=model_type,
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            num_hidden_layers=need("num_hidden_layers"),
            num_attention_heads=heads,
            # transformers' class default when the key is absent; null (and MLA, which has no kv heads) -> heads
            num_key_value_heads=opt_int(hf, "num_key_value_heads") or (
                None if "num_key_value_heads" in hf or model_type in MLA_FAMILIES
                else hf_default("num_key_value_heads", model_type)) or heads,
            rms_norm_eps=opt_float(hf, "rms_norm_eps", hf_default("rms_norm_eps", model_type), positive=True),
            max_position_embeddings=opt_int(hf, "max_position_embeddings",
                                             hf_default("max_position_embeddings", model_type),
                                             "max_position_embeddings"),
            tie_word_embeddings=opt_bool(hf, "tie_word_embeddings", False),
            bos_token_id=bos,
            eos_token_ids=eos_ids,
            name=name or (default_name if isinstance(default_name, str) else "") or declared,
        )
        if model_type in V4_FAMILIES:  # its two RoPE settings, kv heads and sizes are its own
            del common["num_key_value_heads"]
            return cls(**common, **v4_fields_from_hf(hf, common["num_hidden_layers"],
                                                      common["max_position_embeddings"]))
        deepseek = model_type in MLA_FAMILIES
        common["rope"] = rope_from_hf(hf, common["max_position_embeddings"], model_type)
        attention_bias = opt_bool(hf, "attention_bias", False)
        if deepseek:
            mla = MLAConfig(
                q_lora_rank=opt_int(hf, "q_lora_rank"),
                kv_lora_rank=need("kv_lora_rank"),
                qk_nope_head_dim=need("qk_nope_head_dim"),
                qk_rope_head_dim=need("qk_rope_head_dim"),
                v_head_dim=need("v_head_dim"),
            )
            moe = None
            n_experts = opt_int(hf, "n_routed_experts")
            if n_experts:
                moe = deepseek_moe(hf, model_type, n_experts, need)
            return cls(
                **common,
                intermediate_size=need("intermediate_size"),
                head_dim=mla.qk_rope_head_dim,
                qkv_bias=attention_bias,
                o_proj_bias=attention_bias,
                mla=mla,
                moe=moe,
                dsa=dsa_from_hf(hf, need) if model_type in DSA_FAMILIES else None,
            )

        # Qwen3Config's head_dim defaults to 128 (the others: hidden / heads)
        head_dim = opt_int(hf, "head_dim") or (128 if model_type == "qwen3" else hidden // heads)
        if model_type in MOE_GQA_FAMILIES:
            try:
                return cls(**common, **moe_gqa_fields(hf, model_type, head_dim, need))
            except ConfigError as exc:  # name the expert count as this family's config.json does
                key = next((k for k in EXPERT_KEYS[model_type] if hf.get(k) is not None), "n_routed_experts")
                raise ConfigError(str(exc).replace("n_routed_experts", key), field=exc.field) from None
        qk_norm: QKNorm = "none"
        if model_type == "qwen2":
            qkv_bias, o_bias = True, False  # Qwen2 always has q/k/v biases and no o_proj bias
            window = qwen_sliding_window(hf, common["num_hidden_layers"], need)
        elif model_type == "qwen3":  # Qwen3: RMSNorm per head on q and k before RoPE; biases per attention_bias
            qkv_bias = o_bias = attention_bias
            qk_norm = "head"
            window = qwen_sliding_window(hf, common["num_hidden_layers"], need)
        else:
            qkv_bias = o_bias = attention_bias
            # MistralConfig's sliding_window defaults to 4096 when the key is missing; null means none
            default_window = 4096 if model_type == "mistral" and "sliding_window" not in hf else None
            window = opt_int(hf, "sliding_window", default_window) or None
        return cls(
            **common,
            intermediate_size=need("intermediate_size"),
            head_dim=head_dim,
            qkv_bias=qkv_bias,
            o_proj_bias=o_bias,
            sliding_window=window,
            qk_norm=qk_norm,
        )
