"""GGUF beyond SmolLM2: Qwen2 / Qwen3 / Qwen3-MoE / Mixtral, Llama-3.x rope_freqs, K-quant and i-quant storage.

Tiny seeded transformers models are written to GGUF the way llama.cpp's convert_hf_to_gguf.py writes them (names
from the gguf package's own TensorNameMap, Q/K rows permuted for Llama only, llama3 rope scaling folded into
rope_freqs.weight by the converter's formula). The reference is transformers: the HF model itself for logits, and
transformers' own GGUF reader (its own name mapping and un-permutation) for the dequantised tensors.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from moeforge.core.config import ModelConfig
from moeforge.core.errors import ConfigError
from moeforge.model.gguf_loader import read_gguf, supported_tensor_types
from moeforge.model.loader import load_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the GGUF factory
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gguf_factory import TensorSpec, Vocab, converter_permute, write_gguf_file
from test_hf_parity import _randomise  # the HF parity tests' weight spread

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

VOCAB, PROMPT_LEN = 320, 32
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def _llama3(hidden: int = 64, ffn: int = 128) -> Any:
    """Llama-3.x: GQA, llama3 rope scaling (a pretraining length of 64, so most rotary dims are rescaled)."""
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rope_parameters=LLAMA3_ROPE, tie_word_embeddings=False))


def _qwen2(hidden: int = 64, ffn: int = 128) -> Any:
    """Qwen2: q/k/v biases, tied head, one KV head."""
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, max_position_embeddings=512, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}))


def _qwen3(hidden: int = 64, ffn: int = 128) -> Any:
    """Qwen3: per-head q/k RMSNorm, head_dim 32 != hidden / heads, untied head."""
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=512, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}))


def _qwen3_moe(hidden: int = 64, ffn: int = 128) -> Any:
    """Qwen3-MoE: 8 experts, top-2 renormalised (llama.cpp always renormalises; its qwen3moe has no dense layers)."""
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=ffn, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, max_position_embeddings=512, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}))


def _mixtral(hidden: int = 64, ffn: int = 64) -> Any:
    """Mixtral: a llama GGUF with experts (Q/K rows permuted as for Llama), 4 experts, top-2."""
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=512,
        tie_word_embeddings=False, sliding_window=None, rope_parameters={"rope_type": "default", "rope_theta": 1e6}))


BUILDERS = {"llama": _llama3, "qwen2": _qwen2, "qwen3": _qwen3, "qwen3_moe": _qwen3_moe, "mixtral": _mixtral}
ARCHS = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3,
         "qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE, "mixtral": gguf.MODEL_ARCH.LLAMA}
PERMUTED = ("llama", "mixtral")  # convert_hf_to_gguf's LlamaModel (Mixtral included) permutes Q/K rows
LLM, ATTENTION, ROPE = gguf.Keys.LLM, gguf.Keys.Attention, gguf.Keys.Rope
# A byte-level BPE vocabulary with one merge (a + b -> ab): enough for the loader to build a tokenizer.
TOKENIZER = Vocab(["a", "b", "ab", *(f"<t{i}>" for i in range(3, VOCAB))], model="gpt2", pre="qwen2",
                  merges=["a b"], bos=1, eos=2)


def _llama3_rope_factors(config: Any) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.generate_extra_tensors: llama3 rope scaling as per-frequency divisors."""
    rope = config.rope_parameters
    dim = config.hidden_size // config.num_attention_heads
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, np.float32)


def _hparams(cfg: Any) -> dict[str, Any]:
    """The hyper-parameters every converter writes, from a transformers config."""
    return {LLM.CONTEXT_LENGTH: cfg.max_position_embeddings, LLM.EMBEDDING_LENGTH: cfg.hidden_size,
            LLM.BLOCK_COUNT: cfg.num_hidden_layers, LLM.FEED_FORWARD_LENGTH: cfg.intermediate_size,
            ATTENTION.HEAD_COUNT: cfg.num_attention_heads, ROPE.FREQ_BASE: float(cfg.rope_parameters["rope_theta"]),
            ATTENTION.LAYERNORM_RMS_EPS: float(cfg.rms_norm_eps)}


def converter_name(names: gguf.TensorNameMap, hf_name: str) -> str | None:
    """The GGUF name the converter gives ``hf_name`` (None: it has none); stacked experts end in .weight too."""
    gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    if gguf_name is None or gguf_name.endswith((".weight", ".bias")):
        return gguf_name
    return gguf_name + ".weight"


def write_gguf(model: Any, path: Path, kind: str, storage: dict[str, T] | None = None,
               raw: dict[str, np.ndarray] | None = None) -> None:
    """Write ``model`` as llama.cpp's converter would. ``storage``: GGUF type per tensor kind (``attn_q``, ...;
    F32 otherwise) for types the gguf package can quantise; ``raw``: pre-quantised bytes per GGUF tensor name
    (K-quants, which only llama.cpp itself quantises)."""
    cfg = model.config
    arch = ARCHS[kind]
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    metadata = _hparams(cfg) | {ATTENTION.HEAD_COUNT_KV: cfg.num_key_value_heads}
    if kind in ("qwen3", "qwen3_moe"):
        metadata |= {ATTENTION.KEY_LENGTH: head_dim, ATTENTION.VALUE_LENGTH: head_dim}
    if kind in PERMUTED:
        metadata[ROPE.DIMENSION_COUNT] = head_dim
    if kind in ("qwen3_moe", "mixtral"):
        metadata[LLM.EXPERT_COUNT] = cfg.num_local_experts if kind == "mixtral" else cfg.num_experts
        metadata[LLM.EXPERT_USED_COUNT] = cfg.num_experts_per_tok
    if kind == "qwen3_moe":
        metadata[LLM.EXPERT_FEED_FORWARD_LENGTH] = cfg.moe_intermediate_size
    metadata[gguf.Keys.General.NAME] = f"tiny-{kind}"
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    tensors: dict[str, TensorSpec] = {}
    for hf_name, tensor in _stacked_experts(model.state_dict()).items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        gguf_name = converter_name(names, hf_name)
        assert gguf_name is not None, hf_name
        value = tensor.float().numpy()
        if kind in PERMUTED and ".attn_q." in gguf_name:
            value = converter_permute(value, cfg.num_attention_heads, cfg.num_attention_heads)
        elif kind in PERMUTED and ".attn_k." in gguf_name:
            value = converter_permute(value, cfg.num_attention_heads, cfg.num_key_value_heads)
        if raw and gguf_name in raw:  # stored bytes (uint8) as they are
            tensors[gguf_name] = (raw[gguf_name], storage_of(gguf_name, storage))
        else:
            tensors[gguf_name] = (value, storage_of(gguf_name, storage) if value.ndim >= 2 else T.F32)
    if kind == "llama" and cfg.rope_parameters.get("rope_type") == "llama3":
        tensors["rope_freqs.weight"] = _llama3_rope_factors(cfg)
    write_gguf_file(path, gguf.MODEL_ARCH_NAMES[arch], metadata=metadata, tensors=tensors, vocab=TOKENIZER)


def _stacked_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers v5 holds experts fused, ``gate_up_proj`` [E, 2I, H] (gate rows first); the converter writes
    them stacked per projection, named as the name map knows them (``mlp.experts.gate_proj`` -> ffn_gate_exps)."""
    out = {}
    for name, tensor in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            gate, up = tensor.chunk(2, dim=1)
            out[name.replace("gate_up_proj", "gate_proj")] = gate
            out[name.replace("gate_up_proj", "up_proj")] = up
        else:
            out[name] = tensor
    return out


def storage_of(gguf_name: str, storage: dict[str, T] | None) -> T:
    kind = gguf_name.split(".")[-2] if gguf_name.startswith("blk.") else gguf_name.split(".")[0]
    return (storage or {}).get(kind, T.F32)


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def written(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any, Path]:
    torch.manual_seed(0)
    model = BUILDERS[request.param]()
    _randomise(model, seed=1)
    model.eval()
    path = tmp_path_factory.mktemp(f"gguf_{request.param}") / f"tiny-{request.param}.gguf"
    write_gguf(model, path, request.param)
    return request.param, model, path


def _prompt(length: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(7))


@torch.no_grad()
def test_gguf_logits_match_transformers(written: tuple[str, Any, Path]) -> None:
    kind, hf_model, path = written
    loaded = load_model(str(path))
    assert loaded.config.model_type == kind
    ids = _prompt(PROMPT_LEN)
    expected = hf_model(ids).logits
    got = loaded.model(ids, torch.arange(PROMPT_LEN)[None]).logits
    assert expected.abs().max() > 0.5  # logits with real spread
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_gguf_config_reads_each_architecture(written: tuple[str, Any, Path]) -> None:
    kind, hf_model, path = written
    cfg = read_gguf(path).config
    hf = hf_model.config
    assert (cfg.model_type, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        kind, hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads)
    assert cfg.head_dim == (hf.head_dim if kind == "qwen3" else hf.hidden_size // hf.num_attention_heads)
    assert cfg.qk_norm == ("head" if kind.startswith("qwen3") else "none")
    assert cfg.qkv_bias is (kind == "qwen2") and cfg.tie_word_embeddings is hf.tie_word_embeddings
    assert cfg.rope.theta == hf.rope_parameters["rope_theta"] and not cfg.rope.interleaved
    if kind == "llama":  # llama3 scaling arrives as the converter's per-frequency divisors
        factors = cfg.rope.frequency_factors
        assert factors is not None and len(factors) == cfg.head_dim // 2 and max(factors) == 8.0
        assert ModelConfig.from_dict(cfg.to_dict()) == cfg  # and survives the artifact manifest
    else:
        assert cfg.rope.frequency_factors is None


def test_llama3_rope_freqs_change_the_model(written: tuple[str, Any, Path]) -> None:
    """Without the factors the same weights give other logits: the parity above depends on reading them."""
    kind, hf_model, path = written
    if kind != "llama":
        pytest.skip("rope_freqs is Llama-3.x's")
    import dataclasses

    from moeforge.model.loader import build_from_tensors

    ckpt = read_gguf(path)
    plain = dataclasses.replace(ckpt.config, rope=dataclasses.replace(ckpt.config.rope, frequency_factors=None))
    model = build_from_tensors(plain, ckpt.tensors.items())
    ids = _prompt(PROMPT_LEN)
    with torch.no_grad():
        difference = (model(ids, torch.arange(PROMPT_LEN)[None]).logits - hf_model(ids).logits).abs().max()
    assert difference > 1e-2


def test_rope_factors_are_validated() -> None:
    base = dict(model_type="llama", vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=4, head_dim=16)
    from moeforge.core.config import RopeConfig

    ModelConfig(**base, rope=RopeConfig(frequency_factors=(1.0,) * 8))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"3 given.*8 frequencies"):
        ModelConfig(**base, rope=RopeConfig(frequency_factors=(1.0, 2.0, 3.0)))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"rope_freqs\[1\]"):
        ModelConfig(**base, rope=RopeConfig(frequency_factors=(1.0, -2.0) + (1.0,) * 6))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="default or linear scaling only"):
        ModelConfig(**base, rope=RopeConfig(scaling="yarn", factor=2.0, original_max_position_embeddings=64,  # type: ignore[arg-type]
                                            frequency_factors=(1.0,) * 8))


# --------------------------------------------------------------------------- storage types (K-quants, i-quants)
# Every kind of projection in another type; in-features of 256 (a K-quant super-block), except the experts' down
# projection (in-features moe_intermediate_size 32: a 32-block type).
K_STORAGE = {"token_embd": T.Q6_K, "output": T.Q5_K, "attn_q": T.Q4_K, "attn_k": T.Q3_K, "attn_v": T.Q2_K,
             "attn_output": T.IQ4_XS, "ffn_gate": T.Q5_0, "ffn_up": T.BF16, "ffn_down": T.IQ4_NL,
             "ffn_gate_exps": T.Q4_K, "ffn_up_exps": T.Q6_K, "ffn_down_exps": T.Q8_0}


def _random_blocks(rng: np.random.Generator, shape: tuple[int, ...], qtype: T) -> np.ndarray:
    """Random stored bytes of a tensor of ``qtype`` and torch ``shape``. Every byte < 0x3C: each fp16 scale inside a
    block then has an exponent below 15 (finite, < 1), whatever the type's block layout."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return rng.integers(0, 0x3C, (*shape[:-1], shape[-1] // block * size), dtype=np.uint8)


def _as_transformers_names(name: str, ours: torch.Tensor, reference: dict[str, torch.Tensor]) -> torch.Tensor:
    """The reference tensor for one of ours: transformers fuses stacked experts as gate_up_proj [E, 2I, H]."""
    if name.endswith(("mlp.experts.gate_proj", "mlp.experts.up_proj")):
        fused = reference[name.rsplit(".", 1)[0] + ".gate_up_proj"]
        return fused.chunk(2, dim=1)[0 if name.endswith("gate_proj") else 1]
    return reference[name]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3_moe"])
def test_k_and_i_quants_dequantise_as_transformers_reads_them(kind: str, tmp_path: Path) -> None:
    """Both readers dequantise with the gguf package: this checks what each does around it (type dispatch, row
    chunking, shapes, Q/K un-permutation, expert splitting), each its own code."""
    torch.manual_seed(0)
    model = BUILDERS[kind](hidden=256, ffn=256)
    _randomise(model, seed=2)
    rng = np.random.default_rng(3)
    names = gguf.get_tensor_name_map(ARCHS[kind], model.config.num_hidden_layers)
    raw, written = {}, set()
    for hf_name, tensor in _stacked_experts(model.state_dict()).items():
        gguf_name = converter_name(names, hf_name)
        if gguf_name is None or (hf_name == "lm_head.weight" and model.config.tie_word_embeddings):
            continue
        qtype = storage_of(gguf_name, K_STORAGE)
        written.add(qtype.name if tensor.dim() >= 2 else "F32")
        if tensor.dim() >= 2 and qtype not in (T.F32, T.BF16, T.Q5_0, T.Q8_0):  # those the gguf package quantises
            raw[gguf_name] = _random_blocks(rng, tuple(tensor.shape), qtype)
    path = tmp_path / f"{kind}-k.gguf"
    write_gguf(model, path, kind, storage=K_STORAGE, raw=raw)

    ckpt = read_gguf(path)
    assert {ckpt.tensors.gguf_type(n) for n in ckpt.tensors} == written and len(written) >= 8
    # transformers' GGUF config mapping skips expert_feed_forward_length: its tensor reading is what is compared, so
    # it gets the model's own config.
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, config=model.config, dtype=torch.float32).state_dict()
    for name, ours in ckpt.tensors.items():
        assert torch.isfinite(ours).all(), name
        torch.testing.assert_close(ours, _as_transformers_names(name, ours, reference), atol=0, rtol=0, msg=name)


def test_every_type_gguf_dequantises_is_accepted() -> None:
    supported = set(supported_tensor_types())
    assert {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
            "IQ4_NL", "IQ4_XS"} <= supported
    assert "I32" not in supported  # integer tensors are not weights
