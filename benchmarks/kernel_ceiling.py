"""How fast ONNX Runtime's own kernels read each kind of weight an artifact's decode step reads, each kind alone:
the floor a step made of those kernels cannot go below, next to the memory roofline.

The memory roofline (moeforge/runtime/roofline.py) divides a step's bytes by a STREAM-like numpy probe's bandwidth.
A step is a sequence of ONNX Runtime kernels, and a kernel reads its weight at its own rate, which on a 2-core AVX2
machine is well below the probe's. This benchmark times the kernels alone, on the artifact's own shapes, with fresh
random weights (so no cache holds them) and nothing else in the graph:

* ``routed experts``: the MatMulNBits pair (fc1, fc2) of one routed expert (sparse_experts' ``If`` branches),
  repeated with distinct weights to at least 64 MiB, at the rows one expert gets;
* ``lm head``: the matmul that makes the logits (the argmax head's greedy branch), at the batch's rows;
* ``other MatMulNBits``: every other top-level MatMulNBits of the step, one each (attention, shared experts, the
  dense first layer), at the batch's rows;
* ``float MatMul``: every MatMul whose B is a float constant (MLA's absorbed matrices, the block offsets' shares).

``floor_step_ms`` = the routed experts' bytes of a measured step at their rate + the other kinds' times: a step with
no dispatch, no attention, no norms and no activations between kernels. The difference to the measured step is what
the graph adds around the kernels; the difference to the roofline is the kernels' own speed.

With a run's bandwidth (``RunBandwidth``: probed before and after the kernels, as ``bench --roofline`` probes around
its steps) each kind also gets its ``fraction`` of that bandwidth by the roofline's own rule
(moeforge/runtime/roofline_fraction.py): never above 1; a rate above the bandwidth re-probes once and, if it
persists, gives no fraction but the reason (a kind whose weights fit in the last-level cache reads them from there).

    python benchmarks/kernel_ceiling.py build/moe_speed/art-int8 --rows 1 8
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from moeforge.core.artifact import MODEL_FILE
from moeforge.core.run_bandwidth import RunBandwidth
from moeforge.passes.sparse_experts import IF_PREFIX
from moeforge.runtime.roofline import lm_head_node
from moeforge.runtime.roofline_fraction import roofline_fraction

MIN_EXPERT_BYTES = 64 * 2**20


def _nbits(node: onnx.NodeProto) -> dict[str, int]:
    return {a.name: a.i for a in node.attribute if a.name in ("K", "N", "bits", "block_size", "accuracy_level")}


def _walk(graph: onnx.GraphProto, in_expert: bool = False) -> list[tuple[onnx.NodeProto, bool]]:
    """Every node with whether it sits in a sparse_experts branch."""
    out: list[tuple[onnx.NodeProto, bool]] = []
    for node in graph.node:
        out.append((node, in_expert))
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH and attribute.name != "else_branch":
                out += _walk(attribute.g, in_expert or node.name.startswith(IF_PREFIX))
    return out


def kernel_shapes(artifact: str | Path) -> dict[str, list[dict[str, Any]]]:
    """The step's weight-reading matmuls by kind: MatMulNBits attributes, or a float MatMul's weight dims."""
    model = onnx.load(str(Path(artifact) / MODEL_FILE), load_external_data=False)
    dims = {t.name: list(t.dims) for t in model.graph.initializer if t.data_type == TensorProto.FLOAT}
    expert: dict[tuple[int, ...], dict[str, int]] = {}
    top: list[tuple[str, dict[str, Any]]] = []
    floats: list[tuple[str, dict[str, Any]]] = []
    found = lm_head_node(model.graph)  # the head's matmul, or the argmax head's If (its greedy branch's matmuls)
    head = set() if found is None else {found.name} if found.op_type != "If" else {
        n.name for a in found.attribute if a.name == "then_branch" for n in a.g.node}
    for node, in_expert in _walk(model.graph):
        if node.op_type == "MatMulNBits":
            attrs = _nbits(node)
            if in_expert:
                expert.setdefault(tuple(sorted(attrs.items())), attrs)
            else:
                top.append((node.name, attrs))
        elif node.op_type == "MatMul" and len(node.input) > 1 and node.input[1] in dims and not in_expert:
            weight = dims[node.input[1]]
            if len(weight) >= 2 and int(np.prod(weight)) >= 4096:
                floats.append((node.name, {"weight": weight}))
    return {"routed expert": list(expert.values()), "lm head": [a for name, a in top if name in head],
            "other MatMulNBits": [a for name, a in top if name not in head],
            "float MatMul": [w for name, w in floats if name not in head]}


def _weight_bytes(shape: dict[str, Any]) -> int:
    """Bytes of one matmul's weight as ``_graph`` makes it: float32 B, or MatMulNBits codes + float32 scales."""
    if "weight" in shape:
        return 4 * int(np.prod(shape["weight"]))
    blocks = shape["N"] * (shape["K"] // shape["block_size"])
    return blocks * (shape["block_size"] * shape["bits"] // 8) + 4 * blocks


def _graph(shapes: list[dict[str, Any]], rows: int, copies: int, seed: int = 0) -> tuple[onnx.ModelProto, int]:
    """Independent matmuls of ``shapes`` x ``copies``, each with its own random weight and input; their bytes."""
    rng = np.random.default_rng(seed)
    nodes, inits, inputs, outputs = [], [], {}, []
    for copy in range(copies):
        for i, shape in enumerate(shapes):
            tag = f"{copy}_{i}"
            if "weight" in shape:  # float MatMul: A [..., rows, K] against B [..., K, N]
                weight = shape["weight"]
                b = (rng.standard_normal(weight) * 0.02).astype(np.float32)
                a_shape = [*weight[:-2], rows, weight[-2]]
                inits.append(onnx.numpy_helper.from_array(b, f"B{tag}"))
                node = helper.make_node("MatMul", [f"x{'_'.join(map(str, a_shape))}", f"B{tag}"], [f"y{tag}"])
            else:
                k, n, bits, block = shape["K"], shape["N"], shape["bits"], shape["block_size"]
                a_shape = [rows, k]
                b = rng.integers(0, 256, (n, k // block, block * bits // 8), dtype=np.uint8)
                s = (rng.random((n, k // block), dtype=np.float32) * 0.01).astype(np.float32)
                inits += [onnx.numpy_helper.from_array(b, f"B{tag}"), onnx.numpy_helper.from_array(s, f"S{tag}")]
                node = helper.make_node("MatMulNBits", [f"x{rows}_{k}", f"B{tag}", f"S{tag}"], [f"y{tag}"],
                                        domain="com.microsoft", K=k, N=n, bits=bits, block_size=block,
                                        accuracy_level=shape.get("accuracy_level", 4))
            inputs[node.input[0]] = a_shape
            nodes.append(node)
            outputs.append(f"y{tag}")
    total = copies * sum(_weight_bytes(shape) for shape in shapes)
    graph = helper.make_graph(
        nodes, "kernels", [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs.items()],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft",
                                                                                                     1)])
    return model, total


def time_kernels(shapes: list[dict[str, Any]], rows: int, threads: int, copies: int = 1,
                 repeats: int = 15) -> dict[str, Any]:
    """Median time of one run of ``shapes`` x ``copies`` at ``rows`` rows (``seconds``, unrounded), its bytes and
    read rate."""
    model, total = _graph(shapes, rows, copies)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    feeds = {i.name: rng.standard_normal([int(d.dim_value) for d in i.type.tensor_type.shape.dim]).astype(np.float32)
             for i in model.graph.input}
    for _ in range(3):
        session.run(None, feeds)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        session.run(None, feeds)
        times.append(time.perf_counter() - start)
    seconds = float(np.median(times))
    return {"rows": rows, "kernels": len(model.graph.node), "bytes": total, "mib": round(total / 2**20, 1),
            "seconds": seconds, "ms": round(seconds * 1e3, 3), "gb_s": round(total / seconds / 1e9, 2)}


def kernel_ceiling(artifact: str | Path, rows: int, threads: int, expert_rows: int = 1,
                   active_expert_bytes: float | None = None, bandwidth: RunBandwidth | None = None) -> dict[str, Any]:
    """Each kind's kernel rate at ``rows`` rows (experts at ``expert_rows``), and with ``active_expert_bytes`` (a
    measured step's routed bytes) the floor of a step made of these kernels alone. With ``bandwidth`` (the run's:
    probed before and after the kernels here) each kind's ``fraction`` of it, by ``roofline_fraction``'s rule, and the
    probes under ``bandwidth``."""
    out: dict[str, Any] = {"rows": rows, "threads": threads}
    if bandwidth is not None:
        bandwidth.sample("before kernels")
    for kind, shapes in kernel_shapes(artifact).items():
        if not shapes:
            continue
        if kind == "routed expert":
            one = sum(_weight_bytes(shape) for shape in shapes)  # one routed expert's fc1 + fc2
            out[kind] = time_kernels(shapes, expert_rows, threads, copies=max(1, -(-MIN_EXPERT_BYTES // one)))
        else:
            out[kind] = time_kernels(shapes, rows, threads)
    kinds = [k for k, v in out.items() if isinstance(v, dict)]
    if bandwidth is not None:
        bandwidth.sample("after kernels")
        probes = len(bandwidth.probes)
        for kind in kinds:
            out[kind].update(roofline_fraction(out[kind]["bytes"], out[kind]["seconds"], bandwidth).to_dict())
        if len(bandwidth.probes) > probes:  # a re-probe raised the bandwidth: judge the kinds judged before it again
            for kind in kinds:
                if out[kind]["fraction_reason"] is None:
                    out[kind].update(roofline_fraction(out[kind]["bytes"], out[kind]["seconds"], bandwidth).to_dict())
        out["bandwidth"] = bandwidth.to_dict()
    if active_expert_bytes is not None and "routed expert" in out:
        experts_ms = active_expert_bytes / (out["routed expert"]["gb_s"] * 1e9) * 1e3
        others = sum(out[k]["ms"] for k in kinds if k != "routed expert")
        out["floor_step_ms"] = round(experts_ms + others, 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-bandwidth", action="store_true",
                        help="time the kernels only: no bandwidth probes, no fractions")
    args = parser.parse_args()
    for rows in args.rows:
        bandwidth = None if args.no_bandwidth else RunBandwidth.probed(args.threads)
        print(json.dumps(kernel_ceiling(args.artifact, rows, args.threads, bandwidth=bandwidth), indent=1))


if __name__ == "__main__":
    main()
