"""Sampler transforms vs naive per-row restatements; greedy, seeds, frequencies, logprobs, validation."""

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moeforge.runtime.sampler import (
    MAX_LOGPROBS,
    Sampler,
    SamplingParams,
    SamplingParamsError,
    apply_min_p,
    apply_presence_penalty,
    apply_repetition_penalty,
    apply_temperature,
    apply_top_k,
    apply_top_p,
    raw_logprobs,
)

NEG = -np.inf


# ---- naive per-row references (float64, loops, no vectorisation) ----


def _softmax(row):
    e = np.exp(row - row.max())
    return e / e.sum()


def _ref_repetition(row, seen, penalty):
    out = row.astype(np.float64)
    for t in set(seen):
        out[t] = out[t] / penalty if out[t] > 0 else out[t] * penalty
    return out


def _ref_presence(row, output, penalty):
    out = row.astype(np.float64)
    for t in set(output):
        out[t] -= penalty
    return out


def _ref_top_k(row, k):
    out = row.astype(np.float64)
    if 0 < k < len(row):
        kth = sorted(out, reverse=True)[k - 1]
        out[out < kth] = NEG
    return out


def _ref_top_p(row, p):
    out = row.astype(np.float64)
    if p < 1.0:
        probs = _softmax(out)
        # A token is kept while the mass of the strictly more likely tokens is short of p.
        for i in range(len(out)):
            if sum(q for q in probs if q > probs[i]) >= p:
                out[i] = NEG
    return out


def _ref_min_p(row, m):
    out = row.astype(np.float64)
    if m > 0:
        probs = _softmax(out)
        out[probs < m * probs.max()] = NEG
    return out


def _ref_process(row, q: SamplingParams, output, prompt):
    x = row.astype(np.float64)
    if q.repetition_penalty != 1.0:
        x = _ref_repetition(x, list(prompt) + list(output), q.repetition_penalty)
    if q.presence_penalty != 0.0:
        x = _ref_presence(x, output, q.presence_penalty)
    if q.temperature == 0.0:
        return x
    x = x / q.temperature
    return _ref_min_p(_ref_top_p(_ref_top_k(x, q.top_k), q.top_p), q.min_p)


def _assert_same_logits(ours, ref):
    """Same kept set (finite entries) and the same values up to a per-row shift."""
    ours, ref = np.asarray(ours, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    assert np.array_equal(np.isfinite(ours), np.isfinite(ref))
    keep = np.isfinite(ref)
    np.testing.assert_allclose(ours[keep] - ours[keep].max(), ref[keep] - ref[keep].max(), rtol=1e-5, atol=1e-5)


def _tied_logits(rng, rows, vocab):
    """Logits on a half-integer grid: many exact ties."""
    return (np.round(rng.normal(size=(rows, vocab)) * 4) / 2).astype(np.float32)


# ---- transforms ----


def test_repetition_penalty_hf_semantics_by_hand():
    logits = np.array([[2.0, -2.0, 1.0, 0.5]], dtype=np.float32)
    out = apply_repetition_penalty(logits, [[0, 1, 1, 0]], np.array([2.0]))
    # positive divided, negative multiplied, each distinct token once, unseen tokens untouched
    np.testing.assert_array_equal(out, [[1.0, -4.0, 1.0, 0.5]])
    np.testing.assert_array_equal(logits, [[2.0, -2.0, 1.0, 0.5]])  # input unchanged


def test_presence_penalty_once_per_distinct_token():
    logits = np.array([[2.0, -2.0, 1.0, 0.5]], dtype=np.float32)
    out = apply_presence_penalty(logits, [[1, 1, 1, 3]], np.array([0.5]))
    np.testing.assert_array_equal(out, [[2.0, -2.5, 1.0, 0.0]])


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_penalties_match_reference(penalty):
    rng = np.random.default_rng(0)
    logits = _tied_logits(rng, 6, 40)
    seen = [rng.integers(0, 40, size=n).tolist() for n in (0, 1, 5, 12, 30, 60)]
    rep = apply_repetition_penalty(logits, seen, np.full(6, penalty))
    pres = apply_presence_penalty(logits, seen, np.full(6, penalty))
    for i in range(6):
        np.testing.assert_allclose(rep[i], _ref_repetition(logits[i], seen[i], penalty), rtol=1e-6)
        np.testing.assert_allclose(pres[i], _ref_presence(logits[i], seen[i], penalty), rtol=1e-6, atol=1e-6)


def test_temperature_scales_the_distribution():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(3, 16)).astype(np.float32) * 3
    temps = np.array([0.3, 1.0, 2.5])
    out = apply_temperature(logits, temps)
    assert np.all(out.max(axis=-1) == 0)
    for i, t in enumerate(temps):
        np.testing.assert_allclose(_softmax(out[i].astype(np.float64)), _softmax(logits[i] / t), rtol=1e-5)
    # a tiny temperature does not overflow: only the maximum keeps weight
    tiny = apply_temperature(np.array([[1.0, 3.0, 2.0]], dtype=np.float32), np.array([1e-30]))
    assert np.isfinite(tiny).all() and _softmax(tiny[0].astype(np.float64)).tolist() == [0.0, 1.0, 0.0]


def test_top_k_matches_reference_with_ties():
    rng = np.random.default_rng(2)
    vocab = 24
    ks = np.array([0, 1, 2, 3, 7, vocab - 1, vocab, vocab + 5])
    logits = _tied_logits(rng, len(ks), vocab)
    out = apply_top_k(logits, ks)
    for i, k in enumerate(ks):
        _assert_same_logits(out[i], _ref_top_k(logits[i], k))
    assert np.array_equal(out[ks >= vocab], logits[ks >= vocab])  # k >= V is off
    assert np.array_equal(out[0], logits[0])  # k = 0 is off
    # ties with the k-th largest are kept: k=1 over two equal maxima keeps both
    both = apply_top_k(np.array([[1.0, 5.0, 5.0, 2.0]], dtype=np.float32), np.array([1]))
    assert np.isfinite(both[0]).tolist() == [False, True, True, False]


def test_top_p_matches_reference_with_ties():
    rng = np.random.default_rng(3)
    ps = np.array([1e-9, 0.013, 0.37, 0.5, 0.81, 0.97, 1.0])
    logits = np.concatenate([_tied_logits(rng, len(ps), 20), rng.normal(size=(len(ps), 20)).astype(np.float32)])
    ps = np.concatenate([ps, ps])
    out = apply_top_p(logits, ps)
    for i, p in enumerate(ps):
        _assert_same_logits(out[i], _ref_top_p(logits[i], p))


def test_top_p_tiny_keeps_only_the_argmax():
    logits = np.array([[0.1, 3.0, 2.9, -1.0], [4.0, 1.0, 4.0, 0.0]], dtype=np.float32)
    out = apply_top_p(logits, np.array([1e-6, 1e-6]))
    assert np.isfinite(out[0]).tolist() == [False, True, False, False]
    assert np.isfinite(out[1]).tolist() == [True, False, True, False]  # tied maxima both stay


def test_top_p_one_keeps_tokens_of_negligible_mass():
    logits = np.array([[0.0, -80.0, -200.0]], dtype=np.float32)
    assert np.array_equal(apply_top_p(logits, np.array([1.0])), logits)


def test_min_p_matches_reference():
    rng = np.random.default_rng(4)
    ms = np.array([0.0, 0.01, 0.05, 0.2, 0.5, 0.9, 1.0])
    logits = rng.normal(size=(len(ms), 30)).astype(np.float32) * 2
    out = apply_min_p(logits, ms)
    for i, m in enumerate(ms):
        _assert_same_logits(out[i], _ref_min_p(logits[i], m))
    assert np.isfinite(out[-1]).sum() == 1  # min_p 1: only the maximum


def test_full_chain_matches_reference():
    rng = np.random.default_rng(5)
    vocab = 32
    params = [
        SamplingParams(),
        SamplingParams(repetition_penalty=1.5, presence_penalty=0.7),
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.6, min_p=0.05, repetition_penalty=0.8),
        SamplingParams(temperature=1.0, top_k=12, top_p=0.9, min_p=0.1, presence_penalty=-1.0),
        SamplingParams(temperature=0.5, top_k=vocab + 1, top_p=1e-4),
    ]
    logits = _tied_logits(rng, len(params), vocab)
    outputs = [rng.integers(0, vocab, size=n).tolist() for n in (0, 3, 6, 9, 12, 15)]
    prompts = [rng.integers(0, vocab, size=n).tolist() for n in (4, 4, 0, 8, 2, 1)]
    processed = Sampler().process(logits, params, outputs, prompts)
    for i, q in enumerate(params):
        _assert_same_logits(processed[i], _ref_process(logits[i], q, outputs[i], prompts[i]))


# ---- sampling ----


def _sample(sampler, logits, params, generators=None, outputs=None, prompts=None):
    n = len(params)
    return sampler.sample(logits, params, generators or [None] * n, outputs or [[]] * n, prompts or [[]] * n)


def test_greedy_is_argmax_of_penalised_logits_and_leaves_the_generator_alone():
    rng = np.random.default_rng(6)
    logits = rng.normal(size=(4, 50)).astype(np.float32)
    outputs = [[int(np.argmax(logits[i]))] * 2 for i in range(4)]  # penalise each row's argmax
    params = [SamplingParams(), SamplingParams(seed=1, top_k=3), SamplingParams(repetition_penalty=3.0),
              SamplingParams(presence_penalty=2.0)]
    gens = [q.make_generator() for q in params]
    before = gens[1].bit_generator.state
    out = _sample(Sampler(), logits, params, gens, outputs)
    assert out.token_ids[:2].tolist() == logits[:2].argmax(-1).tolist()
    for i in (2, 3):
        ref = _ref_process(logits[i], params[i], outputs[i], [])
        assert out.token_ids[i] == int(np.argmax(ref)) != outputs[i][0]
    assert gens[1].bit_generator.state == before


def _run(sampler, logit_steps, rows, row_params, seed_rows):
    """Decode len(logit_steps) steps for a batch; logit_steps[s][name] is that request's logits [V].
    rows: request names in batch order. Returns {name: tokens}."""
    gens = {n: row_params[n].make_generator() for n in rows}
    history = {n: [] for n in rows}
    for step in logit_steps:
        logits = np.stack([step[n] for n in rows])
        out = sampler.sample(logits, [row_params[n] for n in rows], [gens[n] for n in rows],
                             [history[n] for n in rows], [[1, 2, 3]] * len(rows))
        for n, t in zip(rows, out.token_ids.tolist(), strict=True):
            history[n].append(t)
    return {n: history[n] for n in seed_rows}


def test_seeded_request_is_reproducible_and_independent_of_its_batch():
    rng = np.random.default_rng(7)
    vocab, steps = 64, 12
    row_params = {
        "a": SamplingParams(temperature=1.0, top_p=0.95, repetition_penalty=1.2, seed=1234),
        "b": SamplingParams(temperature=0.8, top_k=10, seed=99),
        "c": SamplingParams(temperature=1.5),  # unseeded: draws from the sampler's generator
        "d": SamplingParams(),  # greedy
    }
    logit_steps = [{n: rng.normal(size=vocab).astype(np.float32) for n in row_params} for _ in range(steps)]
    alone = _run(Sampler(seed=0), logit_steps, ["a"], row_params, ["a"])["a"]
    assert alone == _run(Sampler(seed=1), logit_steps, ["a"], row_params, ["a"])["a"]  # reproducible
    for rows in (["a", "b"], ["c", "a", "d"], ["d", "c", "b", "a"]):
        assert _run(Sampler(seed=5), logit_steps, rows, row_params, ["a"])["a"] == alone, rows
    other_seed = {**row_params, "a": SamplingParams(temperature=1.0, top_p=0.95, repetition_penalty=1.2, seed=4321)}
    assert _run(Sampler(), logit_steps, ["a"], other_seed, ["a"])["a"] != alone


class _FixedDraw:
    """Stands in for a row's generator: always draws u."""

    def __init__(self, u: float) -> None:
        self.u = u

    def random(self) -> float:
        return self.u


@pytest.mark.parametrize("u", [0.0, 0.5, float(np.nextafter(1.0, 0.0))])
def test_extreme_draws_never_pick_a_removed_token(u):
    # Removed tokens at both ends and in the middle; totals that are not powers of two.
    logits = np.array([[-9.0, 1.0, 0.3, -9.0, 2.0, 0.7, -9.0], [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]], dtype=np.float32)
    params = [SamplingParams(temperature=1.0, min_p=0.01), SamplingParams(temperature=0.9)]
    sampler = Sampler()
    processed = sampler.process(logits, params, [[], []], [[], []])
    out = sampler.sample(logits, params, [_FixedDraw(u), _FixedDraw(u)], [[], []], [[], []])
    assert np.isfinite(processed[[0, 1], out.token_ids]).all()
    if u == 0.0:
        assert out.token_ids.tolist() == [1, 0]  # the first kept token
    if u > 0.99:
        assert out.token_ids.tolist() == [5, 6]  # the last kept token


CHI2_999 = {3: 16.266, 4: 18.467, 5: 20.515}  # chi-square quantiles at 0.999, by degrees of freedom


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.5, top_k=4),
        SamplingParams(temperature=2.0, top_p=0.8),
        SamplingParams(temperature=1.0, min_p=0.2, repetition_penalty=1.5),
    ],
)
def test_sampled_frequencies_match_the_processed_distribution(params):
    probs = np.array([0.05, 0.1, 0.15, 0.2, 0.22, 0.28])
    logits = np.log(probs).astype(np.float32)
    n = 6000
    prompt = [1, 4]
    expected = _softmax(_ref_process(logits, params, [], prompt))
    out = _sample(Sampler(seed=11), np.tile(logits, (n, 1)), [params] * n, prompts=[prompt] * n)
    counts = np.bincount(out.token_ids, minlength=len(probs))
    support = expected > 0
    assert counts[~support].sum() == 0
    chi2 = (((counts - n * expected)[support]) ** 2 / (n * expected[support])).sum()
    assert chi2 < CHI2_999[int(support.sum()) - 1], (counts, n * expected)


# ---- logprobs ----


def test_logprobs_are_the_raw_distribution_at_the_chosen_token():
    rng = np.random.default_rng(8)
    logits = _tied_logits(rng, 5, 40)
    params = [SamplingParams(logprobs=0), SamplingParams(temperature=0.6, top_k=3, repetition_penalty=2.0, logprobs=5),
              SamplingParams(temperature=1.7, top_p=0.5, presence_penalty=1.0, logprobs=MAX_LOGPROBS),
              SamplingParams(temperature=1.0, min_p=0.3, logprobs=1), SamplingParams(logprobs=3, seed=3)]
    outputs = [rng.integers(0, 40, size=4).tolist() for _ in params]
    out = _sample(Sampler(seed=2), logits, params, [q.make_generator() for q in params], outputs)
    for i, q in enumerate(params):
        ref = np.log(_softmax(logits[i].astype(np.float64)))
        assert out.logprobs[i] == pytest.approx(ref[out.token_ids[i]], abs=1e-6)
        expected_top = sorted(range(40), key=lambda t, ref=ref: (-ref[t], t))[: q.logprobs]
        assert [t for t, _ in out.top_logprobs[i]] == expected_top  # largest first, ties by lower id
        np.testing.assert_allclose([lp for _, lp in out.top_logprobs[i]], ref[expected_top], atol=1e-6)
    assert out.logprobs.dtype == np.float32 and out.token_ids.dtype == np.int64
    assert out.top_logprobs[0] == []


def test_logprobs_none_computes_none():
    """The default (None) returns no logprobs, greedy or sampled; 0 returns only the chosen token's."""
    logits = _tied_logits(np.random.default_rng(9), 3, 40)
    params = [SamplingParams(), SamplingParams(temperature=1.0, seed=1), SamplingParams(logprobs=0)]
    out = _sample(Sampler(seed=0), logits, params, [q.make_generator() for q in params], [[], [], []])
    assert np.isnan(out.logprobs[:2]).all() and out.top_logprobs[:2] == [[], []]
    ref = np.log(_softmax(logits[2].astype(np.float64)))
    assert out.logprobs[2] == pytest.approx(ref[out.token_ids[2]], abs=1e-6) and out.top_logprobs[2] == []


def test_raw_logprobs_handle_large_logits():
    out = raw_logprobs(np.array([[1000.0, 1000.0, -np.inf]], dtype=np.float32))
    np.testing.assert_allclose(out, [[np.log(0.5), np.log(0.5), -np.inf]])


# ---- properties ----

_vocab = st.integers(2, 24)
_params = st.builds(
    SamplingParams,
    temperature=st.one_of(st.just(0.0), st.floats(1e-3, 5.0)),
    top_k=st.integers(0, 30),
    top_p=st.one_of(st.just(1.0), st.floats(1e-6, 1.0, exclude_min=True)),
    min_p=st.one_of(st.just(0.0), st.floats(0.0, 1.0)),
    repetition_penalty=st.one_of(st.just(1.0), st.floats(0.1, 3.0)),
    presence_penalty=st.floats(-2.0, 2.0),
    seed=st.one_of(st.none(), st.integers(0, 2**32)),
    logprobs=st.one_of(st.none(), st.integers(0, MAX_LOGPROBS)),
)


@st.composite
def _batch(draw):
    vocab = draw(_vocab)
    rows = draw(st.integers(1, 4))
    # a small set of values makes ties common
    values = st.sampled_from([-30.0, -2.0, -0.5, 0.0, 0.0, 0.5, 1.0, 3.0, 12.0])
    logits = np.array(draw(st.lists(st.lists(values, min_size=vocab, max_size=vocab), min_size=rows,
                                    max_size=rows)), dtype=np.float32)
    params = draw(st.lists(_params, min_size=rows, max_size=rows))
    tokens = st.lists(st.integers(0, vocab - 1), max_size=6)
    outputs = draw(st.lists(tokens, min_size=rows, max_size=rows))
    prompts = draw(st.lists(tokens, min_size=rows, max_size=rows))
    return logits, params, outputs, prompts


@settings(max_examples=150, deadline=None)
@given(_batch())
def test_chosen_token_always_survives_the_filters(batch):
    logits, params, outputs, prompts = batch
    for q in params:
        q.validate(logits.shape[1])
    sampler = Sampler(seed=0)
    processed = sampler.process(logits, params, outputs, prompts)
    out = sampler.sample(logits, params, [q.make_generator() for q in params], outputs, prompts)
    rows = np.arange(len(params))
    assert np.all((out.token_ids >= 0) & (out.token_ids < logits.shape[1]))
    assert np.isfinite(processed[rows, out.token_ids]).all()  # non-zero probability after filtering
    # the most likely penalised token is never filtered out
    assert np.isfinite(processed[rows, processed.argmax(-1)]).all()
    asked = np.array([q.logprobs is not None for q in params])
    np.testing.assert_allclose(out.logprobs[asked], raw_logprobs(logits)[rows, out.token_ids][asked], atol=1e-6)
    assert np.isnan(out.logprobs[~asked]).all()


@settings(max_examples=60, deadline=None)
@given(_batch(), _params, st.integers(0, 4))
def test_seeded_row_does_not_depend_on_its_neighbours(batch, params, position):
    logits, others, outputs, prompts = batch
    vocab = logits.shape[1]
    params = replace(params, temperature=max(params.temperature, 0.5), seed=42)
    mine = np.linspace(-1.0, 1.0, vocab, dtype=np.float32)
    position = min(position, len(others))
    batched = np.insert(logits, position, mine, axis=0)
    all_params = [*others[:position], params, *others[position:]]
    gens = [q.make_generator() for q in all_params]
    out = Sampler(seed=1).sample(batched, all_params, gens, [*outputs[:position], [0], *outputs[position:]],
                                 [*prompts[:position], [1], *prompts[position:]])
    alone = Sampler(seed=2).sample(mine[None], [params], [params.make_generator()], [[0]], [[1]])
    assert out.token_ids[position] == alone.token_ids[0]


# ---- validation and input checks ----


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"min_p": -0.01}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"seed": -1}, "seed"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": MAX_LOGPROBS + 1}, "logprobs"),
        ({"stop_token_ids": (3, 100)}, "stop_token_ids"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids"),
        ({"stop_strings": ("",)}, "stop_strings"),
    ],
)
def test_validation_names_the_parameter(kwargs, param):
    with pytest.raises(SamplingParamsError) as excinfo:
        SamplingParams(**kwargs).validate(vocab_size=100)
    assert excinfo.value.param == param
    assert str(excinfo.value).startswith(param)
    assert isinstance(excinfo.value, ValueError)


def test_valid_params_pass_and_lists_become_tuples():
    SamplingParams().validate(100)
    q = SamplingParams(temperature=0.7, top_k=100, top_p=1.0, min_p=1.0, presence_penalty=-2.0, seed=0,
                       max_tokens=1, logprobs=MAX_LOGPROBS, stop_token_ids=[0, 99], stop_strings=["\n\n"])
    q.validate(100)
    assert q.stop_token_ids == (0, 99) and q.stop_strings == ("\n\n",)
    hash(q)


def test_bad_batches_are_rejected():
    sampler = Sampler()
    logits = np.zeros((2, 5), dtype=np.float32)
    with pytest.raises(ValueError, match="params has 1 rows"):
        _sample(sampler, logits, [SamplingParams()], outputs=[[], []], prompts=[[], []])
    with pytest.raises(ValueError, match=r"logits must be \[B, V\]"):
        _sample(sampler, np.zeros(5, dtype=np.float32), [SamplingParams()])
    logits[1, 2] = np.nan
    with pytest.raises(ValueError, match=r"rows \[1\] contain NaN"):
        _sample(sampler, logits, [SamplingParams()] * 2)
