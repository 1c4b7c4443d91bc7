"""DeepSeek-V4 against DeepSeek-V3 of similar size: KV-cache bytes per token and per sequence, and CPU decode speed,
at 4K and 32K tokens of context.

`python benchmarks/v4_kv.py [--contexts 4096 32768] [--rounds 7] [--steps 8] [--caches contiguous paged]`

Two seeded random-weight models of ~35 M parameters (``bench_v3`` / ``bench_v4``: 4 layers of 512, 8 heads; V3's
absorbed MLA caches a 256 + 32 latent per token and layer, V4's layers alternate CSA (one 256 + 64 entry per 4
tokens, the indexer's top 512) and HCA (one 256 entry per 128 tokens) over a 128-token window) are compiled for ONNX
Runtime, contiguous and paged, with max_seq_len just above the longest context.

KV bytes: each artifact's manifest ``kv_cache`` (``KVCacheSpec``): bytes per token and per sequence as it reports
them, what one sequence of each context holds (contiguous: ``bytes_for``; paged: its whole blocks,
``bytes_per_block`` each) and what one contiguous slot allocates (every buffer at max_seq_len). The same numbers for
the full-size shapes (``deepseek-v3`` against V4-Flash / V4-Pro: their presets where moeforge has them, else V4-Flash
from its config.json sizes over ``config_v4.V4_DEFAULTS``), from the layout functions the compile writes manifests
with (``kv_layout.contiguous_spec`` / ``paged_spec``), in float32 as the artifacts (bf16 halves every number).

Decode: single-token steps at batch 1 through the backend the engine opens (``registry.open_backend``, IOBinding,
caches bound in place), the cache filled with random rows up to the context (a step's cost does not depend on the
values; a 32K-token prefill of V4 would take longer than the whole benchmark, see below). Each (model, cache,
context) is timed once per round, ``--rounds`` alternating rounds in a rotating order (``timer.Rounds``): V3 and V4
run side by side, and a drift of the shared VM slows both. The check at the first context fills the contiguous
caches by a real chunked prefill instead, then alternates decode on that cache and on random rows (same backend);
it also times the prefill. A profiled run at the longest context gives each contiguous model's kernel time by op
type. Writes benchmarks/results/v4_kv.json with the machine described and the moeforge it ran (folder, commit, and
whether moeforge/ had uncommitted changes).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from timer import Rounds, Samples, Stopwatch

from moeforge.cli.bench import write_result
from moeforge.compile.driver import CompileOptions, compile_model
from moeforge.core.artifact import load_artifact
from moeforge.core.config import (
    CompressedAttentionConfig,
    DSAConfig,
    HyperConnectionConfig,
    MLAConfig,
    ModelConfig,
    MoEConfig,
    RopeConfig,
)
from moeforge.core.kv_layout import DEFAULT_BLOCK_SIZE, KVCacheSpec, contiguous_spec, dtype_size, paged_spec
from moeforge.core.kv_layout_v4 import default_block_size
from moeforge.model.presets import PRESETS, TINY_BOS, TINY_EOS, Preset, _deepseek_yarn
from moeforge.runtime.backends.base import Backend, BackendOptions, RowInput, StepInput
from moeforge.runtime.backends.kv_bindings import cache_bindings
from moeforge.runtime.backends.registry import open_backend

RESULTS = Path(__file__).parent / "results" / "v4_kv.json"
CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"
MODELS = ("v3", "v4")
SEEDS = {"v3": 31, "v4": 32}
ORIGINAL_POSITIONS = 4096  # both models' RoPE: YaRN over 4096 positions, scaled to max_position_embeddings


# ---------------------------------------------------------------------------------------- the two models
def _common(name: str, max_positions: int) -> dict[str, Any]:
    return dict(name=name, vocab_size=512, hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
                max_position_embeddings=max_positions, bos_token_id=TINY_BOS, eos_token_ids=(TINY_EOS,))


def bench_v3(max_positions: int) -> ModelConfig:
    """DeepSeek-V3 in small: absorbed MLA (latent 256 + rope 32), a dense first layer, then 24 experts top-2 (+1
    shared) routed by sigmoid noaux_tc in 4 groups."""
    return ModelConfig(
        model_type="deepseek_v3", intermediate_size=1024, num_key_value_heads=8, head_dim=32,
        rope=_deepseek_yarn(max_positions / ORIGINAL_POSITIONS, ORIGINAL_POSITIONS, 1.0),
        mla=MLAConfig(q_lora_rank=256, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64),
        moe=MoEConfig(n_routed_experts=24, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=256,
                      first_k_dense_replace=1, scoring_func="sigmoid", topk_method="noaux_tc", n_group=4,
                      topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5),
        **_common("bench-v4-kv-v3", max_positions))


def bench_v4(max_positions: int) -> ModelConfig:
    """DeepSeek-V4 in small, V4-Flash's rates: one KV head of 256 (rope 32) over a 128-token window; CSA and HCA
    layers alternating (entries of 4 and 128 tokens), the indexer 8 heads x 64 keeping the top 512 entries; 4
    hyper-connection streams; 16 experts top-2 (+1 shared), the first layer hash-routed."""
    return ModelConfig(
        model_type="deepseek_v4", intermediate_size=256, num_key_value_heads=1, head_dim=256, sliding_window=128,
        rope=RopeConfig(theta=10000.0, interleaved=True),
        compressed_attention=CompressedAttentionConfig(
            q_lora_rank=256, qk_rope_head_dim=32, o_groups=4, o_lora_rank=128, layer_types=(CSA, HCA, CSA, HCA),
            csa_rate=4, hca_rate=128,
            compress_rope=RopeConfig(theta=160000.0, scaling="yarn", factor=max_positions / ORIGINAL_POSITIONS,
                                     original_max_position_embeddings=ORIGINAL_POSITIONS, attention_factor=1.0,
                                     interleaved=True),
            indexer=DSAConfig(index_topk=512, index_head_dim=64, index_n_heads=8)),
        hyper_connections=HyperConnectionConfig(hc_mult=4, sinkhorn_iters=20, eps=1e-6),
        moe=MoEConfig(n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=256,
                      scoring_func="sqrtsoftplus", topk_method="noaux_tc", norm_topk_prob=True,
                      routed_scaling_factor=1.5, hash_layers=(0,), swiglu_limit=10.0),
        **_common("bench-v4-kv-v4", max_positions))


BENCH_CONFIGS: dict[str, Callable[[int], ModelConfig]] = {"v3": bench_v3, "v4": bench_v4}


def full_size_configs() -> dict[str, tuple[ModelConfig, str]]:
    """{name: (config, where its shapes come from)}: deepseek-v3 and the released V4s, from moeforge's presets where
    it has them; V4-Flash otherwise from its config.json's sizes over transformers' class defaults (V4_DEFAULTS)."""
    configs = {"deepseek-v3": (PRESETS["deepseek-v3"].config, "preset deepseek-v3")}
    for name in ("deepseek-v4-flash", "deepseek-v4-pro"):
        if name in PRESETS:
            configs[name] = (PRESETS[name].config, f"preset {name}")
    if "deepseek-v4-flash" not in configs:
        flash = ModelConfig.from_hf_dict({"model_type": "deepseek_v4", "vocab_size": 129280, "hidden_size": 4096,
                                          "num_hidden_layers": 43, "num_attention_heads": 64},
                                         name="deepseek-v4-flash")
        configs["deepseek-v4-flash"] = (flash, "config.json sizes + config_v4.V4_DEFAULTS (V4-Flash's values)")
    return configs


# ---------------------------------------------------------------------------------------- KV bytes
def sequence_bytes(kv: KVCacheSpec, tokens: int) -> int:
    """Bytes one sequence of ``tokens`` tokens holds: contiguous, ``bytes_for`` (V4: its rings + entries); paged,
    the whole blocks it takes (a V4 block holds its rings too)."""
    if kv.block_size is not None:
        return -(-tokens // kv.block_size) * kv.bytes_per_block
    return kv.bytes_for(tokens)


def slot_bytes(kv: KVCacheSpec) -> int | None:
    """Bytes one contiguous slot allocates whatever it holds (every buffer at max_seq_len); None for pools."""
    if kv.block_size is not None:
        return None
    size = dtype_size(kv.dtype)
    return sum(math.prod(b.contiguous_shape(1, kv.max_seq_len)) * size for b in cache_bindings(kv))


def kv_row(kv: KVCacheSpec, contexts: list[int]) -> dict[str, Any]:
    """The KV numbers of one cache spec at each context."""
    row: dict[str, Any] = {
        "layout": kv.layout, "cache": "paged" if kv.paged else "contiguous", "dtype": kv.dtype,
        "block_size": kv.block_size, "max_seq_len": kv.max_seq_len,
        "bytes_per_token": kv.bytes_per_token, "bytes_per_sequence": kv.bytes_per_sequence,
        "bytes_per_block": kv.bytes_per_block if kv.paged else None, "slot_bytes": slot_bytes(kv),
    }
    for tokens in contexts:
        total = sequence_bytes(kv, tokens)
        row[f"bytes_at_{tokens}"] = total
        row[f"bytes_per_token_at_{tokens}"] = round(total / tokens, 1)
    return row


def full_size_kv(contexts: list[int]) -> list[dict[str, Any]]:
    """KV rows of the full-size configs, contiguous and paged (V4: its default block size, whole windows)."""
    rows = []
    longest = max(contexts)
    for name, (config, source) in full_size_configs().items():
        block = (default_block_size(config, DEFAULT_BLOCK_SIZE) if config.compressed_attention is not None
                 else DEFAULT_BLOCK_SIZE)
        for kv in (contiguous_spec(config, max_seq_len=longest),
                   paged_spec(config, max_seq_len=longest, block_size=block)):
            rows.append({"model": name, "source": source, "parameters": config.num_parameters(),
                         **kv_row(kv, contexts)})
    return rows


# ---------------------------------------------------------------------------------------- decode
@dataclass
class System:
    """One compiled model opened on its backend, its cache filled with random rows up to max_seq_len."""

    model: str
    cache: str
    backend: Backend
    kv: KVCacheSpec

    @property
    def name(self) -> str:
        return f"{self.model} {self.cache}"

    def buffers(self) -> list[np.ndarray]:
        """The cache buffers the backend binds in place (contiguous: its session's rows; paged: its pools)."""
        if self.kv.paged:
            return list(self.backend.pools.values())  # type: ignore[attr-defined]
        return list(self.backend._session.buffers)  # type: ignore[attr-defined]

    def fill_random(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        for buffer in self.buffers():
            buffer[...] = rng.standard_normal(buffer.shape, np.float32)

    def row(self, token: int, start: int) -> RowInput:
        """The decode row of ``token`` at position ``start``; paged: the blocks up to it, as the engine's block table
        would have them (a contiguous slot is told it holds ``start`` tokens)."""
        if not self.kv.paged:
            self.backend.lengths[0] = start  # type: ignore[attr-defined]
            return RowInput(0, (token,), start)
        assert self.kv.block_size is not None
        return RowInput(0, (token,), start, tuple(range(start // self.kv.block_size + 1)))

    def decode(self, context: int, steps: int, warmup: int) -> float:
        """Median seconds of ``steps`` single-token steps right after ``context`` cached tokens (``warmup`` steps
        first, untimed)."""
        samples = Samples()
        for i in range(warmup + steps):
            row = self.row(65 + i % 26, context + i)
            if i < warmup:
                self.backend.execute(StepInput((row,)))
                continue
            with samples.measure():
                self.backend.execute(StepInput((row,)))
        return samples.median()

    def prefill(self, tokens: list[int], chunk: int) -> float:
        """Seconds of a real prefill of ``tokens`` in chunks of ``chunk`` (contiguous: slot 0 from empty)."""
        self.backend.lengths[0] = 0  # type: ignore[attr-defined]
        watch = Stopwatch()
        for start in range(0, len(tokens), chunk):
            part = tokens[start:start + chunk]
            self.backend.execute(StepInput((RowInput(0, tuple(part), start),)))
        return watch.elapsed()


def positions_for(max_seq_len: int) -> int:
    """max_position_embeddings of the bench models: the power of two at or above ``max_seq_len``."""
    return 1 << (max_seq_len - 1).bit_length()


def compile_bench(model: str, config: ModelConfig, cache: str, max_seq_len: int, work: Path) -> Path:
    PRESETS[config.name] = Preset(config, SEEDS[model], f"benchmarks/v4_kv.py {model}")  # random weights
    out = work / f"{model}-{cache}"
    watch = Stopwatch()
    compile_model(CompileOptions.from_flags(model=config.name, output_dir=out, max_seq_len=max_seq_len,
                                            kv_cache=cache, progress=False, force=True))
    print(f"compiled {model} {cache} (max_seq_len {max_seq_len}) in {watch.elapsed():.0f} s", flush=True)
    return out


def open_system(model: str, cache: str, folder: Path, threads: int, seed: int, profile: bool = False) -> System:
    artifact = load_artifact(folder)
    kv = artifact.manifest.kv_cache
    blocks = -(-kv.max_seq_len // kv.block_size) if kv.block_size is not None else None
    backend = open_backend(artifact, BackendOptions(threads=threads, profile=profile), num_slots=1,
                           num_blocks=blocks)
    system = System(model, cache, backend, kv)
    system.fill_random(seed)
    return system


def prefill_check(systems: dict[str, System], context: int, chunk: int, rounds: int, steps: int,
                  warmup: int) -> dict[str, Any]:
    """Per contiguous model: a real chunked prefill of ``context`` random tokens (timed), then decode alternating
    between that cache and random rows in the same buffers (``rounds`` rounds each)."""
    out: dict[str, Any] = {"context": context, "chunk": chunk}
    prompt = np.random.default_rng(7).integers(0, 256, context).tolist()
    for system in systems.values():
        if system.kv.paged:
            continue
        buffers = system.buffers()
        for buffer in buffers:
            buffer[...] = 0
        seconds = system.prefill(prompt, chunk)
        prefilled = [b.copy() for b in buffers]
        print(f"{system.name}: prefill of {context} tokens in chunks of {chunk}: {seconds:.1f} s", flush=True)

        def restore(state: str, system: System = system, prefilled: list[np.ndarray] = prefilled) -> float:
            if state == "prefilled":
                for buffer, saved in zip(system.buffers(), prefilled, strict=True):
                    buffer[...] = saved
            else:
                system.fill_random(context)
            return system.decode(context, steps, warmup)

        times = Rounds(rounds).run({"prefilled": "prefilled", "random": "random"}, restore)
        medians = {state: statistics.median(values) for state, values in times.items()}
        out[system.model] = {"prefill_s": round(seconds, 2), "prefill_tokens_per_s": round(context / seconds, 1),
                             "decode_ms_prefilled": round(1e3 * medians["prefilled"], 2),
                             "decode_ms_random": round(1e3 * medians["random"], 2),
                             "random_over_prefilled": round(medians["random"] / medians["prefilled"], 3)}
        system.fill_random(0)
    return out


def op_shares(folders: dict[str, Path], context: int, threads: int, steps: int) -> dict[str, dict[str, float]]:
    """Each contiguous model's kernel time by op type (top 8 shares) over ``steps`` decode steps at ``context`` (the
    profile counts every run: 2 warm-up steps included)."""
    shares = {}
    for name, folder in folders.items():
        model, cache = name.split()
        if cache != "contiguous":
            continue
        system = open_system(model, cache, folder, threads, 0, profile=True)
        system.decode(context, steps, 2)
        measured = system.backend.op_time_shares() or {}
        shares[model] = {op: round(share, 3) for op, share in sorted(measured.items(), key=lambda kv: -kv[1])[:8]}
        del system
    return shares


# ---------------------------------------------------------------------------------------- report
def mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:,.2f}"


def print_tables(kv_rows: list[dict[str, Any]], decode: list[dict[str, Any]], contexts: list[int]) -> None:
    print(f"\nKV cache (float32; MiB per sequence; B/token*: the spec's bytes_per_token, B/tok: the sequence's bytes "
          f"per token)\n{'model':<24}{'cache':<11}{'B/token*':>10}"
          + "".join(f"{f'@{c}':>12}{'B/tok':>9}" for c in contexts) + f"{'slot':>12}")
    for row in kv_rows:
        print(f"{row['model']:<24}{row['cache']:<11}{row['bytes_per_token']:>10,}"
              + "".join(f"{mib(row[f'bytes_at_{c}']):>12}{row[f'bytes_per_token_at_{c}']:>9,.0f}" for c in contexts)
              + f"{mib(row['slot_bytes']):>12}")
    print(f"\nDecode, batch 1 (median of rounds)\n{'system':<16}{'context':>8}{'ms/step':>10}{'tok/s':>9}"
          f"{'v4/v3':>8}")
    for row in decode:
        ratio = row.get("v4_over_v3")
        print(f"{row['system']:<16}{row['context']:>8}{row['median_ms']:>10.2f}{row['tokens_per_s']:>9.1f}"
              f"{'' if ratio is None else f'{ratio:.2f}':>8}")


def moeforge_source() -> dict[str, Any]:
    """Which moeforge the numbers come from: its folder, and where that is a git checkout its commit and whether
    moeforge/ differs from it."""
    import moeforge

    root = Path(moeforge.__file__).resolve().parents[1]

    def git(*args: str) -> str | None:
        run = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=False)
        return run.stdout.strip() if run.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--", "moeforge") if commit else None
    return {"path": str(root), "commit": commit, "moeforge_modified": None if status is None else bool(status)}


def model_summary(config: ModelConfig) -> dict[str, Any]:
    keep = ("hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "sliding_window", "mla",
            "compressed_attention", "moe")
    return {"parameters": config.num_parameters(), "kv_values_per_token_per_layer": config.kv_cache_values_per_token(),
            **{k: v for k, v in config.to_dict().items() if k in keep and v is not None}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=8, help="timed decode steps per measurement")
    parser.add_argument("--warmup", type=int, default=2, help="untimed decode steps before them")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--caches", nargs="+", choices=("contiguous", "paged"), default=["contiguous", "paged"])
    parser.add_argument("--prefill-chunk", type=int, default=64,
                        help="tokens per run of the real-prefill check (0: no check)")
    parser.add_argument("--work", type=Path, help="compile here and keep the artifacts (default: a temporary folder)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    contexts = sorted(args.contexts)
    # Whole V4 blocks (128 tokens) past the last step of the longest context.
    max_seq_len = -(-(contexts[-1] + args.warmup + args.steps) // 128) * 128
    configs = {model: BENCH_CONFIGS[model](positions_for(max_seq_len)) for model in MODELS}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="moeforge-v4-kv-") as tmp:
        work = args.work or Path(tmp)
        folders = {f"{model} {cache}": compile_bench(model, configs[model], cache, max_seq_len, work)
                   for cache in args.caches for model in MODELS}
        systems = {name: open_system(*name.split(), folder, args.threads, seed=0)
                   for name, folder in folders.items()}
        kv_rows = [{"model": f"bench {name.split()[0]}", "source": str(folders[name].name),
                    "parameters": configs[s.model].num_parameters(), **kv_row(s.kv, contexts)}
                   for name, s in systems.items()]
        kv_rows += full_size_kv(contexts)

        # Every (system, context) once per round, V3 and V4 of one cache and context side by side.
        keys = [(name, c) for c in contexts for cache in args.caches for name in systems if name.endswith(cache)]

        def progress(index: int, so_far: dict[tuple[str, int], list[float]]) -> None:
            print(f"round {index + 1}/{args.rounds}: " + ", ".join(
                f"{name} @{c} {1e3 * so_far[(name, c)][-1]:.1f} ms" for name, c in keys), flush=True)

        times = Rounds(args.rounds).run({key: key for key in keys},
                                        lambda key: systems[key[0]].decode(key[1], args.steps, args.warmup),
                                        progress)
        decode = []
        for name, context in keys:
            rounds = times[(name, context)]
            median = statistics.median(rounds)
            row = {"system": name, "context": context, "median_ms": round(1e3 * median, 2),
                   "min_round_ms": round(1e3 * min(rounds), 2), "max_round_ms": round(1e3 * max(rounds), 2),
                   "tokens_per_s": round(1 / median, 1), "rounds_ms": [round(1e3 * t, 2) for t in rounds]}
            if name.startswith("v4"):
                peer = statistics.median(times[(name.replace("v4", "v3"), context)])
                row["v4_over_v3"] = round(median / peer, 3)
            decode.append(row)

        check = None
        if args.prefill_chunk and "contiguous" in args.caches:
            check = prefill_check(systems, contexts[0], args.prefill_chunk, 3, args.steps, args.warmup)
        systems.clear()  # free the caches before the profiled sessions
        shares = op_shares(folders, contexts[-1], args.threads, args.steps)
    print_tables(kv_rows, decode, contexts)
    write_result(args.out, "v4_kv", {
        "models": {model: model_summary(config) for model, config in configs.items()},
        "moeforge": moeforge_source(), "max_seq_len": max_seq_len, "contexts": contexts, "batch": 1,
        "threads": args.threads, "rounds": args.rounds, "steps": args.steps, "warmup": args.warmup,
        "fill": "random rows",
        "load_average_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "kv": kv_rows, "decode": decode, "prefill_check": check, "op_shares_at_longest_context": shares,
    })


if __name__ == "__main__":
    main()
