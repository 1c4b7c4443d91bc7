"""The sharding plan: every sharded tensor splits exactly into 1/tp (kv heads replicated when fewer than ranks,
MLA's latent cache the same on every rank), experts partition over ep ranks, bad splits are refused by name, and
the column/row rules are the right ones: a tensor-parallel MLP summed over ranks equals the unsharded MLP."""

import pytest
import torch
import torch.nn.functional as F

from moeforge.model.loader import load_config, load_model
from moeforge.model.sharding import ShardingError, plan_sharding


@pytest.mark.parametrize(("name", "tp", "ep"), [("tiny-llama", 2, 1), ("tiny-deepseek-v3", 2, 2),
                                                ("tiny-deepseek-v3", 2, 1), ("deepseek-v3", 8, 8)])
def test_sharded_tensors_split_exactly(name, tp, ep):
    config = load_config(name)
    plan = plan_sharding(config, tp, ep)
    for t in plan.tensors:
        if t.rule in ("vocab", "column", "row", "expert"):
            assert t.per_rank_numel * (ep if t.rule == "expert" and ep > 1 else tp) == t.numel, t.name
        elif t.rule == "replicated":
            assert t.per_rank_numel == t.numel
    assert plan.sharded_fraction_per_rank() == pytest.approx(1 / tp, rel=0.05)
    assert any("norm" in n for n in plan.replicated())
    if config.mla is not None:  # heads split, the latent they read does not
        assert plan.kv_values_per_token == plan.kv_values_per_token_unsharded
    if ep > 1:
        ids = [i for rank in plan.expert_ids for i in rank]
        assert sorted(ids) == list(range(config.moe.n_routed_experts)) and len(plan.expert_ids) == ep


def test_gqa_kv_heads_replicate_when_fewer_than_ranks():
    config = load_config("tiny-llama")  # 2 kv heads
    plan = plan_sharding(config, 4)
    k_proj = next(t for t in plan.tensors if t.name.endswith("k_proj.weight"))
    assert k_proj.rule == "kv-column" and k_proj.per_rank_numel == k_proj.numel // config.num_key_value_heads
    assert plan.kv_values_per_token == config.num_hidden_layers * 2 * 1 * config.head_dim  # one head per rank


def test_bad_splits_name_the_sizes():
    with pytest.raises(ShardingError, match="attention heads"):
        plan_sharding(load_config("tiny-llama"), 3)
    with pytest.raises(ShardingError, match="--ep"):
        plan_sharding(load_config("tiny-deepseek-v3"), 2, 4)


def test_column_row_rules_reproduce_the_mlp():
    """gate/up split by rows (column-parallel), down by columns (row-parallel): the ranks' partial outputs sum
    (the AllReduce) to the unsharded MLP's output."""
    model = load_model("tiny-llama").model
    mlp = model.model.layers[0].mlp
    tp = 2
    x = torch.randn(3, model.config.hidden_size)
    with torch.no_grad():
        full = mlp(x)
        gate, up, down = (mlp.gate_proj.weight.chunk(tp, 0), mlp.up_proj.weight.chunk(tp, 0),
                          mlp.down_proj.weight.chunk(tp, 1))
        ranks = [F.linear(F.silu(F.linear(x, gate[r])) * F.linear(x, up[r]), down[r]) for r in range(tp)]
    torch.testing.assert_close(sum(ranks), full, atol=1e-5, rtol=1e-5)
    rules = {t.name: t.rule for t in plan_sharding(model.config, tp).tensors}
    assert rules["model.layers.0.mlp.gate_proj.weight"] == "column"
    assert rules["model.layers.0.mlp.down_proj.weight"] == "row"
