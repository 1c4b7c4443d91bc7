"""Seeded tiny DeepSeek-V4 models of transformers (``DeepseekV4ForCausalLM``), shared by the model and compile tests.

``hf_config`` fills a small config around the fields a case sets; ``randomise`` gives weights a real spread (HF's
std 0.02 gives near-uniform logits), mHC scales near 1, positive correction biases and a hash table naming K distinct
experts per token id; ``hf_greedy`` is transformers' own greedy generation.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers

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
