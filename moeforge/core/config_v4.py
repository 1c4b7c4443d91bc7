"""DeepSeek-V4's parts of a ``ModelConfig``: read from an HF ``config.json`` as transformers 5.25 reads it
(``DeepseekV4Config.__post_init__``: class defaults, legacy keys, the two RoPE settings), checked, and counted.

``ModelConfig.from_hf_dict`` takes ``v4_fields_from_hf``'s fields, ``ModelConfig.validate`` calls ``validate_v4``;
the sizes (``v4_layer_parameters``, ``v4_kv_values_per_token``) follow ``moeforge/model/deepseek_v4.py``'s modules.
Settings transformers ignores are ignored here too, with a warning; what it cannot build is refused by name.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Protocol, cast

from moeforge.core.config_fields import check_float, check_int, opt_bool, opt_dict, opt_float, opt_int, show
from moeforge.core.config_types import (
    V4_LAYER_TYPES,
    CompressedAttentionConfig,
    DSAConfig,
    HyperConnectionConfig,
    MLAConfig,
    MoEConfig,
    RopeConfig,
    ScoringFunc,
    V4LayerType,
)
from moeforge.core.errors import ConfigError

log = logging.getLogger(__name__)


class ModelConfig(Protocol):
    """The fields of ``moeforge.core.config.ModelConfig`` the checks and counts here read (a protocol: that module
    imports this one)."""

    @property
    def model_type(self) -> str: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def num_hidden_layers(self) -> int: ...
    @property
    def num_attention_heads(self) -> int: ...
    @property
    def num_key_value_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def sliding_window(self) -> int | None: ...
    @property
    def rope(self) -> RopeConfig: ...
    @property
    def mla(self) -> MLAConfig | None: ...
    @property
    def dsa(self) -> DSAConfig | None: ...
    @property
    def moe(self) -> MoEConfig | None: ...
    @property
    def compressed_attention(self) -> CompressedAttentionConfig | None: ...
    @property
    def hyper_connections(self) -> HyperConnectionConfig | None: ...
    @property
    def num_nextn_predict_layers(self) -> int: ...

# transformers' DeepseekV4Config class defaults (DeepSeek-V4-Flash's values), for keys config.json leaves out.
V4_DEFAULTS: dict[str, Any] = {
    "head_dim": 512, "q_lora_rank": 1024, "moe_intermediate_size": 2048, "num_experts_per_tok": 6,
    "n_routed_experts": 256, "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5, "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "swiglu_limit": 10.0,
    "sliding_window": 128, "o_groups": 8, "o_lora_rank": 1024, "index_n_heads": 64, "index_head_dim": 128,
    "index_topk": 512, "num_nextn_predict_layers": 1, "num_hash_layers": 3, "partial_rotary_factor": 64 / 512,
}
CSA: V4LayerType = "compressed_sparse_attention"
HCA: V4LayerType = "heavily_compressed_attention"
DEFAULT_COMPRESS_RATES: dict[str, int] = {CSA: 4, HCA: 128}
# The legacy per-layer ``compress_ratios`` (0 / 4 / 128) as transformers maps them to layer types.
_RATIO_TO_LAYER_TYPE: dict[int, V4LayerType] = {0: "sliding_attention", 4: CSA, 128: HCA}
MLP_LAYER_TYPES = ("hash_moe", "moe")


def _default(hf: dict[str, Any], key: str) -> Any:
    value = hf.get(key)
    return V4_DEFAULTS[key] if value is None else value


def _int(hf: dict[str, Any], key: str, limits: str | None = None) -> int:
    return check_int(_default(hf, key), key, limits)


def _float(hf: dict[str, Any], key: str, positive: bool = False) -> float:
    return check_float(_default(hf, key), key, positive)


def v4_fields_from_hf(hf: dict[str, Any], layers: int, max_positions: int) -> dict[str, Any]:
    """The ``ModelConfig`` fields of a ``deepseek_v4`` config.json beyond the common ones (vocabulary, hidden size,
    layers, heads, eps, positions, ids): head_dim, the window, the main RoPE, MoE, compressed attention, mHC, MTP."""
    head_dim = _int(hf, "head_dim", "head_dim")
    kv_heads = hf.get("num_key_value_heads")
    if kv_heads is not None and kv_heads != 1:
        log.warning("deepseek_v4 config sets num_key_value_heads=%s: transformers' DeepSeek-V4 attention has one "
                    "shared KV head whatever it says, and so does moeforge", show(kv_heads))
    if opt_bool(hf, "attention_bias", False):
        log.warning("deepseek_v4 config sets attention_bias=true: transformers' DeepSeek-V4 attention has no biases, "
                    "and neither does moeforge's")
    rope_dim = _rope_dim(hf, head_dim)
    main, compress = _ropes(hf, head_dim, rope_dim, max_positions)
    layer_types = _layer_types(hf, layers)
    rates = _compress_rates(hf, layer_types)
    moe = _moe(hf, layers)
    return {
        "head_dim": head_dim,
        "intermediate_size": moe.moe_intermediate_size,  # no dense MLP: the shared expert's size stands in
        "num_key_value_heads": 1,
        "sliding_window": _int(hf, "sliding_window", "sliding_window"),
        "rope": main,
        "moe": moe,
        "compressed_attention": CompressedAttentionConfig(
            q_lora_rank=_int(hf, "q_lora_rank", "q_lora_rank"), qk_rope_head_dim=rope_dim,
            o_groups=_int(hf, "o_groups", "o_groups"), o_lora_rank=_int(hf, "o_lora_rank", "o_lora_rank"),
            layer_types=layer_types, csa_rate=rates[CSA], hca_rate=rates[HCA], compress_rope=compress,
            indexer=DSAConfig(index_topk=_int(hf, "index_topk", "index_topk"),
                              index_head_dim=_int(hf, "index_head_dim", "index_head_dim"),
                              index_n_heads=_int(hf, "index_n_heads", "index_n_heads"))),
        "hyper_connections": HyperConnectionConfig(
            hc_mult=_int(hf, "hc_mult", "hc_mult"), sinkhorn_iters=_int(hf, "hc_sinkhorn_iters", "hc_sinkhorn_iters"),
            eps=_float(hf, "hc_eps")),
        "num_nextn_predict_layers": _int(hf, "num_nextn_predict_layers", "num_nextn_predict_layers"),
    }


def _rope_dim(hf: dict[str, Any], head_dim: int) -> int:
    """Dims of each head RoPE turns: head_dim * partial_rotary_factor, else the legacy qk_rope_head_dim, else 64/512."""
    factor = opt_float(hf, "partial_rotary_factor", None)
    if factor is None:
        legacy = opt_int(hf, "qk_rope_head_dim", None, "qk_rope_head_dim")
        factor = legacy / head_dim if legacy is not None else V4_DEFAULTS["partial_rotary_factor"]
    if not 0 < factor <= 1:
        raise ConfigError(f"partial_rotary_factor must be in (0, 1], got {factor}", field="partial_rotary_factor")
    return int(head_dim * factor)


def _ropes(hf: dict[str, Any], head_dim: int, rope_dim: int, max_positions: int) -> tuple[RopeConfig, RopeConfig]:
    """(main, compress) as transformers builds ``rope_parameters``: already nested {"main", "compress"} (what
    save_pretrained writes), or a flat rope dict (rope_scaling / rope_parameters) that becomes the compressed layers'
    scaling over compress_rope_theta (YaRN with attention_factor 1), the main one plain RoPE over rope_theta."""
    scaling = opt_dict(hf, "rope_scaling")
    flat, prefix = (scaling, "rope_scaling.") if scaling else (opt_dict(hf, "rope_parameters"), "rope_parameters.")
    theta = _float(hf, "rope_theta", positive=True)
    if isinstance(flat.get("main"), dict) and isinstance(flat.get("compress"), dict):
        main_d, compress_d = dict(flat["main"]), dict(flat["compress"])
        main_d.setdefault("rope_theta", theta)
        compress_d.setdefault("rope_theta", theta)
        names = (f"{prefix}main.", f"{prefix}compress.")
    else:
        scaled = {k: v for k, v in flat.items() if k not in ("main", "compress")}
        main_d = {"rope_type": "default", "rope_theta": theta}
        compress_d = {**scaled, "rope_theta": _float(hf, "compress_rope_theta", positive=True)}
        compress_d["rope_type"] = scaled.get("rope_type", scaled.get("type", "default"))
        if compress_d["rope_type"] == "yarn":
            compress_d.setdefault("attention_factor", 1.0)  # the V4 reference leaves cos/sin unscaled
        names = ("rope_theta / ", prefix)
    return (_rope(main_d, names[0], head_dim, rope_dim, max_positions),
            _rope(compress_d, names[1], head_dim, rope_dim, max_positions))


def _rope(d: dict[str, Any], prefix: str, head_dim: int, rope_dim: int, max_positions: int) -> RopeConfig:
    kind = d.get("rope_type", d.get("type", "default")) or "default"
    if kind not in ("default", "yarn"):
        raise ConfigError(f"{prefix}rope_type {show(kind)} is not supported for deepseek_v4 (default or yarn)",
                          field=f"{prefix}rope_type")
    factor = opt_float(d, "partial_rotary_factor", None, prefix)
    if factor is not None and int(head_dim * factor) != rope_dim:
        raise ConfigError(f"{prefix}partial_rotary_factor {factor} turns {int(head_dim * factor)} dims, but the "
                          f"model's partial_rotary_factor turns {rope_dim}: both RoPE settings must turn the same dims",
                          field=f"{prefix}partial_rotary_factor")
    theta = opt_float(d, "rope_theta", None, prefix, positive=True)
    assert theta is not None  # set by _ropes
    if kind == "default":
        return RopeConfig(theta=theta, interleaved=True)
    original = opt_int(d, "original_max_position_embeddings", max_positions, "original_max_position_embeddings",
                       prefix)
    scale = opt_float(d, "factor", None, prefix)
    if d.get("truncate") is False:
        # transformers reads truncate from the top-level (nested) rope dict, where it never is: always True.
        log.warning("deepseek_v4 config sets %struncate=false: transformers' DeepSeek-V4 ignores it (truncates), and "
                    "so does moeforge", prefix)
    return RopeConfig(
        theta=theta, scaling="yarn",
        factor=scale if scale is not None else max_positions / original,
        original_max_position_embeddings=original,
        beta_fast=opt_float(d, "beta_fast", None, prefix) or 32.0,
        beta_slow=opt_float(d, "beta_slow", None, prefix) or 1.0,
        mscale=opt_float(d, "mscale", None, prefix), mscale_all_dim=opt_float(d, "mscale_all_dim", None, prefix),
        attention_factor=opt_float(d, "attention_factor", None, prefix), truncate=True, interleaved=True)


def _per_layer(hf: dict[str, Any], key: str, layers: int, allowed: tuple[str, ...]) -> list[str] | None:
    """``hf[key]`` as transformers keeps it: one entry of ``allowed`` per layer (a longer list is cut to the layers)."""
    value = hf.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or len(value) < layers or not all(v in allowed for v in value[:layers]):
        raise ConfigError(f"{key} must list one of {', '.join(allowed)} for each of the {layers} layers, got "
                          f"{show(value)}", field=key)
    if len(value) > layers:
        log.warning("deepseek_v4 config lists %d %s for %d layers: transformers uses the first %d, and so does "
                    "moeforge", len(value), key, layers, layers)
    return [str(v) for v in value[:layers]]


def _layer_types(hf: dict[str, Any], layers: int) -> tuple[V4LayerType, ...]:
    """layer_types, else the legacy compress_ratios (0 / 4 / 128 per layer), else transformers' default: two HCA
    layers, then CSA and HCA alternating (odd: CSA)."""
    types: list[str] | None = _per_layer(hf, "layer_types", layers, V4_LAYER_TYPES)
    if types is None and hf.get("compress_ratios") is not None:
        ratios = hf["compress_ratios"]
        if not isinstance(ratios, list) or len(ratios) < layers or any(
                isinstance(r, bool) or r not in _RATIO_TO_LAYER_TYPE for r in ratios[:layers]):
            raise ConfigError(f"compress_ratios must give 0, 4 or 128 for each of the {layers} layers (transformers' "
                              f"legacy mapping to layer types), got {show(ratios)}", field="compress_ratios")
        types = [str(_RATIO_TO_LAYER_TYPE[r]) for r in ratios[:layers]]
    if types is None:
        types = [str(HCA)] * min(layers, 2) + [str(CSA if i % 2 else HCA) for i in range(max(layers - 2, 0))]
    return tuple(cast(V4LayerType, t) for t in types)


def _compress_rates(hf: dict[str, Any], layer_types: tuple[V4LayerType, ...]) -> dict[str, int]:
    """Tokens per compressed entry of CSA and HCA layers: compress_rates (the legacy compress_rate_csa /
    compress_rate_hca win), transformers' defaults (4, 128) when the dict is absent."""
    given = hf.get("compress_rates")
    if given is not None and not isinstance(given, dict):
        raise ConfigError(f"compress_rates must be a JSON object {{layer type: tokens per entry}}, got {show(given)}",
                          field="compress_rates")
    rates: dict[str, Any] = dict(DEFAULT_COMPRESS_RATES) if given is None else dict(given)
    for kind, legacy in ((CSA, "compress_rate_csa"), (HCA, "compress_rate_hca")):
        if hf.get(legacy) is not None:
            rates[kind] = hf[legacy]
    out: dict[str, int] = {}
    for kind in (CSA, HCA):
        if kind not in rates:
            if kind in layer_types:
                raise ConfigError(f"compress_rates has no rate for {kind}, which layer_types uses",
                                  field="compress_rates")
            rates[kind] = DEFAULT_COMPRESS_RATES[kind]  # no layer of that type: never read
        out[kind] = check_int(rates[kind], f"compress_rates.{kind}", "compress_rate")
    return out


def _moe(hf: dict[str, Any], layers: int) -> MoEConfig:
    """Every layer is MoE: top-k on scores + correction bias (sqrtsoftplus or sigmoid scores), or (hash_moe) the
    experts a frozen tid2eid table names; weights always renormalised, times routed_scaling_factor; one shared expert
    of moe_intermediate_size; experts' SwiGLU clamped to swiglu_limit."""
    scoring = _default(hf, "scoring_func")
    if scoring not in ("sqrtsoftplus", "sigmoid"):
        raise ConfigError(f"scoring_func {show(scoring)} is not supported for deepseek_v4: transformers' DeepSeek-V4 "
                          "router scores with sqrtsoftplus or sigmoid", field="scoring_func")
    for key, used, why in (("norm_topk_prob", True, "always renormalises the top-k weights"),
                           ("n_shared_experts", 1, "builds one shared expert of moe_intermediate_size"),
                           ("n_group", 1, "has no expert groups"), ("topk_group", 1, "has no expert groups")):
        if hf.get(key) is not None and hf[key] != used:
            log.warning("deepseek_v4 config sets %s=%s: transformers' DeepSeek-V4 %s, and so does moeforge",
                        key, show(hf[key]), why)
    mlp_types = _per_layer(hf, "mlp_layer_types", layers, MLP_LAYER_TYPES)
    if mlp_types is None:
        hashed = _int(hf, "num_hash_layers", "num_hidden_layers") if hf.get("num_hash_layers") is not None \
            else V4_DEFAULTS["num_hash_layers"]
        mlp_types = ["hash_moe"] * min(layers, hashed) + ["moe"] * max(0, layers - hashed)
    experts_key = "n_routed_experts" if hf.get("n_routed_experts") is not None else "num_local_experts"
    intermediate = hf.get("moe_intermediate_size")
    return MoEConfig(
        n_routed_experts=check_int(hf.get(experts_key) or V4_DEFAULTS["n_routed_experts"], experts_key,
                                   "n_routed_experts"),
        n_shared_experts=1,
        num_experts_per_tok=_int(hf, "num_experts_per_tok", "num_experts_per_tok"),
        moe_intermediate_size=check_int(intermediate if intermediate is not None
                                        else hf.get("intermediate_size") or V4_DEFAULTS["moe_intermediate_size"],
                                        "moe_intermediate_size", "moe_intermediate_size"),
        scoring_func=cast(ScoringFunc, scoring), topk_method="noaux_tc", norm_topk_prob=True,
        routed_scaling_factor=_float(hf, "routed_scaling_factor", positive=True),
        hash_layers=tuple(i for i, kind in enumerate(mlp_types) if kind == "hash_moe"),
        swiglu_limit=_float(hf, "swiglu_limit", positive=True),
    )


# ---------------------------------------------------------------------------------------- validation
def validate_v4(config: ModelConfig) -> None:
    """DeepSeek-V4's parts: present exactly for deepseek_v4, typed, bounded and consistent with the model's sizes."""
    attn, hc, moe = config.compressed_attention, config.hyper_connections, config.moe
    if config.model_type != "deepseek_v4":
        for name, value in (("compressed_attention", attn), ("hyper_connections", hc)):
            if value is not None:
                raise ConfigError(f"{config.model_type} has no {name}: it belongs to deepseek_v4", field=name)
        if moe is not None and (moe.hash_layers or moe.swiglu_limit is not None):
            raise ConfigError(f"{config.model_type}: hash-routed layers and swiglu_limit belong to deepseek_v4",
                              field="mlp_layer_types")
        return
    if config.mla is not None or config.dsa is not None:
        raise ConfigError("deepseek_v4 has its own attention: it takes no MLA / DSA fields", field="model_type")
    if not isinstance(attn, CompressedAttentionConfig) or not isinstance(hc, HyperConnectionConfig) \
            or not isinstance(moe, MoEConfig):
        raise ConfigError(f"deepseek_v4 needs its attention, hyper-connection and MoE settings, got {show(attn)}, "
                          f"{show(hc)}, {show(moe)}", field="model_type")
    if config.num_key_value_heads != 1:
        raise ConfigError(f"deepseek_v4 has one shared KV head, got num_key_value_heads={config.num_key_value_heads}",
                          field="num_key_value_heads")
    if config.sliding_window is None:
        raise ConfigError("deepseek_v4 needs sliding_window (every layer attends to that window)",
                          field="sliding_window")
    _validate_attention(config, attn)
    for name, limits in (("hc_mult", "hc_mult"), ("sinkhorn_iters", "hc_sinkhorn_iters")):
        check_int(getattr(hc, name), f"hc_{name}" if name == "sinkhorn_iters" else name, limits)
    if check_float(hc.eps, "hc_eps") < 0:
        raise ConfigError(f"hc_eps must be >= 0, got {hc.eps}", field="hc_eps")
    check_int(config.num_nextn_predict_layers, "num_nextn_predict_layers", "num_nextn_predict_layers")
    if moe.first_k_dense_replace or moe.dense_layers:
        raise ConfigError("deepseek_v4 has no dense layers (every layer is MoE)", field="mlp_layer_types")
    if moe.scoring_func not in ("sqrtsoftplus", "sigmoid") or moe.topk_method != "noaux_tc" or moe.n_group != 1:
        raise ConfigError(f"deepseek_v4 routes with sqrtsoftplus or sigmoid scores, top-k on the bias-corrected "
                          f"choice, one group; got {moe.scoring_func} {moe.topk_method} with {moe.n_group} groups",
                          field="scoring_func")
    if not moe.norm_topk_prob or moe.n_shared_experts != 1:
        raise ConfigError("deepseek_v4 renormalises its top-k weights and has one shared expert",
                          field="norm_topk_prob")
    if moe.swiglu_limit is None or check_float(moe.swiglu_limit, "swiglu_limit", positive=True) <= 0:
        raise ConfigError("deepseek_v4 needs swiglu_limit > 0", field="swiglu_limit")
    if not isinstance(moe.hash_layers, tuple) or any(
            isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < config.num_hidden_layers
            for i in moe.hash_layers):
        raise ConfigError(f"hash layers must be layer indices in 0..{config.num_hidden_layers - 1}, got "
                          f"{show(moe.hash_layers)}", field="mlp_layer_types")


def _validate_attention(config: ModelConfig, attn: CompressedAttentionConfig) -> None:
    for name in ("q_lora_rank", "qk_rope_head_dim", "o_groups", "o_lora_rank"):
        check_int(getattr(attn, name), name, name)
    check_int(attn.csa_rate, f"compress_rates.{CSA}", "compress_rate")
    check_int(attn.hca_rate, f"compress_rates.{HCA}", "compress_rate")
    if not isinstance(attn.indexer, DSAConfig):
        raise ConfigError(f"the indexer's sizes must be a DSAConfig, got {show(attn.indexer)}", field="index_topk")
    for name in ("index_topk", "index_head_dim", "index_n_heads"):
        check_int(getattr(attn.indexer, name), name, name)
    rope = attn.qk_rope_head_dim
    if rope % 2 or rope > config.head_dim or rope > attn.indexer.index_head_dim:
        raise ConfigError(f"the rotary dims ({rope} = head_dim * partial_rotary_factor) must be even and at most "
                          f"head_dim ({config.head_dim}) and index_head_dim ({attn.indexer.index_head_dim})",
                          field="partial_rotary_factor")
    width = config.num_attention_heads * config.head_dim
    if width % attn.o_groups:
        raise ConfigError(f"o_groups ({attn.o_groups}) must divide num_attention_heads * head_dim ({width}): the "
                          "grouped output projection splits the heads' outputs evenly", field="o_groups")
    if not isinstance(attn.layer_types, tuple) or len(attn.layer_types) != config.num_hidden_layers or any(
            t not in V4_LAYER_TYPES for t in attn.layer_types):
        raise ConfigError(f"layer_types must list one of {', '.join(V4_LAYER_TYPES)} for each of the "
                          f"{config.num_hidden_layers} layers, got {show(attn.layer_types)}", field="layer_types")
    if not isinstance(attn.compress_rope, RopeConfig) or not attn.compress_rope.interleaved \
            or not config.rope.interleaved:
        raise ConfigError("deepseek_v4's RoPE pairs adjacent dims (interleaved) in both settings",
                          field="rope_parameters")


# ---------------------------------------------------------------------------------------- sizes
def v4_layer_parameters(config: ModelConfig, i: int) -> int:
    """Parameters of DeepSeek-V4 decoder layer ``i`` (transformers' DeepseekV4DecoderLayer), from shapes alone."""
    attn, hc, moe = config.compressed_attention, config.hyper_connections, config.moe
    assert attn is not None and hc is not None and moe is not None
    h, d, n = config.hidden_size, config.head_dim, config.num_attention_heads
    mixes = (2 + hc.hc_mult) * hc.hc_mult
    total = 2 * h + 2 * (mixes * hc.hc_mult * h + mixes + 3)  # two norms, two hyper-connections
    q, groups = attn.q_lora_rank, attn.o_groups
    total += h * q + q + q * n * d + h * d + d + n * d * attn.o_lora_rank + groups * attn.o_lora_rank * h + n
    rate = attn.compress_rate(i)
    if rate is not None:
        overlap = 2 if attn.layer_types[i] == CSA else 1  # CSA's windows overlap: two series per token
        total += _compressor_parameters(h, d, rate, overlap)
        if overlap == 2:  # the indexer: its own compressor at index_head_dim, q_b_proj, weights_proj
            ix = attn.indexer
            total += _compressor_parameters(h, ix.index_head_dim, rate, 2)
            total += q * ix.index_n_heads * ix.index_head_dim + h * ix.index_n_heads
    experts = moe.n_routed_experts + moe.n_shared_experts
    total += 3 * h * moe.moe_intermediate_size * experts + moe.n_routed_experts * h
    if i not in moe.hash_layers:
        total += moe.n_routed_experts  # the correction bias (a hash layer's tid2eid table holds token ids)
    return total


def _compressor_parameters(h: int, width: int, rate: int, overlap: int) -> int:
    # kv_proj and gate_proj [overlap * width, h], position_bias [rate, overlap * width], kv_norm [width]
    return 2 * h * overlap * width + rate * overlap * width + width


def v4_head_parameters(config: ModelConfig) -> int:
    """Parameters of the final HyperHead (hc_fn [N, N*H], hc_base [N], hc_scale [1])."""
    hc = config.hyper_connections
    assert hc is not None
    return hc.hc_mult * hc.hc_mult * config.hidden_size + hc.hc_mult + 1


def v4_kv_values_per_token(config: ModelConfig) -> int:
    """Cached values one more token adds, per layer on average over the layers (rounded up; times the layer count:
    the whole model's): a CSA layer's (head_dim + index_head_dim) / csa_rate, an HCA layer's head_dim / hca_rate, a
    sliding layer's none (its window is a constant sliding_window * head_dim, as is every layer's)."""
    attn = config.compressed_attention
    assert attn is not None
    per_layer = {"sliding_attention": 0.0, CSA: (config.head_dim + attn.indexer.index_head_dim) / attn.csa_rate,
                 HCA: config.head_dim / attn.hca_rate}
    return math.ceil(sum(per_layer[kind] for kind in attn.layer_types) / len(attn.layer_types))
