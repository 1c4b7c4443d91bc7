"""HF safetensors checkpoint reader: tiny seeded transformers models saved with save_pretrained are the
independent reference for names, layouts and values (see shared/notes/test-models.md)."""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from moeforge.core.config import ModelConfig
from moeforge.core.errors import CheckpointError, ConfigError
from moeforge.model.fp8 import FP8_MAX, dequantize_fp8_blockwise, quantize_fp8_blockwise
from moeforge.model.safetensors_loader import HFCheckpoint, expected_keys, read_hf_checkpoint

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: never touch the network
transformers = pytest.importorskip("transformers")

Tensors = dict[str, torch.Tensor]
FP8 = torch.float8_e4m3fn

# ------------------------------------------------------------------------------------------ builders
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def _v3_config(**over: object) -> transformers.DeepseekV3Config:
    kw: dict[str, object] = dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
        first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=8, max_position_embeddings=256, rope_parameters=dict(YARN),
        routed_scaling_factor=2.5,
    )
    kw.update(over)
    return transformers.DeepseekV3Config(**kw)


def _v2_config() -> transformers.DeepseekV2Config:
    return transformers.DeepseekV2Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        n_routed_experts=4, n_shared_experts=2, num_experts_per_tok=2, n_group=2, topk_group=1,
        first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=8, topk_method="group_limited_greedy",
    )


def _llama_config() -> transformers.LlamaConfig:
    # attention_bias exercises q/k/v AND o_proj biases.
    return transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, attention_bias=True, tie_word_embeddings=False,
    )


def _qwen2_config() -> transformers.Qwen2Config:
    return transformers.Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True,
    )


def _build(model_cls: type, hf_config: object, seed: int) -> nn.Module:
    """Seeded model with every parameter random (norms too: a swapped norm must not go unnoticed)."""
    torch.manual_seed(seed)
    model = model_cls(hf_config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # a buffer, zero by default: make it count
                buf.copy_(torch.randn_like(buf) * 0.1 + 0.05)
    return model


MODELS: dict[str, tuple[type, Callable[[], object]]] = {
    "deepseek_v3": (transformers.DeepseekV3ForCausalLM, _v3_config),
    "deepseek_v2": (transformers.DeepseekV2ForCausalLM, _v2_config),
    "llama": (transformers.LlamaForCausalLM, _llama_config),
    "qwen2": (transformers.Qwen2ForCausalLM, _qwen2_config),
}


@pytest.fixture(scope="module")
def models() -> dict[str, nn.Module]:
    return {name: _build(cls, make(), seed) for seed, (name, (cls, make)) in enumerate(MODELS.items())}


@pytest.fixture(scope="module")
def saved(models: dict[str, nn.Module], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """save_pretrained folders: default layout, plus V3 fused (save_original_format=False) and sharded."""
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    for name, model in models.items():
        model.save_pretrained(root / name)
        out[name] = root / name
    models["deepseek_v3"].save_pretrained(root / "v3_fused", save_original_format=False)
    out["v3_fused"] = root / "v3_fused"
    models["deepseek_v3"].save_pretrained(root / "v3_sharded", max_shard_size="20KB")
    out["v3_sharded"] = root / "v3_sharded"
    return out


# ------------------------------------------------------------------------------------------ helpers
def _file_tensors(folder: Path) -> Tensors:
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def _rewrite(src: Path, dst: Path, edit: Callable[[Tensors], Tensors]) -> Path:
    """Copy config.json and write edit(all tensors) as a single model.safetensors."""
    dst.mkdir(parents=True)
    shutil.copy(src / "config.json", dst / "config.json")
    save_file(edit(_file_tensors(src)), str(dst / "model.safetensors"))
    return dst


def _load(folder: Path, **kw: object) -> tuple[ModelConfig, Tensors, list[str]]:
    config = ModelConfig.from_hf_json(folder / "config.json")
    ckpt = read_hf_checkpoint(folder, config, **kw)
    names, tensors = [], {}
    for name, t in ckpt:
        names.append(name)
        tensors[name] = t
    return config, tensors, names


def _reference(model: nn.Module, config: ModelConfig) -> Tensors:
    """transformers' parameters in our naming: fused gate_up_proj [E, 2I, H] -> gate rows, up rows."""
    out = {}
    for key, value in model.state_dict().items():
        if key.endswith("inv_freq") or (config.tie_word_embeddings and key == "lm_head.weight"):
            continue
        if key.endswith(".mlp.experts.gate_up_proj"):
            base = key.removesuffix("gate_up_proj")
            out[base + "gate_proj"], out[base + "up_proj"] = value.chunk(2, dim=1)
        else:
            out[key] = value
    return out


def _assert_same(actual: Tensors, expected: Tensors) -> None:
    assert set(actual) == set(expected)
    for name, want in expected.items():
        assert actual[name].dtype == want.dtype, name
        assert torch.equal(actual[name], want), name


# ------------------------------------------------------------------------------------------ layouts
@pytest.mark.parametrize("name", ["deepseek_v3", "v3_fused", "v3_sharded", "deepseek_v2", "llama", "qwen2"])
def test_tensors_match_transformers(name: str, saved: dict[str, Path], models: dict[str, nn.Module]) -> None:
    config, tensors, names = _load(saved[name])
    model = models[{"v3_fused": "deepseek_v3", "v3_sharded": "deepseek_v3"}.get(name, name)]
    reference = _reference(model, config)
    assert names == expected_keys(config)  # order and completeness
    assert set(expected_keys(config)) == set(reference)  # expected_keys agrees with transformers' modules
    _assert_same(tensors, reference)
    assert not any("_scale_inv" in n or "inv_freq" in n for n in names)


def test_configs_parse(saved: dict[str, Path]) -> None:
    v3 = ModelConfig.from_hf_json(saved["deepseek_v3"] / "config.json")
    assert v3.mla is not None and v3.mla.q_lora_rank == 16 and v3.moe is not None
    assert (v3.moe.n_group, v3.moe.topk_group, v3.moe.first_k_dense_replace) == (2, 1, 1)
    assert v3.moe.topk_method == "noaux_tc" and v3.moe.has_correction_bias
    assert v3.rope.scaling == "yarn" and v3.rope.factor == 4.0 and v3.rope.interleaved
    v2 = ModelConfig.from_hf_json(saved["deepseek_v2"] / "config.json")
    assert v2.mla is not None and v2.mla.q_lora_rank is None and v2.moe is not None
    assert v2.moe.topk_method == "group_limited_greedy" and not v2.moe.has_correction_bias
    assert v2.moe.n_shared_experts == 2
    llama = ModelConfig.from_hf_json(saved["llama"] / "config.json")
    assert llama.mla is None and llama.qkv_bias and llama.o_proj_bias and not llama.tie_word_embeddings
    qwen = ModelConfig.from_hf_json(saved["qwen2"] / "config.json")
    assert qwen.qkv_bias and not qwen.o_proj_bias and qwen.tie_word_embeddings
    assert "lm_head.weight" not in expected_keys(qwen)


def test_key_names_written_by_transformers(saved: dict[str, Path]) -> None:
    """What save_pretrained writes: per-expert by default, fused with save_original_format=False."""
    default, fused = _file_tensors(saved["deepseek_v3"]), _file_tensors(saved["v3_fused"])
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in default
    assert "model.layers.1.mlp.experts.gate_up_proj" in fused
    assert not any(".experts.0." in k for k in fused)
    index = json.loads((saved["v3_sharded"] / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # really sharded


def test_stacked_experts_follow_transformers_forward(
    saved: dict[str, Path], models: dict[str, nn.Module]
) -> None:
    """Gate rows come first in gate_up_proj: our stacked SwiGLU equals HF's experts module per expert."""
    _, tensors, _ = _load(saved["v3_fused"])
    experts = models["deepseek_v3"].model.layers[1].mlp.experts
    p = "model.layers.1.mlp.experts."
    gate, up, down = tensors[p + "gate_proj"], tensors[p + "up_proj"], tensors[p + "down_proj"]
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(0))
    for e in range(gate.shape[0]):
        index = torch.full((3, 1), e)
        with torch.no_grad():
            got = experts(x, index, torch.ones(3, 1))
        want = (torch.nn.functional.silu(x @ gate[e].T) * (x @ up[e].T)) @ down[e].T
        torch.testing.assert_close(got, want)


def test_per_expert_rewrite_equals_fused(saved: dict[str, Path], tmp_path: Path) -> None:
    def split(tensors: Tensors) -> Tensors:
        out = {}
        for key, value in tensors.items():
            if key.endswith(".mlp.experts.gate_up_proj"):
                base = key.removesuffix("gate_up_proj")
                gate, up = value.chunk(2, dim=1)
                for e in range(value.shape[0]):
                    out[f"{base}{e}.gate_proj.weight"] = gate[e].contiguous()
                    out[f"{base}{e}.up_proj.weight"] = up[e].contiguous()
            elif key.endswith(".mlp.experts.down_proj"):
                for e in range(value.shape[0]):
                    out[f"{key.removesuffix('down_proj')}{e}.down_proj.weight"] = value[e].contiguous()
            else:
                out[key] = value
        return out

    folder = _rewrite(saved["v3_fused"], tmp_path / "per_expert", split)
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in _file_tensors(folder)
    _, fused, _ = _load(saved["v3_fused"])
    _, per_expert, _ = _load(folder)
    _assert_same(per_expert, fused)


def test_mtp_layer_and_inv_freq_are_skipped(
    saved: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """DeepSeek-V3 ships its multi-token-prediction module as model.layers.{num_hidden_layers}."""

    def add_mtp(tensors: Tensors) -> Tensors:
        out = dict(tensors)
        for key, value in tensors.items():
            if key.startswith("model.layers.1."):
                out[key.replace("model.layers.1.", "model.layers.2.")] = value.clone()
        h = tensors["model.norm.weight"].shape[0]
        out["model.layers.2.eh_proj.weight"] = torch.randn(h, 2 * h)
        out["model.layers.2.enorm.weight"] = torch.ones(h)
        out["model.layers.2.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        out["model.layers.2.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
        q, s = quantize_fp8_blockwise(torch.randn(8, h))  # an FP8 MTP tensor with its scale
        out["model.layers.2.extra_proj.weight"], out["model.layers.2.extra_proj.weight_scale_inv"] = q, s
        out["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.rand(2)
        return out

    folder = _rewrite(saved["deepseek_v3"], tmp_path / "mtp", add_mtp)
    with caplog.at_level(logging.DEBUG, logger="moeforge.model.safetensors_loader"):
        _, with_mtp, names = _load(folder)
    _, plain, _ = _load(saved["deepseek_v3"])
    _assert_same(with_mtp, plain)
    assert not any(n.startswith("model.layers.2.") for n in names)
    assert "MTP" in caplog.text


def test_tied_lm_head_in_file_is_ignored(saved: dict[str, Path], tmp_path: Path) -> None:
    def add_head(tensors: Tensors) -> Tensors:
        return {**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"].clone()}

    folder = _rewrite(saved["qwen2"], tmp_path / "tied", add_head)
    _, tensors, _ = _load(folder)
    assert "lm_head.weight" not in tensors


def test_dtype_cast_and_shapes(saved: dict[str, Path]) -> None:
    config = ModelConfig.from_hf_json(saved["deepseek_v3"] / "config.json")
    ckpt = read_hf_checkpoint(saved["deepseek_v3"], config, dtype=torch.bfloat16)
    assert isinstance(ckpt, HFCheckpoint) and ckpt.keys() == expected_keys(config)
    assert len(ckpt) == len(ckpt.keys()) and "model.norm.weight" in ckpt
    assert ckpt.shape("model.layers.1.mlp.experts.gate_proj") == (4, 16, 32)
    assert ckpt.shape("model.layers.1.mlp.experts.down_proj") == (4, 32, 16)
    for name, t in ckpt:
        assert t.dtype == torch.bfloat16 and tuple(t.shape) == ckpt.shape(name), name
    assert ckpt.read("model.norm.weight").dtype == torch.bfloat16


# ------------------------------------------------------------------------------------------ FP8
@pytest.fixture(scope="module")
def fp8_model() -> nn.Module:
    # hidden 160, q_lora 136, moe_intermediate 72: dims > 128 and not multiples: partial edge blocks.
    cfg = _v3_config(hidden_size=160, intermediate_size=200, moe_intermediate_size=72, q_lora_rank=136,
                     kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    return _build(transformers.DeepseekV3ForCausalLM, cfg, seed=7)


def _quantise_linears(tensors: Tensors) -> Tensors:
    """DeepSeek-V3 style: projection weights (2-D, and fused 3-D experts) in FP8 + weight_scale_inv."""
    out = {}
    for key, value in tensors.items():
        if key.endswith("proj.weight") or key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out[key], out[key + "_scale_inv"] = quantize_fp8_blockwise(value)
        else:
            out[key] = value
    return out


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_fp8_checkpoint(layout: str, fp8_model: nn.Module, tmp_path: Path) -> None:
    float_dir = tmp_path / "float"
    fp8_model.save_pretrained(float_dir, save_original_format=(layout == "per_expert"))
    folder = _rewrite(float_dir, tmp_path / "fp8", _quantise_linears)
    stored = _file_tensors(folder)
    assert stored["model.layers.0.self_attn.q_a_proj.weight"].dtype == torch.float8_e4m3fn
    assert stored["model.layers.0.self_attn.q_a_proj.weight_scale_inv"].shape == (2, 2)  # [136, 160]

    config, tensors, names = _load(folder)
    _, original, _ = _load(float_dir)
    assert names == expected_keys(config)

    def stored_dequantised(key: str) -> torch.Tensor:
        return dequantize_fp8_blockwise(stored[key], stored[key + "_scale_inv"])

    checked = 0
    for name, t in tensors.items():
        assert t.dtype == torch.float32
        if name + "_scale_inv" in stored:  # directly stored FP8 weight
            want = stored_dequantised(name)
        elif name.endswith(("experts.gate_proj", "experts.up_proj", "experts.down_proj")):
            proj = name.rsplit(".", 1)[1]
            base = name.removesuffix(proj)
            if layout == "fused" and proj != "down_proj":
                want = stored_dequantised(base + "gate_up_proj").chunk(2, dim=1)[proj == "up_proj"]
            else:
                want = torch.stack([stored_dequantised(f"{base}{e}.{proj}.weight") for e in range(4)])
        else:
            assert torch.equal(t, original[name]), name  # norms, embeddings, router stay float
            continue
        assert torch.equal(t, want), name  # exactly the stored data dequantised
        # Within e4m3 rounding of the float original: half an ulp, 2^-4 relative for normals, and
        # half the smallest subnormal step (2^-10 x scale) near zero; scale <= amax(|w|) / 448.
        ref = original[name]
        bound = ref.abs() * 2**-4 + ref.abs().amax() / FP8_MAX * 2**-10 + 1e-7
        assert bool(((t - ref).abs() <= bound).all()), name
        checked += 1
    assert checked >= 10

    config = ModelConfig.from_hf_json(folder / "config.json")
    key = "model.layers.0.self_attn.kv_b_proj.weight"
    bf16 = read_hf_checkpoint(folder, config, dtype=torch.bfloat16).read(key)
    want = dequantize_fp8_blockwise(stored[key], stored[key + "_scale_inv"], dtype=torch.bfloat16)
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, want)


def test_dequantize_partial_edge_blocks() -> None:
    # [130, 260] -> scales [2, 3]: the last row block has 2 rows, the last column block 4 columns.
    weight = torch.ones(130, 260).to(torch.float8_e4m3fn)
    scale = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    out = dequantize_fp8_blockwise(weight, scale)
    assert out.shape == (130, 260) and out.dtype == torch.float32
    assert out[:128, :128].eq(1).all() and out[:128, 128:256].eq(2).all() and out[:128, 256:].eq(3).all()
    assert out[128:, :128].eq(4).all() and out[128:, 128:256].eq(5).all() and out[128:, 256:].eq(6).all()
    assert dequantize_fp8_blockwise(weight, scale, dtype=torch.bfloat16).dtype == torch.bfloat16


def test_dequantize_values_and_batch_dims() -> None:
    gen = torch.Generator().manual_seed(1)
    weight = (torch.randn(3, 200, 150, generator=gen) * 50).to(torch.float8_e4m3fn)
    scale = torch.rand(3, 2, 2, generator=gen) + 0.5
    out = dequantize_fp8_blockwise(weight, scale)
    rows = torch.arange(200) // 128
    cols = torch.arange(150) // 128
    want = weight.float() * scale[:, rows][:, :, cols]  # per-element scale, built independently
    assert torch.equal(out, want)
    with pytest.raises(ValueError, match=r"needs \(3, 2, 2\)"):
        dequantize_fp8_blockwise(weight, scale[:, :1])


def test_quantize_roundtrip() -> None:
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(2, 300, 140, generator=gen)
    weight[0, :128, :128] = 0.0  # an all-zero block stays zero
    q, scale = quantize_fp8_blockwise(weight)
    assert q.dtype == torch.float8_e4m3fn and q.shape == weight.shape and scale.shape == (2, 3, 2)
    assert scale.dtype == torch.float32
    # scale = amax / 448: the block maximum maps to the largest e4m3 value.
    torch.testing.assert_close(scale[1, 2, 1], weight[1, 256:, 128:].abs().amax() / FP8_MAX)
    assert q.float().abs().amax() == FP8_MAX
    back = dequantize_fp8_blockwise(q, scale)
    assert back[0, :128, :128].eq(0).all()
    per_elem_scale = scale.repeat_interleave(128, 1)[:, :300].repeat_interleave(128, 2)[:, :, :140]
    assert bool(((back - weight).abs() <= weight.abs() * 2**-4 + per_elem_scale * 2**-10).all())
    assert math.isclose(float((back - weight).abs().max()), 0.0, abs_tol=0.2)


# ------------------------------------------------------------------------------------------ bad input
def _without(key: str) -> Callable[[Tensors], Tensors]:
    return lambda tensors: {k: v for k, v in tensors.items() if k != key}


def _config_of(saved: dict[str, Path], name: str = "deepseek_v3") -> ModelConfig:
    return ModelConfig.from_hf_json(saved[name] / "config.json")


def test_missing_folder(saved: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"nowhere does not exist"):
        read_hf_checkpoint(tmp_path / "nowhere", _config_of(saved))


def test_no_safetensors_files(saved: dict[str, Path], tmp_path: Path) -> None:
    shutil.copy(saved["deepseek_v3"] / "config.json", tmp_path / "config.json")
    with pytest.raises(CheckpointError, match=r"no model\.safetensors and no model\.safetensors\.index"):
        read_hf_checkpoint(tmp_path, _config_of(saved))
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(CheckpointError, match=r"found pytorch_model\.bin; pickled"):
        read_hf_checkpoint(tmp_path, _config_of(saved))


def test_missing_config_field(saved: dict[str, Path], tmp_path: Path) -> None:
    hf = json.loads((saved["deepseek_v3"] / "config.json").read_text())
    del hf["kv_lora_rank"]
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ConfigError, match=r"missing the required field 'kv_lora_rank'") as info:
        ModelConfig.from_hf_json(tmp_path / "config.json")
    assert info.value.field == "kv_lora_rank"


def test_unsupported_model_type(saved: dict[str, Path], tmp_path: Path) -> None:
    hf = json.loads((saved["llama"] / "config.json").read_text())
    hf["model_type"] = "gpt2"
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ConfigError, match=r"model_type 'gpt2' is not supported"):
        ModelConfig.from_hf_json(tmp_path / "config.json")


def test_missing_shard(saved: dict[str, Path], tmp_path: Path) -> None:
    folder = shutil.copytree(saved["v3_sharded"], tmp_path / "sharded")
    victim = sorted(folder.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=rf"names shard {victim.name} which does not exist"):
        read_hf_checkpoint(folder, _config_of(saved))


def test_index_out_of_sync_with_shard(saved: dict[str, Path], tmp_path: Path) -> None:
    folder = shutil.copytree(saved["v3_sharded"], tmp_path / "sharded")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    wrong = next(s for s in shards if s != index["weight_map"]["model.norm.weight"])
    index["weight_map"]["model.norm.weight"] = wrong
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"'model\.norm\.weight' to {wrong}, but that shard does not"):
        read_hf_checkpoint(folder, _config_of(saved))


@pytest.mark.parametrize("sharded", [False, True])
def test_truncated_file(sharded: bool, saved: dict[str, Path], tmp_path: Path) -> None:
    folder = shutil.copytree(saved["v3_sharded" if sharded else "deepseek_v3"], tmp_path / "copy")
    victim = sorted(folder.glob("*.safetensors"))[-1]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=rf"{victim.name} is truncated or not a valid safetensors file"):
        read_hf_checkpoint(folder, _config_of(saved))


def test_corrupt_index(saved: dict[str, Path], tmp_path: Path) -> None:
    folder = shutil.copytree(saved["v3_sharded"], tmp_path / "sharded")
    (folder / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"index\.json is not a valid safetensors index"):
        read_hf_checkpoint(folder, _config_of(saved))


def test_missing_tensor(saved: dict[str, Path], tmp_path: Path) -> None:
    key = "model.layers.0.self_attn.kv_b_proj.weight"
    folder = _rewrite(saved["deepseek_v3"], tmp_path / "x", _without(key))
    with pytest.raises(CheckpointError, match=rf"missing tensor\(s\) the config needs: {key}"):
        read_hf_checkpoint(folder, _config_of(saved))


def test_missing_correction_bias(saved: dict[str, Path], tmp_path: Path) -> None:
    key = "model.layers.1.mlp.gate.e_score_correction_bias"
    folder = _rewrite(saved["deepseek_v3"], tmp_path / "x", _without(key))
    with pytest.raises(CheckpointError, match=key):
        read_hf_checkpoint(folder, _config_of(saved))


def test_missing_expert(saved: dict[str, Path], tmp_path: Path) -> None:
    key = "model.layers.1.mlp.experts.2.up_proj.weight"
    folder = _rewrite(saved["deepseek_v3"], tmp_path / "x", _without(key))
    msg = r"expert\(s\) 2 of 4 missing \(model\.layers\.1\.mlp\.experts\.2\.up_proj\.weight not found"
    with pytest.raises(CheckpointError, match=msg):
        read_hf_checkpoint(folder, _config_of(saved))


def test_missing_routed_experts_entirely(saved: dict[str, Path], tmp_path: Path) -> None:
    folder = _rewrite(saved["v3_fused"], tmp_path / "x",
                      lambda t: {k: v for k, v in t.items() if not k.endswith("experts.gate_up_proj")})
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.experts\.gate_proj"):
        read_hf_checkpoint(folder, _config_of(saved))


def test_fused_expert_count_mismatch(saved: dict[str, Path], tmp_path: Path) -> None:
    def drop_last(tensors: Tensors) -> Tensors:
        return {k: (v[:3].contiguous() if ".experts." in k else v) for k, v in tensors.items()}

    folder = _rewrite(saved["v3_fused"], tmp_path / "x", drop_last)
    msg = r"fused model\.layers\.1\.mlp\.experts\.gate_up_proj has shape \[3, 32, 32\]; expected \[4,"
    with pytest.raises(CheckpointError, match=msg):
        read_hf_checkpoint(folder, _config_of(saved))


def test_inconsistent_fused_experts(saved: dict[str, Path], tmp_path: Path) -> None:
    def shrink_down(tensors: Tensors) -> Tensors:
        down = {k: v[:, :, :8].contiguous() for k, v in tensors.items() if k.endswith("experts.down_proj")}
        return {**tensors, **down}

    folder = _rewrite(saved["v3_fused"], tmp_path / "x", shrink_down)
    with pytest.raises(CheckpointError, match=r"routed experts of layer 1 are inconsistent"):
        read_hf_checkpoint(folder, _config_of(saved))


def test_unexpected_tensor(saved: dict[str, Path], tmp_path: Path) -> None:
    extra = "model.layers.0.mlp.extra.weight"
    folder = _rewrite(saved["llama"], tmp_path / "x", lambda t: {**t, extra: torch.ones(2)})
    with pytest.raises(CheckpointError, match=r"does not use: model\.layers\.0\.mlp\.extra\.weight"):
        read_hf_checkpoint(folder, _config_of(saved, "llama"))


def test_fp8_without_scale(saved: dict[str, Path], tmp_path: Path) -> None:
    key = "model.layers.0.self_attn.kv_b_proj.weight"
    folder = _rewrite(saved["deepseek_v3"], tmp_path / "x", lambda t: {**t, key: t[key].to(FP8)})
    with pytest.raises(CheckpointError, match=rf"{key} is stored as FP8 \(F8_E4M3\) but has no {key}_scale"):
        read_hf_checkpoint(folder, _config_of(saved))


def test_fp8_scale_wrong_shape(saved: dict[str, Path], tmp_path: Path) -> None:
    key = "model.layers.0.self_attn.kv_b_proj.weight"

    def bad_scale(tensors: Tensors) -> Tensors:
        q, _ = quantize_fp8_blockwise(tensors[key])
        return {**tensors, key: q, key + "_scale_inv": torch.ones(2, 2)}

    folder = _rewrite(saved["deepseek_v3"], tmp_path / "x", bad_scale)
    with pytest.raises(CheckpointError, match=r"_scale_inv has shape \[2, 2\] .* needs \[1, 1\]"):
        read_hf_checkpoint(folder, _config_of(saved))


@torch.no_grad()
def test_fp8_model_matches_transformers_on_dequantised_weights(fp8_model: nn.Module, tmp_path: Path) -> None:
    """End to end: our model from the FP8 checkpoint == transformers running the dequantised weights."""
    from moeforge.model.loader import load_model

    float_dir = tmp_path / "float"
    fp8_model.save_pretrained(float_dir)
    folder = _rewrite(float_dir, tmp_path / "fp8", _quantise_linears)
    stored = _file_tensors(folder)
    reference = copy.deepcopy(fp8_model)
    # Put the dequantised values into transformers' model (its in-memory experts are fused).
    params = dict(reference.named_parameters())
    for key, value in stored.items():
        if not key.endswith("_scale_inv") and key + "_scale_inv" in stored and ".experts." not in key:
            params[key].copy_(dequantize_fp8_blockwise(value, stored[key + "_scale_inv"]))
    for layer_idx, layer in enumerate(reference.model.layers):
        if not hasattr(layer.mlp, "experts"):
            continue
        prefix = f"model.layers.{layer_idx}.mlp.experts"
        for e in range(layer.mlp.experts.gate_up_proj.shape[0]):
            deq = {p: dequantize_fp8_blockwise(stored[f"{prefix}.{e}.{p}.weight"],
                                               stored[f"{prefix}.{e}.{p}.weight_scale_inv"])
                   for p in ("gate_proj", "up_proj", "down_proj")}
            layer.mlp.experts.gate_up_proj[e].copy_(torch.cat([deq["gate_proj"], deq["up_proj"]]))
            layer.mlp.experts.down_proj[e].copy_(deq["down_proj"])
    ids = torch.randint(0, reference.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(5))
    expected = reference(ids).logits
    assert not torch.allclose(expected, fp8_model(ids).logits, atol=1e-4)  # FP8 really changed the weights
    ours = load_model(str(folder)).model(ids, torch.arange(24)[None]).logits
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)
