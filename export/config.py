"""One typed model configuration for DeepSeek-V2/V3 (MLA + MoE) and Llama/Qwen2/Mistral (GQA).

Built from a Hugging Face ``config.json`` (``ModelConfig.from_hf_dict``), from GGUF metadata
(``moeforge.export.gguf_loader``) or from a named preset (``moeforge.export.presets``). Every
consumer (model, exporter, artifact manifest) reads this object; nothing is configured elsewhere.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

from moeforge.errors import ConfigError

Family = Literal["deepseek_v3", "deepseek_v2", "llama", "qwen2", "mistral"]
RopeScaling = Literal["default", "linear", "yarn", "llama3"]
ScoringFunc = Literal["softmax", "sigmoid"]
TopkMethod = Literal["greedy", "group_limited_greedy", "noaux_tc"]
SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("deepseek_v3", "deepseek_v2", "llama", "qwen2", "mistral")


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
class MoEConfig:
    """DeepSeekMoE: routed + shared SwiGLU experts with (group-limited) top-k routing."""

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
    rope: RopeConfig = field(default_factory=RopeConfig)
    mla: MLAConfig | None = None
    moe: MoEConfig | None = None
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
        return self.mla.qk_rope_head_dim if self.mla is not None else self.head_dim

    def is_moe_layer(self, layer_idx: int) -> bool:
        return self.moe is not None and layer_idx >= self.moe.first_k_dense_replace

    @property
    def softmax_scale(self) -> float:
        """Attention scale; MLA multiplies by mscale^2 when YaRN is active (DeepSeek semantics)."""
        if self.mla is None:
            return float(self.head_dim**-0.5)
        scale = float(self.mla.qk_head_dim**-0.5)
        rope = self.rope
        if rope.scaling == "yarn" and rope.mscale_all_dim:
            m = yarn_mscale(rope.factor, rope.mscale_all_dim)
            scale = scale * m * m
        return scale

    def kv_cache_values_per_token(self, mla_impl: Literal["absorb", "naive"] = "absorb") -> int:
        """Cached scalars per token per layer (keys + values, or the MLA latent)."""
        if self.mla is not None:
            if mla_impl == "absorb":
                return self.mla.latent_dim
            return self.num_attention_heads * (self.mla.qk_head_dim + self.mla.v_head_dim)
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
            else:
                q = self.num_attention_heads * self.head_dim
                kv = self.num_key_value_heads * self.head_dim
                total += h * (q + 2 * kv) + q * h
                if self.qkv_bias:
                    total += q + 2 * kv
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
        """Reject an inconsistent config with an error naming the offending field."""
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"model_type {self.model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}",
                field="model_type",
            )
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}", field=name)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})",
                field="num_key_value_heads",
            )
        if self.rms_norm_eps <= 0:
            raise ConfigError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}", field="rms_norm_eps")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ConfigError(f"sliding_window must be > 0, got {self.sliding_window}", field="sliding_window")
        if self.rope_dim % 2:
            raise ConfigError(f"the rotary dimension ({self.rope_dim}) must be even", field="head_dim")
        if self.rope.theta <= 0:
            raise ConfigError(f"rope_theta must be > 0, got {self.rope.theta}", field="rope_theta")
        if self.rope.scaling != "default" and self.rope.factor <= 0:
            raise ConfigError(f"rope_scaling.factor must be > 0, got {self.rope.factor}", field="rope_scaling.factor")
        if self.rope.scaling in ("yarn", "llama3") and not self.rope.original_max_position_embeddings:
            raise ConfigError(
                f"rope_scaling type {self.rope.scaling} needs original_max_position_embeddings",
                field="rope_scaling.original_max_position_embeddings",
            )
        if self.model_type.startswith("deepseek"):
            if self.mla is None:
                raise ConfigError(f"{self.model_type} needs MLA dimensions (kv_lora_rank, ...)", field="kv_lora_rank")
        elif self.mla is not None or self.moe is not None:
            raise ConfigError(f"{self.model_type} is a dense GQA model; it takes no MLA/MoE fields", field="model_type")
        if self.mla is not None:
            for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                value = getattr(self.mla, name)
                if not isinstance(value, int) or value <= 0:
                    raise ConfigError(f"{name} must be a positive integer, got {value!r}", field=name)
            if self.mla.q_lora_rank is not None and self.mla.q_lora_rank <= 0:
                raise ConfigError(f"q_lora_rank must be null or > 0, got {self.mla.q_lora_rank}", field="q_lora_rank")
        if self.moe is not None:
            self._validate_moe(self.moe)

    def _validate_moe(self, moe: MoEConfig) -> None:
        if moe.n_routed_experts <= 0:
            raise ConfigError(f"n_routed_experts must be > 0, got {moe.n_routed_experts}", field="n_routed_experts")
        if not 0 < moe.num_experts_per_tok <= moe.n_routed_experts:
            raise ConfigError(
                f"num_experts_per_tok ({moe.num_experts_per_tok}) must be in 1..n_routed_experts "
                f"({moe.n_routed_experts})",
                field="num_experts_per_tok",
            )
        if moe.scoring_func not in ("softmax", "sigmoid"):
            raise ConfigError(f"scoring_func {moe.scoring_func!r} is not softmax or sigmoid", field="scoring_func")
        if moe.topk_method not in ("greedy", "group_limited_greedy", "noaux_tc"):
            raise ConfigError(
                f"topk_method {moe.topk_method!r} is not one of greedy, group_limited_greedy, noaux_tc",
                field="topk_method",
            )
        if moe.n_group <= 0 or moe.n_routed_experts % moe.n_group:
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
        if moe.moe_intermediate_size <= 0:
            raise ConfigError("moe_intermediate_size must be > 0", field="moe_intermediate_size")
        if not 0 <= moe.first_k_dense_replace <= self.num_hidden_layers:
            raise ConfigError(
                f"first_k_dense_replace ({moe.first_k_dense_replace}) must be in 0..num_hidden_layers",
                field="first_k_dense_replace",
            )

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (written into artifact manifests)."""
        out = dataclasses.asdict(self)
        out["eos_token_ids"] = list(self.eos_token_ids)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """Inverse of ``to_dict``."""
        data = dict(data)
        data["rope"] = RopeConfig(**data.get("rope", {}))
        data["mla"] = MLAConfig(**data["mla"]) if data.get("mla") else None
        data["moe"] = MoEConfig(**data["moe"]) if data.get("moe") else None
        data["eos_token_ids"] = tuple(data.get("eos_token_ids", ()))
        return cls(**data)

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf_json(cls, path: str | Path) -> ModelConfig:
        """Read a Hugging Face ``config.json``."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path} does not exist: an HF model folder needs a config.json") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path} is not valid JSON: {exc}") from None
        return cls.from_hf_dict(data, name=path.parent.name)

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], name: str = "") -> ModelConfig:
        """Translate an HF config dict; unknown or unsupported settings raise ``ConfigError``."""
        model_type = hf.get("model_type")
        if model_type is None:
            raise ConfigError("config.json has no model_type field", field="model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}",
                field="model_type",
            )

        def need(key: str) -> Any:
            if hf.get(key) is None:
                raise ConfigError(f"config.json is missing the required field {key!r} ({model_type})", field=key)
            return hf[key]

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        act = hf.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ConfigError(f"hidden_act {act!r} is not supported (SwiGLU with silu only)", field="hidden_act")
        if hf.get("mlp_bias"):
            raise ConfigError("mlp_bias=true is not supported", field="mlp_bias")
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        common: dict[str, Any] = dict(
            model_type=model_type,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            num_hidden_layers=int(need("num_hidden_layers")),
            num_attention_heads=heads,
            num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=name or hf.get("_name_or_path", "") or model_type,
        )
        deepseek = model_type.startswith("deepseek")
        common["rope"] = _rope_from_hf(hf, interleaved_default=deepseek)
        if deepseek:
            mla = MLAConfig(
                q_lora_rank=hf.get("q_lora_rank"),
                kv_lora_rank=int(need("kv_lora_rank")),
                qk_nope_head_dim=int(need("qk_nope_head_dim")),
                qk_rope_head_dim=int(need("qk_rope_head_dim")),
                v_head_dim=int(need("v_head_dim")),
            )
            moe = None
            n_experts = hf.get("n_routed_experts")
            if n_experts:
                default_method = "noaux_tc" if model_type == "deepseek_v3" else "greedy"
                default_scoring = "sigmoid" if model_type == "deepseek_v3" else "softmax"
                moe = MoEConfig(
                    n_routed_experts=int(n_experts),
                    n_shared_experts=int(hf.get("n_shared_experts") or 0),
                    num_experts_per_tok=int(need("num_experts_per_tok")),
                    moe_intermediate_size=int(need("moe_intermediate_size")),
                    first_k_dense_replace=int(hf.get("first_k_dense_replace") or 0),
                    # Checked by ModelConfig.validate(), with a message naming the field.
                    scoring_func=cast(ScoringFunc, hf.get("scoring_func") or default_scoring),
                    topk_method=cast(TopkMethod, hf.get("topk_method") or default_method),
                    n_group=int(hf.get("n_group") or 1),
                    topk_group=int(hf.get("topk_group") or 1),
                    norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                    routed_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0),
                )
                if hf.get("moe_layer_freq", 1) != 1:
                    raise ConfigError("moe_layer_freq != 1 is not supported", field="moe_layer_freq")
            return cls(
                **common,
                intermediate_size=int(need("intermediate_size")),
                head_dim=mla.qk_rope_head_dim,
                qkv_bias=bool(hf.get("attention_bias", False)),
                o_proj_bias=bool(hf.get("attention_bias", False)),
                mla=mla,
                moe=moe,
            )

        head_dim = int(hf.get("head_dim") or hidden // heads)
        if model_type == "qwen2":
            qkv_bias, o_bias = True, False  # Qwen2 always has q/k/v biases and no o_proj bias
            window = None
            if hf.get("use_sliding_window"):
                if int(hf.get("max_window_layers", 0)) < common["num_hidden_layers"]:
                    raise ConfigError(
                        "Qwen2 sliding window on only some layers (max_window_layers) is not supported",
                        field="max_window_layers",
                    )
                window = int(need("sliding_window"))
        else:
            qkv_bias = o_bias = bool(hf.get("attention_bias", False))
            window = hf.get("sliding_window")
            window = int(window) if window else None
        if common["rope"].interleaved:
            raise ConfigError("interleaved rope weights are only read for DeepSeek", field="rope_interleave")
        return cls(
            **common,
            intermediate_size=int(need("intermediate_size")),
            head_dim=head_dim,
            qkv_bias=qkv_bias,
            o_proj_bias=o_bias,
            sliding_window=window,
        )


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN magnitude correction: 0.1 * mscale * ln(factor) + 1 (1.0 when factor <= 1)."""
    if factor <= 1:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


def _rope_from_hf(hf: dict[str, Any], interleaved_default: bool) -> RopeConfig:
    # transformers v5 writes rope_parameters (theta inside); older files write rope_theta + rope_scaling.
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = merged.get("rope_type", merged.get("type", "default")) or "default"
    if kind not in ("default", "linear", "yarn", "llama3"):
        raise ConfigError(
            f"rope_scaling type {kind!r} is not supported (default, linear, yarn, llama3)", field="rope_scaling.type"
        )
    interleaved = bool(hf.get("rope_interleave", interleaved_default))
    if kind == "default":
        return RopeConfig(theta=theta, interleaved=interleaved)
    factor = merged.get("factor")
    original = merged.get("original_max_position_embeddings")
    if factor is None and kind == "yarn" and original:
        factor = hf.get("max_position_embeddings", original) / original
    if factor is None:
        raise ConfigError(f"rope_scaling ({kind}) is missing 'factor'", field="rope_scaling.factor")
    return RopeConfig(
        theta=theta,
        scaling=cast(RopeScaling, kind),  # checked above
        factor=float(factor),
        original_max_position_embeddings=int(original) if original else None,
        beta_fast=float(merged.get("beta_fast") or 32.0),
        beta_slow=float(merged.get("beta_slow") or 1.0),
        mscale=merged.get("mscale"),
        mscale_all_dim=merged.get("mscale_all_dim"),
        attention_factor=merged.get("attention_factor"),
        truncate=bool(merged.get("truncate", True)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        interleaved=interleaved,
    )
