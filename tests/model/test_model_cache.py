"""Cached decode equals the uncached forward; naive and absorbed MLA agree; masks behave."""

import dataclasses

import pytest
import torch

from moeforge.model.attention import causal_mask
from moeforge.model.model import CausalLM, init_random_weights
from moeforge.model.presets import get_preset

PROMPT_LEN, STEPS = 16, 16


def _model(name: str, impl: str = "absorb", **changes) -> CausalLM:
    preset = get_preset(name)
    config = dataclasses.replace(preset.config, **changes) if changes else preset.config
    model = CausalLM(config, impl)
    init_random_weights(model, preset.seed)
    return model.eval()


def _cached_logits(model: CausalLM, ids: torch.Tensor) -> torch.Tensor:
    """Prefill PROMPT_LEN tokens, then feed the rest one at a time through the cache."""
    positions = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1)
    out = model(ids[:, :PROMPT_LEN], positions[:, :PROMPT_LEN])
    logits, past = [out.logits], out.past_key_values
    for t in range(PROMPT_LEN, ids.shape[1]):
        out = model(ids[:, t : t + 1], positions[:, t : t + 1], past)
        logits.append(out.logits)
        past = out.past_key_values
    return torch.cat(logits, dim=1)


@pytest.mark.parametrize("name", ["tiny-deepseek-v3", "tiny-deepseek-v2", "tiny-llama"])
@pytest.mark.parametrize("impl", ["absorb", "naive"])
@torch.no_grad()
def test_cached_decode_matches_uncached_forward(name, impl):
    model = _model(name, impl)
    ids = torch.randint(0, model.config.vocab_size, (2, PROMPT_LEN + STEPS), generator=torch.Generator().manual_seed(0))
    full = model(ids, torch.arange(ids.shape[1])[None].expand(2, -1)).logits
    cached = _cached_logits(model, ids)
    assert full.shape == cached.shape == (2, PROMPT_LEN + STEPS, model.config.vocab_size)
    torch.testing.assert_close(cached, full, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["tiny-deepseek-v3", "tiny-deepseek-v2"])
@torch.no_grad()
def test_absorbed_mla_equals_naive_mla(name):
    absorbed, naive = _model(name, "absorb"), _model(name, "naive")
    ids = torch.randint(0, 512, (1, 24), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(24)[None]
    a, n = absorbed(ids, pos), naive(ids, pos)
    torch.testing.assert_close(a.logits, n.logits, atol=1e-4, rtol=0)
    config = absorbed.config
    # The absorbed cache holds only the latent: kv_lora_rank + qk_rope_head_dim per token per layer.
    assert [tuple(t.shape) for t in a.past_key_values[0]] == [(1, 24, config.mla.latent_dim)]
    h, mla = config.num_attention_heads, config.mla
    assert [tuple(t.shape) for t in n.past_key_values[0]] == [(1, h, 24, mla.qk_head_dim), (1, h, 24, mla.v_head_dim)]


@torch.no_grad()
def test_sliding_window_cached_decode_and_effect():
    windowed = _model("tiny-llama", sliding_window=4)
    ids = torch.randint(0, 512, (1, PROMPT_LEN + STEPS), generator=torch.Generator().manual_seed(2))
    pos = torch.arange(ids.shape[1])[None]
    full = windowed(ids, pos).logits
    torch.testing.assert_close(_cached_logits(windowed, ids), full, atol=1e-4, rtol=0)
    # Within the window the model equals the unwindowed one; beyond it, it must differ.
    plain = _model("tiny-llama")(ids, pos).logits
    torch.testing.assert_close(full[:, :4], plain[:, :4], atol=1e-5, rtol=0)
    assert (full[:, 8:] - plain[:, 8:]).abs().max() > 1e-3


def test_causal_mask_is_bottom_right_aligned():
    mask = causal_mask(3, 2, None, torch.device("cpu"))
    assert mask.tolist() == [[True, True, True, True, False], [True, True, True, True, True]]
    windowed = causal_mask(3, 2, 2, torch.device("cpu"))
    assert windowed.tolist() == [[False, False, True, True, False], [False, False, False, True, True]]


@torch.no_grad()
def test_positions_are_explicit_inputs():
    # RoPE reads position_ids, not indices: a uniform shift keeps relative distances (same output),
    # a gap changes them (different output).
    model = _model("tiny-llama")
    ids = torch.randint(0, 512, (1, 8), generator=torch.Generator().manual_seed(3))
    a = model(ids, torch.arange(8)[None]).logits
    shifted = model(ids, torch.arange(8)[None] + 5).logits
    gapped = model(ids, torch.tensor([[0, 1, 2, 3, 20, 21, 22, 23]])).logits
    torch.testing.assert_close(shifted, a, atol=1e-4, rtol=0)
    assert (gapped[:, 4:] - a[:, 4:]).abs().max() > 1e-3
