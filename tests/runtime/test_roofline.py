"""The memory roofline (moeforge/runtime/roofline.py, moeforge/core/bandwidth.py): a step's weight bytes by kind,
counted from the compiled graph and checked against the model config's own arithmetic; the experts a step computes
(the union over its tokens) against the PyTorch router; the bandwidth probe and its per-machine cache."""

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from moeforge.compile.driver import CompileOptions, compile_model
from moeforge.core.bandwidth import CACHE_FILE, Bandwidth, probe_read_bandwidth, read_bandwidth
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
    bandwidth = Bandwidth(best_gb_s=10.0, median_gb_s=9.0, threads=2, probe_bytes=1, rounds=1, cpu="", measured_utc="")
    roof = decode_roofline(traffic, batch=2, mean_context=100, kv_bytes_per_token=4, active_experts=np.array([3, 4]),
                           bandwidth=bandwidth, decode_tokens_per_s=2e6)
    step = 1000 + 20 + 3 * 50 + 4 * 70 + 2 * 100 * 4
    assert roof.step_bytes == step
    assert roof.measured_step_s == pytest.approx(1e-6)
    assert roof.fraction == pytest.approx(step / 1e10 / 1e-6)
    text = format_roofline(roof.to_dict())
    assert "of the roofline" in text and "3.50 of 8" in text


def test_ranks_read_their_own_bytes_through_one_memory():
    """Two ep ranks, each holding 4 of 8 experts and half of the KV: the step reads both ranks' bytes, each rank's
    routed experts from its own activity; the report names each rank's share."""
    from moeforge.runtime.roofline import WeightTraffic, ranks_roofline

    ranks = [WeightTraffic(dense_bytes=600, head_bytes=60, gathered_row_bytes=10, expert_bytes=[50, 70],
                           experts=[4, 4], total_bytes=0) for _ in range(2)]
    bandwidth = Bandwidth(best_gb_s=10.0, median_gb_s=9.0, threads=2, probe_bytes=1, rounds=1, cpu="", measured_utc="")
    roof = ranks_roofline(ranks, batch=1, mean_context=100, kv_bytes_per_token=[2, 2],
                          active_experts=[np.array([3, 1]), np.array([1, 3])], bandwidth=bandwidth,
                          decode_tokens_per_s=1e6)
    rank0 = 600 + 10 + 3 * 50 + 1 * 70 + 100 * 2
    rank1 = 600 + 10 + 1 * 50 + 3 * 70 + 100 * 2
    assert roof.rank_step_bytes == [rank0, rank1] and roof.step_bytes == rank0 + rank1
    assert roof.active_experts_per_layer == [4, 4] and roof.experts_per_layer == [8, 8]
    assert roof.active_expert_bytes == 4 * 50 + 4 * 70 and roof.head_bytes == 120
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
