"""KV tiers on real paged artifacts: outputs with tiers equal outputs without (greedy tokens and logprobs) on
tiny-llama (GQA), tiny-deepseek-v3 (MLA latent) and tiny-deepseek-v3.2 (MLA + the DSA indexer cache), also after a
restart that serves from disk, with disk files corrupted, with two engines sharing a directory, and with preemption
swapping through the host tier. The workload is ``moeforge bench --multi-turn``'s, scaled down."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from moeforge.cli.multi_turn import MultiTurnWorkload, run_multi_turn
from moeforge.compile.driver import CompileOptions, compile_model
from moeforge.runtime.engine import CacheOptions, EngineConfig, EngineConfigError, LLMEngine, SchedulingOptions
from moeforge.runtime.sampler import SamplingParams

WORKLOAD = MultiTurnWorkload(conversations=8, turns=3, system_prompts=2, system_len=48, user_len=16, new_tokens=5,
                             concurrency=2)
POOL = 15  # blocks of 16: two requests of the last turn (111 tokens) fit; the 560 prefix tokens (35 blocks) do not
LOGPROB_ATOL = 1e-5  # a promoted block is the computed one bit for bit; recomputing it may round differently


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-deepseek-v3", "tiny-deepseek-v3.2"])
def artifact(request, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiers") / request.param
    return compile_model(CompileOptions.from_flags(model=request.param, output_dir=out, max_seq_len=128,
                                                   progress=False, kv_cache="paged", kv_block_size=16)).output_dir


def _run(artifact: Path, cache: CacheOptions, workload: MultiTurnWorkload = WORKLOAD) -> tuple[dict, LLMEngine]:
    engine = LLMEngine.from_artifact(artifact, EngineConfig(
        scheduling=SchedulingOptions(max_num_seqs=workload.concurrency, max_num_batched_tokens=64), cache=cache))
    try:
        return run_multi_turn(engine, workload, logprobs=True), engine
    finally:
        engine.shutdown()


def _same_outputs(run: dict, reference: dict) -> None:
    assert [t["token_ids"] for t in run["turns"]] == [t["token_ids"] for t in reference["turns"]]
    got = np.concatenate([t["logprobs"] for t in run["turns"]])
    want = np.concatenate([t["logprobs"] for t in reference["turns"]])
    np.testing.assert_allclose(got, want, atol=LOGPROB_ATOL, rtol=0)


@pytest.fixture(scope="module")
def pool_only(artifact) -> dict:
    return _run(artifact, CacheOptions(kv_blocks=POOL))[0]


def test_host_and_disk_tiers_equal_the_pool_alone_and_survive_a_restart(artifact, pool_only, tmp_path):
    host, engine = _run(artifact, CacheOptions(kv_blocks=POOL, host_bytes=64 << 20))
    _same_outputs(host, pool_only)
    stats = engine.stats().kv_tiers
    assert stats is not None and stats.host_hits > 0 and stats.promotions == stats.host_hits
    assert host["prefill_tokens_computed"] < pool_only["prefill_tokens_computed"]

    disk = CacheOptions(kv_blocks=POOL, disk_dir=tmp_path / "kv")
    first, engine = _run(artifact, disk)
    _same_outputs(first, pool_only)
    assert engine.stats().kv_tiers.disk_hits > 0
    restarted, engine = _run(artifact, disk)  # a new engine: empty pool, the directory the first one left
    _same_outputs(restarted, pool_only)
    stats = engine.stats().kv_tiers
    assert stats.disk_hits > 0 and stats.disk.rejected == 0
    # Every turn's prompt is cached but its last partial block: each request computes at most 16 prompt tokens.
    assert restarted["prefill_tokens_computed"] <= 16 * restarted["requests"]
    computed = restarted["prefill_tokens_computed"]
    assert computed < min(first["prefill_tokens_computed"], pool_only["prefill_tokens_computed"] / 3)


def test_corrupt_truncated_and_foreign_files_are_never_loaded(artifact, pool_only, tmp_path):
    disk = CacheOptions(kv_blocks=POOL, disk_dir=tmp_path / "kv")
    _run(artifact, disk)
    files = sorted((tmp_path / "kv").rglob("*.kvblock"))
    assert len(files) > 6
    for index, path in enumerate(files):
        data = bytearray(path.read_bytes())
        if index % 3 == 0:
            data[-1] ^= 0x01  # one bit of the payload
        elif index % 3 == 1:
            del data[len(data) // 2:]  # truncated
        else:
            data = bytearray(files[index - 1].read_bytes())  # another block's file under this name
        path.write_bytes(bytes(data))
    restarted, engine = _run(artifact, disk)
    _same_outputs(restarted, pool_only)  # nothing wrong was loaded: the bad blocks were recomputed
    assert engine.stats().kv_tiers.disk.rejected > 0


def test_two_engines_sharing_a_directory(artifact, pool_only, tmp_path):
    disk = CacheOptions(kv_blocks=POOL, disk_dir=tmp_path / "kv", host_bytes=1 << 20)
    config = EngineConfig(scheduling=SchedulingOptions(max_num_seqs=2, max_num_batched_tokens=64), cache=disk)
    first, second = LLMEngine.from_artifact(artifact, config), LLMEngine.from_artifact(artifact, config)
    half = dataclasses.replace(WORKLOAD, turns=2)
    try:
        a, b = run_multi_turn(first, half, logprobs=True), run_multi_turn(second, half, logprobs=True)
    finally:
        first.shutdown()
        second.shutdown()
    assert [t["token_ids"] for t in a["turns"]] == [t["token_ids"] for t in b["turns"]]
    third, engine = _run(artifact, disk)  # finds what both wrote; outputs unchanged
    _same_outputs(third, pool_only)
    assert engine.stats().kv_tiers.disk.rejected == 0 and engine.stats().kv_tiers.disk_hits > 0


def test_preemption_swaps_through_the_host_tier(artifact):
    prompts = [list(range(i, i + 40)) for i in range(0, 600, 100)]  # 6 requests of 80 tokens in a 112-token pool
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    outputs = {}
    for name, cache in (("recompute", CacheOptions(kv_blocks=7)),
                        ("host", CacheOptions(kv_blocks=7, host_bytes=64 << 20))):
        engine = LLMEngine.from_artifact(artifact, EngineConfig(
            scheduling=SchedulingOptions(max_num_seqs=4, max_num_batched_tokens=64), cache=cache))
        outputs[name] = [o.token_ids for o in engine.generate(prompts, params)]
        assert engine.metrics.preemptions > 0
        if name == "host":
            assert engine.stats().kv_tiers.promotions > 0  # a preempted request came back from the host tier
    assert outputs["host"] == outputs["recompute"]


def test_tiers_need_a_paged_artifact(tmp_path):
    out = compile_model(CompileOptions.from_flags(model="tiny-llama", output_dir=tmp_path / "c", max_seq_len=64,
                                                  progress=False)).output_dir
    with pytest.raises(EngineConfigError, match="--kv-cache paged"):
        LLMEngine.from_artifact(out, EngineConfig(cache=CacheOptions(host_bytes=1 << 20)))
    with pytest.raises(EngineConfigError, match="offload_dtype"):
        CacheOptions(offload_dtype="fp4")


def test_a_full_disk_loses_blocks_not_requests(artifact, pool_only, tmp_path, monkeypatch):
    import errno

    from moeforge.runtime.kv_tiers import disk_tier

    def full(*_: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_tier.os, "replace", full)
    run, engine = _run(artifact, CacheOptions(kv_blocks=POOL, disk_dir=tmp_path / "kv"))
    _same_outputs(run, pool_only)
    stats = engine.stats().kv_tiers
    assert stats.disk.write_errors > 0 and stats.disk_hits == 0
    assert not list((tmp_path / "kv").rglob("*.kvblock")) and not list((tmp_path / "kv").rglob("*.tmp"))
