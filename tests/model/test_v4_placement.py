"""DeepSeek-V4's MoE under an expert placement (``--placement``): two expert-parallel ranks holding slots, replicas of
one expert on both ranks, an empty slot, must sum to the unsharded block, for a hash-routed layer (``tid2eid``) and a
top-k one. The compile of a placed V4 checkpoint: tests/compile/test_compile_deepseek_v4.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moeforge.model.deepseek_v4_moe import V4MoE
from moeforge.model.expert_slots import EMPTY, ExpertSlots
from moeforge.model.moe import route_to_replicas
from moeforge.model.presets import get_preset
from moeforge.model.rank_model_v4 import shard_v4_moe, v4_rank_config

CONFIG = get_preset("tiny-deepseek-v4").config
EXPERTS = 8


@torch.no_grad()
def _block(layer: int, seed: int) -> V4MoE:
    gen = torch.Generator().manual_seed(seed)
    block = V4MoE(CONFIG, layer).eval()
    for p in block.parameters():
        p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    if block.gate.tid2eid is not None:  # K distinct experts per token id, as a checkpoint's table
        table = torch.rand(CONFIG.vocab_size, EXPERTS, generator=gen).argsort(-1)[:, :block.gate.top_k]
        block.gate.tid2eid.copy_(table)
    else:
        assert block.gate.e_score_correction_bias is not None
        block.gate.e_score_correction_bias.copy_(torch.rand(EXPERTS, generator=gen) * 0.2)
    return block


@torch.no_grad()
@pytest.mark.parametrize("layer", [0, 1], ids=["hash", "top-k"])
def test_placed_ranks_sum_to_the_unplaced_block(layer: int) -> None:
    assert CONFIG.moe is not None and CONFIG.moe.hash_layers == (0,) and CONFIG.moe.n_routed_experts == EXPERTS
    block = _block(layer, seed=layer)
    gen = torch.Generator().manual_seed(10 + layer)
    x = torch.randn(2, 9, CONFIG.hidden_size, generator=gen)  # [B, S, H]
    input_ids = torch.randint(0, CONFIG.vocab_size, (2, 9), generator=gen)  # [B, S]
    ids, _ = block.gate(x.reshape(-1, CONFIG.hidden_size), input_ids.reshape(-1))  # [T, K] logical experts
    counts = torch.bincount(ids.reshape(-1), minlength=EXPERTS)
    heavy0, heavy1 = int(counts[:4].argmax()), 4 + int(counts[4:].argmax())
    # Each rank its half in reverse order (slot != expert id); heavy1 replicated on rank 0 beside an empty slot,
    # heavy0 on rank 0 and twice on rank 1. Every layer the same row (only ``layer``'s is read here).
    row = [3, 2, 1, 0, heavy1, EMPTY, 7, 6, 5, 4, heavy0, heavy0]
    slots = ExpertSlots.from_array([row] * CONFIG.num_hidden_layers, ep=2)
    slots.check(CONFIG.num_hidden_layers, EXPERTS, 2, CONFIG.name)
    local_config = v4_rank_config(CONFIG, 2, 2)
    ranks = [shard_v4_moe(block, local_config, 2, 2, rank, (6 * rank, 6 * rank + 6), nn.Identity(), slots, layer)
             for rank in range(2)]
    expected = block(x, input_ids)
    torch.testing.assert_close(sum(rank(x, input_ids) for rank in ranks), expected, rtol=1e-5, atol=1e-5)

    # The placement is what routes: each heavy expert's tokens reach more than one of its slots, on both ranks for
    # heavy0, and the placed weights without the slot table give another output.
    table, replicas = slots.slot_table(layer, EXPERTS)
    chosen = route_to_replicas(ids, torch.tensor(table), torch.tensor(replicas))  # [T, K] slots
    used = {int(s) for s in chosen[ids == heavy0]}
    assert len(used) > 1 and {s // 6 for s in used} == {0, 1}
    assert len({int(s) for s in chosen[ids == heavy1]}) > 1
    for rank in ranks:
        rank.slot_table = None
    assert not torch.allclose(sum(rank(x, input_ids) for rank in ranks), expected, atol=1e-3)
