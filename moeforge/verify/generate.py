"""Reference generation in PyTorch with a KV cache: the oracle for every later parity check.

Sampling parameters and prompts are checked by the runtime's own rules (``SamplingParams.validate``,
``prompt_token_ids``), so this path refuses exactly what the engine refuses. Those two are plain-Python
leaves of ``runtime`` (numpy only), imported here against the export < runtime layering on purpose:
one set of rules, not two that drift.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from moeforge.core.errors import MoeforgeError
from moeforge.model.model import CausalLM
from moeforge.runtime.request import prompt_token_ids
from moeforge.runtime.sampler import SamplingParams


@dataclass(frozen=True)
class SamplingConfig:
    """temperature 0 means greedy; top_k 0 and top_p 1.0 disable those filters."""

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def validate(self, vocab_size: int, names: Mapping[str, str] | None = None) -> None:
        """Raise ``SamplingParamsError`` naming the parameter: the engine's rules (``SamplingParams.validate``),
        with ``max_tokens`` called ``max_new_tokens`` here. ``names`` maps a ``SamplingParams`` field to the
        name the user knows (e.g. ``{"max_tokens": "--max-new-tokens"}``), as for ``SamplingParams.validate``."""
        params = SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=self.seed,
                                max_tokens=self.max_new_tokens, stop_token_ids=self.stop_token_ids)
        params.validate(vocab_size, {"max_tokens": "max_new_tokens", **(names or {})})


@dataclass
class GenerationResult:
    """Generated ids only (the prompt excluded), their step logits [V] if kept, and why it stopped."""

    token_ids: list[int]
    finish_reason: str
    step_logits: list[torch.Tensor] = field(default_factory=list)


def check_prompt(prompt_ids: Sequence[int], vocab_size: int, max_positions: int, max_new_tokens: int) -> list[int]:
    """The prompt as plain ints: non-empty integer ids inside the vocabulary (the engine's rules,
    ``prompt_token_ids``) that leave room for the new tokens; else ``MoeforgeError`` (``RequestError``)."""
    ids = prompt_token_ids(prompt_ids, vocab_size)
    if len(ids) + max_new_tokens > max_positions:
        raise MoeforgeError(
            f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
            f"{max_positions} positions; shorten the prompt or lower max_new_tokens (the CLI's --max-new-tokens); "
            "nothing is truncated"
        )
    return ids


def sample_next(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None) -> int:
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
    model: CausalLM, prompt_ids: Sequence[int], cfg: SamplingConfig
) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield (token id, logits [V] it was sampled from) one at a time: prefill, then cached decode."""
    config = model.config
    cfg.validate(config.vocab_size)
    prompt = check_prompt(prompt_ids, config.vocab_size, config.max_position_embeddings, cfg.max_new_tokens)
    generator = torch.Generator().manual_seed(cfg.seed) if cfg.seed is not None else None
    device = model.output_embedding.device
    ids = torch.tensor([prompt], dtype=torch.int64, device=device)  # [1, P]
    positions = torch.arange(ids.shape[1], device=device)[None]
    past = None
    for _ in range(cfg.max_new_tokens):
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
    model: CausalLM, prompt_ids: Sequence[int], cfg: SamplingConfig, keep_logits: bool = False
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
