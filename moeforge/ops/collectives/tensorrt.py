"""A sharded rank's collectives in a TensorRT network: ``IDistCollectiveLayer`` (NCCL at run time).

TensorRT-RTX's ONNX parser (1.7) has no importer for ``com.microsoft.AllReduce`` / ``AllGather``: it looks for a
plugin of that name and finds none. TensorRT has its own collective layer instead (``add_dist_collective``:
ALL_REDUCE, ALL_GATHER, ... over NCCL). So a rank's graph is parsed with each collective turned into an
``Identity`` (in memory: the artifact's graph keeps its contrib nodes), and each of those identities is then
bypassed by a distributed collective layer on its input. TensorRT gathers along the first dimension only, so an
AllGather along another axis is wrapped in two transposes. The attention of a rank (its share of the heads)
may fall outside TensorRT-RTX's dedicated attention kernels, so attention is allowed to decompose there.

Dimension letters: N ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import onnx
from onnx import helper

from moeforge.ops.collectives.torch_op import COLLECTIVE_OPS, MS_DOMAIN


@dataclass(frozen=True)
class Collective:
    """One collective node of the rank graph: its op, and the axis an AllGather concatenates."""

    op: str
    axis: int = 0


def placeholder_graph(graph: onnx.ModelProto) -> dict[str, Collective]:
    """Turn ``graph``'s collectives into ``Identity`` nodes, in place; returns {output name: collective}."""
    found: dict[str, Collective] = {}
    for node in graph.graph.node:
        if node.domain == MS_DOMAIN and node.op_type in COLLECTIVE_OPS:
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            found[node.output[0]] = Collective(node.op_type, int(attrs.get("axis", 0)))
            node.op_type, node.domain = "Identity", ""
            del node.attribute[:]
    return found


def insert_collectives(trt: Any, network: Any, collectives: dict[str, Collective], num_ranks: int) -> int:
    """Bypass each placeholder ``Identity`` of ``network`` with an ``IDistCollectiveLayer`` over ``num_ranks``
    ranks (its consumers, and a network output it was, move to the collective's result); let attention
    decompose. Returns the number of collective layers added."""
    module = trt.module
    layers = [network.get_layer(i) for i in range(network.num_layers)]
    added = 0
    for layer in layers:
        if layer.type != module.LayerType.IDENTITY or layer.get_output(0).name not in collectives:
            continue
        placeholder = layer.get_output(0)
        spec = collectives[placeholder.name]
        result = _collective(module, network, layer.get_input(0), spec, num_ranks)
        for other in layers:
            if other is layer:
                continue
            for index in range(other.num_inputs):
                tensor = other.get_input(index)
                if tensor is not None and tensor.name == placeholder.name:
                    other.set_input(index, result)
        if placeholder.is_network_output:
            name = placeholder.name
            network.unmark_output(placeholder)
            placeholder.name = f"{name}/placeholder"
            result.name = name
            network.mark_output(result)
        added += 1
    for layer in layers:
        if layer.type == module.LayerType.ATTENTION_INPUT:
            layer.__class__ = module.IAttentionBoundaryLayer  # the bindings hand out the base class
            layer.attention.decomposable = True
    return added


def _collective(module: Any, network: Any, source: Any, spec: Collective, num_ranks: int) -> Any:
    """The collective's output tensor; an AllGather along axis a > 0 runs on a transposed view [a first]."""
    if spec.op == "AllReduce":
        layer = network.add_dist_collective(source, module.CollectiveOperation.ALL_REDUCE,
                                            module.ReduceOperation.SUM, -1, None)
        layer.num_ranks = num_ranks
        return layer.get_output(0)
    rank = len(source.shape)
    axis = spec.axis % rank
    perm = [axis] + [d for d in range(rank) if d != axis]
    if axis:
        front = network.add_shuffle(source)
        front.first_transpose = perm
        source = front.get_output(0)
    layer = network.add_dist_collective(source, module.CollectiveOperation.ALL_GATHER, module.ReduceOperation.NONE,
                                        -1, None)
    layer.num_ranks = num_ranks
    result = layer.get_output(0)
    if axis:
        back = network.add_shuffle(result)
        back.first_transpose = [perm.index(d) for d in range(rank)]
        result = back.get_output(0)
    return result
