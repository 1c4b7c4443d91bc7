"""config.json fields read as transformers v5 reads them, checked against transformers itself.

Each case saves a seeded tiny transformers model, then edits its config.json the way real files differ: a field
transformers ignores for that family (V2's scoring_func and rope_interleave, V3's scoring_func / topk_method,
OLMoE's sliding_window), a key left out (so transformers' class default applies), or both rope_scaling and
rope_parameters. transformers and moeforge then read the same folder, and their logits must agree to 1e-4.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from moeforge.core.config import ModelConfig
from moeforge.model.loader import load_model

TINY = dict(vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=512,
            tie_word_embeddings=False)
DEEPSEEK = dict(TINY, intermediate_size=96, moe_intermediate_size=32, num_key_value_heads=4, kv_lora_rank=32,
                q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, n_routed_experts=8,
                num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1)
V3 = dict(DEEPSEEK, n_group=1, topk_group=1)
V2 = dict(DEEPSEEK, topk_method="greedy")
LINEAR_MSCALE = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0, "mscale_all_dim": 0.7}
LLAMA = dict(TINY, intermediate_size=96, num_key_value_heads=2)

# name: (transformers class prefix, config kwargs, config.json edits, config.json keys removed)
CASES: dict[str, tuple[str, dict[str, Any], dict[str, Any], tuple[str, ...]]] = {
    "v2 rope_interleave false (V2 always interleaves)": ("DeepseekV2", V2, {"rope_interleave": False}, ()),
    "v2 scoring_func sigmoid (V2 always softmax)": ("DeepseekV2", V2, {"scoring_func": "sigmoid"}, ()),
    "v2 linear rope with mscale_all_dim": ("DeepseekV2", dict(V2, rope_parameters=LINEAR_MSCALE), {}, ()),
    "v2 n_shared_experts 0 (zero-width tensors)": ("DeepseekV2", dict(V2, n_shared_experts=0), {}, ()),
    "v2 n_shared_experts missing (default 2)": ("DeepseekV2", dict(V2, n_shared_experts=2), {}, ("n_shared_experts",)),
    "v3 scoring_func softmax (V3 always sigmoid)": ("DeepseekV3", V3, {"scoring_func": "softmax"}, ()),
    "v3 topk_method greedy (V3 always noaux_tc)": ("DeepseekV3", V3, {"topk_method": "greedy"}, ()),
    "v3 linear rope with mscale_all_dim": ("DeepseekV3", dict(V3, rope_parameters=LINEAR_MSCALE), {}, ()),
    "v3 first_k_dense_replace beyond the layers": ("DeepseekV3", dict(V3, first_k_dense_replace=5), {}, ()),
    "v3 routing keys missing (defaults 8/4 groups, 2.5, renormalised)": (
        "DeepseekV3", dict(DEEPSEEK, n_routed_experts=16, num_experts_per_tok=6, n_group=8, topk_group=4,
                           routed_scaling_factor=2.5, norm_topk_prob=True),
        {}, ("n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob")),
    "v3 layer keys missing (default 3 dense, 1 shared)": (
        "DeepseekV3", dict(V3, num_hidden_layers=4, first_k_dense_replace=3, n_shared_experts=1), {},
        ("first_k_dense_replace", "n_shared_experts")),
    "olmoe sliding_window (its mask never slides)": (
        "Olmoe", dict(TINY, intermediate_size=48, num_key_value_heads=4, num_experts=8, num_experts_per_tok=2),
        {"sliding_window": 8}, ()),
    "mixtral eps and theta missing (1e-5, 1e6)": (
        "Mixtral", dict(LLAMA, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, rms_norm_eps=1e-5,
                        rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
        {}, ("rms_norm_eps", "rope_parameters", "rope_theta")),
    "llama rope_scaling wins over rope_parameters": (
        "Llama", dict(LLAMA, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
        {"rope_scaling": {"rope_type": "linear", "factor": 8.0}}, ()),
}


@torch.no_grad()
def _randomise(model: torch.nn.Module) -> None:
    gen = torch.Generator().manual_seed(1)
    for name, p in sorted(model.named_parameters()):
        if p.dim() == 1:
            p.copy_((1.0 if "norm" in name else 0.0) + 0.1 * torch.randn(p.shape, generator=gen))
        elif p.numel():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.7 / p.shape[-1] ** 0.5))
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.copy_(torch.rand(buffer.shape, generator=gen) * 0.2)


def _save(folder: Path, prefix: str, kwargs: dict[str, Any], edits: dict[str, Any], removed: tuple[str, ...]) -> None:
    torch.manual_seed(0)
    config = getattr(transformers, f"{prefix}Config")(**kwargs)
    model = getattr(transformers, f"{prefix}ForCausalLM")(config)
    _randomise(model)
    model.eval().save_pretrained(folder)
    path = folder / "config.json"
    data = json.loads(path.read_text())
    data.update(edits)
    for key in removed:
        assert key in data or key == "rope_theta", key  # the case must really remove something
        data.pop(key, None)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("case", sorted(CASES))
@torch.no_grad()
def test_logits_match_transformers_reading_the_same_config(case, tmp_path, caplog):
    prefix, kwargs, edits, removed = CASES[case]
    _save(tmp_path, prefix, kwargs, edits, removed)
    ids = torch.randint(0, TINY["vocab_size"], (1, 24), generator=torch.Generator().manual_seed(7))
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), attn_implementation="eager", dtype=torch.float32).eval()
    expected = reference(ids).logits[0]
    with caplog.at_level(logging.WARNING, logger="moeforge"):
        ours = load_model(str(tmp_path)).model(ids, torch.arange(24)[None]).logits[0]
    assert (ours - expected).abs().max().item() < 1e-4
    if edits and "rope_scaling" not in edits:  # a field transformers ignores is ignored out loud
        assert any(key in record.getMessage() for key in edits for record in caplog.records)


def test_missing_keys_take_the_family_defaults():
    base = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 8}
    mistral = ModelConfig.from_hf_dict({"model_type": "mistral", **base})
    assert mistral.sliding_window == 4096 and mistral.num_key_value_heads == 8
    assert mistral.max_position_embeddings == 4096 * 32
    assert ModelConfig.from_hf_dict({"model_type": "mistral", "sliding_window": None, **base}).sliding_window is None
    mixtral = ModelConfig.from_hf_dict({"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2,
                                        **base})
    assert mixtral.rms_norm_eps == 1e-5 and mixtral.rope.theta == 1e6 and mixtral.num_key_value_heads == 8
    # null is not absent: transformers' __post_init__ turns it into num_attention_heads
    with pytest.raises(Exception, match=r"multiple of num_key_value_heads \(32\)"):  # Qwen2Config's default 32
        ModelConfig.from_hf_dict({"model_type": "qwen2", **base})
    assert ModelConfig.from_hf_dict({"model_type": "qwen2", "num_key_value_heads": None, **base}
                                    ).num_key_value_heads == 8
    llama = ModelConfig.from_hf_dict({"model_type": "llama", **base})
    assert llama.num_key_value_heads == 8 and llama.rms_norm_eps == 1e-6 and llama.rope.theta == 10000.0
    assert llama.max_position_embeddings == 2048


def test_v32_mlp_layer_types_pick_the_dense_layers():
    hf = {"model_type": "deepseek_v32", **{k: v for k, v in DEEPSEEK.items() if k != "first_k_dense_replace"},
          "num_hidden_layers": 3, "n_group": 2, "topk_group": 1, "index_topk": 8, "index_head_dim": 16,
          "index_n_heads": 2, "mlp_layer_types": ["sparse", "dense", "sparse"]}
    config = ModelConfig.from_hf_dict(hf)
    assert [config.is_moe_layer(i) for i in range(3)] == [True, False, True]
    with pytest.raises(Exception, match="mlp_layer_types"):
        ModelConfig.from_hf_dict({**hf, "mlp_layer_types": ["sparse", "dense"]})

