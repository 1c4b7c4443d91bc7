"""DeepSeek-V4 checkpoint names: the tensors a model needs (transformers' DeepseekV4ForCausalLM names, routed experts
stacked), and the published checkpoint's names read as those, the way transformers' conversion mapping reads them
(transformers' save_pretrained writes the published leaf names under ``model.``: read the same way).

Published (deepseek-ai/DeepSeek-V4-*)              ->  ours
  embed.weight, head.weight, norm.weight              model.embed_tokens.weight, lm_head.weight, model.norm.weight
  hc_head_{fn,base,scale}                             model.hc_head.hc_{fn,base,scale}
  layers.N.attn_norm / ffn_norm                       model.layers.N.input_layernorm / post_attention_layernorm
  layers.N.hc_{attn,ffn}_{fn,base,scale}              model.layers.N.{attn,ffn}_hc.{fn,base,scale}
  layers.N.attn.{wq_a, q_norm, wq_b, wkv, kv_norm,    model.layers.N.self_attn.{q_a_proj, q_a_norm, q_b_proj, kv_proj,
                 wo_a, wo_b, attn_sink}                   kv_norm, o_a_proj, o_b_proj, sinks}
  layers.N.attn.compressor.{wkv, wgate, ape, norm}    ...self_attn.compressor.{kv_proj, gate_proj, position_bias,
                                                          kv_norm}
  layers.N.attn.indexer.compressor.*                  ...self_attn.compressor.indexer.* (as the compressor's)
  layers.N.attn.indexer.{wq_b, weights_proj}          ...self_attn.compressor.indexer.{q_b_proj, scorer.weights_proj}
  layers.N.ffn.gate.{weight, bias, tid2eid}           model.layers.N.mlp.gate.{weight, e_score_correction_bias, tid2eid}
  layers.N.ffn.experts.E.{w1, w3, w2}                 model.layers.N.mlp.experts.E.{gate_proj, up_proj, down_proj}
  layers.N.ffn.shared_experts.{w1, w3, w2}            model.layers.N.mlp.shared_experts.{gate_proj, up_proj, down_proj}
  X.scale (FP8 block scales, beside X.weight)         X.weight_scale_inv (the V3 FP8 path dequantises it)
  mtp.K.*                                             kept under its own name (loaded, not run)
"""

from __future__ import annotations

import re

from moeforge.core.config import ModelConfig

EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")
MTP_PREFIX = "mtp."
# An integer tensor of a V4 checkpoint: a hash layer's token -> experts table.
INTEGER_SUFFIX = ".mlp.gate.tid2eid"

# transformers' conversion_mapping["deepseek_v4"] renames, in its order (each applied to every published name).
_RENAMES: tuple[tuple[re.Pattern[str], str], ...] = tuple((re.compile(a), b) for a, b in (
    (r"\.attn\.", ".self_attn."), (r"\.ffn\.", ".mlp."), (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight", "embed_tokens.weight"), (r"^head\.weight", "lm_head.weight"),
    (r"^hc_head_fn", "hc_head.hc_fn"), (r"^hc_head_base", "hc_head.hc_base"), (r"^hc_head_scale", "hc_head.hc_scale"),
    (r"\.attn_norm\.", ".input_layernorm."), (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_fn", ".attn_hc.fn"), (r"\.hc_attn_base", ".attn_hc.base"), (r"\.hc_attn_scale", ".attn_hc.scale"),
    (r"\.hc_ffn_fn", ".ffn_hc.fn"), (r"\.hc_ffn_base", ".ffn_hc.base"), (r"\.hc_ffn_scale", ".ffn_hc.scale"),
    (r"\.attn_sink", ".sinks"), (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."), (r"\.norm\.", ".kv_norm."), (r"\.ape", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."), (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."), (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."), (r"\.wo_a\.", ".o_a_proj."), (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."), (r"\.gate\.bias", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."), (r"(\.experts\.\d+)\.w1\.", r"\1.gate_proj."),
    (r"(\.experts\.\d+)\.w3\.", r"\1.up_proj."), (r"(\.experts\.\d+)\.w2\.", r"\1.down_proj."),
))


def v4_expected_keys(config: ModelConfig) -> list[str]:
    """Every tensor name a DeepSeek-V4 model for ``config`` needs (``DeepseekV4ForCausalLM.state_dict()``'s)."""
    attn, moe = config.compressed_attention, config.moe
    assert attn is not None and moe is not None
    keys = ["model.embed_tokens.weight"]
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        keys += [p + f"{hc}.{n}" for hc in ("attn_hc", "ffn_hc") for n in ("fn", "base", "scale")]
        keys += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        keys += [p + "self_attn." + k for k in ("q_a_proj.weight", "q_a_norm.weight", "q_b_proj.weight",
                                                 "kv_proj.weight", "kv_norm.weight", "o_a_proj.weight",
                                                 "o_b_proj.weight", "sinks")]
        compressor = ("kv_proj.weight", "gate_proj.weight", "position_bias", "kv_norm.weight")
        if attn.compress_rate(i) is not None:
            keys += [p + "self_attn.compressor." + k for k in compressor]
        if attn.layer_types[i] == "compressed_sparse_attention":
            keys += [p + "self_attn.compressor.indexer." + k
                     for k in (*compressor, "q_b_proj.weight", "scorer.weights_proj.weight")]
        keys += [p + "mlp.gate.weight",
                 p + ("mlp.gate.tid2eid" if i in moe.hash_layers else "mlp.gate.e_score_correction_bias")]
        keys += [p + f"mlp.experts.{n}" for n in EXPERT_PROJS]  # stacked [E, ...]
        keys += [p + f"mlp.shared_experts.{n}.weight" for n in EXPERT_PROJS]
    keys += ["model.norm.weight", "model.hc_head.hc_fn", "model.hc_head.hc_base", "model.hc_head.hc_scale"]
    if not config.tie_word_embeddings:
        keys.append("lm_head.weight")
    return keys


def v4_name(key: str, stored: set[str]) -> str:
    """Our name for a stored tensor name (``stored``: every name in the checkpoint, for the FP8 scale rule)."""
    if key.endswith(".scale") and key[: -len(".scale")] + ".weight" in stored:
        key = key[: -len(".scale")] + ".weight_scale_inv"  # the published FP8 block scale of X.weight
    if key.startswith((MTP_PREFIX, "model." + MTP_PREFIX)):
        return key.removeprefix("model.")
    # Our names are fixed points of the renames, so a name in either scheme (or transformers' save_pretrained mix of
    # both: the published leaf names under "model.") reads right. The renames see the name without "model.", as
    # transformers applies them (else "model.norm.weight" would match "\.norm\.").
    body = key.removeprefix("model.")
    for pattern, replacement in _RENAMES:
        body = pattern.sub(replacement, body)
    return body if body.startswith("lm_head.") else "model." + body
