"""The memory roofline of a decode step: the bytes it must read, and how close a measured step comes to reading them
at this machine's bandwidth (``moeforge bench --roofline``).

A decode step of B sequences reads, at least:
- every weight no routing can skip, once: attention, norms, dense MLPs, shared experts, the router and the LM head
  (with the certified argmax head, moeforge/passes/argmax_head.py, greedy steps read its int8 draft and the float
  rows of its candidates instead of the float head);
- one embedding row per token (a Gather);
- per MoE layer, the experts the step's tokens were routed to: the union over the batch, measured from the graph's
  ``expert_hits`` output (moeforge/passes/expert_load.py), times one expert's bytes (its fc1/fc2/fc3 weights,
  scales and zero points; ``com.microsoft.MoE``/``QMoE`` or an unlowered ``moeforge.MoEExperts``);
- the KV cache of every sequence up to its position (``bytes_per_token`` of the manifest's KV spec per token).

The roofline step time is those bytes over the read bandwidth measured in the same run (moeforge/core/run_bandwidth.py:
probes before and after the timed steps, or the cache's number as a fallback); the achieved fraction is roofline time /
measured step time, given only when it is at most 1 (moeforge/runtime/roofline_fraction.py: above 1 the run re-probes
once, and if it persists reports no fraction but which input is likely wrong). Compute, dispatch and activations are
what the rest of the step is.

A sharded artifact's ranks (tp / ep) run a step at once on one machine (``ranks_roofline``): each reads its own
graph's weights (a replicated weight once per rank, a tp-split one in halves), the union of its own experts the
step's tokens were routed to, and its share of the KV cache. The step's bytes are the ranks' sum, read through one
machine's memory: the sum over the bandwidth probed with all the ranks' threads.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper

from moeforge.core.bandwidth import Bandwidth
from moeforge.core.run_bandwidth import RunBandwidth, describe_bandwidth
from moeforge.passes.sparse_experts import IF_PREFIX as SPARSE_IF_PREFIX
from moeforge.runtime.roofline_fraction import RooflineFraction, roofline_fraction

MS_DOMAIN = "com.microsoft"
_MOE_EXPERT_INPUTS = {(MS_DOMAIN, "MoE"): 2, (MS_DOMAIN, "QMoE"): 2, ("moeforge", "MoEExperts"): 3}
_ARGMAX_IF = "argmax_head/If"
_HEAD_OPS = {"MatMul", "Gemm", "MatMulNBits", "If"}


@dataclass(frozen=True)
class WeightTraffic:
    """What one decode step reads of an artifact's weights, by kind (bytes).

    ``dense_bytes`` every step reads whatever the routing (``head_bytes`` of it the LM head); ``gathered_row_bytes``
    per token (embedding rows, argmax-head candidate rows); per MoE layer in graph order (expert_hits' order),
    ``expert_bytes[l]`` of one expert of the ``experts[l]`` it holds. ``total_bytes``: every initializer."""

    dense_bytes: int
    head_bytes: int
    gathered_row_bytes: int
    expert_bytes: list[int] = field(default_factory=list)
    experts: list[int] = field(default_factory=list)
    total_bytes: int = 0

    def step_weight_bytes(self, tokens: int, active_experts: np.ndarray | None) -> float:
        """Weight bytes of a step of ``tokens`` tokens whose MoE layers computed ``active_experts`` [L_moe] experts."""
        routed = 0.0
        if self.expert_bytes:
            if active_experts is None or len(active_experts) != len(self.expert_bytes):
                raise ValueError(f"need the active experts of each of the {len(self.expert_bytes)} MoE layers, got "
                                 f"{None if active_experts is None else len(active_experts)}")
            routed = float(np.dot(np.asarray(active_experts, np.float64), self.expert_bytes))
        return self.dense_bytes + tokens * self.gathered_row_bytes + routed


def tensor_bytes(tensor: onnx.TensorProto) -> int:
    """Stored bytes of an initializer from its dims and type (external data is not read)."""
    count = int(np.prod(tensor.dims, dtype=np.int64)) if tensor.dims else 1
    if tensor.data_type in (onnx.TensorProto.INT4, onnx.TensorProto.UINT4):
        return (count + 1) // 2
    return count * helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize


def _nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    """The nodes a greedy decode step runs: the main graph's and, inside subgraphs, all of them except the float head
    branch of the certified argmax head (greedy steps take its certified branch) and the experts of sparse_experts'
    ``If`` nodes (counted as routed experts, by ``_sparse_experts``)."""
    for node in graph.node:
        yield node
        if _sparse_expert(node) is not None:
            continue
        for attribute in node.attribute:
            if attribute.type != onnx.AttributeProto.GRAPH:
                continue
            if node.name == _ARGMAX_IF and attribute.name == "else_branch":
                continue
            yield from _nodes(attribute.g)


def _sparse_expert(node: onnx.NodeProto) -> str | None:
    """The layer key of one expert's ``If`` made by moeforge/passes/sparse_experts.py, else None."""
    if node.op_type != "If" or not node.name.startswith(SPARSE_IF_PREFIX) or not node.name.endswith("/If"):
        return None
    return node.name.split("/")[1]


def _branch_inputs(node: onnx.NodeProto) -> set[str]:
    """Outer-scope names an ``If``'s then-branch reads."""
    branch = next(a.g for a in node.attribute if a.name == "then_branch")
    return {name for inner in branch.node for name in inner.input}


def weight_traffic(model_path: str | Path) -> WeightTraffic:
    """Classify an artifact graph's initializers by how a decode step reads them (external data is not loaded)."""
    model = onnx.load(str(model_path), load_external_data=False)
    sizes = {t.name: tensor_bytes(t) for t in model.graph.initializer}
    dense: set[str] = set()
    gathered: dict[str, int] = {}  # name -> bytes read per token
    layers: dict[str, list[int]] = {}  # per MoE layer, in graph order: the bytes of each of its experts
    expert_names: set[str] = set()
    by_dims = {t.name: list(t.dims) for t in model.graph.initializer}
    head_node = lm_head_node(model.graph)
    head: set[str] = set()
    for node in _nodes(model.graph):
        layer = _sparse_expert(node)
        if layer is not None:
            names = sorted(n for n in _branch_inputs(node) & sizes.keys() if sizes[n] > 64)  # not its index
            layers.setdefault(f"sparse {layer}", []).append(sum(sizes[n] for n in names))
            expert_names.update(names)
            continue
        first_expert_input = _MOE_EXPERT_INPUTS.get((node.domain, node.op_type))
        in_head = head_node is not None and (node.output[:1] == head_node.output[:1] or (
            head_node.op_type == "If" and node.name.startswith("argmax_head/")))
        if first_expert_input is not None:
            names = [n for n in node.input[first_expert_input:] if n in sizes]
            if names:
                count = by_dims[names[0]][0]
                layers[f"node {len(layers)}"] = [sum(sizes[n] for n in names) // count] * count
                expert_names.update(names)
            continue
        for position, name in enumerate(node.input):
            if name not in sizes:
                continue
            if node.op_type == "Gather" and position == 0:
                axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
                dims = by_dims[name]
                slice_bytes = sizes[name] // max(dims[axis], 1) if dims else 0  # one index's row (or column)
                gathered[name] = max(gathered.get(name, 0), _rows_per_token(node, model.graph) * slice_bytes)
            else:
                dense.add(name)
                if in_head:
                    head.add(name)
    experts = [(sum(b) // len(b), len(b)) for b in layers.values()]  # one expert's bytes (all alike), the count
    # a table some node reads whole (a tied head that is also the embedding) is counted once, as dense
    row_bytes = sum(b for name, b in gathered.items() if name not in dense and name not in expert_names)
    small = {name for name in dense if sizes[name] <= 64}  # shapes and axes: not weights, and not worth a line
    return WeightTraffic(
        dense_bytes=sum(sizes[n] for n in dense - small), head_bytes=sum(sizes[n] for n in head - small),
        gathered_row_bytes=row_bytes, expert_bytes=[b for b, _ in experts], experts=[c for _, c in experts],
        total_bytes=sum(sizes.values()))


def _rows_per_token(node: onnx.NodeProto, graph: onnx.GraphProto) -> int:
    """Rows a Gather reads per token: one for an embedding; the candidate count for the argmax head's rows."""
    if not node.name.startswith("argmax_head/"):
        return 1
    for tensor in graph.initializer:
        if tensor.name == "argmax_head.k":
            return int(onnx.numpy_helper.to_array(tensor).reshape(-1)[0])
    return 1


def lm_head_node(graph: onnx.GraphProto) -> Any:
    """The node (onnx.NodeProto) computing the LM head, or None: the nearest weight-reading MatMul (or the argmax
    head's If) upstream of the ``logits`` output, walking back through reshapes, slices and gathers."""
    producers = {out: node for node in graph.node for out in node.output}
    initializers = {t.name for t in graph.initializer}
    frontier = [o.name for o in graph.output if o.name == "logits"]
    seen: set[str] = set()
    for _ in range(16):
        next_frontier: list[str] = []
        for name in frontier:
            node = producers.get(name)
            if node is None or node.name in seen:
                continue
            seen.add(node.name)
            if node.op_type == "If" and node.name == _ARGMAX_IF:
                return node
            if node.op_type in _HEAD_OPS and any(i in initializers for i in node.input):
                return node
            next_frontier += [i for i in node.input if i and i not in initializers]
        frontier = next_frontier
    return None


@dataclass(frozen=True)
class StepBytes:
    """What a decode step of ``batch`` sequences reads (bytes), by kind, and how long a measured one took."""

    batch: int
    weight_bytes: float  # per step: dense + gathered rows + active experts
    active_expert_bytes: float  # part of weight_bytes
    head_bytes: int  # part of weight_bytes
    kv_bytes: float  # per step: every sequence's cache up to its position
    active_experts_per_layer: list[float]
    experts_per_layer: list[int]
    measured_step_s: float
    rank_step_bytes: list[float] = field(default_factory=list)  # sharded: what each rank read (sum: step_bytes)

    @property
    def step_bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes


@dataclass(frozen=True)
class Roofline:
    """A decode step measured against the memory roofline: its bytes, the run's bandwidth, and the fraction reached
    (``result``: None when it came out above 1 twice, with the reason)."""

    step: StepBytes
    result: RooflineFraction
    bandwidth_report: dict[str, Any]  # RunBandwidth.to_dict() once judged: every probe of the run (the spread)

    @classmethod
    def judge(cls, step: StepBytes, run_bandwidth: RunBandwidth) -> Roofline:
        """The step against ``run_bandwidth`` by the roofline's rule (``roofline_fraction``: it may re-probe)."""
        result = roofline_fraction(step.step_bytes, step.measured_step_s, run_bandwidth)
        return cls(step, result, run_bandwidth.to_dict())

    @property
    def step_bytes(self) -> float:
        return self.step.step_bytes

    @property
    def bandwidth(self) -> Bandwidth:
        """The bandwidth the fraction is against."""
        return self.result.bandwidth

    @property
    def roofline_step_s(self) -> float:
        return self.step_bytes / self.bandwidth.bytes_per_s

    @property
    def fraction(self) -> float | None:
        """Achieved fraction of the roofline (1.0 reads the bytes at the run's bandwidth); None: not a result."""
        return self.result.value

    @property
    def achieved_gb_s(self) -> float:
        return self.result.achieved_gb_s

    def to_dict(self) -> dict[str, Any]:
        step = self.step
        return {
            "batch": step.batch,
            "step_bytes": round(step.step_bytes),
            "weight_bytes": round(step.weight_bytes),
            "active_expert_bytes": round(step.active_expert_bytes),
            "head_bytes": step.head_bytes,
            "kv_bytes": round(step.kv_bytes),
            "active_experts_per_layer": [round(a, 2) for a in step.active_experts_per_layer],
            "experts_per_layer": step.experts_per_layer,
            **self.bandwidth_report,  # bandwidth_gb_s: the one the fraction is against (the run's highest)
            "measured_step_ms": round(1e3 * step.measured_step_s, 3),
            "roofline_step_ms": round(1e3 * self.roofline_step_s, 3),
            "achieved_gb_s": round(self.achieved_gb_s, 2),
            **self.result.to_dict(),
            **({"ranks": len(step.rank_step_bytes), "rank_step_bytes": [round(b) for b in step.rank_step_bytes]}
               if step.rank_step_bytes else {}),
        }


def decode_step_bytes(traffic: WeightTraffic, *, batch: int, mean_context: float, kv_bytes_per_token: int,
               active_experts: np.ndarray | None, decode_tokens_per_s: float) -> StepBytes:
    """The bytes of a decode step of ``batch`` sequences at ``mean_context`` tokens of cache each, whose MoE layers
    computed ``active_experts`` [L_moe] experts on average, measured at ``decode_tokens_per_s`` (all sequences
    together)."""
    if batch < 1 or decode_tokens_per_s <= 0:
        raise ValueError(f"need batch >= 1 and a positive decode rate (got {batch}, {decode_tokens_per_s})")
    active = np.zeros(0) if active_experts is None else np.asarray(active_experts, np.float64)
    weights = traffic.step_weight_bytes(batch, active if traffic.expert_bytes else None)
    routed = float(np.dot(active, traffic.expert_bytes)) if traffic.expert_bytes else 0.0
    return StepBytes(batch=batch, weight_bytes=weights, active_expert_bytes=routed, head_bytes=traffic.head_bytes,
                     kv_bytes=batch * mean_context * kv_bytes_per_token,
                     active_experts_per_layer=[float(a) for a in active], experts_per_layer=list(traffic.experts),
                     measured_step_s=batch / decode_tokens_per_s)


def decode_roofline(traffic: WeightTraffic, *, batch: int, mean_context: float, kv_bytes_per_token: int,
                    active_experts: np.ndarray | None, bandwidth: RunBandwidth,
                    decode_tokens_per_s: float) -> Roofline:
    """The roofline of a decode step (``decode_step_bytes``) against the run's ``bandwidth`` (``roofline_fraction``'s
    rule)."""
    step = decode_step_bytes(traffic, batch=batch, mean_context=mean_context, kv_bytes_per_token=kv_bytes_per_token,
                             active_experts=active_experts, decode_tokens_per_s=decode_tokens_per_s)
    return Roofline.judge(step, bandwidth)


def ranks_roofline(traffics: Sequence[WeightTraffic], *, batch: int, mean_context: float,
                   kv_bytes_per_token: Sequence[int], active_experts: Sequence[np.ndarray | None],
                   bandwidth: RunBandwidth, decode_tokens_per_s: float) -> Roofline:
    """The roofline of a step of a sharded artifact whose ranks run at once on this machine: rank ``r`` reads
    ``traffics[r]``'s weights with its own ``active_experts[r]`` [L_moe] and ``kv_bytes_per_token[r]``; the step reads
    their sum through one memory (``bandwidth``: probed with all the ranks' threads). Per layer, the experts computed
    and held are the ranks' sums (an ep rank's own experts; with tp every rank computes its slice of each)."""
    if not traffics or not len(traffics) == len(kv_bytes_per_token) == len(active_experts):
        raise ValueError(f"need one traffic, KV size and activity per rank (got {len(traffics)}, "
                         f"{len(kv_bytes_per_token)}, {len(active_experts)})")
    parts = [decode_step_bytes(traffic, batch=batch, mean_context=mean_context, kv_bytes_per_token=kv,
                               active_experts=active, decode_tokens_per_s=decode_tokens_per_s)
             for traffic, kv, active in zip(traffics, kv_bytes_per_token, active_experts, strict=True)]
    layers = {len(p.active_experts_per_layer) for p in parts} | {len(p.experts_per_layer) for p in parts}
    if len(layers) > 1:
        raise ValueError(f"the ranks' graphs disagree on their MoE layers ({sorted(layers)}): not one artifact's ranks")
    active = np.sum([p.active_experts_per_layer for p in parts], axis=0) if parts[0].active_experts_per_layer else []
    held = np.sum([p.experts_per_layer for p in parts], axis=0) if parts[0].experts_per_layer else []
    step = StepBytes(batch=batch, weight_bytes=sum(p.weight_bytes for p in parts),
                     active_expert_bytes=sum(p.active_expert_bytes for p in parts),
                     head_bytes=sum(p.head_bytes for p in parts), kv_bytes=sum(p.kv_bytes for p in parts),
                     active_experts_per_layer=[float(a) for a in active], experts_per_layer=[int(e) for e in held],
                     measured_step_s=parts[0].measured_step_s, rank_step_bytes=[p.step_bytes for p in parts])
    return Roofline.judge(step, bandwidth)


def format_roofline(report: dict[str, Any]) -> str:
    """Human lines from ``Roofline.to_dict()``: where a step's bytes are, the run's bandwidth (each probe's best and
    median), and how close the step comes to reading them at that bandwidth; no fraction where it came out above 1
    twice, but the reason."""
    mib = 2**20
    experts = report["experts_per_layer"]
    lines = [f"roofline (batch {report['batch']}): a decode step reads {report['step_bytes'] / mib:.1f} MiB: weights "
             f"{report['weight_bytes'] / mib:.1f} MiB (LM head {report['head_bytes'] / mib:.1f}"
             + (f", routed experts {report['active_expert_bytes'] / mib:.1f}" if experts else "")
             + f"), KV cache {report['kv_bytes'] / mib:.1f} MiB"]
    if experts:
        active = report["active_experts_per_layer"]
        mean_active = float(np.mean(active)) if active else 0.0
        lines.append(f"  experts computed per MoE layer and step: {mean_active:.2f} of {max(experts)} "
                     + ("(each rank's union over the batch's tokens of the experts, or the expert slices, it holds; "
                        "summed over the ranks)" if report.get("ranks") else "(the union over the batch's tokens)"))
    if report.get("ranks"):
        lines.append(f"  {report['ranks']} ranks on this machine read "
                     + " + ".join(f"{b / mib:.1f}" for b in report["rank_step_bytes"])
                     + " MiB a step: their sum through one memory")
    lines.append(f"  {describe_bandwidth(report)}")
    steps = f"  roofline step {report['roofline_step_ms']:.2f} ms, measured {report['measured_step_ms']:.2f} ms"
    if report["fraction"] is None:
        lines.append(f"{steps} ({report['achieved_gb_s']:.1f} GB/s read): {report['fraction_reason']}")
    else:
        fraction = report["fraction"]
        lines.append(f"{steps} -> {fraction:.2f}" if fraction >= 0.01 else f"{steps} -> {fraction:.2g}")
        lines[-1] += f" of the roofline ({report['achieved_gb_s']:.1f} GB/s)"
        if report.get("fraction_reason"):  # how it was reached: a re-probe replaced a stale number
            lines.append(f"  ({report['fraction_reason']})")
    shares = report.get("kernel_time_shares")
    if shares:
        lines.append("  kernel time (profiled run): " + ", ".join(f"{op} {100 * v:.0f}%" for op, v in
                                                                   list(shares.items())[:6]))
    return "\n".join(lines)
