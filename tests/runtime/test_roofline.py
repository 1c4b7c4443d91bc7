"""The memory roofline (moeforge/runtime/roofline.py, moeforge/core/bandwidth.py): a step's weight bytes by kind,
counted from the compiled graph and checked against the model config's own arithmetic; the experts a step computes
(the union over its tokens) against the PyTorch router; the bandwidth probe and its per-machine cache; ``bench
--roofline`` against the bandwidth probed in its own run (the probe replaced by fixed numbers: a stale low cache, a
persisting fraction above 1, the cache as a fallback with its age)."""

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

from moeforge.cli import main
from moeforge.compile.driver import CompileOptions, compile_model
from moeforge.core import bandwidth as bandwidth_mod
from moeforge.core.bandwidth import CACHE_FILE, MIN_GB_S, Bandwidth, probe_read_bandwidth, read_bandwidth
from moeforge.core.run_bandwidth import RunBandwidth
from moeforge.model.loader import load_model
from moeforge.runtime.backends.onnxruntime import ExpertCounter
from moeforge.runtime.engine import BackendOptions, EngineConfig, LLMEngine, SchedulingOptions
from moeforge.runtime.roofline import decode_roofline, format_roofline, tensor_bytes, weight_traffic
from moeforge.runtime.sampler import SamplingParams

PRESET = "tiny-deepseek-v3"


@pytest.fixture(scope="module")
def int8_artifact(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("roofline") / "int8"
    compile_model(CompileOptions.from_flags(model=PRESET, output_dir=out, max_seq_len=64, kv_cache="paged",
                                            quant="int8", progress=False))
    return out


def test_expert_bytes_are_one_experts_weights_scales_included(int8_artifact):
    config = load_model(PRESET).config
    moe, hidden = config.moe, config.hidden_size
    traffic = weight_traffic(int8_artifact / "model.onnx")
    moe_layers = config.num_hidden_layers - moe.first_k_dense_replace
    assert traffic.experts == [moe.n_routed_experts] * moe_layers
    # int8 codes of gate+up [2I, H] and down [H, I]; sparse_experts' MatMulNBits repeat the per-row scale over
    # blocks of 32 of K (float32)
    inter = moe.moe_intermediate_size
    one_expert = 3 * inter * hidden + 4 * (2 * inter * hidden // 32 + hidden * inter // 32)
    assert traffic.expert_bytes == [one_expert] * moe_layers
    model = onnx.load(str(int8_artifact / "model.onnx"), load_external_data=False)
    everything = sum(tensor_bytes(t) for t in model.graph.initializer)
    assert traffic.total_bytes == everything
    routed_total = sum(b * e for b, e in zip(traffic.expert_bytes, traffic.experts, strict=True))
    # the rest of the weights: the embedding table (read a row a token) and what every step reads
    embedding = config.vocab_size * hidden * 4
    assert traffic.dense_bytes + routed_total + embedding <= everything
    assert traffic.dense_bytes + routed_total + embedding >= everything - 4096  # shape constants only
    assert traffic.gathered_row_bytes == hidden * 4
    assert 0 < traffic.head_bytes < traffic.dense_bytes


def test_a_step_reads_its_active_experts_only():
    from moeforge.runtime.roofline import WeightTraffic

    traffic = WeightTraffic(dense_bytes=1000, head_bytes=100, gathered_row_bytes=10, expert_bytes=[50, 70],
                            experts=[8, 8], total_bytes=0)
    assert traffic.step_weight_bytes(1, np.array([2, 2])) == 1000 + 10 + 2 * 50 + 2 * 70
    assert traffic.step_weight_bytes(8, np.array([5.5, 8])) == 1000 + 80 + 5.5 * 50 + 8 * 70
    with pytest.raises(ValueError, match="2 MoE layers"):
        traffic.step_weight_bytes(1, np.array([2]))
    bandwidth = RunBandwidth(threads=2, cached=Bandwidth(best_gb_s=10.0, median_gb_s=9.0, threads=2, probe_bytes=1,
                                                         rounds=1, cpu="", measured_utc="", cached=True))
    roof = decode_roofline(traffic, batch=2, mean_context=100, kv_bytes_per_token=4, active_experts=np.array([3, 4]),
                           bandwidth=bandwidth, decode_tokens_per_s=2e6)
    step = 1000 + 20 + 3 * 50 + 4 * 70 + 2 * 100 * 4
    assert roof.step_bytes == step
    assert roof.step.measured_step_s == pytest.approx(1e-6)
    assert roof.fraction == pytest.approx(step / 1e10 / 1e-6)
    text = format_roofline(roof.to_dict())
    assert "of the roofline" in text and "3.50 of 8" in text


def test_ranks_read_their_own_bytes_through_one_memory():
    """Two ep ranks, each holding 4 of 8 experts and half of the KV: the step reads both ranks' bytes, each rank's
    routed experts from its own activity; the report names each rank's share."""
    from moeforge.runtime.roofline import WeightTraffic, ranks_roofline

    ranks = [WeightTraffic(dense_bytes=600, head_bytes=60, gathered_row_bytes=10, expert_bytes=[50, 70],
                           experts=[4, 4], total_bytes=0) for _ in range(2)]
    bandwidth = RunBandwidth(threads=2, cached=Bandwidth(best_gb_s=10.0, median_gb_s=9.0, threads=2, probe_bytes=1,
                                                         rounds=1, cpu="", measured_utc="", cached=True))
    roof = ranks_roofline(ranks, batch=1, mean_context=100, kv_bytes_per_token=[2, 2],
                          active_experts=[np.array([3, 1]), np.array([1, 3])], bandwidth=bandwidth,
                          decode_tokens_per_s=1e6)
    rank0 = 600 + 10 + 3 * 50 + 1 * 70 + 100 * 2
    rank1 = 600 + 10 + 1 * 50 + 3 * 70 + 100 * 2
    assert roof.step.rank_step_bytes == [rank0, rank1] and roof.step_bytes == rank0 + rank1
    assert roof.step.active_experts_per_layer == [4, 4] and roof.step.experts_per_layer == [8, 8]
    assert roof.step.active_expert_bytes == 4 * 50 + 4 * 70 and roof.step.head_bytes == 120
    assert roof.fraction == pytest.approx((rank0 + rank1) / 1e10 / 1e-6)
    report = roof.to_dict()
    assert report["ranks"] == 2 and report["rank_step_bytes"] == [rank0, rank1]
    assert "2 ranks on this machine" in format_roofline(report)
    assert "ranks" not in decode_roofline(ranks[0], batch=1, mean_context=1, kv_bytes_per_token=1,
                                          active_experts=np.array([1, 1]), bandwidth=bandwidth,
                                          decode_tokens_per_s=1.0).to_dict()
    with pytest.raises(ValueError, match="one traffic, KV size and activity per rank"):
        ranks_roofline(ranks, batch=1, mean_context=1, kv_bytes_per_token=[2], active_experts=[None, None],
                       bandwidth=bandwidth, decode_tokens_per_s=1.0)


def test_the_experts_a_run_computes_are_the_union_over_its_tokens():
    counter = ExpertCounter(layers=2, experts=4)
    hits = np.zeros((2, 3, 4), bool)
    hits[0, 0, [0, 1]] = hits[0, 1, [1, 2]] = True  # layer 0: experts 0, 1, 2
    hits[1, :, 3] = True  # layer 1: expert 3 for every token
    hits[1, 2, 0] = True  # ... and expert 0 on the padded row, which must not count
    counter.add(hits, np.array([True, True, False]))
    counter.add(hits[:, :1], np.array([True]))
    activity = counter.activity()
    assert activity.runs == 2
    np.testing.assert_array_equal(activity.active, [3 + 2, 1 + 1])
    np.testing.assert_array_equal(counter.counts[1], [0, 0, 0, 3])


def test_engine_activity_counts_each_runs_union(int8_artifact):
    """A prefill run computes the union of the experts its prompt's tokens went to (the experts the run's load counts
    are non-zero for); a batch-1 decode run exactly top_k per layer."""
    engine = LLMEngine.from_artifact(int8_artifact, EngineConfig(
        scheduling=SchedulingOptions(max_num_seqs=1), backend=BackendOptions(track_expert_load=True)))
    rng = np.random.default_rng(5)
    start = engine.expert_activity()
    assert start is not None and start.runs == 0
    engine.generate([rng.integers(0, 512, 11).tolist()], SamplingParams(max_tokens=1, ignore_eos=True))
    prefill, load = engine.expert_activity(), engine.expert_load()
    assert prefill.runs == 1
    np.testing.assert_array_equal(prefill.active, (load > 0).sum(axis=1))
    assert (prefill.active > load.sum(axis=1) // 11).all()  # 11 tokens touch more than one token's experts
    engine.add_request(rng.integers(0, 512, 7).tolist(), SamplingParams(max_tokens=4, ignore_eos=True))
    top_k = load_model(PRESET).config.moe.num_experts_per_tok
    steps = []
    while engine.has_unfinished():
        before = engine.expert_activity()
        engine.step()
        steps.append(engine.expert_activity().since(before))
    assert [s.runs for s in steps] == [1, 1, 1, 1]  # the prefill, then 3 single-token decode runs
    assert (steps[0].active > top_k).all()
    for step in steps[1:]:
        np.testing.assert_array_equal(step.active, top_k)  # one token: exactly its top_k experts per layer


def test_bandwidth_probe_and_its_cache(tmp_path):
    measured = probe_read_bandwidth(threads=2, probe_bytes=32 * 2**20, rounds=2)
    assert measured.best_gb_s >= measured.median_gb_s > 0 and measured.threads == 2 and not measured.cached
    first = read_bandwidth(threads=1, folder=tmp_path)
    assert not first.cached
    again = read_bandwidth(threads=1, folder=tmp_path)
    assert again.cached and again.best_gb_s == first.best_gb_s
    assert not read_bandwidth(threads=1, folder=tmp_path, remeasure=True).cached
    (tmp_path / CACHE_FILE).write_text("{not json")
    assert not read_bandwidth(threads=1, folder=tmp_path).cached  # unreadable: measured over
    assert json.loads((tmp_path / CACHE_FILE).read_text())  # and rewritten whole
    with pytest.raises(ValueError, match="threads >= 1"):
        probe_read_bandwidth(threads=0)


# ------------------------------------------------------------------------- bench --roofline and the run's bandwidth
def _bandwidth(best: float, median: float, threads: int, probe_bytes: int = 2**20, rounds: int = 2) -> Bandwidth:
    return Bandwidth(best_gb_s=best, median_gb_s=median, threads=threads, probe_bytes=probe_bytes, rounds=rounds,
                     cpu="test", measured_utc=datetime.now(UTC).isoformat(timespec="seconds"), load_1min=0.5)


@pytest.fixture
def probe_at(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, Any]:
    """The probe replaced by fixed numbers (``state["best"]``, ``state["median"]`` GB/s; the real one reads 128-512
    MiB), its calls recorded; the bandwidth cache in ``tmp_path``."""
    state: dict[str, Any] = {"best": 400.0, "median": 380.0, "calls": []}

    def probe(threads: int | None = None, probe_bytes: int = bandwidth_mod.DEFAULT_PROBE_BYTES,
              rounds: int = bandwidth_mod.DEFAULT_ROUNDS) -> Bandwidth:
        state["calls"].append((threads, probe_bytes, rounds))
        return _bandwidth(state["best"], state["median"], threads or 1, probe_bytes, rounds)

    monkeypatch.setattr(bandwidth_mod, "probe_read_bandwidth", probe)
    monkeypatch.setenv("MOEFORGE_CACHE_DIR", str(tmp_path))
    return state


def _cache(folder: Path, best: float, age: timedelta) -> dict[str, Any]:
    """A cache entry for the bench's threads (the usable cores) of ``best`` GB/s, measured ``age`` ago."""
    threads = bandwidth_mod.probe_threads(None)
    entry = {"best_gb_s": best, "median_gb_s": best, "threads": threads, "probe_bytes": 2**29, "rounds": 7,
             "cpu": "test", "measured_utc": (datetime.now(UTC) - age).isoformat(timespec="seconds")}
    (folder / CACHE_FILE).write_text(json.dumps({bandwidth_mod._cache_key(threads): entry}))
    return entry


def _bench(capsys: pytest.CaptureFixture[str], artifact: Path, *flags: str) -> tuple[int, str, str]:
    code = main(["bench", str(artifact), "--batch", "1", "--prompt-len", "4", "--new-tokens", "4", "--no-compare",
                 "--roofline", "--quiet", *flags])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_stale_low_cache_is_not_the_runs_bandwidth(int8_artifact, probe_at, tmp_path, capsys):
    """The cache holds the bandwidth a busy first run measured, far below the machine's: bench probes in the run and
    uses that, so the fraction is at most 1; with --cached-bandwidth it starts from the cache, finds the step reading
    faster than it, re-probes once and uses the re-probe; --remeasure-bandwidth replaces the cached number."""
    stale = _cache(tmp_path, MIN_GB_S, timedelta(days=2))
    code, out, err = _bench(capsys, int8_artifact, "--json")
    assert code == 0, err
    roof = json.loads(out)["moeforge_onnxruntime"]["roofline"]
    assert roof["achieved_gb_s"] > stale["best_gb_s"]  # the cached number would give a fraction above 1
    assert roof["bandwidth_source"] == "probed in this run" and roof["bandwidth_gb_s"] == 400.0
    assert 0 < roof["fraction"] <= 1 and roof["fraction_reason"] is None
    assert [p["when"] for p in roof["bandwidth_probes"]] == ["before", "after"]
    assert [(p["best_gb_s"], p["median_gb_s"]) for p in roof["bandwidth_probes"]] == [(400.0, 380.0)] * 2
    short = (bandwidth_mod.run_probe_bytes(), bandwidth_mod.RUN_PROBE_ROUNDS)
    assert [call[1:] for call in probe_at["calls"]] == [short, short]  # the short probe, not the 512 MiB one
    assert "bandwidth_cache" not in roof and json.loads((tmp_path / CACHE_FILE).read_text())  # the cache untouched

    probe_at["calls"].clear()
    code, out, err = _bench(capsys, int8_artifact, "--json", "--cached-bandwidth")
    assert code == 0, err
    roof = json.loads(out)["moeforge_onnxruntime"]["roofline"]
    assert roof["bandwidth_source"] == "probed in this run" and roof["bandwidth_gb_s"] == 400.0
    assert 0 < roof["fraction"] <= 1 and "stale" in roof["fraction_reason"]
    assert "GB/s of the cache, 2.0 days old" in roof["fraction_reason"]
    assert [p["when"] for p in roof["bandwidth_probes"]] == ["re-probe"] and len(probe_at["calls"]) == 1
    assert roof["bandwidth_cache"]["best_gb_s"] == MIN_GB_S
    assert roof["bandwidth_cache"]["age_s"] == pytest.approx(2 * 86400, abs=600)

    code, out, err = _bench(capsys, int8_artifact, "--json", "--remeasure-bandwidth")
    assert code == 0, err
    roof = json.loads(out)["moeforge_onnxruntime"]["roofline"]
    assert roof["bandwidth_probes"][0]["when"] == "before (full probe, now cached)"
    assert roof["bandwidth_probes"][0]["probe_bytes"] == bandwidth_mod.DEFAULT_PROBE_BYTES
    assert read_bandwidth(folder=tmp_path).best_gb_s == 400.0  # the cache now holds the full probe's number


def test_a_busy_first_runs_cache_is_not_used_the_real_probe_is(int8_artifact, monkeypatch, tmp_path, capsys):
    """The same with this machine's own probe (the short one, ~0.1 s each): the cache holds 0.01 GB/s, as a first run
    on a machine busy enough leaves it, and bench --roofline uses the bandwidth its two probes measured, never the
    cached number, and gives no fraction above 1."""
    monkeypatch.setenv("MOEFORGE_CACHE_DIR", str(tmp_path))
    stale = _cache(tmp_path, MIN_GB_S, timedelta(days=30))
    code, out, err = _bench(capsys, int8_artifact, "--json")
    assert code == 0, err
    roof = json.loads(out)["moeforge_onnxruntime"]["roofline"]
    probes = roof["bandwidth_probes"]
    assert roof["bandwidth_source"] == "probed in this run" and "bandwidth_cache" not in roof
    assert [p["when"] for p in probes[:2]] == ["before", "after"]
    assert {p["probe_bytes"] for p in probes} == {bandwidth_mod.run_probe_bytes()}
    assert roof["bandwidth_gb_s"] == max(p["best_gb_s"] for p in probes) > 100 * stale["best_gb_s"]
    assert roof["achieved_gb_s"] > stale["best_gb_s"]  # against the cached number it would be above 1
    if roof["fraction"] is None:  # the tiny step's bytes fit in the last-level cache: no result, and why
        assert roof["fraction_suspect"] in ("bytes", "bandwidth") and "re-probed once" in roof["fraction_reason"]
    else:
        assert 0 < roof["fraction"] <= 1
    assert json.loads((tmp_path / CACHE_FILE).read_text())[bandwidth_mod._cache_key(roof["bandwidth_threads"])] \
        == stale  # the cache untouched: only --remeasure-bandwidth replaces it


def test_the_cache_as_a_fallback_says_its_age_and_the_spread_is_printed(int8_artifact, probe_at, tmp_path, capsys):
    _cache(tmp_path, 900.0, timedelta(days=3))  # above anything the tiny step reads: no re-probe
    code, out, err = _bench(capsys, int8_artifact, "--cached-bandwidth")
    assert code == 0, err
    assert probe_at["calls"] == []  # the cached number, no probe
    assert "read bandwidth 900.0 GB/s" in out and "the cached number 900.0 / 900.0, 3.0 days old" in out
    assert "512 MiB x 7 rounds" in out and "--remeasure-bandwidth replaces it" in out and "of the roofline" in out
    probe_at.update(best=500.0, median=250.0)
    code, out, err = _bench(capsys, int8_artifact)
    assert code == 0, err
    assert "probed in this run" in out and "before 500.0 / 250.0, after 500.0 / 250.0" in out
    code, _, err = _bench(capsys, int8_artifact, "--cached-bandwidth", "--remeasure-bandwidth")
    assert code == 2 and "pass one of them" in err
    assert main(["bench", str(int8_artifact), "--no-compare", "--cached-bandwidth"]) == 2
    assert "--cached-bandwidth goes with --roofline" in capsys.readouterr().err


def test_a_fraction_above_1_that_persists_is_not_printed_but_explained(int8_artifact, probe_at, capsys):
    """Every probe reads less than the step: re-probed once, still above 1, so no fraction, and the probes agree, so
    the byte count is the likely culprit (the tiny model's step fits in the last-level cache)."""
    probe_at.update(best=0.001, median=0.00095)
    code, out, err = _bench(capsys, int8_artifact, "--json")
    assert code == 0, err
    roof = json.loads(out)["moeforge_onnxruntime"]["roofline"]
    assert roof["fraction"] is None and roof["fraction_suspect"] == "bytes"
    assert "re-probed once, and it persists" in roof["fraction_reason"]
    assert "likely the byte count" in roof["fraction_reason"]
    assert [p["when"] for p in roof["bandwidth_probes"]] == ["before", "after", "re-probe"]
    code, out, err = _bench(capsys, int8_artifact)
    assert code == 0, err
    assert "of the roofline" not in out  # no fraction printed
    assert "no fraction" in out and "likely the byte count" in out and "re-probe 0.0 / 0.0" in out
