"""Pipeline stages (issue 35): the split planner, --pp-layers, stage configs, and StageLM against the whole model."""

from __future__ import annotations

import itertools

import pytest
import torch

from moeforge.core.errors import MoeforgeError
from moeforge.model.loader import load_model
from moeforge.model.model import CausalLM, init_random_weights
from moeforge.model.pipeline_stages import (
    StageSpec,
    parse_pp_layers,
    plan_stages,
    stage_config,
    stage_costs,
    stage_model,
    stage_sources,
)
from moeforge.model.presets import get_preset
from moeforge.model.rank_model import TensorSlice


def _chain(model: CausalLM, specs: list[StageSpec], ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    x = ids
    for spec in specs:
        x = stage_model(model, spec)(x, positions).logits
    return x


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-deepseek-v3", "tiny-deepseek-v3.2", "tiny-qwen3-moe"])
def test_stages_chained_equal_the_whole_model(preset: str) -> None:
    model = load_model(preset, mla_impl="absorb").model
    n = model.config.num_hidden_layers
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    positions = torch.arange(9).expand(2, 9)
    with torch.no_grad():
        whole = model(ids, positions).logits
        for pp in range(2, n + 1):
            staged = _chain(model, plan_stages(model.config, pp), ids, positions)
            assert torch.equal(staged, whole), (preset, pp)


def test_tied_embeddings_head_lives_on_the_last_stage() -> None:
    config = get_preset("tiny-llama").config.replace(tie_word_embeddings=True)
    model = CausalLM(config)
    init_random_weights(model, seed=3)
    specs = plan_stages(config, 2)
    ids = torch.randint(0, config.vocab_size, (1, 6))
    positions = torch.arange(6)[None]
    with torch.no_grad():
        assert torch.equal(_chain(model, specs, ids, positions), model(ids, positions).logits)
    last = stage_model(model, specs[-1])
    assert last.model.embed_tokens is None and last.lm_head is not None
    assert torch.equal(last.lm_head.weight, model.model.embed_tokens.weight)
    where = stage_sources(specs[-1], lambda name: TensorSlice(name), tied=True)
    assert where("lm_head.weight") == TensorSlice("model.embed_tokens.weight")
    assert where("model.layers.0.input_layernorm.weight") == TensorSlice(
        f"model.layers.{specs[-1].first_layer}.input_layernorm.weight")


def test_stage_config_renumbers_the_dense_and_moe_layers() -> None:
    config = get_preset("tiny-deepseek-v3").config  # layer 0 dense (first_k_dense_replace 1), then MoE
    first, second = StageSpec(0, 2, 0, 2), StageSpec(1, 2, 2, 3)
    assert stage_config(config, first).num_hidden_layers == 2
    assert [stage_config(config, first).is_moe_layer(i) for i in range(2)] == [config.is_moe_layer(i) for i in (0, 1)]
    assert stage_config(config, second).is_moe_layer(0) == config.is_moe_layer(2)
    assert stage_config(config, second).moe.first_k_dense_replace == 0  # type: ignore[union-attr]


def test_the_planner_balances_bytes_and_puts_the_embedding_and_head_at_the_ends() -> None:
    config = get_preset("deepseek-v3").config  # 61 layers, 3 dense, 671 B parameters
    for pp in (2, 4, 8):
        specs = plan_stages(config, pp, bytes_per_weight=1.0, kv_bytes_per_value=1, kv_tokens=4096)
        assert [s.stage for s in specs] == list(range(pp)) and specs[0].first_layer == 0
        assert specs[-1].last_layer == config.num_hidden_layers
        assert all(a.last_layer == b.first_layer and a.num_layers >= 1 for a, b in itertools.pairwise(specs))
        costs = [c.weight_bytes + c.kv_bytes_per_token * 4096 for c in stage_costs(config, specs, 1.0, 1)]
        # Balanced: no stage more than one MoE layer (its bytes) above the mean.
        layer = config.layer_parameters(config.num_hidden_layers - 1) + config.kv_cache_values_per_token() * 4096
        assert max(costs) - sum(costs) / pp <= layer
        # An even split of layers is never better than the plan's largest stage.
        even = [StageSpec(s, pp, s * 61 // pp, (s + 1) * 61 // pp) for s in range(pp)]
        assert max(costs) <= max(c.weight_bytes + c.kv_bytes_per_token * 4096
                                  for c in stage_costs(config, even, 1.0, 1))


def test_pp_layers_parse_and_refuse_with_the_fix() -> None:
    assert parse_pp_layers("0-13, 14-27", 28, 2) == [(0, 14), (14, 28)]
    assert parse_pp_layers("0,1-2", 3, 2) == [(0, 1), (1, 3)]
    for text, why in [("0-13", "1 ranges"), ("0-12,14-27", "start at layer 13"), ("0-13,14-26", "covers"),
                      ("a-b,1-2", "not a range"), ("0-5,5-27", "start at layer 6")]:
        with pytest.raises(MoeforgeError, match=why):
            parse_pp_layers(text, 28, 2)
    with pytest.raises(MoeforgeError, match="decoder layers"):
        plan_stages(get_preset("tiny-llama").config, 3)
    specs = plan_stages(get_preset("tiny-deepseek-v3").config, 2, layers="0,1-2")
    assert [(s.first_layer, s.last_layer) for s in specs] == [(0, 1), (1, 3)]
