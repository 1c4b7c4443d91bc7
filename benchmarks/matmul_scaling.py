"""How ONNX Runtime's CPU matmul kernels grow with the rows they multiply: the ceiling on batched decode.

A decode step at batch B multiplies B rows by every weight. Weight-bound kernels cost nearly the same for 1 row as
for 8, so batch 8 decodes close to 8x the tokens of batch 1; compute-bound kernels cost 8x, and batching gains
nothing. Issue 14 asks for batch 8 >= 4x batch 1 at int4. This benchmark measures, kernel by kernel, what that can
reach on this machine, outside any model:

* ``MatMulNBits int4``: 4-bit blocks of 32, ``accuracy_level`` 4 (int8 activations). moeforge's int4 lowering and
  ONNX Runtime GenAI's int4 both run it.
* ``int4 + block offsets``: the same kernel plus moeforge int4-asym's exact block offsets (``quant_lowering``'s
  form: y = MatMulNBits(x) + ReduceSum(Reshape(x)) @ offsets, fp32 offsets [K/32, N]).
* ``MatMulNBits int4, accuracy 0``: fp32 compute.
* ``MatMulNBits int8``: 8-bit blocks of 32, accuracy 4 (moeforge's 8-bit LM head).
* ``DynamicQuantizeMatMul int8``: per-channel int8 weights, activations quantised per tensor at run time.
* ``MatMul fp32``.

The shapes are a model's projections (default: SmolLM2-135M's fused QKV, O, fused gate/up and down), ``--copies``
of each with distinct weights (default 30, one per layer), so that the weights stream from memory every run as in
a decode step, not from cache. One graph per kernel holds every copy; each run multiplies ``M`` rows by all of
them, outputs bound to preallocated buffers. Every graph's output is checked against NumPy's product of the same
dequantised weights before it is timed. Kernels run in alternating rounds; the report gives the median microseconds
per layer (one copy of each shape) and each kernel's time at 8 rows over its time at 1: batch 8 can decode at most
8 / that ratio times batch 1's tokens with that kernel (less, since attention and the LM head grow too).

Run (from the repository root)::

    python benchmarks/matmul_scaling.py

It prints a markdown table and writes benchmarks/results/matmul_scaling.json with the machine described.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from peers import usable_cores
from timer import Rounds, repeat

from moeforge.cli.bench import write_result
from moeforge.core import ort_session
from moeforge.passes.quant_math import pack_nbits

RESULTS = Path(__file__).resolve().parent / "results" / "matmul_scaling.json"
SMOLLM2_SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576))  # (K, N): QKV, O, gate/up, down
BLOCK = 32
MS = "com.microsoft"


@dataclass
class Weight:
    """One projection's weights in a kernel's form: the ONNX nodes computing ``output`` from ``x`` and their
    initializers, and the fp32 matrix [K, N] they stand for (the reference)."""

    nodes: list[onnx.NodeProto]
    tensors: list[onnx.TensorProto]
    dense: np.ndarray


Builder = Callable[[np.random.Generator, str, str, str, int, int], Weight]


def _blocks(rng: np.random.Generator, k: int, n: int, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Signed codes [N, K] and scales [N, K/32] of a random block-quantised weight (scales ~ 1 / sqrt(K))."""
    half = 1 << (bits - 1)
    codes = rng.integers(-half, half, (n, k)).astype(np.int16)
    scales = ((rng.random((n, k // BLOCK)) + 0.5) / (half * np.sqrt(k))).astype(np.float32)
    return codes, scales


def _nbits(bits: int, level: int) -> Builder:
    def build(rng: np.random.Generator, x: str, output: str, stem: str, k: int, n: int) -> Weight:
        codes, scales = _blocks(rng, k, n, bits)
        node = helper.make_node("MatMulNBits", [x, stem + ".b", stem + ".s"], [output], domain=MS, K=k, N=n,
                                bits=bits, block_size=BLOCK, accuracy_level=level)
        tensors = [numpy_helper.from_array(pack_nbits(codes, bits, BLOCK), stem + ".b"),
                   numpy_helper.from_array(scales.reshape(-1), stem + ".s")]
        dense = (codes.reshape(n, k // BLOCK, BLOCK) * scales[..., None]).reshape(n, k).T
        return Weight([node], tensors, dense)
    return build


def _nbits_offsets(rng: np.random.Generator, x: str, output: str, stem: str, k: int, n: int) -> Weight:
    """int4 plus fp32 block offsets, as moeforge/passes/quant_lowering.py lowers int4-asym."""
    main = _nbits(4, 4)(rng, x, stem + ".main", stem, k, n)
    offsets = (rng.standard_normal((k // BLOCK, n)) / (8 * np.sqrt(k))).astype(np.float32)  # [K/32, N]
    nodes = [*main.nodes,
             helper.make_node("Reshape", [x, stem + ".view_shape"], [stem + ".view"]),
             helper.make_node("ReduceSum", [stem + ".view", stem + ".axis"], [stem + ".sums"], keepdims=0),
             helper.make_node("MatMul", [stem + ".sums", stem + ".offsets"], [stem + ".correction"]),
             helper.make_node("Add", [stem + ".main", stem + ".correction"], [output])]
    tensors = [*main.tensors, numpy_helper.from_array(np.array([0, k // BLOCK, BLOCK], np.int64), stem + ".view_shape"),
               numpy_helper.from_array(np.array([-1], np.int64), stem + ".axis"),
               numpy_helper.from_array(offsets, stem + ".offsets")]
    return Weight(nodes, tensors, main.dense + np.repeat(offsets, BLOCK, axis=0))


def _dynamic_int8(rng: np.random.Generator, x: str, output: str, stem: str, k: int, n: int) -> Weight:
    # Codes within +-63: on CPUs without VNNI (AVX2 only, e.g. this project's AMD EPYC VMs) ONNX Runtime's U8S8 kernel
    # adds pairs of u8 x s8 products in int16 (vpmaddubsw), which saturates beyond 255 * 63 * 2; with full-range codes
    # its output is ~26% off there and exact on VNNI CPUs. The kernel's speed does not depend on the codes' range.
    codes = rng.integers(-63, 64, (k, n)).astype(np.int8)
    scales = ((rng.random(n) + 0.5) / (63 * np.sqrt(k))).astype(np.float32)
    node = helper.make_node("DynamicQuantizeMatMul", [x, stem + ".b", stem + ".s"], [output], domain=MS)
    tensors = [numpy_helper.from_array(codes, stem + ".b"), numpy_helper.from_array(scales, stem + ".s")]
    return Weight([node], tensors, codes.astype(np.float32) * scales)


def _fp32(rng: np.random.Generator, x: str, output: str, stem: str, k: int, n: int) -> Weight:
    dense = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
    return Weight([helper.make_node("MatMul", [x, stem + ".w"], [output])],
                  [numpy_helper.from_array(dense, stem + ".w")], dense)


KERNELS: dict[str, Builder] = {
    "MatMulNBits int4": _nbits(4, 4),
    "int4 + block offsets": _nbits_offsets,
    "MatMulNBits int4, accuracy 0": _nbits(4, 0),
    "MatMulNBits int8": _nbits(8, 4),
    "DynamicQuantizeMatMul int8": _dynamic_int8,
    "MatMul fp32": _fp32,
}


@dataclass
class KernelGraph:
    """One kernel's graph: ``copies`` projections of every shape, each reading ``x<K>`` [M, K] and writing its own
    output; ``references`` the fp32 weight per output."""

    model: onnx.ModelProto
    references: dict[str, np.ndarray]
    weight_mb: float


def build_graph(kernel: str, shapes: tuple[tuple[int, int], ...], copies: int, seed: int = 0) -> KernelGraph:
    """The graph of ``kernel`` over ``copies`` distinct weights of each (K, N) in ``shapes``."""
    rng = np.random.default_rng(seed)
    nodes: list[onnx.NodeProto] = []
    tensors: list[onnx.TensorProto] = []
    references: dict[str, np.ndarray] = {}
    for copy in range(copies):
        for index, (k, n) in enumerate(shapes):
            stem = f"c{copy}_p{index}"
            weight = KERNELS[kernel](rng, f"x{k}", stem + ".y", stem, k, n)
            nodes += weight.nodes
            tensors += weight.tensors
            references[stem + ".y"] = weight.dense
    inputs = [helper.make_tensor_value_info(f"x{k}", TensorProto.FLOAT, ["M", k])
              for k in sorted({k for k, _ in shapes})]
    outputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["M", ref.shape[1]])
               for name, ref in references.items()]
    graph = helper.make_graph(nodes, kernel, inputs, outputs, tensors)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(MS, 1)])
    weight_mb = sum(t.ByteSize() for t in tensors) / 1e6
    return KernelGraph(model, references, round(weight_mb, 2))


class Bound:
    """A session over a kernel graph with ``rows`` rows bound in and every output bound to a preallocated buffer."""

    def __init__(self, graph: KernelGraph, session: ort.InferenceSession, rows: int, seed: int = 1) -> None:
        rng = np.random.default_rng(seed)
        self.session, self.binding = session, session.io_binding()
        self.inputs = {i.name: rng.standard_normal((rows, int(i.shape[1]))).astype(np.float32)
                       for i in session.get_inputs()}
        self.outputs = {name: np.zeros((rows, ref.shape[1]), np.float32) for name, ref in graph.references.items()}
        for name, value in self.inputs.items():
            self.binding.bind_cpu_input(name, value)
        for name, buffer in self.outputs.items():
            self.binding.bind_output(name, "cpu", 0, np.float32, list(buffer.shape), buffer.ctypes.data)

    def worst_error(self, references: dict[str, np.ndarray]) -> float:
        """Run once; the largest |output - x @ reference| over every output, relative to that output's largest
        |expected| value."""
        self.session.run_with_iobinding(self.binding)
        worst = 0.0
        for name, reference in references.items():
            expected = self.inputs[f"x{reference.shape[0]}"].astype(np.float64) @ reference
            worst = max(worst, float(np.abs(self.outputs[name] - expected).max() / np.abs(expected).max()))
        return worst

    def time(self, runs: int) -> float:
        """Median microseconds of ``runs`` runs after 3 unmeasured ones."""
        return 1e6 * repeat(partial(self.session.run_with_iobinding, self.binding), runs, warmup=3).median()


def make_session(model: onnx.ModelProto, threads: int) -> ort.InferenceSession:
    """A CPU session of the in-memory kernel graph with ``threads`` intra-op threads."""
    return ort_session.make_session(None, graph=model, threads=threads, providers=["CPUExecutionProvider"])


# Largest relative error accepted before timing: int8 activations (accuracy 4, DynamicQuantizeMatMul) are ~1e-2 off.
TOLERANCE = {"MatMulNBits int4, accuracy 0": 1e-4, "MatMul fp32": 1e-4}
DEFAULT_TOLERANCE = 5e-2


def parse_shapes(text: str) -> tuple[tuple[int, int], ...]:
    """``"576x960,1536x576"`` -> ((576, 960), (1536, 576)); K must be a multiple of 32."""
    shapes = []
    for part in text.split(","):
        k, _, n = part.strip().partition("x")
        if not (k.isdigit() and n.isdigit()) or int(k) % BLOCK or int(n) < 1:
            raise SystemExit(f"--shapes: {part!r} is not KxN with K a multiple of {BLOCK} (e.g. 576x960)")
        shapes.append((int(k), int(n)))
    return tuple(shapes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", type=parse_shapes, default=SMOLLM2_SHAPES,
                        help="projection shapes KxN, comma-separated (default: SmolLM2-135M's)")
    parser.add_argument("--copies", type=int, default=30, help="distinct weights per shape (default: %(default)s)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=list(KERNELS))
    parser.add_argument("--runs", type=int, default=50, help="timed runs per session per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=usable_cores())
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    bound: dict[tuple[str, int], Bound] = {}
    graphs = {}
    for kernel in args.kernels:
        graphs[kernel] = build_graph(kernel, args.shapes, args.copies)
        session = make_session(graphs[kernel].model, args.threads)
        for rows in args.rows:
            bound[kernel, rows] = Bound(graphs[kernel], session, rows)
            error = bound[kernel, rows].worst_error(graphs[kernel].references)
            if error > TOLERANCE.get(kernel, DEFAULT_TOLERANCE):
                raise SystemExit(f"{kernel} at {rows} rows is {error:.2e} off NumPy's product: not timing it")
    rounds = Rounds(args.rounds, stride=max(1, len(bound) // args.rounds))
    times = rounds.run(bound, lambda b: b.time(args.runs) / args.copies,
                       after_round=lambda index, _: print(f"round {index + 1}/{args.rounds}", flush=True))
    rows_out: dict[str, Any] = {}
    for kernel in args.kernels:
        per_rows = {str(r): round(statistics.median(times[kernel, r]), 2) for r in args.rows}
        row: dict[str, Any] = {"us_per_layer": per_rows, "weight_mb": graphs[kernel].weight_mb,
                               "us_rounds": {str(r): [round(t, 2) for t in times[kernel, r]] for r in args.rows}}
        if "1" in per_rows and "8" in per_rows:
            row["m8_over_m1"] = round(per_rows["8"] / per_rows["1"], 2)
        rows_out[kernel] = row
    table = markdown(rows_out, args.rows)
    print(table)
    result = {"shapes": [list(s) for s in args.shapes], "copies": args.copies, "rows": args.rows,
              "runs": args.runs, "rounds": args.rounds, "threads": args.threads, "kernels": rows_out,
              "markdown": table}
    print(f"wrote {write_result(args.results, 'matmul_scaling', result)}")


def markdown(kernels: dict[str, Any], rows: list[int]) -> str:
    """Kernels down, row counts across (us per layer), then 8 rows over 1 and the weight MB of all copies."""
    lines = ["| kernel | " + " | ".join(f"M={r} us" for r in rows) + " | M=8 / M=1 | weights MB |",
             "|---" * (len(rows) + 3) + "|"]
    for kernel, row in kernels.items():
        ratio = row.get("m8_over_m1")
        lines.append(f"| {kernel} | " + " | ".join(f"{row['us_per_layer'][str(r)]:.1f}" for r in rows)
                     + f" | {'-' if ratio is None else f'{ratio:.2f}'} | {row['weight_mb']:.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
