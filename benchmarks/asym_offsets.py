"""Ways to run int4-asym's block offsets on ONNX Runtime CPU: speed and held-out accuracy of each, side by side.

int4-asym (``--quant int4-asym``) stores min-max blocks W = scale * codes + offset (llama.cpp's Q4_1), which
``quant_lowering`` runs as y = MatMulNBits(x; codes, scale, default zero point 8) + S(x) @ (offset + 8 * scale)
with S(x) [..., K/32] the block sums of x (ReduceSum over a Reshape; artifacts compiled before 2026-12-02: a MatMul
against the [K, K/32] block indicator): three small nodes next to every projection. This script rewrites that
lowering, in memory, into the alternatives and measures each on the same artifact:

* ``lowered``: the artifact as compiled (the reference);
* ``float-zero-points``: one MatMulNBits with float zero points -offset / scale (exact; ORT's slow path);
* ``digits-D`` (D = 1, 2, 3): the offsets folded into the MatMulNBits as extra K blocks, x' = [x, S, .., S] with
  S = x @ E (block sums, padded to 32s) and the offsets coded as D int4 digits (radix expansion, one scale per
  column and block): one node fewer per projection, K grows by 32 * D per 32 blocks;
* ``uint4-zero-points``: ORT's own asymmetric int4 (integer zero points, the offsets rounded to a whole step);
* ``uint4-zero-points+int8-residual``: ORT's native zero points round(-offset / scale) in the MatMulNBits, and the
  residual offsets (|r| <= scale / 2) as int8 codes (one scale per column and 16 blocks) in a second MatMulNBits
  over S(x): the same node count, a quarter of the float offsets' bytes;
* ``uint4-zero-points+residual-digit``: the same zero points, the residual as ONE int4 digit per column and 32 blocks
  in extra K blocks over the block sums (x' = [x, S(x)], one MatMulNBits): one node fewer, not exact;
* ``uint8-zero-points``: 8-bit codes on the Q4_1 grid at 1/17 of a step with integer zero points (native, no
  extra nodes; 2x the code bytes; offsets rounded to 1/34 of a step);
* ``offsets-dropped``: the MatMulNBits alone (numerically wrong: what the offsets cost, for timing only).

Speed: greedy decode of ``--steps`` tokens at batch 1 through ``OrtSession.decode`` (the engine's bound decode
path), alternating rounds, medians. Accuracy: teacher-forced top-1 / KL against transformers fp32 on the GGUF, on
the held-out text of ``heldout_accuracy.py`` (the GPL-3 preamble).

    moeforge compile smollm2-135m -o /work/perf/int4-asym --quant int4-asym
    python benchmarks/asym_offsets.py /work/perf/int4-asym

Writes benchmarks/results/asym_offsets.json (``moeforge.cli.bench.write_result``) and prints a table.

``--mixed`` instead measures held-out accuracy only (asym_offsets_mixed.json) when integer zero points (no extra
nodes) replace the exact offsets on part of the model: on each group of same-shaped projections (one kind per
layer: qkv, o, gate/up, down), and on the first / second half of the projections in graph order.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent))  # heldout_accuracy, beside this script

from genai_compare import default_gguf
from heldout_accuracy import DEFAULT_START, DEFAULT_TEXT, compare, prose, reference_logits
from timer import Rounds, Stopwatch

from moeforge.cli.bench import write_result
from moeforge.core.artifact import load_artifact
from moeforge.passes.quant_lowering import asym_digit_weights
from moeforge.runtime.backends.onnxruntime import OrtSession

RESULTS = Path(__file__).resolve().parent / "results" / "asym_offsets.json"
MIXED_RESULTS = RESULTS.with_name("asym_offsets_mixed.json")
BLOCK = 32
MS = "com.microsoft"


class Lowered:
    """One projection of the lowered graph: MatMulNBits + block sums S + MatMul(S, shifted) + Add, with its
    arrays: codes [N, K/32, 32] uint8 0..15, scale [N, K/32], shifted [N, K/32] (offset + 8 * scale)."""

    def __init__(self, nbits: onnx.NodeProto, sums: list[onnx.NodeProto], correction: onnx.NodeProto,
                 add: onnx.NodeProto, arrays: Callable[[str], np.ndarray]) -> None:
        self.nbits, self.sums, self.correction, self.add = nbits, sums, correction, add
        attributes = {a.name: helper.get_attribute_value(a) for a in nbits.attribute}
        self.k, self.n, self.level = attributes["K"], attributes["N"], attributes["accuracy_level"]
        blocks = self.k // BLOCK
        packed = arrays(nbits.input[1]).reshape(self.n, blocks, BLOCK // 2)
        self.codes = np.empty((self.n, blocks, BLOCK), np.uint8)
        self.codes[..., 0::2], self.codes[..., 1::2] = packed & 15, packed >> 4
        self.packed = packed
        self.scale = arrays(nbits.input[2]).reshape(self.n, blocks).astype(np.float64)
        self.shifted = arrays(correction.input[1]).T.astype(np.float64)

    @property
    def offset(self) -> np.ndarray:
        return self.shifted - 8 * self.scale


def find_projections(model: onnx.ModelProto, base: Path) -> list[Lowered]:
    """Every offset-lowered projection of ``model`` (external data read from ``base``)."""
    initializers = {i.name: i for i in model.graph.initializer}
    producer = {out: node for node in model.graph.node for out in node.output}

    def arrays(name: str) -> np.ndarray:
        return numpy_helper.to_array(initializers[name], base_dir=str(base))

    found = []
    for add in (n for n in model.graph.node if n.op_type == "Add"):
        first, second = (producer.get(i) for i in add.input)
        if not (first and second and first.op_type == "MatMulNBits" and second.op_type == "MatMul"):
            continue
        sums = producer.get(second.input[0])
        view = producer.get(sums.input[0]) if sums is not None and sums.op_type == "ReduceSum" else None
        if sums is not None and sums.op_type == "MatMul" and sums.input[0] == first.input[0]:
            found.append(Lowered(first, [sums], second, add, arrays))
        elif view is not None and view.op_type == "Reshape" and view.input[0] == first.input[0]:
            found.append(Lowered(first, [view, sums], second, add, arrays))
    return found


def pack(codes: np.ndarray) -> np.ndarray:
    """[..., 32] uint8 codes 0..15 -> MatMulNBits' [..., 16] bytes (even element in the low nibble)."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


Rewrite = Callable[[Lowered, str], tuple[list[onnx.NodeProto], list[onnx.TensorProto]]]


def rewrite(model: onnx.ModelProto, projections: list[Lowered], fn: Rewrite) -> onnx.ModelProto:
    """A copy of ``model`` with each projection's four nodes replaced by ``fn``'s nodes (which write the Add's
    output) and its initializers added; initializers nothing reads any more are dropped."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    replaced: dict[str, list[onnx.NodeProto]] = {}
    removed: set[str] = set()
    extra: list[onnx.TensorProto] = []
    for i, p in enumerate(projections):
        nodes, tensors = fn(p, f"asym_offsets/{i}")
        replaced[p.add.output[0]] = nodes
        removed.update(n.output[0] for n in (p.nbits, *p.sums, p.correction))
        extra += tensors
    nodes = []
    for node in out.graph.node:
        if node.output and node.output[0] in removed:
            continue
        nodes.extend(replaced.get(node.output[0], [node]) if node.output else [node])
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    used = {name for node in out.graph.node for name in node.input}
    kept = [i for i in out.graph.initializer if i.name in used]
    del out.graph.initializer[:]
    out.graph.initializer.extend(kept + extra)
    return out


def _nbits(inputs: list[str], output: str, p: Lowered, k: int, bits: int = 4) -> onnx.NodeProto:
    return helper.make_node("MatMulNBits", inputs, [output], domain=MS, K=k, N=p.n, bits=bits, block_size=BLOCK,
                            accuracy_level=p.level)


def float_zero_points(p: Lowered, stem: str) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    zero = (-p.offset / p.scale).astype(np.float32).reshape(-1)
    tensors = [numpy_helper.from_array(zero, stem + ".zp")]
    inputs = [p.nbits.input[0], p.nbits.input[1], p.nbits.input[2], stem + ".zp"]
    return [_nbits(inputs, p.add.output[0], p, p.k)], tensors


def digits(count: int) -> Rewrite:
    def fn(p: Lowered, stem: str) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
        blocks = p.k // BLOCK
        groups = -(-blocks // BLOCK)  # 32-wide blocks of block sums
        residual = np.zeros((p.n, groups * BLOCK))
        residual[:, :blocks] = p.shifted
        residual = residual.reshape(p.n, groups, BLOCK)
        codes, scales = [p.packed], [p.scale.astype(np.float32)]
        for _ in range(count):
            step = np.abs(residual).max(-1) / 7
            step[step == 0] = 1e-30
            digit = np.clip(np.rint(residual / step[..., None]), -7, 7)
            residual = residual - digit * step[..., None]
            codes.append(pack((digit + 8).astype(np.uint8)))
            scales.append(step.astype(np.float32))
        indicator = np.zeros((p.k, groups * BLOCK), np.float32)
        for b in range(blocks):
            indicator[b * BLOCK:(b + 1) * BLOCK, b] = 1
        tensors = [numpy_helper.from_array(np.concatenate(codes, axis=1), stem + ".codes"),
                   numpy_helper.from_array(np.concatenate(scales, axis=1).reshape(-1), stem + ".scale"),
                   numpy_helper.from_array(indicator, stem + ".indicator")]
        x = p.nbits.input[0]
        nodes = [helper.make_node("MatMul", [x, stem + ".indicator"], [stem + ".sums"]),
                 helper.make_node("Concat", [x] + [stem + ".sums"] * count, [stem + ".x"], axis=-1),
                 _nbits([stem + ".x", stem + ".codes", stem + ".scale"], p.add.output[0], p,
                        p.k + count * groups * BLOCK)]
        return nodes, tensors
    return fn


def uint8_zero_points(p: Lowered, stem: str) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    step = p.scale / 17  # 15 * 17 = 255: the 16 Q4_1 levels sit on every 17th 8-bit code
    step[step == 0] = 1e-30
    zero = np.clip(np.rint(-p.offset / step), 0, 255)
    weights = p.scale[..., None] * p.codes + p.offset[..., None]
    codes = np.clip(np.rint(weights / step[..., None] + zero[..., None]), 0, 255).astype(np.uint8)
    tensors = [numpy_helper.from_array(codes, stem + ".codes"),
               numpy_helper.from_array(step.astype(np.float32).reshape(-1), stem + ".scale"),
               numpy_helper.from_array(zero.astype(np.uint8).reshape(-1), stem + ".zp")]
    return [_nbits([p.nbits.input[0], stem + ".codes", stem + ".scale", stem + ".zp"], p.add.output[0], p, p.k,
                   bits=8)], tensors


def uint4_zero_points(p: Lowered, stem: str) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """ORT's native asymmetric int4: the same scale, the zero point -offset / scale rounded to an integer (the
    min-max RTN fit of ORT's quantiser and GenAI's ``is_symmetric=false``): each block moves by < scale / 2."""
    zero = np.clip(np.rint(-p.offset / p.scale), 0, 15).astype(np.uint8)  # [N, K/32]
    weights = p.scale[..., None] * p.codes + p.offset[..., None]
    codes = np.clip(np.rint(weights / p.scale[..., None] + zero[..., None]), 0, 15).astype(np.uint8)
    if zero.shape[1] % 2:  # 4-bit zero points, two per byte, each column padded to whole bytes
        zero = np.pad(zero, ((0, 0), (0, 1)))
    tensors = [numpy_helper.from_array(pack(codes), stem + ".codes"),
               numpy_helper.from_array((zero[:, 0::2] | (zero[:, 1::2] << 4)).reshape(-1), stem + ".zp")]
    return [_nbits([p.nbits.input[0], stem + ".codes", p.nbits.input[2], stem + ".zp"], p.add.output[0], p,
                   p.k)], tensors


def _block_sum_nodes(x: str, stem: str, blocks: int) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """Reshape + ReduceSum writing ``stem``.sums: x [B, S, K]'s sums over its ``blocks`` blocks of 32 (the lowering's
    form, quant_lowering._block_sums)."""
    tensors = [numpy_helper.from_array(np.array([0, 0, blocks, BLOCK], np.int64), stem + ".view_shape"),
               numpy_helper.from_array(np.array([-1], np.int64), stem + ".axis")]
    nodes = [helper.make_node("Reshape", [x, stem + ".view_shape"], [stem + ".view"]),
             helper.make_node("ReduceSum", [stem + ".view", stem + ".axis"], [stem + ".sums"], keepdims=0)]
    return nodes, tensors


def zero_points_residual(p: Lowered, stem: str) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """Native zero points z = round(-offset / scale) plus the residual r = offset + z * scale as int8 codes."""
    blocks, group = p.k // BLOCK, 16  # residual codes: one scale per column and 16 blocks (MatMulNBits' least)
    zero = np.clip(np.rint(-p.offset / p.scale), 0, 15).astype(np.uint8)  # [N, K/32]
    groups = -(-blocks // group)
    residual = np.zeros((p.n, groups * group))
    residual[:, :blocks] = p.offset + zero * p.scale
    residual = residual.reshape(p.n, groups, group)
    step = np.abs(residual).max(-1) / 127
    step[step == 0] = 1e-30
    codes = (np.clip(np.rint(residual / step[..., None]), -127, 127) + 128).astype(np.uint8)
    if zero.shape[1] % 2:
        zero = np.pad(zero, ((0, 0), (0, 1)))
    x = p.nbits.input[0]
    sum_nodes, tensors = _block_sum_nodes(x, stem, blocks)
    tensors += [numpy_helper.from_array((zero[:, 0::2] | (zero[:, 1::2] << 4)).reshape(-1), stem + ".zp"),
                numpy_helper.from_array(codes, stem + ".residual"),
                numpy_helper.from_array(step.astype(np.float32).reshape(-1), stem + ".residual_scale")]
    nodes = [_nbits([x, p.nbits.input[1], p.nbits.input[2], stem + ".zp"], stem + ".main", p, p.k), *sum_nodes,
             helper.make_node("MatMulNBits", [stem + ".sums", stem + ".residual", stem + ".residual_scale"],
                              [stem + ".correction"], domain=MS, K=blocks, N=p.n, bits=8, block_size=group,
                              accuracy_level=p.level),
             helper.make_node("Add", [stem + ".main", stem + ".correction"], [p.add.output[0]])]
    return nodes, tensors


def zero_points_residual_digit(p: Lowered, stem: str) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """Native zero points z = round(-offset / scale), and the residual r = offset + z * scale (< scale / 2) as one
    int4 digit per block in extra K blocks over the block sums: x' = [x, S(x)], one MatMulNBits."""
    # The compiler's arrays (moeforge/passes/quant_lowering.py), from the lowered artifact's codes, scale and offsets.
    codes, scales, zeros = asym_digit_weights(p.codes.reshape(p.n, p.k).T, p.scale.T, p.offset.T, BLOCK, 4)
    x = p.nbits.input[0]
    sum_nodes, tensors = _block_sum_nodes(x, stem, p.k // BLOCK)
    tensors += [numpy_helper.from_array(codes, stem + ".codes"), numpy_helper.from_array(scales, stem + ".scale"),
                numpy_helper.from_array(zeros, stem + ".zp")]
    nodes = [*sum_nodes, helper.make_node("Concat", [x, stem + ".sums"], [stem + ".x"], axis=-1),
             _nbits([stem + ".x", stem + ".codes", stem + ".scale", stem + ".zp"], p.add.output[0], p,
                    p.k + p.k // BLOCK)]
    return nodes, tensors


def offsets_dropped(p: Lowered, stem: str) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    return [_nbits(list(p.nbits.input), p.add.output[0], p, p.k)], []


VARIANTS: dict[str, Rewrite | None] = {
    "lowered": None, "float-zero-points": float_zero_points, "digits-1": digits(1), "digits-2": digits(2),
    "digits-3": digits(3), "uint4-zero-points": uint4_zero_points,
    "uint4-zero-points+int8-residual": zero_points_residual,
    "uint4-zero-points+residual-digit": zero_points_residual_digit, "uint8-zero-points": uint8_zero_points,
    "offsets-dropped": offsets_dropped}


def mixed(projections: list[Lowered]) -> dict[str, Callable[[Lowered], bool]]:
    """name -> which projections take integer zero points (the rest keep the exact lowering)."""
    shapes = sorted({(p.k, p.n) for p in projections})
    half = len(projections) // 2
    index = {id(p): i for i, p in enumerate(projections)}
    out: dict[str, Callable[[Lowered], bool]] = {
        f"zero points on K{k}xN{n}": (lambda shape: lambda p: (p.k, p.n) == shape)((k, n)) for k, n in shapes}
    out["zero points on the first half"] = lambda p: index[id(p)] < half
    out["zero points on the second half"] = lambda p: index[id(p)] >= half
    return out


def mixed_accuracy(base: onnx.ModelProto, projections: list[Lowered], artifact_dir: Path,
                   results: Path, tokens: int) -> None:
    artifact = load_artifact(artifact_dir)
    ids, reference = reference_logits(default_gguf(), prose(DEFAULT_TEXT, DEFAULT_START), tokens)
    rows: dict[str, dict[str, Any]] = {}
    print("| integer zero points on | projections | top-1 | mean KL |\n|---|---|---|---|")
    for name, rounded in mixed(projections).items():
        def fn(p: Lowered, stem: str, rounded: Callable[[Lowered], bool] = rounded) -> tuple[
                list[onnx.NodeProto], list[onnx.TensorProto]]:
            return uint4_zero_points(p, stem) if rounded(p) else ([p.nbits, *p.sums, p.correction, p.add], [])
        session = OrtSession(artifact.model_path, kv_cache=artifact.manifest.kv_cache,
                             graph=rewrite(base, projections, fn))
        session.allocate(1, len(ids) + 1)
        logits = session.forward(np.array([ids]), np.arange(len(ids))[None], np.ones((1, len(ids)), np.int64))[0]
        rows[name] = {"projections": sum(map(rounded, projections)), **compare(reference, logits, ids)}
        print(f"| {name.removeprefix('zero points on ')} | {rows[name]['projections']} | "
              f"{rows[name]['top1_agreement']:.3f} | {rows[name]['mean_kl']:.3g} |", flush=True)
    write_result(results, "asym_offsets_mixed", {
        "artifact": str(artifact_dir), "projections": len(projections), "text": str(DEFAULT_TEXT),
        "tokens": len(ids), "reference": "transformers fp32 on the GGUF", "rows": rows})
    print(f"wrote {results}")


def decode_rate(session: OrtSession, steps: int) -> float:
    """Greedy decode tokens/s at batch 1 from position 0 (8 warm-up steps first)."""
    session.allocate(1, steps + 16)
    token, position = 1, 0
    watch = Stopwatch()
    for i in range(steps + 8):
        if i == 8:
            watch.restart()
        logits = session.decode(0, 1, [token], [position], [position + 1])
        token, position = int(logits[0, -1].argmax()), position + 1
    return steps / watch.elapsed()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact", type=Path, help="an int4-asym artifact (contiguous cache)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=512, help="held-out tokens for the accuracy")
    parser.add_argument("--slow-steps", type=int, default=16, help="decode steps for float-zero-points (slow)")
    parser.add_argument("--results", type=Path, default=None)
    parser.add_argument("--mixed", action="store_true", help="held-out accuracy with integer zero points on parts")
    args = parser.parse_args()

    artifact = load_artifact(args.artifact)
    kv = artifact.manifest.kv_cache
    base = onnx.load(str(artifact.model_path), load_external_data=False)
    projections = find_projections(base, artifact.model_path.parent)
    if not projections:
        raise SystemExit(f"{args.artifact}: no offset-lowered projections (compile it with --quant int4-asym)")
    if args.mixed:
        mixed_accuracy(base, projections, args.artifact, args.results or MIXED_RESULTS, args.tokens)
        return
    args.results = args.results or RESULTS
    sessions: dict[str, OrtSession] = {}
    node_counts: dict[str, int] = {}
    for name in args.variants:
        fn = VARIANTS[name]
        graph = base if fn is None else rewrite(base, projections, fn)
        sessions[name] = OrtSession(artifact.model_path, kv_cache=kv, graph=graph, huge_pages=True)
        node_counts[name] = len(graph.graph.node)
        print(f"built {name}: {node_counts[name]} nodes", flush=True)

    ids, reference = reference_logits(default_gguf(), prose(DEFAULT_TEXT, DEFAULT_START), args.tokens)
    rows: dict[str, dict[str, Any]] = {}
    for name, session in sessions.items():
        session.allocate(1, len(ids) + 1)
        logits = session.forward(np.array([ids]), np.arange(len(ids))[None], np.ones((1, len(ids)), np.int64))[0]
        rows[name] = {"nodes": node_counts[name], **compare(reference, logits, ids), "decode_tokens_per_s": []}
    for _, order in Rounds(args.rounds, reverse=True).orders(sessions):
        for name in order:
            steps = args.slow_steps if name == "float-zero-points" else args.steps
            rows[name]["decode_tokens_per_s"].append(round(decode_rate(sessions[name], steps), 1))
    base_rate = statistics.median(rows["lowered"]["decode_tokens_per_s"]) if "lowered" in rows else None
    print("| variant | nodes | decode b1 tok/s (median) | vs lowered | top-1 | mean KL |\n|---|---|---|---|---|---|")
    for name, row in rows.items():
        row["median_tokens_per_s"] = statistics.median(row["decode_tokens_per_s"])
        row["vs_lowered"] = round(row["median_tokens_per_s"] / base_rate, 3) if base_rate else None
        print(f"| {name} | {row['nodes']} | {row['median_tokens_per_s']:.1f} | {row['vs_lowered']} | "
              f"{row['top1_agreement']:.3f} | {row['mean_kl']:.3g} |")
    write_result(args.results, "asym_offsets", {
        "artifact": str(args.artifact), "projections": len(projections), "steps": args.steps,
        "rounds": args.rounds, "text": str(DEFAULT_TEXT), "tokens": len(ids),
        "reference": "transformers fp32 on the GGUF", "variants": rows})
    print(f"wrote {args.results}")


if __name__ == "__main__":
    main()
