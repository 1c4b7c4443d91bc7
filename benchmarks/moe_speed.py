"""MoE decode at the memory roofline, side by side with llama.cpp, on a DeepSeek-V3-shaped model of >1 B parameters.

Steps (each reused when its output is already there):

1. the benchmark model (benchmarks/synthetic_gguf.py): a GGUF ``deepseek2`` file per format and an HF folder of its
   dequantised values -- ``q8_0`` (Q8_0 everywhere) and ``q4_1`` (Q4_1 projections and experts, Q8_0 embedding and
   head);
2. moeforge artifacts compiled from the HF folders with the streamed compile: ``int8`` (blocks of 32: Q8_0's grid)
   from q8_0, ``int4-asym`` from q4_1 (contiguous KV cache);
3. accuracy: teacher-forced logits of ``--accuracy-tokens`` (1024) seeded random tokens, each system against
   moeforge's own PyTorch model of the dequantised weights: top-1 agreement and mean KL; moeforge and llama.cpp of
   one format also compared position by position (``paired_top1``: the gap's 95% interval, McNemar's p);
4. speed in alternating rounds in one process (benchmarks/peers.py): greedy decode at each ``--batches`` size
   (llama.cpp at batch 1: llama-cpp-python's API runs one sequence), TTFT, prefill of ``--prefill-len`` tokens;
5. the memory roofline of each artifact's decode at each batch (``moeforge bench --roofline``'s numbers,
   moeforge/runtime/roofline.py): bytes a step reads, by kind, the read bandwidth probed in that run (before and
   after its timed steps, then before and after its kernels), the fraction reached (never above 1: the roofline's
   rule, moeforge/runtime/roofline_fraction.py, gives none and the reason instead); the floor of ONNX Runtime's
   kernels on its shapes (kernel_ceiling.py, their fractions of the same bandwidth) and the router's share
   (router_share.py);
6. expert parallelism (``--ep-compare``): the int8 model compiled ``--tp 2 --ep 2`` against unsharded, decode step
   time at batch 1 (``moeforge bench`` on each, the ranks started by the CLI).

Writes benchmarks/results/moe_speed.json (the machine described) and prints the tables.

    python benchmarks/moe_speed.py                       # ~1.4 B parameters, 8 layers, 32 experts, top-4
    python benchmarks/moe_speed.py --layers 2 --hidden 512 --experts 8 --vocab 4096 --folder /tmp/ms  # a quick look
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from heldout_accuracy import compare, llama_cpp_logits, moeforge_logits, paired_top1
from kernel_ceiling import kernel_ceiling
from peers import make_runners, markdown, public_records, run_rounds, summarize, usable_cores
from router_share import router_share
from synthetic_deepseek import DEFAULTS, add_shape_arguments, parameter_count, shape_from_args
from synthetic_gguf import FORMATS, benchmark_shape, reuse_or_write
from timer import Stopwatch

from moeforge.cli.bench import bench_engine, write_result
from moeforge.core.artifact import load_artifact
from moeforge.core.run_bandwidth import RunBandwidth
from moeforge.model.loader import load_model

QUANT_OF = {"q8_0": "int8", "q4_1": "int4-asym"}
# Compile flags per scheme: int8 in blocks of 32 along K reproduces a Q8_0 weight exactly (scale = block max / 127, as
# Q8_0's; per-channel int8 would re-round every block of it); int4-asym's layers are Q4_1's min-max blocks of 32.
QUANT_FLAGS = {"int8": ("--quant", "int8", "--block-size", "32"), "int4-asym": ("--quant", "int4-asym")}
CLI = [sys.executable, "-m", "moeforge.cli"]


def ensure_artifact(source: Path, out: Path, *extra: str) -> dict[str, Any]:
    """Compile ``source`` into ``out`` with ``extra`` flags unless ``out`` holds an artifact of that source already;
    the compile's seconds and its log's last line."""
    stamp = out.with_name(out.name + ".compile.json")
    if stamp.is_file() and ((out / "manifest.json").is_file() or (out / "sharded.json").is_file()):
        recorded = json.loads(stamp.read_text())
        if recorded.get("command_flags") == list(extra) and recorded.get("source") == str(source.resolve()):
            return {**recorded, "reused": True}
    with Stopwatch() as watch:
        done = subprocess.run([*CLI, "compile", str(source), "-o", str(out), "--force", *extra],
                              capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"compile of {source} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    record = {"source": str(source.resolve()), "artifact": str(out), "command_flags": list(extra),
              "seconds": round(watch.seconds, 1), "last_line": done.stdout.strip().splitlines()[-1:]}
    stamp.write_text(json.dumps(record, indent=2) + "\n")
    return record


def accuracy(hf_dir: Path, artifacts: dict[str, Path], ggufs: dict[str, Path], tokens: int, threads: int,
             seed: int = 7) -> dict[str, Any]:
    """Teacher-forced top-1 agreement and mean KL of each system against the PyTorch model of ``hf_dir``."""
    vocab = int(json.loads((hf_dir / "config.json").read_text())["vocab_size"])
    ids = np.random.default_rng(seed).integers(0, vocab, tokens).tolist()
    loaded = load_model(str(hf_dir))
    with torch.inference_mode():
        reference = loaded.model(torch.tensor([ids]), torch.arange(tokens)[None]).logits[0].float().numpy()
    del loaded
    out: dict[str, Any] = {"tokens": tokens, "reference": f"moeforge PyTorch fp32 on {hf_dir.name}"}
    ours: dict[str, np.ndarray] = {label: moeforge_logits(artifact, ids, threads) for label, artifact in
                                   artifacts.items()}
    theirs: dict[str, np.ndarray] = {}
    for label, gguf in ggufs.items():
        try:
            theirs[label] = llama_cpp_logits(gguf, ids, threads)
        except ImportError as error:
            out[label] = {"error": f"llama-cpp-python not importable: {error}"}
    for label, logits in {**ours, **theirs}.items():
        out[label] = compare(reference, logits, ids)
    # the same positions for both: which one gets more of them right, and whether the gap is more than chance
    out["paired"] = {f"{mine} vs {peer}": paired_top1(reference, ours[mine], theirs[peer])
                     for mine in ours for peer in theirs}
    return out


def rooflines(artifacts: dict[str, Path], batches: list[int], prompt_len: int, new_tokens: int,
              threads: int, top_k: int) -> dict[str, Any]:
    """Each artifact's decode against the memory roofline at each batch size (``moeforge bench --roofline``: the
    bandwidth probed in each row's run), against the floor of ONNX Runtime's own kernels on its shapes
    (benchmarks/kernel_ceiling.py), and the router's profiled share of the step (benchmarks/router_share.py)."""
    out: dict[str, Any] = {}
    used: list[float] = []
    for label, artifact in artifacts.items():
        for batch in batches:
            bandwidth = RunBandwidth.probed(threads)  # this row's own: probed around its steps, then its kernels
            measured = bench_engine(artifact, batch, prompt_len, new_tokens, threads, roofline=bandwidth)
            roof = measured["roofline"]
            active = roof["active_experts_per_layer"]
            union = sum(active) / max(len(active), 1)  # experts a step computes per layer; each gets ~B*k/union rows
            expert_rows = max(1, round(batch * top_k / union)) if union else 1
            ceiling = kernel_ceiling(artifact, batch, threads, expert_rows, roof["active_expert_bytes"],
                                     bandwidth=bandwidth)
            used.append(roof["bandwidth_gb_s"])
            out[f"{label} b{batch}"] = {"decode_tokens_per_s": round(measured["decode_tokens_per_s"], 2),
                                        **roof, "kernel_ceiling": ceiling,
                                        "router": router_share(artifact, batch, threads=threads)}
    # what the rows' bandwidths were (each row's own is in its bandwidth_gb_s and bandwidth_probes)
    return {"bandwidth": {"source": "probed in each row's run", "threads": threads,
                          "lowest_gb_s": min(used, default=None), "highest_gb_s": max(used, default=None)}, **out}


def expert_parallel(hf_dir: Path, folder: Path, quant: str, prompt_len: int, new_tokens: int) -> dict[str, Any]:
    """Decode step time at batch 1: the model compiled --tp 2 --ep 2 (2 rank processes, one thread each) against
    unsharded (one process, 2 threads), both through ``moeforge bench``."""
    out: dict[str, Any] = {}
    for label, flags, threads in (("ep1", (), 2), ("ep2", ("--tp", "2", "--ep", "2"), 1)):
        artifact = folder / (f"art-{quant}" if label == "ep1" else f"art-{quant}-{label}")  # ep1: the main artifact
        out[label] = {"compile": ensure_artifact(hf_dir, artifact, *QUANT_FLAGS[quant], *flags)}
        done = subprocess.run([*CLI, "bench", str(artifact), "--no-compare", "--json", "--batch", "1",
                               "--prompt-len", str(prompt_len), "--new-tokens", str(new_tokens),
                               "--threads", str(threads)], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            out[label]["error"] = done.stderr[-2000:]
            continue
        measured = json.loads(done.stdout)["moeforge_onnxruntime"]
        out[label].update(threads_per_process=threads,
                          decode_tokens_per_s=round(measured["decode_tokens_per_s"], 2),
                          step_ms=round(1e3 / measured["decode_tokens_per_s"], 2))
    if "step_ms" in out.get("ep1", {}) and "step_ms" in out.get("ep2", {}):
        out["ep2_step_over_ep1"] = round(out["ep2"]["step_ms"] / out["ep1"]["step_ms"], 3)
    return out


def genai_builder_support() -> str:
    """Whether onnxruntime-genai's builder takes this architecture (it names the ones it builds in its source)."""
    try:
        import onnxruntime_genai  # optional (dev) dependency
    except ImportError:
        return "onnxruntime-genai not installed"
    builder = Path(onnxruntime_genai.__file__).parent / "models" / "builder.py"
    source = builder.read_text() if builder.is_file() else ""
    if "DeepseekV3ForCausalLM" in source or "DeepseekV2ForCausalLM" in source:
        return "supported: not yet wired into this benchmark"
    return (f"onnxruntime-genai {getattr(onnxruntime_genai, '__version__', '?')}: its builder has no DeepseekV2/V3 "
            "architecture (models/builder.py), so it is not compared")


def goals(summary: dict[str, Any], accuracy_by_format: dict[str, Any], roof: dict[str, Any],
          batches: list[int]) -> dict[str, dict[str, Any]]:
    """Issue 38's bars, each with its measured value and whether it is met (None: not measured)."""
    ratios = summary["ratios"]
    out: dict[str, dict[str, Any]] = {}

    def add(name: str, value: float | None, bar: float) -> None:
        out[name] = {"value": None if value is None else round(value, 3), "bar": bar,
                     "met": None if value is None else value >= bar}

    for fmt, quant in QUANT_OF.items():
        ours, theirs = f"moeforge {quant}", f"llama.cpp {fmt.upper()}"
        add(f"decode b1: {ours} / {theirs} >= 1.2", ratios.get(f"decode b1: {ours} / {theirs}"), 1.2)
        acc = accuracy_by_format.get(fmt, {})
        if "top1_agreement" in acc.get(ours, {}) and "top1_agreement" in acc.get(theirs, {}):
            name = f"top-1: {ours} - {theirs} >= 0"
            add(name, acc[ours]["top1_agreement"] - acc[theirs]["top1_agreement"], 0.0)
            paired = acc.get("paired", {}).get(f"{ours} vs {theirs}")
            if paired is not None:  # the gap's 95% interval and McNemar's p: is a miss more than chance?
                out[name].update(ci95=paired["difference_ci95"], mcnemar_p=paired["mcnemar_p"])
        row = roof.get(f"{ours} b1", {})
        add(f"roofline fraction b1: {ours} >= 0.85", row.get("fraction"), 0.85)
        if row.get("fraction_reason") and row.get("fraction") is None:  # above 1 twice: no result, and why
            out[f"roofline fraction b1: {ours} >= 0.85"]["reason"] = row["fraction_reason"]
        if len(batches) > 1:
            add(f"decode b{batches[-1]} / b{batches[0]}: {ours} >= 3", ratios.get(
                f"decode b{batches[-1]} / b{batches[0]}: {ours}"), 3.0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", type=Path, default=Path("build/moe_speed"))
    parser.add_argument("--layers", type=int, default=8)
    add_shape_arguments(parser)
    parser.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--accuracy-tokens", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=None, help="every system's threads (default: the cores)")
    parser.add_argument("--no-llama", action="store_true", help="leave llama.cpp out")
    parser.add_argument("--ep-compare", action="store_true", help="also time --tp 2 --ep 2 against unsharded")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/moe_speed.json"))
    parser.add_argument("--note", action="append", default=[],
                        help="a line for the results' notes (how this run differs from the defaults, and why)")
    args = parser.parse_args()
    for key, value in DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    threads = args.threads or usable_cores()
    shape = benchmark_shape(shape_from_args(args, args.layers))
    print(f"benchmark model: {parameter_count(shape) / 1e9:.2f} B parameters", flush=True)
    models = {fmt: reuse_or_write(args.folder, shape, fmt, seed=args.seed) for fmt in args.formats}
    artifacts: dict[str, Path] = {}
    compiles: dict[str, Any] = {}
    for fmt, info in models.items():
        quant = QUANT_OF[fmt]
        out = args.folder / f"art-{quant}"
        compiles[quant] = ensure_artifact(Path(info["hf"]), out, *QUANT_FLAGS[quant])
        artifacts[f"moeforge {quant}"] = out
        print(f"artifact {out}: {compiles[quant]}", flush=True)
    ggufs = {} if args.no_llama else {f"llama.cpp {fmt.upper()}": Path(info["gguf"]) for fmt, info in models.items()}

    accuracy_by_format = {}
    for fmt, info in models.items():
        quant = QUANT_OF[fmt]
        mine = {f"moeforge {quant}": artifacts[f"moeforge {quant}"]}
        theirs = {k: v for k, v in ggufs.items() if k.endswith(fmt.upper())}
        accuracy_by_format[fmt] = accuracy(Path(info["hf"]), mine, theirs, args.accuracy_tokens, threads)
        print(f"accuracy {fmt}: {json.dumps(accuracy_by_format[fmt])}", flush=True)

    runners, systems = [], {}
    for fmt in models:
        label = f"moeforge {QUANT_OF[fmt]}"
        gguf = ggufs.get(f"llama.cpp {fmt.upper()}")
        more, info = make_runners([artifacts[label]], {}, gguf, args.batches, args.prompt_len, args.prefill_len,
                                  threads)
        runners += more
        systems.update(info)
    vocab = shape.vocab
    records = run_rounds(runners, args.rounds, args.prompt_len, args.new_tokens, args.prefill_len, vocab)
    summary = summarize(records, systems)
    del runners
    roof = rooflines(artifacts, args.batches, args.prompt_len, args.new_tokens, threads, shape.top_k)
    for key, value in roof.items():
        print(f"roofline {key}: {value}", flush=True)
    ep = None
    if args.ep_compare:
        first = next(iter(models))
        ep = expert_parallel(Path(models[first]["hf"]), args.folder, QUANT_OF[first], args.prompt_len,
                             args.new_tokens)
        print(f"expert parallel: {json.dumps(ep)}", flush=True)
    table = markdown(summary, args.batches, args.prefill_len)
    print(table)
    results = {**({"notes": args.note} if args.note else {}), "genai_builder": genai_builder_support(),
               "shape": shape.to_dict(), "parameters": parameter_count(shape), "models": models,
               "compiles": compiles, "threads": threads, "rounds": args.rounds, "batches": args.batches,
               "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "prefill_len": args.prefill_len,
               "systems": systems, **summary, "accuracy": accuracy_by_format, "roofline": roof,
               "expert_parallel": ep, "markdown": table,
               "goals": goals(summary, accuracy_by_format, roof, args.batches), "records": public_records(records),
               "artifact_bytes": {label: sum(f.stat().st_size for f in Path(a).iterdir() if f.is_file())
                                  for label, a in artifacts.items()},
               "weights": {label: load_artifact(a, verify=False).manifest.quantization for label, a in
                           artifacts.items()}}
    print(f"wrote {write_result(args.out, 'moe_speed', results)}")


if __name__ == "__main__":
    main()
