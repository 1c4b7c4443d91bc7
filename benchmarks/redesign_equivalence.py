"""Prove a refactor changed no artifact: compile the same models with two git revisions of moeforge and
compare the graphs node for node and the manifests field for field.

Each revision is exported with ``git archive`` and installed with ``pip install --no-deps --target`` into
its own folder; each compile runs ``moeforge compile`` from that folder in a fresh interpreter (so the
installed or editable moeforge is never mixed in). ``--after WORKTREE`` uses the working tree instead of a
commit. Compared, per artifact:

- ``model.onnx``: opset imports, graph inputs/outputs (name, dtype, shape), every node in order (op type,
  domain, name, inputs, outputs, attributes), local functions the same way, every initializer (name,
  dtype, shape, sha256 of its bytes), and the sha256 of the whole file once the exporter's per-node source
  locations (stack traces: paths and line numbers; namespace and class hierarchy: module paths of the Python
  classes, which a refactor that moves modules changes) are removed;
- ``manifest.json``: everything except tool versions, ``created_utc``, pass timings, TensorRT build
  timings/sizes and the source path; the sha256 of every file except TensorRT plans (rebuilt differently each
  time), so ``model.onnx``, its weights, the tokenizer and configs must be byte-identical;
- ``golden/*.json``: byte for byte.

Usage: ``python benchmarks/redesign_equivalence.py --before 1874753 --after WORKTREE``; writes
``benchmarks/results/redesign_equivalence.json`` and exits 1 on any difference.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import onnx
from onnx import numpy_helper

from moeforge.cli.bench import machine_info

ROOT = Path(__file__).resolve().parents[1]
CALIB = "tests/data/quant_calib_en.txt"
# (label, compile arguments): the list (tiny-llama; tiny-deepseek-v3 contiguous, paged, int4-asym,
# int8 KV; --target trt) plus one of each remaining quantisation family.
CASES: list[tuple[str, list[str]]] = [
    ("tiny-llama", ["tiny-llama"]),
    ("tiny-llama-paged", ["tiny-llama", "--kv-cache", "paged"]),
    ("tiny-deepseek-v3", ["tiny-deepseek-v3"]),
    ("tiny-deepseek-v3-paged", ["tiny-deepseek-v3", "--kv-cache", "paged", "--kv-block-size", "8"]),
    ("tiny-deepseek-v3-int4-asym", ["tiny-deepseek-v3", "--quant", "int4-asym", "--block-size", "16"]),
    ("tiny-deepseek-v3-kv-int8", ["tiny-deepseek-v3", "--kv-quant", "int8", "--calib", CALIB]),
    ("tiny-llama-int4-kv-int8", ["tiny-llama", "--quant", "int4", "--block-size", "16", "--kv-quant", "int8",
                                 "--calib", CALIB]),
    ("tiny-llama-int4-awq-keep-fp", ["tiny-llama", "--quant", "int4-awq", "--block-size", "16", "--calib", CALIB,
                                     "--keep-fp", "0.2"]),
    ("tiny-llama-w8a8", ["tiny-llama", "--quant", "w8a8", "--calib", CALIB]),
    ("tiny-deepseek-v3-fp8", ["tiny-deepseek-v3", "--quant", "fp8", "--block-size", "16"]),
    ("tiny-llama-trt", ["tiny-llama", "--target", "trt"]),
    ("tiny-llama-trt-int4", ["tiny-llama", "--target", "trt", "--quant", "int4", "--block-size", "16"]),
    ("tiny-deepseek-v3-trt-paged", ["tiny-deepseek-v3", "--target", "trt", "--kv-cache", "paged"]),
    # The MoE families (one MoERouter attribute set each), DeepSeek-V3.2's sparse attention, and sharded artifacts.
    ("tiny-deepseek-v2", ["tiny-deepseek-v2"]),
    ("tiny-qwen3-moe", ["tiny-qwen3-moe"]),
    ("tiny-mixtral-paged", ["tiny-mixtral", "--kv-cache", "paged"]),
    ("tiny-olmoe", ["tiny-olmoe"]),
    ("tiny-glm4-moe", ["tiny-glm4-moe"]),
    ("tiny-kimi-k2-int8", ["tiny-kimi-k2", "--quant", "int8"]),
    ("tiny-deepseek-v3.2", ["tiny-deepseek-v3.2"]),
    ("tiny-deepseek-v3.2-paged", ["tiny-deepseek-v3.2", "--kv-cache", "paged", "--kv-block-size", "8"]),
    ("tiny-llama-tp2", ["tiny-llama", "--tp", "2"]),
    ("tiny-deepseek-v3-tp2-ep2", ["tiny-deepseek-v3", "--tp", "2", "--ep", "2"]),
    ("tiny-deepseek-v3.2-tp2-paged", ["tiny-deepseek-v3.2", "--tp", "2", "--kv-cache", "paged"]),
]
# Flags a later revision needs for the same artifact: since the backend registry, a TensorRT paged engine (which no
# moeforge backend runs) is built only with --build-only. Given to the "after" side when it accepts the flag.
AFTER_ONLY_FLAGS: dict[str, list[str]] = {"tiny-deepseek-v3-trt-paged": ["--build-only"]}
VOLATILE_MANIFEST = ("tool_versions", "created_utc", "files", "source")
# Files not compared byte for byte: TensorRT plans (a build embeds its own details each time) and model.onnx, whose
# nodes carry the exporter's stack traces (source file paths and line numbers of the moeforge that exported it);
# model.onnx is compared node for node and as a hash of its bytes with those stack traces removed.
NONDETERMINISTIC_FILES = ("model.plan", "timing.cache", "model.onnx")
# Node metadata that records where the exporter found each op in moeforge's source: the stack trace (paths, line
# numbers) and the Python classes it passed through (module paths, e.g. moeforge.model.model.CausalLM), which a
# refactor that moves modules changes; the ops, names and attributes themselves are compared node for node.
SOURCE_LOCATION_KEYS = ("pkg.torch.onnx.stack_trace", "namespace", "pkg.torch.onnx.class_hierarchy")
VOLATILE_ENGINE = ("build_seconds", "plan_bytes", "layer_types", "tensorrt_version")


def install_revision(rev: str, into: Path) -> Path:
    """moeforge at git ``rev`` (or the working tree for ``WORKTREE``) installed into ``into/site``."""
    source = ROOT
    if rev != "WORKTREE":
        source = into / "src"
        source.mkdir(parents=True)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(source)], input=archive, check=True)
    site = into / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(site), str(source)], check=True)
    return site


def compile_case(site: Path, args: list[str], out: Path) -> None:
    """``moeforge compile`` from ``site`` only, in a fresh interpreter whose working directory holds no moeforge."""
    env = {**os.environ, "PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1"}
    argv = [*args, "-o", str(out), "--quiet"]
    help_text = subprocess.run([sys.executable, "-c", "import sys; from moeforge.cli import main; "
                                "sys.exit(main(['compile', '--help']))"], env=env, cwd=out.parent,
                               capture_output=True, text=True).stdout
    argv = [a for a in argv if not a.startswith("--build-only") or "--build-only" in help_text]
    argv = [str(ROOT / a) if a == CALIB else a for a in argv]
    code = ("import sys, moeforge; assert moeforge.__file__.startswith(sys.argv[1]), moeforge.__file__; "
            "from moeforge.cli import main; sys.exit(main(['compile', *sys.argv[2:]]))")
    subprocess.run([sys.executable, "-c", code, str(site), *argv], check=True, env=env, cwd=out.parent)


def _attributes(node: onnx.NodeProto) -> dict[str, str]:
    return {a.name: hashlib.sha256(a.SerializeToString()).hexdigest()[:16] for a in node.attribute}


def _nodes(nodes: Any) -> list[dict[str, Any]]:
    return [{"op": f"{n.domain}::{n.op_type}", "name": n.name, "inputs": list(n.input), "outputs": list(n.output),
             "attributes": _attributes(n)} for n in nodes]


def _value(v: onnx.ValueInfoProto) -> dict[str, Any]:
    t = v.type.tensor_type
    return {"name": v.name, "elem_type": t.elem_type,
            "shape": [d.dim_param or d.dim_value for d in t.shape.dim]}


def describe_graph(path: Path) -> dict[str, Any]:
    """A canonical, comparable description of model.onnx (weights as hashes)."""
    proto = onnx.load(str(path), load_external_data=True)
    graph = proto.graph
    initializers = {}
    for init in graph.initializer:
        array = numpy_helper.to_array(init)
        initializers[init.name] = {"dtype": str(array.dtype), "shape": list(array.shape),
                                   "sha256": hashlib.sha256(array.tobytes()).hexdigest()}
    return {
        "sha256_without_source_locations": _hash_without_source_locations(path),
        "opsets": sorted((o.domain, o.version) for o in proto.opset_import),
        "inputs": [_value(v) for v in graph.input],
        "outputs": [_value(v) for v in graph.output],
        "nodes": _nodes(graph.node),
        "functions": {f"{f.domain}::{f.name}": {"inputs": list(f.input), "outputs": list(f.output),
                                                "attributes": list(f.attribute), "nodes": _nodes(f.node)}
                      for f in proto.functions},
        "initializers": initializers,
    }


def _hash_without_source_locations(path: Path) -> str:
    """sha256 of model.onnx (weights stay external) after dropping the stack-trace metadata of every node."""
    proto = onnx.load(str(path), load_external_data=False)
    for nodes in [proto.graph.node, *(f.node for f in proto.functions)]:
        for node in nodes:
            kept = [p for p in node.metadata_props if p.key not in SOURCE_LOCATION_KEYS]
            del node.metadata_props[:]
            node.metadata_props.extend(kept)
    return hashlib.sha256(proto.SerializeToString(deterministic=True)).hexdigest()


def describe_manifest(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())
    data["file_hashes"] = {name: entry["sha256"] for name, entry in data.get("files", {}).items()
                           if name not in NONDETERMINISTIC_FILES}
    for key in VOLATILE_MANIFEST:
        data.pop(key, None)
    data["passes"] = [{k: v for k, v in p.items() if k != "seconds"} for p in data.get("passes", [])]
    if data.get("engine"):
        data["engine"] = {k: v for k, v in data["engine"].items() if k not in VOLATILE_ENGINE}
    return data


def describe(artifact: Path) -> dict[str, Any]:
    """One artifact, or a sharded one: its sharded.json (less the compile's id, time, source and the ranks' manifest
    hashes, which cover those manifests' own times) and each rank directory described as an artifact."""
    if (artifact / "sharded.json").is_file():
        sharded = json.loads((artifact / "sharded.json").read_text())
        for key in ("compile_id", "created_utc", "source"):
            sharded.pop(key, None)
        for rank in sharded.get("ranks", []):
            rank.pop("manifest_sha256", None)
        ranks = sorted(p for p in artifact.iterdir() if p.is_dir())
        return {"sharded": sharded, "ranks": {p.name: describe(p) for p in ranks},
                "files": sorted(p.name for p in artifact.iterdir())}
    golden = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted((artifact / "golden").glob("*"))}
    manifest = describe_manifest(artifact / "manifest.json")
    manifest.get("sharding", {}).pop("compile_id", None)
    return {"graph": describe_graph(artifact / "model.onnx"), "manifest": manifest,
            "golden": golden, "files": sorted(p.name for p in artifact.iterdir())}


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Paths where two JSON-like values differ (at most a few per list)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{path}.{k}: only in {'before' if k in a else 'after'}" for k in sorted(set(a) ^ set(b))]
        for k in sorted(set(a) & set(b)):
            out += differences(a[k], b[k], f"{path}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: {len(a)} items before, {len(b)} after"]
        out = []
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            out += differences(x, y, f"{path}[{i}]")
        return out
    return [] if a == b else [f"{path}: {a!r} -> {b!r}"[:300]]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="git revision before the change")
    parser.add_argument("--after", default="WORKTREE", help="git revision after (default: the working tree)")
    parser.add_argument("--cases", nargs="*", help="labels to run (default: all)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/redesign_equivalence.json")
    args = parser.parse_args()
    cases = [c for c in CASES if not args.cases or c[0] in args.cases]
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="moeforge-equiv-") as tmp:
        sites = {side: install_revision(rev, Path(tmp) / side) for side, rev in (("before", args.before),
                                                                                  ("after", args.after))}
        for label, case_args in cases:
            described = {}
            for side, site in sites.items():
                out = Path(tmp) / side / "artifacts" / label
                out.parent.mkdir(parents=True, exist_ok=True)
                compile_case(site, case_args + (AFTER_ONLY_FLAGS.get(label, []) if side == "after" else []), out)
                described[side] = describe(out)
            diff = differences(described["before"], described["after"])
            after = described["after"]
            graph = after["graph"] if "graph" in after else after["ranks"]["rank0"]["graph"]  # sharded: rank 0's
            results[label] = {"args": case_args, "identical": not diff, "differences": diff[:50],
                              "nodes": len(graph["nodes"]), "initializers": len(graph["initializers"]),
                              "functions": len(graph["functions"])}
            print(f"{label:<32} {'identical' if not diff else f'{len(diff)} difference(s)'} "
                  f"({len(graph['nodes'])} nodes, {len(graph['initializers'])} initializers)", flush=True)
            for line in diff[:10]:
                print("   ", line)
    report = {"before": args.before, "after": args.after, "machine": machine_info(),
              "compared": "model.onnx node for node (ops, names, I/O, attributes), functions, initializer "
                          "hashes; manifest except " + ", ".join(VOLATILE_MANIFEST) + ", pass seconds, engine "
                          + ", ".join(VOLATILE_ENGINE) + "; sha256 of every file but "
                          + ", ".join(NONDETERMINISTIC_FILES) + "; golden files byte for byte",
              "all_identical": all(r["identical"] for r in results.values()), "cases": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"{'all identical' if report['all_identical'] else 'DIFFERENCES'}; wrote {args.out}")
    return 0 if report["all_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
