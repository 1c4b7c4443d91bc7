"""Hugging Face ``config.json`` -> the parts of a ``ModelConfig``, read as transformers v5 reads each family.

Missing keys take transformers' class defaults (``HF_DEFAULTS``), so moeforge and transformers build the same model
from the same file; settings transformers ignores are ignored here too, with a warning; anything moeforge cannot
build is refused by name. ``ModelConfig.from_hf_dict`` (``moeforge.core.config``) assembles the result.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, cast

from moeforge.core.config_fields import check_int, opt_bool, opt_dict, opt_float, opt_int, show
from moeforge.core.config_types import (
    MLA_FAMILIES,
    DSAConfig,
    MoEConfig,
    RopeConfig,
    RopeScaling,
    ScoringFunc,
    TopkMethod,
)
from moeforge.core.errors import ConfigError

log = logging.getLogger(__name__)

# What transformers v5 assumes when config.json leaves a field out (configuration_<family>.py's class defaults, and
# default_theta = 1e6 for Mixtral, 1e4 for the rest): moeforge reads a missing key the same way, so both build
# the same model. Families not listed for a key use its "*" entry; the DeepSeekMoE keys are read for DeepSeek only.
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "rms_norm_eps": {"*": 1e-6, "mixtral": 1e-5, "olmoe": 1e-5, "glm4_moe": 1e-5},
    "rope_theta": {"*": 10000.0, "mixtral": 1e6},
    "max_position_embeddings": {"*": 4096, "llama": 2048, "deepseek_v2": 2048, "qwen2": 32768, "qwen3": 32768,
                                "qwen3_moe": 32768, "mistral": 131072, "mixtral": 131072, "glm4_moe": 131072,
                                "deepseek_v32": 163840, "deepseek_v4": 1048576},
    # None: num_attention_heads
    "num_key_value_heads": {"*": None, "qwen2": 32, "qwen3": 32, "mistral": 8, "mixtral": 8, "qwen3_moe": 4,
                            "glm4_moe": 8},
    # DeepSeekMoE only (GLM-4.5 reads its own defaults in moe_gqa_fields): V2's and V3's (and V3.2's) differ
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


def deepseek_moe(hf: dict[str, Any], model_type: str, n_experts: int, need: Callable[..., int]) -> MoEConfig:
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

    first_dense = min(opt_int(hf, "first_k_dense_replace", default("first_k_dense_replace")), layers)
    dense_layers: tuple[int, ...] = ()
    types = hf.get("mlp_layer_types") if model_type == "deepseek_v32" else None
    if types is not None:
        if not isinstance(types, list) or len(types) != layers or not set(types) <= {"dense", "sparse"}:
            raise ConfigError(f"mlp_layer_types must list 'dense' or 'sparse' for each of the {layers} layers, got "
                              f"{show(types)}", field="mlp_layer_types")
        first_dense, dense_layers = 0, tuple(i for i, kind in enumerate(types) if kind == "dense")
    return MoEConfig(
        n_routed_experts=n_experts,
        n_shared_experts=opt_int(hf, "n_shared_experts", default("n_shared_experts")),
        num_experts_per_tok=need("num_experts_per_tok"),
        moe_intermediate_size=need("moe_intermediate_size"),
        first_k_dense_replace=first_dense,
        # Checked by ModelConfig.validate(), with a message naming the field.
        scoring_func=cast(ScoringFunc, scoring),
        topk_method=cast(TopkMethod, method),
        n_group=opt_int(hf, "n_group", default("n_group")),
        topk_group=opt_int(hf, "topk_group", default("topk_group")),
        norm_topk_prob=_deepseek_norm_topk_prob(hf, v3),
        routed_scaling_factor=opt_float(hf, "routed_scaling_factor", default("routed_scaling_factor")),
        dense_layers=dense_layers,
    )


def _deepseek_norm_topk_prob(hf: dict[str, Any], v3: bool) -> bool:
    """``norm_topk_prob`` as transformers v5 applies it: V3 (and V3.2) renormalise the top-k weights when it is set;
    V2's router never does (DeepseekV2TopkRouter: softmax, top-k, times routed_scaling_factor), whatever the config
    says -- released V2 checkpoints all say false. A V2 config that says true is followed as transformers runs it,
    with a warning, since DeepSeek's own V2 code would renormalise (and then not scale)."""
    value = opt_bool(hf, "norm_topk_prob", v3)  # transformers' defaults: V3 True, V2 False
    if value and not v3:
        log.warning("deepseek_v2 config sets norm_topk_prob=true: transformers' DeepSeek-V2 router ignores it (the "
                    "top-k softmax weights are not renormalised), and so does moeforge, to match it")
    return value and v3


def qwen_sliding_window(hf: dict[str, Any], layers: int, need: Callable[..., int]) -> int | None:
    """Qwen2's sliding window as transformers v5 applies it: the window exists only with ``use_sliding_window``, and
    then applies to the layers ``layer_types`` marks "sliding_attention" (default: layers i >= ``max_window_layers``);
    so the window is None when no layer slides, and a mix of sliding and full layers is refused by name."""
    if not opt_bool(hf, "use_sliding_window", False):
        return None
    window = need("sliding_window")
    types = hf.get("layer_types")
    if types is None:
        first = opt_int(hf, "max_window_layers")
        first = 28 if first is None else first  # transformers' default
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or not set(types) <= {"sliding_attention",
                                                                                  "full_attention"}:
        raise ConfigError(f"layer_types must list 'sliding_attention' or 'full_attention' for each of the {layers} "
                          f"layers, got {show(types)}", field="layer_types")
    sliding = [i for i, kind in enumerate(types) if kind == "sliding_attention"]
    if not sliding:
        return None  # use_sliding_window, but max_window_layers >= num_hidden_layers: every layer attends fully
    if len(sliding) < layers:
        raise ConfigError(f"a sliding window on some layers only (layers {sliding[0]}..{sliding[-1]} of {layers}, from "
                          "max_window_layers / layer_types) is not supported: moeforge applies one window to every "
                          "layer or to none", field="max_window_layers")
    return window


# ---------------------------------------------------------------------------------------- GQA + MoE families
def moe_gqa_fields(hf: dict[str, Any], model_type: str, head_dim: int, need: Callable[..., int]) -> dict[str, Any]:
    """The ModelConfig fields (beyond ``common``) of Qwen3-MoE, GLM-4.5 MoE, Mixtral and OLMoE, as transformers v5
    builds each (modeling_<family>.py): biases, q/k norm, partial rotary, clipping, sliding window, experts."""
    layers = need("num_hidden_layers", "num_hidden_layers")  # bounded: the dense-layer scan loops over it
    attention_bias = opt_bool(hf, "attention_bias", False)
    fields: dict[str, Any] = {"head_dim": head_dim, "intermediate_size": need("intermediate_size")}
    experts = _expert_count(hf, model_type)
    moe: dict[str, Any] = {"n_routed_experts": experts, "num_experts_per_tok": need("num_experts_per_tok"),
                           "n_shared_experts": 0, "scoring_func": "softmax", "topk_method": "greedy"}
    if model_type == "qwen3_moe":
        fields.update(qkv_bias=attention_bias, o_proj_bias=attention_bias, qk_norm="head")
        if opt_bool(hf, "use_sliding_window", False):
            fields["sliding_window"] = need("sliding_window")  # every layer, as transformers v5 does
        step = opt_int(hf, "decoder_sparse_step", 1)
        if step < 1:
            raise ConfigError(f"decoder_sparse_step must be >= 1, got {step}", field="decoder_sparse_step")
        only = hf.get("mlp_only_layers") or []
        if not isinstance(only, list):
            raise ConfigError(f"mlp_only_layers must be a list of layer indices, got {show(only)}",
                              field="mlp_only_layers")
        # A layer is MoE iff it is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0.
        dense = {check_int(i, "mlp_only_layers") for i in only} | {i for i in range(layers) if (i + 1) % step}
        moe.update(moe_intermediate_size=need("moe_intermediate_size"), dense_layers=tuple(sorted(dense)),
                   norm_topk_prob=opt_bool(hf, "norm_topk_prob", False))
    elif model_type == "glm4_moe":
        # q/k/v carry attention_bias, o_proj never does; RoPE rotates the first head_dim * partial_rotary_factor
        # dims (0.5 when absent: transformers' default); sigmoid + correction bias routing as DeepSeek-V3's.
        fields.update(qkv_bias=attention_bias, o_proj_bias=False,
                      qk_norm="head" if opt_bool(hf, "use_qk_norm", False) else "none")
        params, prefix = _rope_dict(hf)
        factor = opt_float(params, "partial_rotary_factor", None, prefix)
        if factor is None:
            factor = opt_float(hf, "partial_rotary_factor", 0.5)
        elif "partial_rotary_factor" in hf and hf["partial_rotary_factor"] != factor:
            log.warning("glm4_moe config sets partial_rotary_factor=%s at the top level and %s in %s: transformers "
                        "reads the latter, and so does moeforge", hf["partial_rotary_factor"], factor, prefix[:-1])
        if not 0 < factor <= 1:
            raise ConfigError(f"partial_rotary_factor must be in (0, 1], got {factor}", field="partial_rotary_factor")
        rotary = int(head_dim * factor)
        if rotary < 2:
            raise ConfigError(f"partial_rotary_factor {factor} rotates {rotary} of head_dim {head_dim} dims: RoPE "
                              "needs at least 2 (an even number)", field="partial_rotary_factor")
        fields["rotary_dim"] = None if rotary == head_dim else rotary
        moe.update(moe_intermediate_size=need("moe_intermediate_size"),
                   n_shared_experts=opt_int(hf, "n_shared_experts", 1),
                   first_k_dense_replace=opt_int(hf, "first_k_dense_replace", 1),
                   scoring_func="sigmoid", topk_method="noaux_tc",
                   n_group=_at_least_one(hf, "n_group"), topk_group=_at_least_one(hf, "topk_group"),
                   norm_topk_prob=opt_bool(hf, "norm_topk_prob", True),
                   routed_scaling_factor=opt_float(hf, "routed_scaling_factor", 1.0))
    elif model_type == "mixtral":
        # softmax over all experts, top-k, renormalised (= softmax over the top-k logits); experts sized
        # intermediate_size; no attention biases.
        window = opt_int(hf, "sliding_window")
        if window == 0:
            log.warning("mixtral config sets sliding_window=0: read as no window (null), as transformers' mask does")
        fields.update(qkv_bias=False, o_proj_bias=False, sliding_window=window or None)
        moe.update(moe_intermediate_size=fields["intermediate_size"], norm_topk_prob=True)
    else:  # olmoe
        # q_norm / k_norm are RMSNorms over the whole projections [Hq*D], [Hkv*D] (transformers sizes q_norm by
        # hidden_size, so D must be hidden / heads); q, k, v clamped to clip_qkv after them.
        heads = need("num_attention_heads")
        if head_dim * heads != need("hidden_size"):
            raise ConfigError(f"olmoe needs head_dim * num_attention_heads == hidden_size (its q_norm spans "
                              f"hidden_size), got head_dim {head_dim}", field="head_dim")
        # transformers' OLMoE mask never slides (modeling_olmoe: "no sliding"), whatever sliding_window says
        if opt_int(hf, "sliding_window"):
            log.warning("olmoe config sets sliding_window=%s: transformers' OLMoE attends to the whole context "
                        "(its causal mask has no window), and so does moeforge, to match it", hf["sliding_window"])
        fields.update(qkv_bias=attention_bias, o_proj_bias=attention_bias, qk_norm="projection",
                      clip_qkv=opt_float(hf, "clip_qkv", None, positive=True))
        moe.update(moe_intermediate_size=fields["intermediate_size"],
                   norm_topk_prob=opt_bool(hf, "norm_topk_prob", False))
    fields["moe"] = MoEConfig(**moe)  # checked by ModelConfig.validate(), with messages naming the fields
    return fields


def dsa_from_hf(hf: dict[str, Any], need: Callable[..., int]) -> DSAConfig:
    """DeepSeek-V3.2's indexer sizes (config.json: index_topk, index_head_dim, index_n_heads; all required)."""
    return DSAConfig(index_topk=need("index_topk", "index_topk"),
                     index_head_dim=need("index_head_dim", "index_head_dim"),
                     index_n_heads=need("index_n_heads", "index_n_heads"))


# Where each family's config.json keeps its routed-expert count (transformers v5 writes num_local_experts for
# every one of them; released checkpoints use the family's own key).
EXPERT_KEYS: dict[str, tuple[str, ...]] = {
    "qwen3_moe": ("num_experts", "num_local_experts"), "olmoe": ("num_experts", "num_local_experts"),
    "glm4_moe": ("n_routed_experts", "num_local_experts"), "mixtral": ("num_local_experts", "num_experts"),
}


def _at_least_one(hf: dict[str, Any], key: str) -> int:
    """An optional count that defaults to 1 (absent or null) and is refused below 1, not read as 1."""
    value = opt_int(hf, key)
    if value is None:
        return 1
    if value < 1:
        raise ConfigError(f"{key} must be >= 1 (or absent for 1), got {value}", field=key)
    return value


def _expert_count(hf: dict[str, Any], model_type: str) -> int:
    keys = EXPERT_KEYS[model_type]
    for key in keys:
        if hf.get(key) is not None:
            count = check_int(hf[key], key)
            if count < 1:
                raise ConfigError(f"{key} is {count}: a {model_type} config without routed experts has no MoE "
                                  "layers; this family needs >= 1 (a dense model is another model_type)", field=key)
            return count
    raise ConfigError(f"config.json is missing the required field {keys[0]!r} ({model_type})", field=keys[0])


def _rope_dict(hf: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The rope dict transformers v5 reads (a non-empty ``rope_scaling`` replaces ``rope_parameters`` whole) and
    the prefix its fields are named by in errors."""
    scaling = opt_dict(hf, "rope_scaling")
    return (scaling, "rope_scaling.") if scaling else (opt_dict(hf, "rope_parameters"), "rope_parameters.")


def rope_from_hf(hf: dict[str, Any], max_positions: int, model_type: str) -> RopeConfig:
    """RoPE as transformers v5 reads it (convert_rope_params_to_dict): older files write rope_theta + rope_scaling,
    v5 writes rope_parameters (theta inside); a non-empty rope_scaling replaces rope_parameters whole; theta comes
    from the rope dict, else the top-level rope_theta, else the family's default. Interleaved (DeepSeek's pairwise)
    rotation: DeepSeek-V3 per rope_interleave (default true); V2's and V3.2's MLA always interleave; the other
    families never do (transformers does not read the key there)."""
    merged, prefix = _rope_dict(hf)
    theta = opt_float(merged, "rope_theta", None, prefix, positive=True)
    if theta is None:
        theta = opt_float(hf, "rope_theta", hf_default("rope_theta", model_type), positive=True)
    elif hf.get("rope_theta") is not None and hf["rope_theta"] != theta:
        log.warning("config sets rope_theta=%s at the top level and %s in %s: transformers reads the latter, and so "
                    "does moeforge", hf["rope_theta"], theta, prefix[:-1])
    kind = merged.get("rope_type", merged.get("type", "default")) or "default"
    if not isinstance(kind, str) or kind not in ("default", "linear", "yarn", "llama3"):
        raise ConfigError(
            f"rope_scaling type {show(kind)} is not supported (default, linear, yarn, llama3)",
            field="rope_scaling.type",
        )
    interleaved = model_type in MLA_FAMILIES
    given = opt_bool(hf, "rope_interleave", interleaved)
    if model_type == "deepseek_v3":
        interleaved = given
    elif given != interleaved:
        log.warning("%s config sets rope_interleave=%s: transformers' %s ignores it (%s), and so does moeforge",
                    model_type, given, model_type, "always interleaved" if interleaved else "rotate_half")
    if kind == "default":
        return RopeConfig(theta=theta, interleaved=interleaved)
    factor = opt_float(merged, "factor", None, prefix)
    original = opt_int(merged, "original_max_position_embeddings", None, "original_max_position_embeddings",
                        prefix)
    if kind in ("yarn", "llama3"):
        # As transformers' standardize_rope_params: a top-level original_max_position_embeddings (Phi-3 style) wins
        # over the one inside the rope dict, and without either the pretraining length is max_position_embeddings.
        top = opt_int(hf, "original_max_position_embeddings", None, "original_max_position_embeddings")
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
        beta_fast=opt_float(merged, "beta_fast", None, prefix) or 32.0,
        beta_slow=opt_float(merged, "beta_slow", None, prefix) or 1.0,
        mscale=opt_float(merged, "mscale", None, prefix),
        mscale_all_dim=opt_float(merged, "mscale_all_dim", None, prefix),
        attention_factor=opt_float(merged, "attention_factor", None, prefix),
        truncate=opt_bool(merged, "truncate", True, prefix),
        low_freq_factor=opt_float(merged, "low_freq_factor", 1.0, prefix),
        high_freq_factor=opt_float(merged, "high_freq_factor", 4.0, prefix),
        interleaved=interleaved,
    )
