"""The engine section of ``moeforge inspect`` for TensorRT artifacts.

With a GPU, the plan is deserialised and TensorRT's EngineInspector lists the engine's layers (fused
kernels included). Without one (TensorRT-RTX builds on CPU, but a plan deserialises only on a GPU),
the section lists the layers of the network parsed from model.onnx, and says why.
"""

from __future__ import annotations

import json

from moeforge.compile.trt.engine_build import ParsedNetwork
from moeforge.core.artifact import Artifact
from moeforge.core.errors import MoeforgeError
from moeforge.runtime.backends.trt_adapter import load_tensorrt, local_sm


def _fmt_shape(shape: list[int]) -> str:
    return "[" + ", ".join("?" if d == -1 else str(d) for d in shape) + "]"


def engine_lines(artifact: Artifact) -> list[str]:
    """Lines describing ``artifact.manifest.engine`` and its layers (none for an artifact without an engine)."""
    engine = artifact.manifest.engine
    if engine is None:
        return []
    lines = ["", f"engine     {engine['plan_file']}: {engine['impl']} {engine['tensorrt_version']}, "
                 f"{engine['compute_capability']}, {engine['plan_bytes'] / 2**20:.1f} MiB, "
                 f"built in {engine['build_seconds']:.1f} s"]
    for profile in engine.get("profiles", []):
        lines.append(f"  profile {profile['name']:<8} batch {profile['batch']}  tokens {profile['tokens']}")
    shown = ", ".join(f"{t['name']} {t['dtype']} {_fmt_shape(t['shape'])}" for t in engine["inputs"][:3])
    lines.append("  engine inputs  " + shown + (" ..." if len(engine["inputs"]) > 3 else ""))
    layers, why = engine_layers(artifact)
    lines.append(f"layers     {why}")
    counts: dict[str, int] = {}
    for _, kind in layers:
        counts[kind] = counts.get(kind, 0) + 1
    for kind, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        lines.append(f"  {kind:<24} {n}")
    return lines


def engine_layers(artifact: Artifact) -> tuple[list[tuple[str, str]], str]:
    """(name, type) per layer and where they come from (the engine, or the parsed network and why)."""
    engine = artifact.manifest.engine
    if engine is None:
        return [], "not shown: the artifact has no engine"
    try:
        trt = load_tensorrt(engine["impl"])
    except MoeforgeError as exc:
        return [], f"not shown: {exc}"
    plan = artifact.root / engine["plan_file"]
    reason = ""
    try:
        if local_sm() is None:
            reason = "no CUDA GPU visible, and a plan deserialises only on a GPU"
        else:
            runtime = trt.module.Runtime(trt.logger())
            cuda_engine = runtime.deserialize_cuda_engine(plan.read_bytes())
            if cuda_engine is None:
                reason = "the plan did not deserialise on this GPU"
            else:
                inspector = cuda_engine.create_engine_inspector()
                info = json.loads(inspector.get_engine_information(trt.module.LayerInformationFormat.JSON))
                rows = [(str(layer.get("Name", layer)) if isinstance(layer, dict) else str(layer),
                         str(layer.get("LayerType", "?")) if isinstance(layer, dict) else "?")
                        for layer in info.get("Layers", [])]
                return rows, f"{len(rows)} engine layers (EngineInspector)"
    except Exception as exc:  # inspection must not fail the rest of inspect
        reason = f"engine inspection failed: {exc}"
    parsed = ParsedNetwork(trt, artifact.model_path)
    rows = parsed.layers()
    return rows, f"{len(rows)} network layers parsed from {artifact.model_path.name} ({reason})"
