"""DeepSeek-V3.2 sparse attention (DSA): decode step time against context length, sparse (top-k 256) vs dense.

`python benchmarks/sparse_attention.py [--contexts 1024 4096 16384] [--repeats 20]` compiles two tiny V3.2
artifacts that differ only in index_topk -- 256 (sparse) and more than the longest context (every token kept:
dense) -- and times single-token decode steps (batch 1, IOBinding, caches bound in place) at each context, the
caches filled with random rows up to it (step time does not depend on their values; a 16K-token prefill
would take longer than the whole benchmark). The model is small but attention-heavy: 32 heads over a
kv_lora_rank 256 + rope 64 latent, 2 layers, a dense MLP. Per step the sparse graph gathers and attends over 256
latent rows whatever the context; only its indexer (4 heads x 64 dims per token) grows with the context.
The sparse model is timed twice: through the ONNX Runtime lowering the backends use (``sparse``: MatMul core)
and with the lowering's opset-23 Attention core (``sparse_attention_core``: one Attention node per layer).
Writes benchmarks/results/sparse_attention.json with the machine described.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import onnx
from timer import Samples, repeat

from moeforge.cli.bench import write_result
from moeforge.compile.driver import CompileOptions, compile_model
from moeforge.core.artifact import load_artifact
from moeforge.core.config import DSAConfig, MLAConfig, ModelConfig
from moeforge.model.presets import PRESETS, TINY_BOS, TINY_EOS, Preset, _deepseek_yarn
from moeforge.ops.sparse_mla.function import Core
from moeforge.ops.sparse_mla.ort_lowering import lower_for_ort
from moeforge.runtime.backends.onnxruntime import OrtSession

RESULTS = Path(__file__).parent / "results" / "sparse_attention.json"
TOPK = 256


def bench_config(name: str, topk: int, max_positions: int) -> ModelConfig:
    return ModelConfig(
        model_type="deepseek_v32", name=name, vocab_size=512, hidden_size=512, intermediate_size=1024,
        num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=32, head_dim=64,
        max_position_embeddings=max_positions, bos_token_id=TINY_BOS, eos_token_ids=(TINY_EOS,),
        rope=_deepseek_yarn(4.0, max_positions // 4, 1.0),
        mla=MLAConfig(q_lora_rank=256, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64),
        dsa=DSAConfig(index_topk=topk, index_head_dim=64, index_n_heads=4))


def step_times(session: OrtSession, context: int, repeats: int, seed: int) -> Samples:
    """Times of decode steps at position ``context`` over ``context`` random cached rows (each step's inputs made
    inside its timing)."""
    rng = np.random.default_rng(seed)
    for buffer in session.buffers:  # [1, 1, L, W]: rows 0..context-1 hold "cached tokens"
        buffer[:, :, :context] = rng.standard_normal(buffer[:, :, :context].shape, np.float32)
    return repeat(lambda: session.forward(rng.integers(0, 256, (1, 1)), np.array([[context]]),
                                          np.ones((1, context + 1), np.int64)), repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    longest = max(args.contexts) + 1
    max_positions = 1 << (longest - 1).bit_length()
    variants = {"sparse": TOPK, "dense": longest}
    rows: dict[int, dict[str, float]] = {c: {"context": c} for c in args.contexts}
    with tempfile.TemporaryDirectory(prefix="moeforge-dsa-bench-") as tmp:
        for label, topk in variants.items():
            name = f"bench-dsa-{label}"
            PRESETS[name] = Preset(bench_config(name, topk, max_positions), 11, f"DSA benchmark, top-{topk}")
            out = compile_model(CompileOptions.from_flags(model=name, output_dir=Path(tmp) / name,
                                                          max_seq_len=longest, progress=False)).output_dir
            artifact = load_artifact(out)
            # What the backends run (the ONNX Runtime lowering, MatMul core) and, for the sparse model, the lowering
            # with the opset-23 Attention core for comparison.
            forms: dict[str, Core] = {label: "matmul"}
            if label == "sparse":
                forms[f"{label}_attention_core"] = "attention"
            for form, core in forms.items():
                graph = lower_for_ort(onnx.load(str(artifact.model_path), load_external_data=False), core)
                session = OrtSession(artifact.model_path, kv_cache=artifact.manifest.kv_cache, threads=args.threads,
                                     graph=graph, lower=False, huge_pages=True)  # as the engine runs
                session.allocate(1, longest)
                step_times(session, 64, 5, 0)  # warm-up
                for context in args.contexts:
                    times = step_times(session, context, args.repeats, context)
                    rows[context][f"{form}_median_ms"] = round(1e3 * times.median(), 3)
                    print(f"{form:15s} top-{topk:<6d} context {context:6d}: {rows[context][f'{form}_median_ms']} ms",
                          flush=True)
                del session
    table = [rows[c] for c in args.contexts]
    first, last = table[0], table[-1]
    growth = {label: round(last[f"{label}_median_ms"] / first[f"{label}_median_ms"], 2) for label in variants}
    write_result(RESULTS, "sparse_attention", {
        "model": {k: v for k, v in bench_config("bench-dsa", TOPK, max_positions).to_dict().items()
                  if k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "mla", "dsa")},
        "topk_sparse": TOPK, "topk_dense": longest, "batch": 1, "threads": args.threads, "repeats": args.repeats,
        "rows": table, "growth_last_to_first": growth,
    })
    print(f"step time at {args.contexts[-1]} / at {args.contexts[0]}: sparse {growth['sparse']}x, "
          f"dense {growth['dense']}x")


if __name__ == "__main__":
    main()
