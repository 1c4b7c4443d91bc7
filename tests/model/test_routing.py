"""Routing vs transformers' DeepSeek routers and vs a plain-numpy statement of the semantics."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moeforge.core.config import MoEConfig
from moeforge.model.routing import route_tokens


def _numpy_route(logits: np.ndarray, bias: np.ndarray | None, moe: MoEConfig):
    """Token-by-token restatement of deepseek.md: returns a list of {expert: weight} dicts."""
    out = []
    for row in logits.astype(np.float64):
        scores = np.exp(row - row.max()) / np.exp(row - row.max()).sum() if moe.scoring_func == "softmax" \
            else 1 / (1 + np.exp(-row))
        choice = scores + (bias if bias is not None else 0)
        allowed = np.ones_like(choice, dtype=bool)
        if moe.topk_method != "greedy" and moe.n_group > 1:
            groups = choice.reshape(moe.n_group, -1)
            group_score = np.sort(groups, axis=1)[:, -2:].sum(1) if moe.topk_method == "noaux_tc" else groups.max(1)
            kept = np.argsort(-group_score, kind="stable")[: moe.topk_group]
            allowed = np.zeros((moe.n_group, groups.shape[1]), dtype=bool)
            allowed[kept] = True
            allowed = allowed.reshape(-1)
        masked = np.where(allowed, choice, -np.inf)
        chosen = np.argsort(-masked, kind="stable")[: moe.num_experts_per_tok]
        w = scores[chosen]
        if moe.norm_topk_prob:
            w = w / w.sum()
        out.append(dict(zip(chosen.tolist(), (w * moe.routed_scaling_factor).tolist(), strict=True)))
    return out


def _as_dicts(ids: torch.Tensor, weights: torch.Tensor):
    return [dict(zip(i.tolist(), w.tolist(), strict=True)) for i, w in zip(ids, weights, strict=True)]


def _assert_same_routing(ours, reference, atol=1e-5):
    for a, b in zip(ours, reference, strict=True):
        assert set(a) == set(b)
        for e in a:
            assert a[e] == pytest.approx(b[e], abs=atol)


V3 = MoEConfig(n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4, moe_intermediate_size=8,
               scoring_func="sigmoid", topk_method="noaux_tc", n_group=4, topk_group=2, norm_topk_prob=True,
               routed_scaling_factor=2.5)
V2 = MoEConfig(n_routed_experts=16, n_shared_experts=2, num_experts_per_tok=3, moe_intermediate_size=8,
               scoring_func="softmax", topk_method="group_limited_greedy", n_group=4, topk_group=2,
               routed_scaling_factor=1.5)


def test_matches_transformers_v3_router():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    hf_config = DeepseekV3Config(hidden_size=16, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                                 topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)
    router = DeepseekV3TopkRouter(hf_config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.eye(16))  # router logits = the hidden states
        bias = torch.rand(16, generator=gen) * 0.2  # positive: HF and the reference agree then
        router.e_score_correction_bias.copy_(bias)
    x = torch.randn(64, 16, generator=gen) * 2
    _, hf_w, hf_ids = router(x)
    ids, w = route_tokens(x, bias, V3)
    _assert_same_routing(_as_dicts(ids, w), _as_dicts(hf_ids, hf_w))


def test_matches_transformers_v2_router():
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    hf_config = DeepseekV2Config(hidden_size=16, n_routed_experts=16, num_experts_per_tok=3, n_group=4,
                                 topk_group=2, topk_method="group_limited_greedy", routed_scaling_factor=1.5,
                                 num_attention_heads=2, num_key_value_heads=2)
    router = DeepseekV2TopkRouter(hf_config)
    with torch.no_grad():
        router.weight.copy_(torch.eye(16))
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(1)) * 2
    _, hf_w, hf_ids = router(x)
    ids, w = route_tokens(x, None, V2)
    _assert_same_routing(_as_dicts(ids, w), _as_dicts(hf_ids, hf_w))


def test_masked_groups_are_never_chosen_even_with_negative_scores():
    # Biased scores below zero: a 0.0 mask (the known bug) would pick masked experts; -inf must not.
    moe = MoEConfig(n_routed_experts=8, n_shared_experts=0, num_experts_per_tok=4, moe_intermediate_size=8,
                    scoring_func="sigmoid", topk_method="noaux_tc", n_group=4, topk_group=2)
    logits = torch.randn(32, 8, generator=torch.Generator().manual_seed(2))
    bias = torch.full((8,), -2.0)
    ids, _ = route_tokens(logits, bias, moe)
    choice = (logits.sigmoid() + bias).view(32, 4, 2)
    kept = choice.topk(2, dim=-1).values.sum(-1).topk(2, dim=-1).indices  # [T, 2] kept groups
    for token in range(32):
        assert set((ids[token] // 2).tolist()) <= set(kept[token].tolist())


moe_configs = st.builds(
    lambda method, groups, topk_group_frac, k_frac, per_group, norm, scale: MoEConfig(
        n_routed_experts=groups * per_group, n_shared_experts=0,
        num_experts_per_tok=max(1, round(k_frac * max(1, round(topk_group_frac * groups)) * per_group)),
        moe_intermediate_size=4, scoring_func="sigmoid" if method == "noaux_tc" else "softmax",
        topk_method=method, n_group=groups if method != "greedy" else 1,
        topk_group=max(1, round(topk_group_frac * groups)) if method != "greedy" else 1,
        norm_topk_prob=norm, routed_scaling_factor=scale),
    st.sampled_from(["greedy", "group_limited_greedy", "noaux_tc"]), st.integers(1, 4),
    st.floats(0.25, 1.0), st.floats(0.1, 1.0), st.integers(2, 4), st.booleans(), st.sampled_from([1.0, 2.5]),
)


@settings(max_examples=60, deadline=None)
@given(moe=moe_configs, tokens=st.integers(1, 5), seed=st.integers(0, 2**16), quantise=st.booleans())
def test_property_matches_numpy_reference(moe, tokens, seed, quantise):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, moe.n_routed_experts, generator=gen)
    if quantise:
        # Coarse logits create exact ties, where more than one answer is right: check validity only.
        logits = (logits * 2).round() / 2
    bias = torch.rand(moe.n_routed_experts, generator=gen) * 0.1 if moe.topk_method == "noaux_tc" else None
    ids, w = route_tokens(logits, bias, moe)
    assert ids.shape == w.shape == (tokens, moe.num_experts_per_tok)
    assert (ids >= 0).all() and (ids < moe.n_routed_experts).all()
    assert all(len(set(row.tolist())) == moe.num_experts_per_tok for row in ids)  # no expert twice
    per_group = moe.n_routed_experts // moe.n_group
    assert all(len(set((row // per_group).tolist())) <= moe.topk_group for row in ids)  # within kept groups
    scores = logits.softmax(-1) if moe.scoring_func == "softmax" else logits.sigmoid()
    expected_w = scores.gather(1, ids)
    if moe.norm_topk_prob:
        expected_w = expected_w / expected_w.sum(-1, keepdim=True)
    torch.testing.assert_close(w, expected_w * moe.routed_scaling_factor, atol=1e-5, rtol=1e-5)
    if not quantise:
        reference = _numpy_route(logits.numpy(), None if bias is None else bias.numpy(), moe)
        _assert_same_routing(_as_dicts(ids, w), reference)
    if moe.norm_topk_prob:
        torch.testing.assert_close(w.sum(-1), torch.full((tokens,), moe.routed_scaling_factor), atol=1e-5, rtol=0)
