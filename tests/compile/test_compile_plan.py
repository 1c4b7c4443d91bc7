"""``moeforge compile --plan`` (per-rank bytes, the streamed compile's peak and time, from the config alone) and
``--max-memory`` (a compile whose plan does not fit is refused before any weight is read)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from moeforge.cli.commands import main
from moeforge.compile.driver import CompileOptions, compile_model
from moeforge.compile.plan import LAYER_FACTOR, PER_LAYER_BYTES, RUNTIME_BYTES, plan_compile
from moeforge.core.errors import MoeforgeError
from moeforge.core.host_memory import memory_limit, parse_size
from moeforge.core.kv_layout import contiguous_spec, paged_spec
from moeforge.core.sizes import format_bytes
from moeforge.model.loader import load_config


def test_deepseek_v3_plan_counts_its_published_size_and_splits_it_over_the_ranks() -> None:
    config = load_config("deepseek-v3")
    whole = plan_compile("deepseek-v3", config)
    # DeepSeek-V3: 671 B parameters without its multi-token-prediction layer (685 B with it), as published.
    assert 670.5e9 < whole.total_parameters < 671.5e9
    assert whole.ranks[0].parameters == whole.total_parameters
    assert whole.ranks[0].artifact_bytes == 4 * whole.total_parameters  # fp32
    # Routed experts stream one expert at a time, so a MoE layer's 256 x 3 matrices of 7168 x 2048 count as one
    # expert's 3: the largest unit is now the embedding table (= the LM head), 129280 x 7168 float32.
    experts = 256 * 3 * 7168 * 2048 * 4
    assert whole.ranks[0].largest_layer_fp32_bytes == 4 * config.vocab_size * config.hidden_size < experts / 10
    assert whole.peak_bytes == RUNTIME_BYTES + int(LAYER_FACTOR * whole.ranks[0].largest_layer_fp32_bytes) \
        + PER_LAYER_BYTES * config.num_hidden_layers

    sharded = plan_compile("deepseek-v3", config, tp=8, ep=8)
    assert len(sharded.ranks) == 8 and len({r.parameters for r in sharded.ranks}) == 1
    # Every weight lands on some rank; the embedding table (129280 x 7168) is on every rank, and small ones (norms,
    # routers) too.
    extra = sum(r.parameters for r in sharded.ranks) - whole.total_parameters
    embedding = 7 * config.vocab_size * config.hidden_size
    assert embedding <= extra < 1.2 * embedding
    assert sharded.ranks[0].largest_layer_fp32_bytes <= whole.ranks[0].largest_layer_fp32_bytes

    int4 = plan_compile("deepseek-v3", config, "int4")
    assert 0.13 < int4.ranks[0].artifact_bytes / whole.ranks[0].artifact_bytes < 0.16  # 4 bits + scales


def test_plan_on_the_command_line_needs_no_weights_and_writes_nothing(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "moeforge.cli", "compile", "deepseek-v3", "--plan", "--tp", "8",
                             "--ep", "8"], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("plan: deepseek-v3, 671.0 B parameters, fp32 weights, tp 8 x ep 8")
    assert sum(1 for line in lines if line.split()[:1] and line.split()[0].isdigit()) == 8  # a line per rank
    assert any("peak memory" in line for line in lines) and any(line.startswith("time: ~") for line in lines)
    assert list(tmp_path.iterdir()) == []


def test_compile_without_output_or_plan_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compile", "tiny-llama"]) == 2
    assert "-o/--output DIR is required" in capsys.readouterr().err


@pytest.mark.parametrize(("stream", "match"), [(True, "the streamed compile plans"),
                                               (False, "more than --max-memory.*Hugging Face safetensors folder, "
                                                       "which streams")])
def test_a_compile_over_max_memory_is_refused_before_reading_weights(tmp_path: Path, stream: bool,
                                                                     match: str) -> None:
    options = CompileOptions(model="tiny-deepseek-v3", output_dir=tmp_path / "out", max_memory=1000,
                             stream=stream, progress=False)
    with pytest.raises(MoeforgeError, match=match):
        compile_model(options)
    assert not (tmp_path / "out").exists()


def test_sizes_and_the_memory_limit() -> None:
    assert parse_size("3GiB") == parse_size("3G") == 3 * 2**30
    assert parse_size("3GB") == 3 * 10**9 and parse_size("1.5M") == 3 * 2**19 and parse_size("123") == 123
    for bad in ("", "x", "-1G", "0", "3Q", "1e9"):
        with pytest.raises(ValueError, match="not a size"):
            parse_size(bad)
    limit = memory_limit()
    assert limit is not None and limit > 2**28


def test_v4_paged_plan_states_the_block_size_trade_off(capsys: pytest.CaptureFixture[str]) -> None:
    # DeepSeek-V4-Flash paged: the default block (256 tokens: a multiple of its compress rates, at least twice its
    # 128-token window) keeps its own rings; the plan states the per-token cost at larger blocks (falling) and
    # contiguous buffers' (rings once per sequence), each equal to that layout's KVCacheSpec.
    assert main(["compile", "deepseek-v4-flash", "-o", "unused", "--plan", "--kv-cache", "paged"]) == 0
    out = capsys.readouterr().out
    config = load_config("deepseek-v4-flash")
    assert config.sliding_window == 128
    blocks = (256, 512, 1024, 2048)
    costs = [paged_spec(config, max_seq_len=2048, block_size=b).bytes_per_token for b in blocks]
    assert costs == sorted(costs, reverse=True)
    assert f"256-token blocks, float32: {format_bytes(costs[0])} per token" in out
    assert ", ".join(f"{b}: {format_bytes(c)}" for b, c in zip(blocks[1:], costs[1:], strict=True)) in out
    contiguous = contiguous_spec(config, max_seq_len=2048)
    assert f"--kv-cache contiguous: {format_bytes(contiguous.bytes_per_token)} + " in out
    assert paged_spec(config, max_seq_len=2048, block_size=128).bytes_per_token > costs[0]  # the former default
