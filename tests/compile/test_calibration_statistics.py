"""Calibration statistics gathered without holding every activation (a streamed compile's calibration of a deep
model). AWQ (``quant/plan.py``): counts and means in one pass over the prompts, then each target's seeded sample of
rows, a group of targets at a time; the result must be what the direct computation on every row gives,
``x[permutation(len(x))[:rows]]`` and ``mean |x|`` of the concatenated activations, with one generator drawn target
after target. w8a8 (``quant/act_calibration.py``): activations fetched a group at a time give the same ranges."""

from __future__ import annotations

import numpy as np

from moeforge.quant.act_calibration import fetch_groups
from moeforge.quant.plan import activation_totals, gather_rows


class _Runner:
    """A stand-in for ``GraphRunner``: each prompt yields fixed activations [1, len(ids) * k, width] per output."""

    def __init__(self, widths: dict[str, int], per_token: dict[str, int]) -> None:
        self.extra_outputs = tuple(widths)
        self.widths, self.per_token = widths, per_token
        self.runs: list[tuple[str, ...]] = []

    def value(self, name: str, ids: list[int]) -> np.ndarray:
        rng = np.random.default_rng([sum(ids), len(ids), self.extra_outputs.index(name)])
        return rng.standard_normal((1, len(ids) * self.per_token[name], self.widths[name])).astype(np.float32)

    def run(self, ids: list[int], weights: None = None, extras: tuple[str, ...] | None = None) -> list[np.ndarray]:
        names = self.extra_outputs if extras is None else extras
        self.runs.append(tuple(names))
        return [np.zeros((len(ids), 3), np.float32), *(self.value(n, ids) for n in names)]


def test_sampled_rows_and_means_equal_the_direct_computation() -> None:
    widths, per_token = {"a": 8, "b": 5, "c": 8}, {"a": 1, "b": 2, "c": 1}
    runner = _Runner(widths, per_token)
    prompts = [[1, 2, 3, 4, 5], [7] * 40, [3, 9], list(range(300))]
    names = {"t0": "a", "t1": "b", "t2": "a", "t3": "c"}  # t0 and t2 read the same activation
    rows = 64

    whole = {x: np.concatenate([runner.value(x, ids).reshape(-1, widths[x]) for ids in prompts]) for x in widths}
    rng = np.random.default_rng(0)
    expected = {t: whole[x][rng.permutation(len(whole[x]))[:rows]] for t, x in names.items()}

    count, means = activation_totals(runner, prompts)
    for x in widths:
        assert count[x] == len(whole[x])
        np.testing.assert_allclose(means[x], np.abs(whole[x]).mean(0), rtol=1e-6)
    rng = np.random.default_rng(0)
    chosen = {t: rng.permutation(count[x])[:rows] for t, x in names.items()}
    # A budget that fits two targets' samples at a time: two groups, each one more pass fetching only its outputs.
    groups = fetch_groups(list(names), {t: rows * widths[x] * 4 for t, x in names.items()}, 2 * rows * 8 * 4)
    assert groups == [("t0", "t1"), ("t2", "t3")]
    runner.runs.clear()
    for group in groups:
        samples = gather_rows(runner, {t: names[t] for t in group}, chosen, prompts)
        for t in group:
            np.testing.assert_array_equal(samples[t], expected[t])
    assert runner.runs == [("a", "b")] * len(prompts) + [("a", "c")] * len(prompts)


def test_a_target_larger_than_the_budget_is_a_group_of_its_own() -> None:
    assert fetch_groups(["x", "y", "z"], {"x": 10, "y": 1000, "z": 10}, 100) == [("x",), ("y",), ("z",)]
    assert fetch_groups(["x", "y", "z"], {"x": 10, "y": 80, "z": 10}, 100) == [("x", "y", "z")]


def test_static_ranges_are_the_same_whatever_the_fetch_groups(monkeypatch) -> None:
    """w8a8 calibration fetches its activations a group at a time (a run per group and prompt), so that a deep
    model's activations never come back all at once: one name per group gives the ranges of a single group."""
    from moeforge.compile.onnx_export import export_stateless
    from moeforge.model.loader import load_model
    from moeforge.quant import act_calibration
    from moeforge.quant.act_calibration import ActivationPlan, check_options

    model = export_stateless(load_model("tiny-llama").model)
    prompts = [[5, 9, 2, 7, 1, 3], list(range(20, 60)), [11, 4]]
    spec = check_options("w8a8", "percentile", 99.0)
    assert spec is not None
    whole = ActivationPlan.calibrate(model, spec, prompts)
    monkeypatch.setattr(act_calibration, "FETCH_BUDGET", 1)  # every activation in a group of its own
    runs: list[int] = []
    original = act_calibration._Activations.rows

    def counted(self: act_calibration._Activations):  # type: ignore[no-untyped-def]
        runs.append(len(self.groups))
        yield from original(self)

    monkeypatch.setattr(act_calibration._Activations, "rows", counted)
    grouped = ActivationPlan.calibrate(model, spec, prompts)
    assert runs and runs[0] > 1  # one group per activation (q, k and v share theirs)
    assert grouped.amax == whole.amax
    assert grouped.smoothing.keys() == whole.smoothing.keys()
    for name in whole.smoothing:
        np.testing.assert_array_equal(grouped.smoothing[name], whole.smoothing[name])
