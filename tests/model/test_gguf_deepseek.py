"""DeepSeek-V2 / V3 GGUFs (llama.cpp's ``deepseek2`` architecture) against transformers on the HF model they were
written from. The writer follows llama.cpp's convert_hf_to_gguf.py DeepseekV2Model: MLA as MQA over the latent
(``key_length_mla``), ``kv_b_proj`` split per head into ``attn_k_b`` (transposed) and ``attn_v_b``, experts stacked,
the correction bias as ``exp_probs_b``, YaRN's mscale_all_dim as ``yarn_log_multiplier``; and the older layout that
kept ``attn_kv_b`` and the real head sizes in ``key_length``."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from moeforge.core.errors import CheckpointError
from moeforge.model.gguf_loader import read_gguf
from moeforge.model.loader import load_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the GGUF factory
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gguf_factory import TensorSpec, write_gguf_file
from test_gguf_architectures import (  # the converter's shared parts
    ATTENTION,
    LLM,
    ROPE,
    TOKENIZER,
    _hparams,
    _stacked_experts,
    converter_name,
)
from test_hf_parity import _deepseek_v2, _deepseek_v3, _randomise  # tiny transformers DeepSeek models

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
PROMPT_LEN = 32


def write_deepseek_gguf(model: Any, path: Path, split_kv_b: bool = True) -> None:
    """``model`` (transformers DeepseekV2/V3ForCausalLM) as llama.cpp's converter writes it."""
    cfg = model.config
    rope = cfg.rope_parameters
    metadata = _hparams(cfg) | {LLM.LEADING_DENSE_BLOCK_COUNT: cfg.first_k_dense_replace,
                                ATTENTION.Q_LORA_RANK: cfg.q_lora_rank, ATTENTION.KV_LORA_RANK: cfg.kv_lora_rank}
    qk_head = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    if split_kv_b:  # MLA as MQA over the latent; the real head sizes in *_mla
        metadata |= {ATTENTION.HEAD_COUNT_KV: 1, ATTENTION.KEY_LENGTH: cfg.kv_lora_rank + cfg.qk_rope_head_dim,
                     ATTENTION.VALUE_LENGTH: cfg.kv_lora_rank, ATTENTION.KEY_LENGTH_MLA: qk_head,
                     ATTENTION.VALUE_LENGTH_MLA: cfg.v_head_dim}
    else:
        metadata |= {ATTENTION.HEAD_COUNT_KV: cfg.num_attention_heads, ATTENTION.KEY_LENGTH: qk_head,
                     ATTENTION.VALUE_LENGTH: cfg.v_head_dim}
    v3 = cfg.model_type == "deepseek_v3"
    gating = gguf.ExpertGatingFuncType.SIGMOID if v3 else gguf.ExpertGatingFuncType.SOFTMAX
    metadata |= {LLM.EXPERT_FEED_FORWARD_LENGTH: cfg.moe_intermediate_size, LLM.EXPERT_COUNT: cfg.n_routed_experts,
                 LLM.EXPERT_USED_COUNT: cfg.num_experts_per_tok, LLM.EXPERT_SHARED_COUNT: cfg.n_shared_experts,
                 LLM.EXPERT_WEIGHTS_SCALE: float(cfg.routed_scaling_factor),
                 LLM.EXPERT_WEIGHTS_NORM: True if v3 and cfg.norm_topk_prob else None,
                 LLM.EXPERT_GATING_FUNC: int(gating.value)}
    if cfg.n_group and cfg.n_group > 1:
        metadata |= {LLM.EXPERT_GROUP_COUNT: cfg.n_group, LLM.EXPERT_GROUP_USED_COUNT: cfg.topk_group}
    metadata[ROPE.DIMENSION_COUNT] = cfg.qk_rope_head_dim
    if rope.get("rope_type") == "yarn":
        metadata |= {ROPE.SCALING_TYPE: gguf.RopeScalingType.YARN.value, ROPE.SCALING_FACTOR: float(rope["factor"]),
                     ROPE.SCALING_ORIG_CTX_LEN: rope["original_max_position_embeddings"],
                     ROPE.SCALING_YARN_LOG_MUL: 0.1 * rope["mscale_all_dim"]}
    metadata[gguf.Keys.General.NAME] = f"tiny-{cfg.model_type}"
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, cfg.num_hidden_layers)
    tensors: dict[str, TensorSpec] = {}
    heads, nope, v_dim = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    for hf_name, tensor in _stacked_experts(model.state_dict()).items():
        value = tensor.float()
        hf_name = hf_name.replace("e_score_correction_bias", "e_score_correction.bias")  # as the converter renames
        if split_kv_b and hf_name.endswith("kv_b_proj.weight"):
            k_b, v_b = value.view(heads, nope + v_dim, -1).split([nope, v_dim], dim=1)
            pairs = [(hf_name.replace("kv_b_proj", "k_b_proj"), k_b.transpose(1, 2)),
                     (hf_name.replace("kv_b_proj", "v_b_proj"), v_b)]
        else:
            pairs = [(hf_name, value)]
        for name, part in pairs:
            gguf_name = converter_name(names, name)
            assert gguf_name is not None, name
            tensors[gguf_name] = np.ascontiguousarray(part.numpy())
    write_gguf_file(path, "deepseek2", metadata=metadata, tensors=tensors, vocab=TOKENIZER)


BUILDERS = {"deepseek_v3": _deepseek_v3, "deepseek_v2": _deepseek_v2}


@pytest.fixture(scope="module", params=[(k, split) for k in sorted(BUILDERS) for split in (True, False)],
                ids=lambda p: f"{p[0]}-{'k_b+v_b' if p[1] else 'kv_b'}")
def written(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any, Path]:
    kind, split = request.param
    torch.manual_seed(0)
    model = BUILDERS[kind]()
    _randomise(model, seed=1)
    model.eval()
    path = tmp_path_factory.mktemp(kind) / f"tiny-{kind}.gguf"
    write_deepseek_gguf(model, path, split_kv_b=split)
    return kind, model, path


def _prompt() -> torch.Tensor:
    return torch.randint(0, 320, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(7))


@torch.no_grad()
def test_deepseek_gguf_logits_match_transformers(written: tuple[str, Any, Path]) -> None:
    kind, hf_model, path = written
    ids = _prompt()
    expected = hf_model(ids).logits
    assert expected.abs().max() > 0.5  # logits with real spread
    for impl in ("absorb", "naive"):
        loaded = load_model(str(path), mla_impl=impl)
        assert loaded.config.model_type == kind
        got = loaded.model(ids, torch.arange(PROMPT_LEN)[None]).logits
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_deepseek_gguf_config(written: tuple[str, Any, Path]) -> None:
    kind, hf_model, path = written
    hf, cfg = hf_model.config, read_gguf(path).config
    assert cfg.mla is not None and cfg.moe is not None
    assert (cfg.mla.q_lora_rank, cfg.mla.kv_lora_rank, cfg.mla.qk_nope_head_dim, cfg.mla.qk_rope_head_dim,
            cfg.mla.v_head_dim) == (hf.q_lora_rank, hf.kv_lora_rank, hf.qk_nope_head_dim, hf.qk_rope_head_dim,
                                    hf.v_head_dim)
    assert (cfg.moe.n_routed_experts, cfg.moe.n_shared_experts, cfg.moe.first_k_dense_replace, cfg.moe.n_group,
            cfg.moe.topk_group) == (hf.n_routed_experts, hf.n_shared_experts, hf.first_k_dense_replace, hf.n_group,
                                    hf.topk_group)
    assert cfg.moe.topk_method == ("noaux_tc" if kind == "deepseek_v3" else "group_limited_greedy")
    assert cfg.rope.interleaved and cfg.rope.scaling == "yarn"
    assert cfg.rope.mscale_all_dim == pytest.approx(hf.rope_parameters["mscale_all_dim"])


def test_a_lone_half_of_kv_b_is_refused(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _deepseek_v2()
    path = tmp_path / "half.gguf"
    state = model.state_dict
    model.state_dict = lambda: {k: v for k, v in state().items() if "layers.1.self_attn.kv_b_proj" not in k}
    write_deepseek_gguf(model, path, split_kv_b=True)  # layer 1 loses both halves: no kv_b_proj at all
    with pytest.raises(CheckpointError, match=r"no tensor for model\.layers\.1\.self_attn\.kv_b_proj\.weight"):
        read_gguf(path)
