"""Reference generation in PyTorch with a KV cache: the oracle for every later parity check.

It takes the engine's ``SamplingParams`` and checks them and the prompt by the runtime's own rules
(``SamplingParams.validate``, ``prompt_token_ids``, ``check_room``), so this path refuses exactly what the engine
refuses: one sampling type and one set of rules, not two that drift.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from moeforge.model.model import CausalLM
from moeforge.runtime.request import check_room, prompt_token_ids
from moeforge.runtime.sampler import SamplingParams, SamplingParamsError


@dataclass
class GenerationResult:
    """Generated ids only (the prompt excluded), their step logits [V] if kept, and why it stopped."""

    token_ids: list[int]
    finish_reason: str
    step_logits: list[torch.Tensor] = field(default_factory=list)


def check_request(params: SamplingParams, prompt_ids: Sequence[int], vocab_size: int, max_positions: int,
                  names: Mapping[str, str] | None = None) -> list[int]:
    """The prompt as plain ints, checked with the engine's rules (``SamplingParams.validate``,
    ``prompt_token_ids``, ``check_room``), and the parameters the reference applies: ``RequestError`` or
    ``SamplingParamsError`` naming the problem (``names``: field -> the name the caller's user knows)."""
    params.validate(vocab_size, names)
    for field_name, off in (("min_p", 0.0), ("repetition_penalty", 1.0), ("presence_penalty", 0.0),
                            ("stop_strings", ()), ("logprobs", None)):
        if getattr(params, field_name) != off:
            raise SamplingParamsError((names or {}).get(field_name, field_name),
                                      "is not applied by the PyTorch reference (it samples with temperature, top_k, "
                                      "top_p and seed, and stops at stop_token_ids): run the artifact for it")
    ids = prompt_token_ids(prompt_ids, vocab_size)
    check_room(len(ids), params.max_tokens, max_positions, "the model's positions", names)
    return ids


def sample_next(logits: torch.Tensor, cfg: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick the next token from logits [V] (float32)."""
    if cfg.temperature == 0.0:
        return int(torch.argmax(logits))
    # As the engine's sampler: shift so the max maps to 0 (no inf - inf), divide in float64 (a temperature below
    # float32's smallest would round to 0); the far tail becomes -inf, probability 0.
    scaled = ((logits - logits.max()).double() / cfg.temperature).float()
    if cfg.top_k > 0:
        kth = torch.topk(scaled, min(cfg.top_k, scaled.numel())).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if cfg.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always survives).
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= cfg.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
        probs = probs / probs.sum()
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.inference_mode()
def generate_stream(
    model: CausalLM, prompt_ids: Sequence[int], cfg: SamplingParams
) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield (token id, logits [V] it was sampled from) one at a time: prefill, then cached decode. ``cfg`` is the
    engine's ``SamplingParams``; the reference refuses the fields it does not apply (``check_request``)."""
    config = model.config
    prompt = check_request(cfg, prompt_ids, config.vocab_size, config.max_position_embeddings)
    generator = torch.Generator().manual_seed(cfg.seed) if cfg.seed is not None else None
    device = model.output_embedding.device
    ids = torch.tensor([prompt], dtype=torch.int64, device=device)  # [1, P]
    positions = torch.arange(ids.shape[1], device=device)[None]
    past = None
    for _ in range(cfg.max_tokens):
        out = model(ids, positions, past)
        past = out.past_key_values
        logits = out.logits[0, -1]
        token = sample_next(logits, cfg, generator)
        yield token, logits
        if token in cfg.stop_token_ids:
            return
        next_pos = int(positions[0, -1]) + 1
        ids = torch.tensor([[token]], dtype=torch.int64, device=device)
        positions = torch.tensor([[next_pos]], dtype=torch.int64, device=device)


def generate(
    model: CausalLM, prompt_ids: Sequence[int], cfg: SamplingParams, keep_logits: bool = False
) -> GenerationResult:
    """Run ``generate_stream`` to the end."""
    tokens: list[int] = []
    logits: list[torch.Tensor] = []
    for token, step_logits in generate_stream(model, prompt_ids, cfg):
        tokens.append(token)
        if keep_logits:
            logits.append(step_logits.clone())
    stopped = bool(tokens) and tokens[-1] in cfg.stop_token_ids
    return GenerationResult(tokens, "stop" if stopped else "length", logits)
