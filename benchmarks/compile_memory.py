"""Compile memory as a container counts it: `python benchmarks/compile_memory.py [--quick] [options]`.

Issue 34's yardstick for a streamed, out-of-core compile. Three parts:

* **A synthetic DeepSeek-V3-shaped checkpoint** (``synthetic_deepseek.py``): seeded, in the release's layout
  (sharded safetensors, the real tensor names, projections in FP8 e4m3 with 128 x 128 block scales, a byte-level
  tokenizer), written in row chunks so that the generator's memory stays small whatever the model's size.
* **A runner** (``cgroup_memory.py``): each compile runs alone in a fresh memory cgroup (v1 or v2; needs root),
  with an optional cap, swap off; it reports the group's peak (page cache included), OOM kills, the largest peak
  RSS of its processes and the wall time, and removes the group afterwards whatever happens. The checkpoint's page
  cache is dropped before each run, so every compile reads it cold and its page cache is charged to the compile's
  group (as in a fresh container). Shared libraries already in memory (torch, onnxruntime) stay charged to whoever
  loaded them first: a fresh container would count a few hundred MiB more, the same at every size.
* **The smallest cap** (``smallest_cap``, here): an uncapped peak says little, as the kernel fills any free memory
  with page cache, which a cap reclaims; so the cap is bisected (to ``--resolution-mib``) between one that fails
  (OOM-killed, or slower than ``--timeout-factor`` times the uncapped compile) and one that succeeds. "Uncapped"
  runs are capped at ``--safety-cap-gib`` (default 75% of the available memory), so that a compile too big for
  the machine is killed alone.

For each checkpoint size (``--layers``) and configuration (``--quant``, ``--kv-cache``, ``--tp``; by default each
varied alone from fp32 / contiguous / tp 1, ``--grid full`` for every combination) the results hold the smallest
cap, the uncapped peak and time, the time at the smallest cap and the bytes written, plus issue 34's criteria
(smallest cap flat in the layer count, under 3 GiB for the ~1.4 B-parameter model). Results go to
benchmarks/results/compile_memory.json (``--output``), rewritten after every row.

    python benchmarks/compile_memory.py --quick          # 2 and 4 layers of a ~0.1 B model, fp32: a few minutes
    python benchmarks/compile_memory.py --layers 2 4 8   # the issue's ~1.4 B model (8 layers), every config
    python benchmarks/compile_memory.py --layers 8 --mode stream --quant fp32 --kv-cache contiguous --tp 1 --parity
    python benchmarks/compile_memory.py --generate-only /tmp/ds3 --layers 2 --hidden 256 --experts 4 --vocab 512

Run the whole script under ``nice`` on a shared machine. The compiles run as ``python -m moeforge.cli compile``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cgroup_memory import MIB, RunResult, drop_page_cache, find_memory_cgroup, mountinfo, run_in_cgroup
from synthetic_deepseek import (
    DEFAULTS,
    STAMP_FILE,
    add_shape_arguments,
    checkpoint_files,
    reuse_or_write,
    shape_from_args,
    write_checkpoint,
)

from moeforge.cli.bench import write_result

RESULTS = Path(__file__).parent / "results" / "compile_memory.json"
REPO = Path(__file__).resolve().parents[1]
DEFAULT_WORK_DIR = REPO / "build" / "compile_memory"  # build/ is git-ignored; on disk, not tmpfs
GIB = 2**30
# Issue 34's targets: the smallest cap flat in the layer count, and under 3 GiB for the ~1.4 B model.
FLAT_TOLERANCE = 0.10
CAP_TARGET_BYTES = 3 * GIB


# ================================================================================== the smallest cap
@dataclass
class CapSearch:
    """Bisection of the cap: ``min_cap_bytes`` succeeded, ``max_failing_cap_bytes`` did not (None: not found)."""

    uncapped: RunResult
    min_cap_bytes: int | None
    max_failing_cap_bytes: int
    at_min_cap: RunResult | None
    runs: list[RunResult]


class RunFailed(RuntimeError):
    """A run failed for a reason other than memory (a bug, a bad option): bisection cannot go on."""


def _round_up(value: int, step: int) -> int:
    return -(-value // step) * step


def smallest_cap(run: Callable[[int | None], RunResult], resolution: int, *, ceiling: int | None = None,
                 on_run: Callable[[RunResult], None] | None = None) -> CapSearch:
    """The smallest cap (a multiple of ``resolution``) under which ``run(cap)`` succeeds, by bisection.

    First uncapped (its peak bounds the search from above; a cap at the peak is checked, and doubled up to
    ``ceiling`` if even that fails: reclaim is not free), then halving the interval between the largest failing
    cap (0 at first) and the smallest succeeding one. A failure that is not for memory (nor a timeout, which a cap
    so tight that the compile thrashes gives) raises ``RunFailed``."""
    runs: list[RunResult] = []

    def attempt(cap: int | None) -> RunResult:
        result = run(cap)
        runs.append(result)
        if on_run is not None:
            on_run(result)
        if not result.ok and not result.out_of_memory and not (result.timed_out and cap is not None):
            raise RunFailed(f"run with cap {cap} failed (exit {result.returncode}):\n{result.log_tail}")
        return result

    uncapped = attempt(None)
    if not uncapped.ok:
        raise RunFailed(f"the uncapped run failed (exit {uncapped.returncode}):\n{uncapped.log_tail}")
    lo, hi = 0, _round_up(max(uncapped.peak_bytes, resolution), resolution)
    best = attempt(hi)
    while not best.ok:
        lo = hi
        if ceiling is not None and hi >= ceiling:
            return CapSearch(uncapped, None, lo, None, runs)
        hi = min(2 * hi, ceiling) if ceiling is not None else 2 * hi
        best = attempt(hi)
    while hi - lo > resolution:
        mid = lo + (hi - lo) // 2 // resolution * resolution  # lo < mid < hi: both are multiples of resolution
        result = attempt(mid)
        if result.ok:
            hi, best = mid, result
        else:
            lo = mid
    return CapSearch(uncapped, hi, lo, best, runs)


# ================================================================================== compile configurations
# Schemes that run the graph over --calib prompts (AWQ scales, static activation ranges + SmoothQuant).
CALIBRATED = ("int4-awq", "w8a8")
CALIB_PROMPTS = ("The quick brown fox jumps over the lazy dog.",
                 "Mixture of experts routes each token to a few experts.",
                 "A streamed compile reads, transforms and writes one tensor at a time.",
                 "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)")


@dataclass(frozen=True)
class CompileConfig:
    quant: str = "fp32"
    kv_cache: str = "contiguous"
    tp: int = 1
    mode: str = "in-memory"  # or "stream": moeforge compile --stream (weights read as the artifact is written)
    target: str = "ort"  # or "trt": the TensorRT(-RTX) engine, built on CPU

    @property
    def name(self) -> str:
        parts = ([self.target] if self.target != "ort" else []) + [self.quant, self.kv_cache] + (
            [f"tp{self.tp}"] if self.tp > 1 else []) + (["stream"] if self.mode == "stream" else [])
        return "/".join(parts)

    def flags(self, calib: Path | None = None) -> list[str]:
        """The compile's flags; ``calib``: the prompts file a calibrated scheme reads."""
        return [*(["--target", self.target] if self.target != "ort" else []),
                *(["--quant", self.quant] if self.quant != "fp32" else []),
                *(["--calib", str(calib)] if self.quant in CALIBRATED and calib is not None else []),
                *(["--kv-cache", self.kv_cache] if self.kv_cache != "contiguous" else []),
                *(["--tp", str(self.tp)] if self.tp > 1 else []),
                "--stream" if self.mode == "stream" else "--no-stream"]  # in-memory: today's default streams HF


def compile_configs(quants: Sequence[str], kv_caches: Sequence[str], tps: Sequence[int],
                    grid: str = "axes", modes: Sequence[str] = ("in-memory",), target: str = "ort"
                    ) -> list[CompileConfig]:
    """``grid`` "full": every combination; "axes": the base (the first of each list) and each other value of each
    list varied alone from it (fp32, int8, int4-asym, paged, tp 2 for the defaults). ``target``: every one's."""
    if grid == "full":
        return [CompileConfig(q, k, t, m, target) for q, k, t, m in itertools.product(quants, kv_caches, tps, modes)]
    base = CompileConfig(quants[0], kv_caches[0], tps[0], modes[0], target)
    configs = [base]
    configs += [dataclasses.replace(base, quant=q) for q in quants[1:]]
    configs += [dataclasses.replace(base, kv_cache=k) for k in kv_caches[1:]]
    configs += [dataclasses.replace(base, tp=t) for t in tps[1:]]
    configs += [dataclasses.replace(base, mode=m) for m in modes[1:]]
    return list(dict.fromkeys(configs))


def tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def measure_compile(checkpoint: Path, config: CompileConfig, work: Path, *, resolution: int, bisect: bool,
                    timeout_factor: float, min_timeout_s: float, safety_cap: int | None,
                    parent: tuple[int, Path] | None = None, log: Callable[[str], None] = print,
                    parity: bool = False) -> dict[str, Any]:
    """One row: the compile of ``checkpoint`` with ``config``, uncapped and (``bisect``) at its smallest cap.

    "Uncapped" runs are capped at ``safety_cap`` all the same, so that a compile bigger than the machine is killed
    alone rather than whatever the kernel's global OOM killer picks; it also bounds the bisection. A compile that
    fails for another reason gives a row with its ``error``."""
    out = work / "artifact"
    calib = work / "calib.txt"
    calib.write_text("\n".join(p.replace("\n", " ") for p in CALIB_PROMPTS) + "\n")
    cmd = [sys.executable, "-m", "moeforge.cli", "compile", str(checkpoint), "-o", str(out), "--quiet",
           *config.flags(calib)]
    files = checkpoint_files(checkpoint)
    written: dict[int | None, int] = {}
    timeout: list[float | None] = [None]

    def run(cap: int | None) -> RunResult:
        shutil.rmtree(out, ignore_errors=True)
        drop_page_cache(files)  # cold: the compile's group is charged for the checkpoint pages it reads
        result = run_in_cgroup(cmd, cap if cap is not None else safety_cap,
                               timeout_s=timeout[0] if cap is not None else None, parent=parent)
        result = dataclasses.replace(result, limit_bytes=cap)
        if result.ok:
            written[cap] = tree_bytes(out)
        shutil.rmtree(out, ignore_errors=True)
        return result

    def report(result: RunResult) -> None:
        cap = "uncapped" if result.limit_bytes is None else f"cap {result.limit_bytes // MIB} MiB"
        state = "ok" if result.ok else ("timeout" if result.timed_out else
                                        "OOM-killed" if result.oom_killed else f"exit {result.returncode}")
        log(f"  {config.name} {cap}: {state} in {result.seconds:.1f} s, cgroup peak {result.peak_bytes / MIB:.0f} "
            f"MiB, max RSS {result.max_rss_bytes / MIB:.0f} MiB")
        if result.limit_bytes is None and result.ok:
            timeout[0] = max(min_timeout_s, timeout_factor * result.seconds)

    row: dict[str, Any] = {"config": config.name, "target": config.target, "quant": config.quant,
                           "kv_cache": config.kv_cache, "tp": config.tp,
                           "command": " ".join(["moeforge", *cmd[3:]]),
                           "safety_cap_mib": None if safety_cap is None else safety_cap // MIB}
    if not bisect:
        result = run(None)
        report(result)
        if not result.ok:
            return {**row, "uncapped": result.summary(), "error": result.log_tail[-1500:]}
        return {**row, "uncapped": {**result.summary(), "bytes_written": written[None]}}
    try:
        search = smallest_cap(run, resolution, ceiling=safety_cap, on_run=report)
    except RunFailed as failure:
        log(f"  {config.name}: {str(failure).splitlines()[0]}")
        return {**row, "error": str(failure)[-1500:]}
    at_min = search.at_min_cap
    if parity and config.mode == "stream" and search.min_cap_bytes is not None:
        row["parity_at_min_cap"] = measure_parity(cmd, out, files, search.min_cap_bytes, safety_cap, parent, log)
    return {
        **row,
        "min_cap_mib": None if search.min_cap_bytes is None else search.min_cap_bytes // MIB,
        "max_failing_cap_mib": search.max_failing_cap_bytes // MIB,
        "seconds_at_min_cap": None if at_min is None else round(at_min.seconds, 1),
        "uncapped": {**search.uncapped.summary(), "bytes_written": written[None]},
        "bytes_written": written[None],
        "runs": [r.summary() for r in search.runs],
    }


def measure_parity(compile_cmd: list[str], out: Path, files: list[Path], cap: int, safety_cap: int | None,
                   parent: tuple[int, Path] | None, log: Callable[[str], None]) -> dict[str, Any]:
    """Compile once (under the safety cap) and run ``moeforge parity OUT --stream`` on the artifact in a fresh group
    capped at ``cap``, the checkpoint's and the artifact's page cache dropped first. Exit 0 = parity passed."""
    shutil.rmtree(out, ignore_errors=True)
    built = run_in_cgroup(compile_cmd, safety_cap, parent=parent)
    if not built.ok:
        return {"error": "the compile failed: " + built.log_tail[-800:]}
    try:
        drop_page_cache([*files, *(p for p in out.rglob("*") if p.is_file())])
        cmd = [sys.executable, "-m", "moeforge.cli", "parity", str(out), "--stream", "--steps", "4"]
        result = run_in_cgroup(cmd, cap, parent=parent)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    passed = result.returncode == 0 and not result.timed_out
    log(f"  parity --stream under cap {cap // MIB} MiB: {'PASS' if passed else 'FAIL'} (exit {result.returncode}) in "
        f"{result.seconds:.1f} s, cgroup peak {result.peak_bytes / MIB:.0f} MiB")
    return {**result.summary(), "command": "moeforge parity ARTIFACT --stream --steps 4", "passed": passed,
            "output_tail": result.log_tail[-1200:]}


def criteria(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Issue 34's judgement per model family (the checkpoints that differ only in their layer count) and
    configuration: the smallest cap at the most layers within ``FLAT_TOLERANCE`` of the fewest, and under 3 GiB."""
    out: dict[str, Any] = {}
    for family, config in dict.fromkeys((r.get("family", ""), r["config"]) for r in rows):
        same = {r["layers"]: r for r in rows
                if (r.get("family", ""), r["config"]) == (family, config) and r.get("min_cap_mib")}
        if not same:
            continue
        few, many = min(same), max(same)
        caps = {layers: r["min_cap_mib"] for layers, r in sorted(same.items())}
        entry: dict[str, Any] = {"min_cap_mib_by_layers": {str(k): v for k, v in caps.items()}}
        if many > few:
            ratio = caps[many] / caps[few]
            entry |= {"ratio_most_to_fewest_layers": round(ratio, 3), "flat": ratio <= 1 + FLAT_TOLERANCE}
        entry["under_3_gib_at_most_layers"] = caps[many] * MIB < CAP_TARGET_BYTES
        if same[many].get("parameters"):
            entry["min_cap_over_fp32_weights_at_most_layers"] = round(caps[many] * MIB / (4 * same[many]["parameters"]),
                                                                       3)
        out[f"{family} {config}".strip()] = entry
    return out


# ================================================================================== command line
QUICK = {"layers": [2, 4], "hidden": 1024, "experts": 16, "vocab": 16384, "shard_mib": 128, "quant": ["fp32"],
         "kv_cache": ["contiguous"], "tp": [1], "mode": ["in-memory"]}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="a ~0.1 B model (hidden 1024, 16 experts, vocab 16384) at 2 and 4 layers, fp32 only: "
                             "a few minutes (flags given explicitly still win)")
    size = parser.add_argument_group("checkpoint")
    size.add_argument("--layers", type=int, nargs="+", help="checkpoint sizes to measure (default: 2 4 8)")
    add_shape_arguments(size)
    size.add_argument("--family", choices=["deepseek-v3", "llama"], default="deepseek-v3",
                      help="generated checkpoints: DeepSeek-V3-shaped FP8 (default) or a Llama (GQA, fp32, "
                           "intermediate 4 x --hidden, --hidden / 64 heads, 4 KV heads; written by transformers)")
    size.add_argument("--checkpoint", type=Path,
                      help="measure this existing HF folder instead of generating (one checkpoint; --layers ignored)")
    size.add_argument("--generate-only", type=Path, metavar="DIR",
                      help="write the checkpoint (the first --layers) to DIR and exit")
    what = parser.add_argument_group("compiles")
    what.add_argument("--quant", nargs="+",
                      choices=["fp32", "int8", "int8-asym", "int4", "int4-asym", "fp8", *CALIBRATED],
                      help="weight schemes (default: fp32 int8 int4-asym; int4-awq and w8a8 calibrate on a few "
                           "built-in prompts, --calib)")
    what.add_argument("--target", choices=["ort", "trt"], default="ort",
                      help="ort (default) or trt: the TensorRT-RTX engine built on CPU (fp16; use --family llama: "
                           "TensorRT-RTX has no attention kernel for the DeepSeek shapes' MLA heads)")
    what.add_argument("--kv-cache", nargs="+", choices=["contiguous", "paged"],
                      help="KV-cache layouts (default: contiguous paged)")
    what.add_argument("--tp", type=int, nargs="+", help="tensor-parallel sizes (default: 1 2)")
    what.add_argument("--mode", nargs="+", choices=["in-memory", "stream"],
                      help="in-memory: today's compile; stream: moeforge compile --stream (default: in-memory)")
    what.add_argument("--grid", choices=["axes", "full"], default="axes",
                      help="axes: each value varied alone from the first of each list; full: every combination")
    how = parser.add_argument_group("measurement")
    how.add_argument("--resolution-mib", type=int, default=64, help="bisection resolution (default: 64)")
    how.add_argument("--no-bisect", dest="bisect", action="store_false",
                     help="uncapped runs only (the cgroup's peak, page cache included)")
    how.add_argument("--timeout-factor", type=float, default=5.0,
                     help="a capped run slower than this times the uncapped one counts as failing (default: 5)")
    how.add_argument("--min-timeout-s", type=float, default=120.0, help="but never under this (default: 120)")
    how.add_argument("--safety-cap-gib", type=float,
                     help="the cap of 'uncapped' runs, and the most the bisection tries, so that a compile too big "
                          "for the machine is killed alone (default: 75%% of MemAvailable at the start)")
    how.add_argument("--work-dir", type=Path, default=DEFAULT_WORK_DIR,
                     help=f"where checkpoints and artifacts go (default: {DEFAULT_WORK_DIR.relative_to(REPO)}); "
                          "a checkpoint found there with the same parameters is reused")
    how.add_argument("--parity", action="store_true",
                     help="stream mode: after the bisection, compile once more and run `moeforge parity --stream` "
                          "on the artifact under the compile's smallest cap (issue 34: parity inside the same cap)")
    how.add_argument("--keep-checkpoints", action="store_true", help="keep the generated checkpoints")
    how.add_argument("--output", type=Path, help=f"results JSON (default: {RESULTS.relative_to(REPO)})")
    how.add_argument("--merge", action="store_true",
                     help="keep the rows of --output for other (checkpoint, config) pairs")
    how.add_argument("--note", default="", help="a note stored with the results (e.g. which compile this is)")
    return parser


def _resolve(args: argparse.Namespace) -> argparse.Namespace:
    defaults = {"layers": [2, 4, 8], **DEFAULTS, "quant": ["fp32", "int8", "int4-asym"],
                "kv_cache": ["contiguous", "paged"], "tp": [1, 2],
                "mode": ["in-memory"]}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, QUICK[key] if args.quick else value)
    if args.output is None:
        args.output = RESULTS
    return args


def _filesystem_warning(path: Path) -> str | None:
    """tmpfs pages are memory that no cap reclaims (there is no swap): the files would count as the compile's."""
    path = path.resolve()
    best = ("", "")
    for _, point, fstype, _ in mountinfo():
        if (str(path) + "/").startswith(point.rstrip("/") + "/") and len(point) > len(best[0]):
            best = (point, fstype)
    return f"{path} is on {best[1]}: files there are memory; use --work-dir on a disk" if best[1] in (
        "tmpfs", "ramfs") else None


def _load_results(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(rows, checkpoints) of an earlier results file, for --merge."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        results = json.loads(path.read_text())["results"]
        return list(results["rows"]), list(results["checkpoints"])
    return [], []


def main(argv: Sequence[str] | None = None) -> None:
    args = _resolve(_parser().parse_args(argv))
    if args.generate_only is not None:
        info = write_checkpoint(args.generate_only, shape_from_args(args, args.layers[0]), seed=args.seed,
                                shard_bytes=args.shard_mib * MIB, tokenizer=args.tokenizer)
        print(json.dumps(info, indent=2))
        return
    warning = _filesystem_warning(args.work_dir.parent if not args.work_dir.exists() else args.work_dir)
    if warning:
        raise SystemExit(warning)
    parent = find_memory_cgroup()  # every run, capped or not, is measured in a cgroup
    configs = compile_configs(args.quant, args.kv_cache, args.tp, args.grid, args.mode, args.target)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    available = _mem_available() or physical
    safety_cap = int(args.safety_cap_gib * GIB) if args.safety_cap_gib else int(0.75 * available)
    safety_cap = safety_cap // (args.resolution_mib * MIB) * args.resolution_mib * MIB
    print(f"memory cgroup v{parent[0]} under {parent[1]}; safety cap {safety_cap / GIB:.1f} GiB", flush=True)
    previous_rows, previous_checkpoints = _load_results(args.output) if args.merge else ([], [])
    rows: list[dict[str, Any]] = []
    checkpoints: dict[str, dict[str, Any]] = {}
    load_at_start = round(os.getloadavg()[0], 2)
    # SIGTERM unwinds like Ctrl-C, so the cgroup of a run in flight is removed (MemoryCgroup.close).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    def save() -> None:
        keys = {(r["checkpoint_id"], r["config"]) for r in rows}
        merged = [r for r in previous_rows if (r.get("checkpoint_id"), r.get("config")) not in keys] + rows
        kept = [c for c in previous_checkpoints if c.get("checkpoint_id") not in checkpoints]
        write_result(args.output, "compile_memory", {
            "note": args.note,
            "moeforge_commit": _commit(),
            "method": (f"each compile runs alone in a fresh memory cgroup (v{parent[0]} under {parent[1]}), the "
                       "checkpoint's page cache dropped before each run; peak = the cgroup's peak usage (anonymous + "
                       f"page cache); the smallest cap is bisected to {args.resolution_mib} MiB, a capped run slower "
                       f"than {args.timeout_factor:g}x the uncapped one (at least {args.min_timeout_s:g} s) counting "
                       f"as failing; 'uncapped' runs are capped at the safety cap ({safety_cap // MIB} MiB); "
                       "max_rss = the largest VmHWM of the compile's processes (shared library pages included, which "
                       "the cgroup does not count when another group loaded them first)"),
            "load_avg_1min_at_start": load_at_start,
            "checkpoints": kept + list(checkpoints.values()),
            "rows": merged,
            "criteria": criteria([r for r in merged if "min_cap_mib" in r]),
        })

    for layers in [None] if args.checkpoint else args.layers:
        if args.checkpoint is not None:
            folder = args.checkpoint
            info: dict[str, Any] = {"folder": str(folder), "given": True}
            if (folder / STAMP_FILE).is_file():
                info |= json.loads((folder / STAMP_FILE).read_text())
            layers = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
            family = folder.name
        elif args.family == "llama":
            family = f"llama-H{args.hidden}-V{args.vocab}-s{args.seed}"
            folder = args.work_dir / f"llama-L{layers}-{family}"
            print(f"checkpoint: {layers} layers -> {folder}", flush=True)
            info = write_llama_checkpoint(folder, layers, args.hidden, args.vocab, args.seed)
            info["folder"] = str(folder)
        else:
            shape = shape_from_args(args, layers)
            family = (f"H{shape.hidden}-E{shape.experts}-K{shape.top_k}-V{shape.vocab}-mtp{shape.mtp_layers}"
                      f"-s{args.seed}")
            folder = args.work_dir / f"ds3-L{layers}-{family}"
            print(f"checkpoint: {layers} layers -> {folder}", flush=True)
            info = reuse_or_write(folder, shape, seed=args.seed, shard_bytes=args.shard_mib * MIB,
                                  tokenizer=args.tokenizer)
            info["folder"] = str(folder)
            how = "reused" if info.get("reused") else f"written in {info['generate_seconds']} s"
            print(f"  {info['parameters'] / 1e9:.3f} B parameters, {info['file_bytes'] / GIB:.2f} GiB in "
                  f"{info['shards']} shards ({how})", flush=True)
        checkpoint_id = folder.name
        checkpoints[checkpoint_id] = {"checkpoint_id": checkpoint_id, "family": family, "layers": layers, **info}
        try:
            for config in configs:
                load = round(os.getloadavg()[0], 2)
                row = measure_compile(folder, config, args.work_dir, resolution=args.resolution_mib * MIB,
                                      bisect=args.bisect, timeout_factor=args.timeout_factor,
                                      min_timeout_s=args.min_timeout_s, safety_cap=safety_cap, parent=parent,
                                      log=lambda line: print(line, flush=True), parity=args.parity)
                rows.append({"checkpoint_id": checkpoint_id, "family": family, "layers": layers,
                             "parameters": info.get("parameters"), "fp32_weight_bytes": info.get("fp32_weight_bytes"),
                             "checkpoint_file_bytes": info.get("file_bytes"), "load_avg_1min_at_start": load,
                             **row})
                if args.bisect and "error" not in row:
                    print(f"  -> {config.name}: smallest cap {row['min_cap_mib']} MiB", flush=True)
                save()
        finally:
            if args.checkpoint is None and not args.keep_checkpoints:
                shutil.rmtree(folder, ignore_errors=True)
    save()
    print("wrote", args.output)


def write_llama_checkpoint(folder: Path, layers: int, hidden: int, vocab: int, seed: int) -> dict[str, Any]:
    """A seeded Llama (GQA, untied head) saved by transformers, with a byte-level tokenizer (for --calib)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from moeforge.model.tokenizer import Tokenizer

    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                         num_attention_heads=max(1, hidden // 64), num_key_value_heads=min(4, max(1, hidden // 64)),
                         vocab_size=vocab, max_position_embeddings=4096, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(folder, max_shard_size="512MB")
    Tokenizer.byte_level(vocab, 256, 257).save(folder)
    params = sum(p.numel() for p in model.parameters())
    return {"parameters": params, "fp32_weight_bytes": 4 * params,
            "file_bytes": sum(f.stat().st_size for f in folder.glob("*.safetensors"))}


def _mem_available() -> int | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def _commit() -> str | None:
    """The moeforge commit measured (with "+dirty" for uncommitted changes), to tell before from after."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


if __name__ == "__main__":
    main()
