"""EPLB expert placement: invariants of every plan, the balance it buys on skewed load, refusals, the CLI."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moeforge.cli import main
from moeforge.core.errors import MoeforgeError
from moeforge.parallel.eplb import EMPTY, EplbError, Placement, contiguous, parse_stats, rebalance, round_robin


def zipf_load(layers: int, experts: int, seed: int = 0, s: float = 1.2) -> np.ndarray:
    """Seeded Zipf-skewed routed-token counts, each layer's popular experts at random positions."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, experts + 1) ** s
    return np.stack([np.round(rng.permutation(weights) * 100_000) for _ in range(layers)])


def check_invariants(plan: Placement) -> None:
    layers, experts = plan.load.shape
    slots = experts + plan.redundant
    assert plan.physical_to_logical.shape == (layers, slots)
    assert plan.rank_slots.shape == (layers, plan.ep, slots // plan.ep)  # equal slot count per rank
    for layer in range(layers):
        held = np.bincount(plan.physical_to_logical[layer], minlength=experts)
        assert (held >= 1).all()  # every logical expert has a slot
        np.testing.assert_array_equal(held, plan.replica_count[layer])
    assert (plan.physical_to_logical >= 0).all()  # no empty slot: replicas fill exactly the spare slots
    np.testing.assert_array_equal(plan.replica_count.sum(axis=1), slots)
    np.testing.assert_allclose(plan.rank_load.sum(axis=1), plan.load.sum(axis=1), rtol=1e-9)


def check_groups_on_one_node(plan: Placement) -> None:
    layers, experts = plan.load.shape
    ranks_per_node, group_size = plan.ep // plan.nodes, experts // plan.groups
    node_of_slot = np.arange(experts + plan.redundant) // plan.rank_slots.shape[2] // ranks_per_node
    for layer in range(layers):
        for group in range(plan.groups):
            in_group = plan.physical_to_logical[layer] // group_size == group
            assert len(set(node_of_slot[in_group].tolist())) == 1, (layer, group)


@pytest.mark.parametrize(("ep", "redundant", "nodes", "groups", "mode"), [
    (4, 4, 1, 1, "hierarchical"), (4, 0, 1, 1, "hierarchical"), (8, 8, 2, 4, "hierarchical"),
    (8, 16, 4, 8, "hierarchical"), (4, 4, 2, 1, "global"), (6, 4, 3, 2, "global"), (2, 2, 2, 4, "hierarchical"),
])
def test_plan_invariants(ep, redundant, nodes, groups, mode):
    plan = rebalance(zipf_load(3, 32, seed=ep + redundant), ep, redundant, nodes=nodes, groups=groups)
    assert plan.mode == mode
    check_invariants(plan)
    if mode == "hierarchical":
        check_groups_on_one_node(plan)


@pytest.mark.parametrize("experts", [16, 64])
def test_skewed_load_is_balanced_at_least_30_percent_better_than_contiguous(experts):
    load = zipf_load(4, experts, seed=1)
    plan = rebalance(load, ep=4, redundant=4)
    base = contiguous(load, ep=4, redundant=4)
    np.testing.assert_allclose(base.imbalance, plan.imbalance_before)
    robin = round_robin(load, ep=4, redundant=4)
    print(f"E={experts}: contiguous {base.imbalance.round(3)}, round-robin {robin.imbalance.round(3)}, "
          f"eplb {plan.imbalance.round(3)}")
    assert (plan.imbalance <= 0.7 * base.imbalance).all()
    assert (plan.imbalance <= robin.imbalance + 1e-12).all()


def test_uniform_load_without_redundancy_is_balanced_everywhere():
    load = np.full((2, 16), 7.0)
    for plan in (rebalance(load, 4, 0), rebalance(load, 4, 0, nodes=2, groups=4), contiguous(load, 4),
                 round_robin(load, 4), round_robin(load, 4, fill_redundant=False)):
        np.testing.assert_allclose(plan.imbalance, 1.0)
        np.testing.assert_allclose(plan.imbalance_before, 1.0)


def test_all_zero_layer_is_planned_as_uniform():
    load = np.zeros((2, 8))
    load[1] = np.arange(8)
    plan = rebalance(load, 4, 4)
    check_invariants(plan)
    np.testing.assert_array_equal(plan.replica_count[0], np.full(8, 1) + (np.arange(8) < 4))
    np.testing.assert_allclose(plan.imbalance[0], 1.0)


def test_baselines_without_fill_leave_spare_slots_empty():
    load = zipf_load(2, 8)
    for plan in (contiguous(load, 4, 4), round_robin(load, 4, 4, fill_redundant=False)):
        assert (plan.rank_slots[:, :, -1] == EMPTY).all()
        np.testing.assert_array_equal(plan.replica_count, 1)
    filled = contiguous(load, 4, 4, fill_redundant=True)
    np.testing.assert_array_equal(filled.replica_count.sum(axis=1), 12)
    np.testing.assert_array_equal(filled.rank_slots[0, :, :2], np.arange(8).reshape(4, 2))
    np.testing.assert_array_equal(round_robin(load, 4, 0).rank_slots[0], np.arange(8).reshape(2, 4).T)


def test_round_trip_through_dict():
    plan = rebalance(zipf_load(3, 16), 4, 4, nodes=2, groups=4, artifact_sha256="ab" * 32)
    data = json.loads(json.dumps(plan.to_dict()))
    again = Placement.from_dict(data)
    assert again.to_dict() == plan.to_dict()
    assert data["version"] == 1 and again.artifact_sha256 == "ab" * 32
    with pytest.raises(EplbError, match="version"):
        Placement.from_dict({**data, "version": 99})
    broken = [row[:] for row in data["physical_to_logical"]]
    broken[0][0] = (broken[0][0] + 1) % 16
    with pytest.raises(EplbError, match=r"replica_count|no slot"):
        Placement.from_dict({**data, "physical_to_logical": broken})


@pytest.mark.parametrize(("load", "kwargs", "message"), [
    ([[1.0, -2.0, 3.0, 4.0]], {}, "negative"),
    ([[1.0, float("nan"), 3.0, 4.0]], {}, "NaN or inf"),
    ([[1.0, float("inf"), 3.0, 4.0]], {}, "NaN or inf"),
    ([1.0, 2.0, 3.0, 4.0], {}, "2-D"),
    ([[[1.0, 2.0]]], {}, "2-D"),
    ([[1.0, 2.0], [3.0]], {}, "equal-length rows"),
    ([[1.0] * 6], {"groups": 4}, "do not divide into --groups 4"),
    ([[1.0] * 6], {"ep": 4}, "does not divide the 6 experts"),
    ([[1.0] * 8], {"ep": 4, "nodes": 3}, "--nodes 3 does not divide --ep 4"),
    ([[1.0] * 8], {"redundant": -4}, "--redundant must be >= 0"),
    ([[1.0] * 8], {"ep": 0}, "must be >= 1"),
])
def test_bad_statistics_and_arguments_are_refused(load, kwargs, message):
    args = {"ep": 2, "redundant": 0, **kwargs}
    with pytest.raises(EplbError, match=message) as info:
        rebalance(load, **args)
    assert isinstance(info.value, MoeforgeError)


def test_contiguous_needs_experts_divisible_by_ranks():
    with pytest.raises(EplbError, match="contiguous placement needs"):
        contiguous([[1.0] * 6], ep=4, redundant=2)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), experts_per_group=st.integers(1, 6), groups=st.sampled_from([1, 2, 4]),
       nodes=st.sampled_from([1, 2, 4]), ranks_per_node=st.integers(1, 3), layers=st.integers(1, 3))
def test_property_invariants_hold(data, experts_per_group, groups, nodes, ranks_per_node, layers):
    experts, ep = experts_per_group * groups, nodes * ranks_per_node
    spare = data.draw(st.integers(0, 2 * ep), label="spare")
    redundant = spare + (-(experts + spare)) % ep
    value = st.floats(0, 1e6, allow_nan=False, allow_subnormal=False)
    load = data.draw(st.lists(st.lists(value, min_size=experts, max_size=experts), min_size=layers, max_size=layers),
                     label="load")
    plan = rebalance(load, ep, redundant, nodes=nodes, groups=groups)
    check_invariants(plan)
    assert (plan.imbalance >= 1 - 1e-9).all() and (plan.imbalance <= ep + 1e-9).all()
    if plan.mode == "hierarchical":
        check_groups_on_one_node(plan)
    assert Placement.from_dict(json.loads(json.dumps(plan.to_dict()))).to_dict() == plan.to_dict()


def scrape_text(load: np.ndarray) -> str:
    lines = ["# HELP moeforge:expert_routed_tokens_total Tokens the router sent to each expert.",
             "# TYPE moeforge:expert_routed_tokens_total counter"]
    for layer, row in enumerate(load.tolist()):
        lines += [f'moeforge:expert_routed_tokens_total{{model_name="m",layer="{layer}",expert="{expert}"}} {value}'
                  for expert, value in enumerate(row)]
    lines += ['moeforge:expert_load_imbalance{model_name="m",layer="0"} 2.0', "moeforge:engine_steps_total 5.0"]
    return "\n".join(lines) + "\n"


def test_parse_stats_reads_json_list_and_scrape():
    load = zipf_load(2, 8)
    np.testing.assert_array_equal(parse_stats(json.dumps(load.tolist()))[0], load)
    parsed, sha = parse_stats(json.dumps({"artifact_sha256": "f" * 64, "layers": load.tolist()}))
    np.testing.assert_array_equal(parsed, load)
    assert sha == "f" * 64
    np.testing.assert_array_equal(parse_stats(scrape_text(load))[0], load)
    with pytest.raises(EplbError, match="appears twice"):
        parse_stats(scrape_text(load).replace('layer="1",expert="7"', 'layer="1",expert="0"'))
    with pytest.raises(EplbError, match="lacks layer 1 expert 3"):
        parse_stats("".join(line for line in scrape_text(load).splitlines(keepends=True)
                            if 'layer="1",expert="3"' not in line))
    with pytest.raises(EplbError, match="neither JSON nor"):
        parse_stats("hello")
    with pytest.raises(EplbError, match="must be a number"):
        parse_stats('{"layers": [["1", 2]]}')


def _run(capsys, *args):
    code = main([str(arg) for arg in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("kind", ["json", "scrape"])
def test_cli_writes_a_plan_that_round_trips(capsys, tmp_path, kind):
    load = zipf_load(3, 16, seed=2)
    stats = tmp_path / "stats.txt"
    stats.write_text(json.dumps({"artifact_sha256": "0" * 64, "layers": load.tolist()}) if kind == "json"
                     else scrape_text(load))
    out = tmp_path / "plan.json"
    code, text, err = _run(capsys, "eplb", stats, "-o", out, "--ep", 4, "--redundant", 4, "--nodes", 2,
                           "--groups", 4)
    assert code == 0, err
    assert "contiguous" in text and "round-robin" in text and "eplb" in text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json", "stats.txt"]  # no temporary file left
    plan = Placement.from_dict(json.loads(out.read_text()))
    assert plan.mode == "hierarchical" and plan.ep == 4 and plan.nodes == 2 and plan.groups == 4
    np.testing.assert_array_equal(plan.load, load)
    assert plan.artifact_sha256 == ("0" * 64 if kind == "json" else None)
    check_invariants(plan)
    check_groups_on_one_node(plan)
    code, text, _ = _run(capsys, "eplb", stats, "-o", out, "--ep", 4, "--redundant", 4, "--json", "--force")
    summary = json.loads(text)
    assert code == 0 and summary["mode"] == "hierarchical" and len(summary["layers"]) == 3
    for row, before, after in zip(summary["layers"], plan.imbalance_before, plan.imbalance, strict=True):
        assert row["contiguous"] == pytest.approx(before) and row["eplb"] <= 0.7 * row["contiguous"]
        assert after == pytest.approx(rebalance(load, 4, 4, nodes=2, groups=4).imbalance[row["layer"]])


@pytest.mark.parametrize(("content", "args", "message"), [
    ("[[1, -1, 2, 3]]", ("--ep", 2, "--redundant", 0), "negative"),
    ("[[1, NaN, 2, 3]]", ("--ep", 2, "--redundant", 0), "NaN or inf"),
    ("[1, 2, 3, 4]", ("--ep", 2, "--redundant", 0), "2-D"),
    ("[[1, 2, 3, 4]]", ("--ep", 3, "--redundant", 0), "--ep 3 does not divide"),
    ("not stats", ("--ep", 2, "--redundant", 0), "neither JSON nor"),
])
def test_cli_refuses_bad_input_with_exit_code_2(capsys, tmp_path, content, args, message):
    stats = tmp_path / "stats.json"
    stats.write_text(content)
    code, _, err = _run(capsys, "eplb", stats, "-o", tmp_path / "plan.json", *args)
    assert code == 2
    assert message in err and err.startswith("moeforge eplb: error:")
    assert not (tmp_path / "plan.json").exists()
    code, _, err = _run(capsys, "eplb", tmp_path / "missing.json", "-o", tmp_path / "plan.json", "--ep", 2,
                        "--redundant", 0)
    assert code == 2 and "cannot read statistics" in err
