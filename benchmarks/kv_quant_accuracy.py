"""Accuracy, size and decode time of an int8 KV cache (`--kv-quant int8`) on SmolLM2-135M.

`python benchmarks/kv_quant_accuracy.py` exports SmolLM2 once and, for fp32 weights and int4-asym weights,
each with an fp32 and an int8 cache, feeds the 322-token English text of tests/data/quant_eval_en.txt
teacher-forced ONE TOKEN PER STEP (every step reads the whole cache so far, as real decoding does) and
compares each position's logits with PyTorch fp32 (top-1 agreement, mean KL). Per-head scales are
calibrated on tests/data/quant_calib_en.txt (different text). Also records cache bytes per token and the
mean decode step time over the run (batch 1, growing context up to 322 tokens).
Writes benchmarks/results/kv_quant_accuracy_smollm2.json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import onnx_ir as ir
import torch
from timer import Stopwatch

from moeforge.cli.bench import write_result
from moeforge.compile.onnx_export import export_stateless
from moeforge.core.kv_layout import KVCacheSpec, contiguous_spec
from moeforge.model.loader import load_model
from moeforge.passes.base import PassContext
from moeforge.passes.pipeline import ort_pipeline, run_passes
from moeforge.quant.calibration import mean_kl, read_prompts, tokenize_prompts
from moeforge.quant.kv_calibration import CalibratedKVQuantization
from moeforge.quant.plan import CALIB_MAX_TOKENS, quant_passes
from moeforge.quant.spec import QuantSpec
from moeforge.runtime.backends.onnxruntime import OrtSession

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT / "tests" / "data" / "quant_eval_en.txt"
CALIB = ROOT / "tests" / "data" / "quant_calib_en.txt"
RESULTS = ROOT / "benchmarks" / "results" / "kv_quant_accuracy_smollm2.json"
VARIANTS = [  # (label, weight scheme or None, int8 cache granularity or None)
    ("fp32", None, None), ("fp32+kv-int8", None, "head"), ("fp32+kv-int8-per-channel", None, "channel"),
    ("int4-asym", "int4-asym", None), ("int4-asym+kv-int8", "int4-asym", "head"),
]


def decode_logits(path: Path, kv_cache: KVCacheSpec, ids: list[int]) -> tuple[np.ndarray, float, int]:
    """Logits [N, V] feeding ``ids`` one token per step; mean seconds per step; cache bytes per token."""
    session = OrtSession(path, kv_cache=kv_cache, threads=2)
    session.allocate(batch=1, max_len=len(ids) + 1)
    rows, watch = [], Stopwatch()
    for pos, token in enumerate(ids):
        rows.append(session.forward(np.array([[token]]), np.array([[pos]]), np.ones((1, pos + 1), np.int64))[0, -1])
    seconds = watch.elapsed() / len(ids)
    per_token = sum(b.nbytes // b.shape[2] for b in session.buffers)
    return np.stack(rows), seconds, per_token


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", nargs="+", choices=[v[0] for v in VARIANTS], default=None,
                        help="run only these variants and merge them into the existing results file")
    args = parser.parse_args()
    loaded = load_model("smollm2-135m")
    ids = loaded.tokenizer.encode(TEXT.read_text())
    with torch.inference_mode():
        reference = loaded.model(torch.tensor([ids]), torch.arange(len(ids))[None]).logits[0].numpy()
    model = export_stateless(loaded.model)
    ctx = PassContext(config=loaded.config, max_seq_len=512)
    run_passes(model, ctx, ort_pipeline())
    proto = ir.serde.serialize_model(model)
    prompts = tokenize_prompts(read_prompts(CALIB), loaded.tokenizer, CALIB_MAX_TOKENS)
    rows: dict[str, dict[str, object]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, scheme, granularity in VARIANTS:
            if args.only and label not in args.only:
                continue
            copy = ir.serde.deserialize_model(proto)
            if scheme is not None:
                run_passes(copy, ctx, quant_passes(QuantSpec(scheme), [])[0])
            summary = {}
            if granularity:
                kv_pass = CalibratedKVQuantization(prompts, granularity)
                kv_pass.apply(copy, ctx)
                summary = kv_pass.summary
            folder = Path(tmp) / label
            folder.mkdir()
            ir.save(copy, folder / "model.onnx", external_data="model.onnx.data")
            kv_cache = contiguous_spec(loaded.config, max_seq_len=512, dtype="int8" if granularity else "float32")
            ours, seconds, cache_bytes = decode_logits(folder / "model.onnx", kv_cache, ids)
            rows[label] = {
                "weights": scheme or "fp32", "kv_cache": f"int8 per {granularity}" if granularity else "fp32",
                "top1_agreement": float((ours.argmax(-1) == reference.argmax(-1)).mean()),
                "mean_kl": mean_kl(reference, ours), "cache_bytes_per_token": cache_bytes,
                "decode_ms_per_step": round(seconds * 1e3, 2),
                **({"kv_scale_range": summary["scale_range"]} if summary else {}),
            }
            print(label, rows[label], flush=True)
    if args.only and RESULTS.is_file():  # keep the other variants' earlier rows
        rows = {**json.loads(RESULTS.read_text())["results"]["results"], **rows}
    write_result(RESULTS, "kv_quant_accuracy", {
        "model": "smollm2-135m", "reference": "PyTorch fp32", "text": str(TEXT.relative_to(ROOT)),
        "tokens": len(ids), "feeding": "teacher-forced, one token per step (decode path)",
        "calibration": str(CALIB.relative_to(ROOT)), "scales": "max |cache| / 127 per KV head or per channel",
        "threads": 2, "results": rows,
    })


if __name__ == "__main__":
    main()
