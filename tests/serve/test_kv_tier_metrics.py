"""KV tiers behind the server: /metrics exports the tiers' counters (equal to the engine's), and stopping the server
writes the cached blocks to the disk tier, from which a new server's engine serves the same prompt."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from moeforge.compile.driver import CompileOptions, compile_model
from moeforge.runtime.engine import CacheOptions, EngineConfig, LLMEngine, SchedulingOptions
from moeforge.serve import ServerConfig, create_app

from .conftest import MODEL, _running

# Three 49-token prompts (3 full blocks before the last token) in a 6-block pool: the third evicts the first, which
# then comes back from a tier.
PROMPTS = [[(7 * i + j) % 250 + 1 for j in range(49)] for i in range(3)]


def _metrics(url: str) -> dict[tuple[str, str], float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {(s.name, s.labels.get("tier", "")): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name.startswith("moeforge:kv_tier_")}


def test_tier_metrics_and_the_disk_tier_across_a_server_restart(tmp_path):
    out = compile_model(CompileOptions.from_flags(model=MODEL, output_dir=tmp_path / "a", max_seq_len=128,
                                                  progress=False, kv_cache="paged", kv_block_size=16)).output_dir
    config = EngineConfig(scheduling=SchedulingOptions(max_num_seqs=1),
                          cache=CacheOptions(kv_blocks=6, host_bytes=1 << 20, disk_dir=tmp_path / "kv"))
    engine = LLMEngine.from_artifact(out, config)
    texts = []
    with _running(create_app(engine, ServerConfig(model_name=MODEL))) as url:
        for prompt in [*PROMPTS, PROMPTS[0]]:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "ignore_eos": True, "temperature": 0}
            reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            assert reply.status_code == 200
            texts.append(reply.json()["choices"][0]["text"])
        samples = _metrics(url)
    stats = engine.stats().kv_tiers
    assert stats is not None and stats.host_hits == 3  # the first prompt's three full blocks came back from L2
    assert samples[("moeforge:kv_tier_hits_total", "host")] == stats.host_hits
    assert samples[("moeforge:kv_tier_misses_total", "disk")] == stats.disk_misses
    assert samples[("moeforge:kv_tier_promotions_total", "")] == stats.promotions
    assert samples[("moeforge:kv_tier_demotions_total", "")] == stats.demotions > 0
    assert samples[("moeforge:kv_tier_capacity_bytes", "host")] == 1 << 20
    assert ("moeforge:kv_tier_io_seconds_total", "disk") in samples
    assert list((tmp_path / "kv").rglob("*.kvblock"))  # the stopped server left its blocks on disk

    restarted = LLMEngine.from_artifact(out, config)
    with _running(create_app(restarted, ServerConfig(model_name=MODEL))) as url:
        body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 4, "ignore_eos": True, "temperature": 0}
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert reply.json()["choices"][0]["text"] == texts[1]
        assert _metrics(url)[("moeforge:kv_tier_hits_total", "disk")] == 3  # served from disk, not recomputed
