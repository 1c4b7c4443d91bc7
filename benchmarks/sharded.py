"""Per-rank weight and KV-cache bytes of sharded DeepSeek-V3 (and the tiny presets), from the config alone.

`python benchmarks/sharded.py` plans (moeforge/sharding.py: Megatron / DeepSeek-reference column, row, vocab and
expert rules, the model built on PyTorch's meta device: no weights) deepseek-v3's real shapes at tp 1, tp 8 / ep 8,
tp 16 / ep 16 and tp 8 / ep 1, and writes per rank: weight bytes in bf16 and fp8 (DeepSeek-V3's checkpoint format;
norms and the router stay as they are in the count, a small overcount), the replicated share, and the KV-cache
bytes per token (MLA's latent is replicated on every rank, so it does not shrink with tp). Results:
benchmarks/results/sharded.json with the machine described.

Measured step time at tp 1 vs tp 2 needs the sharded runtime (issue 17), which does not exist yet: the JSON says so
rather than carrying a number.
"""

from __future__ import annotations

from pathlib import Path

from moeforge.bench import write_result
from moeforge.export.loader import load_config
from moeforge.sharding import plan_sharding

RESULTS = Path(__file__).resolve().parent / "results" / "sharded.json"
SPLITS = [("deepseek-v3", 1, 1), ("deepseek-v3", 8, 8), ("deepseek-v3", 16, 16), ("deepseek-v3", 8, 1),
          ("tiny-llama", 2, 1), ("tiny-deepseek-v3", 2, 2), ("tiny-deepseek-v2", 2, 1)]


def main() -> None:
    rows = []
    for name, tp, ep in SPLITS:
        plan = plan_sharding(load_config(name), tp, ep)
        row = plan.summary(dtype_bytes=2, kv_dtype_bytes=2)
        row["weight_gib_per_rank_bf16"] = round(plan.weight_bytes_per_rank(2) / 2**30, 2)
        row["weight_gib_per_rank_fp8"] = round(plan.weight_bytes_per_rank(1) / 2**30, 2)
        rows.append(row)
    print("| model | tp | ep | weights/rank bf16 GiB | fp8 GiB | replicated/rank | KV B/token/rank (bf16) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['tp']} | {r['ep']} | {r['weight_gib_per_rank_bf16']} | "
              f"{r['weight_gib_per_rank_fp8']} | {r['replicated_bytes_per_rank']:,} B | "
              f"{r['kv_bytes_per_token_per_rank']:,} |")
    write_result(RESULTS, "sharded", {
        "plans": rows,
        "step_time_tp1_vs_tp2": "not measured: the sharded runtime (per-rank artifacts, collectives, "
                                "torch.distributed launch) is not built yet",
    })


if __name__ == "__main__":
    main()
