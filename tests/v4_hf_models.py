"""Seeded tiny DeepSeek-V4 models of transformers (``DeepseekV4ForCausalLM``), shared by the model and compile tests.

``hf_config`` fills a small config around the fields a case sets; ``randomise`` gives weights a real spread (HF's
std 0.02 gives near-uniform logits), mHC scales near 1, positive correction biases and a hash table naming K distinct
experts per token id; ``hf_greedy`` is transformers' own greedy generation.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors.torch import load_file, save_file

VOCAB = 96
CSA, HCA, SLIDING = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"


def hf_config(**fields: Any) -> Any:
    base = dict(vocab_size=VOCAB, hidden_size=32, moe_intermediate_size=16, num_attention_heads=4, head_dim=16,
                q_lora_rank=16, n_routed_experts=6, num_experts_per_tok=2, o_groups=2, o_lora_rank=8,
                index_head_dim=8, partial_rotary_factor=0.25, max_position_embeddings=256, routed_scaling_factor=1.5,
                swiglu_limit=1.0, eos_token_id=None, pad_token_id=None, bos_token_id=None)
    config = transformers.DeepseekV4Config(**{**base, **fields})
    config._attn_implementation = "eager"
    return config


@torch.no_grad()
def randomise(model: torch.nn.Module, seed: int) -> None:
    """Seeded weights with a real spread (see the module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        if name.endswith("scale"):
            p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
        elif p.dim() == 1:
            p.copy_((1.0 if "norm" in name else 0.0) + 0.1 * torch.randn(p.shape, generator=gen))
        else:
            p.copy_(torch.randn(p.shape, generator=gen) * (0.7 / p.shape[-1] ** 0.5))
    for name, b in sorted(model.named_buffers()):
        if name.endswith("e_score_correction_bias"):
            b.copy_(torch.rand(b.shape, generator=gen) * 0.2)
        elif name.endswith("tid2eid"):
            experts = model.config.n_routed_experts  # type: ignore[union-attr]
            b.copy_(torch.rand(b.shape[0], experts, generator=gen).argsort(-1)[:, : b.shape[1]])


def hf_model(fields: dict[str, Any], seed: int) -> Any:
    """A seeded transformers DeepSeek-V4 of ``fields`` (eval mode)."""
    torch.manual_seed(0)
    model = transformers.DeepseekV4ForCausalLM(hf_config(**fields))
    randomise(model, seed)
    return model.eval()


@torch.no_grad()
def hf_greedy(model: Any, prompt: list[int], steps: int) -> list[int]:
    """transformers' greedy continuation of ``prompt`` (``steps`` tokens)."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return [int(t) for t in out[0, len(prompt):]]


# ---------------------------------------------------------------------------------------- published checkpoints
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # e2m1 magnitudes, codes 0..7 (bit 3: the sign)


def published_name(key: str) -> str:
    """transformers' save_pretrained name (the published leaf names under "model.") -> the published name."""
    leaf = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
            "model.hc_head.hc_fn": "hc_head_fn", "model.hc_head.hc_base": "hc_head_base",
            "model.hc_head.hc_scale": "hc_head_scale"}
    return leaf.get(key, key.removeprefix("model."))


def fp8_ue8m0(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (float8_e4m3fn blocks, float8_e8m0fnu scales): a power-of-two scale per block x block."""
    out, inn = w.shape
    blocks = w.reshape(out // block, block, inn // block, block)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
    q = (blocks / scale[:, None, :, None]).reshape(out, inn).to(torch.float8_e4m3fn)
    return q, scale.to(torch.float8_e8m0fnu)


def fp4_ue8m0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, K] -> (int8 [out, K/2]: two e2m1 codes a byte, value 2j in the low nibble; float8_e8m0fnu [out, K/32]),
    the layout of DeepSeek-V4-Flash's routed experts (a power-of-two scale per 32 values along K)."""
    out, k = w.shape
    groups = w.reshape(out, k // 32, 32)
    scale = torch.exp2(torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-12) / 6.0)))  # [out, K/32]
    scaled = groups / scale[..., None]
    magnitude = (scaled.abs()[..., None] - E2M1).abs().argmin(-1)  # nearest e2m1 magnitude code
    codes = (magnitude + 8 * (scaled < 0)).reshape(out, k).to(torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.view(torch.int8), scale.to(torch.float8_e8m0fnu)


def write_published(model: Any, folder: Any, *, experts: str, block: int = 8, packed: torch.dtype = torch.int8) -> None:
    """``model``'s checkpoint as DeepSeek publishes V4-Flash, into ``folder``: published names; attention, shared and
    (``experts`` "fp8") routed-expert projections FP8 with ue8m0 ``.scale`` blocks of ``block``; (``experts`` "fp4")
    routed experts FP4 as ``fp4_ue8m0`` packs them, stored as ``packed`` (int8 as published, uint8, or
    float4_e2m1fn_x2); compressor and indexer projections unquantised, as in V4-Flash."""
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        tensors = load_file(str(Path(tmp) / "model.safetensors"))
        hf_json = json.loads((Path(tmp) / "config.json").read_text())
    published: dict[str, torch.Tensor] = {}
    quantised = (".wq_a.", ".wq_b.", ".wkv.", ".wo_a.", ".wo_b.", ".w1.", ".w2.", ".w3.")
    for key, value in tensors.items():
        name = published_name(key)
        if name.endswith(".weight") and any(q in name for q in quantised) and ".compressor." not in name:
            fp4 = experts == "fp4" and ".experts." in name and ".shared_experts." not in name
            q, scale = fp4_ue8m0(value) if fp4 else fp8_ue8m0(value, block)
            q = q.view(packed) if fp4 else q
            published[name], published[name.removesuffix("weight") + "scale"] = q, scale
        else:
            published[name] = value
    Path(folder).mkdir(parents=True, exist_ok=True)
    save_file(published, str(Path(folder) / "model.safetensors"))
    hf_json["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [block, block], "scale_fmt": "ue8m0",
                                      "expert_dtype": experts, "activation_scheme": "dynamic"}
    (Path(folder) / "config.json").write_text(json.dumps(hf_json))
