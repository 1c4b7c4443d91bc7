"""Quantised routed experts as one ``If`` per expert over MatMulNBits: a decode step reads its routed experts at the
speed of ONNX Runtime's int8/int4 GEMV kernels instead of QMoE's.

ONNX Runtime's CPU ``com.microsoft.QMoE`` dequantises each routed expert's weights to float blocks before its GEMM
(``moe_quantization_cpu.cc``): on this 2-core VM four int8 experts of a DeepSeek-V3-shaped layer (H 2048, I 768)
took 12.6 ms in QMoE against 3.2 ms as four MatMulNBits (accuracy_level 4) on the same codes -- 1.5 vs 5.8 GB/s.
MatMulNBits reads the codes as they are, so this pass rewrites each QMoE node (8-bit per channel or 4/8-bit blocks,
symmetric, SwiGLU with gate/up rows interleaved, no biases) into:

    w       = Where(IsNaN(s), 0, s),  s = Softmax(router_probs)      [T, E]  the kernel's weights (-inf: not chosen;
                                                                             a row of -inf gives 0, as the kernel)
    hit     = ReduceMax(w, axis 0) > 0                               [E]     experts any token of the step chose
    acc_0   = 0                                                      [T, H]
    acc_e+1 = If(hit[e],
                 then: rows = NonZero(w[:, e] > 0)                   [n]     its tokens only
                       h    = SwiGLU(MatMulNBits(x[rows], fc1_e))    [n, I]  gate and up rows de-interleaved
                       ScatterND(acc_e, rows, w[rows, e] * MatMulNBits(h, fc2_e), reduction="add"),
                 else: acc_e)
    y       = acc_E

The expert's codes and scales are QMoE's own bytes (both store ``code + 2^(bits-1)`` with the low nibble first);
a per-channel scale is repeated over blocks of 32 of K, which dequantises to the same values. The softmax over the
finite entries is the kernel's renormalised top-k (``normalize_routing_weights=1``, k finite entries: moe_lowering
puts -inf on every other expert). A decode step runs ~K branches per layer and skips the rest for the cost of an
``If``; a long prefill runs every expert on its own tokens (NonZero/Gather/ScatterND), as QMoE does.

Each expert's weights are named ``<QMoE fc1/fc2 name>.expert<e>`` and built one expert at a time from the stack
(``ops/expert_stack``), so a streamed compile still holds one expert at a time. ``sparse_experts`` in an If's name
lets the roofline (moeforge/runtime/roofline.py) count those weights as routed, not dense.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import onnx_ir as ir

from moeforge.ops.expert_stack import experts_of
from moeforge.passes.base import MS_DOMAIN, PassContext, add_initializer

IF_PREFIX = "sparse_experts/"
_BLOCK = 32  # the block a per-channel scale is repeated over (any power of two >= 16 that divides K would do)
_X, _PROBS, _FC1, _FC1_SCALES, _FC1_BIAS, _FC2, _FC2_SCALES, _FC2_BIAS = range(8)


class SparseExperts:
    """Rewrite each eligible ``com.microsoft.QMoE`` node into per-expert ``If`` + MatMulNBits; returns how many."""

    name = "sparse_experts"

    def apply(self, model: ir.Model, ctx: PassContext) -> int:
        graph = model.graph
        nodes = [n for n in graph if (n.domain, n.op_type) == (MS_DOMAIN, "QMoE") and _eligible(n)]
        for layer, node in enumerate(nodes):
            _rewrite(graph, node, f"{IF_PREFIX}{layer}")
        return len(nodes)


def _attr(node: ir.Node, name: str, default: object = None) -> object:
    attribute = node.attributes.get(name)
    return default if attribute is None else attribute.value


def _eligible(node: ir.Node) -> bool:
    """SwiGLU with interleaved rows, softmax-renormalised routing, symmetric codes, no biases, no fc3, no
    router_weights, static shapes: what the rewrite reproduces."""
    inputs = list(node.inputs)
    present = {i for i, v in enumerate(inputs) if v is not None}
    if present - {_X, _PROBS, _FC1, _FC1_SCALES, _FC2, _FC2_SCALES}:
        return False  # biases, fc3, zero points or router_weights: not what moe_lowering + quant_lowering emit
    if (_attr(node, "activation_type") != "swiglu" or _attr(node, "swiglu_fusion") != 1
            or _attr(node, "normalize_routing_weights") != 1 or _attr(node, "use_sparse_mixer", 0) != 0
            or _attr(node, "activation_alpha", 1.0) != 1.0 or _attr(node, "activation_beta", 0.0) != 0.0
            or _attr(node, "swiglu_limit", None) is not None):
        return False
    for i in (_FC1, _FC1_SCALES, _FC2, _FC2_SCALES):
        value = inputs[i]
        if value is None or value.const_value is None or value.shape is None:
            return False
    return True


def _experts(tensor: ir.TensorProtocol) -> Callable[[int], np.ndarray]:
    """Expert e of a stacked constant: from its ``ExpertStack`` when it is one, else sliced from the whole array
    (computed once)."""
    per_expert = experts_of(tensor)
    if per_expert is not None:
        return per_expert
    whole = functools.cache(tensor.numpy)
    return lambda e: np.asarray(whole()[e])


def _rewrite(graph: ir.Graph, node: ir.Node, prefix: str) -> None:
    x, probs = node.inputs[_X], node.inputs[_PROBS]
    fc1, fc1_scales, fc2, fc2_scales = (node.inputs[i] for i in (_FC1, _FC1_SCALES, _FC2, _FC2_SCALES))
    assert x is not None and probs is not None and fc1 is not None and fc2 is not None
    assert fc1_scales is not None and fc2_scales is not None
    bits = int(_attr(node, "expert_weight_bits", 8))  # type: ignore[call-overload]
    accuracy = int(_attr(node, "accuracy_level", 0))  # type: ignore[call-overload]
    block = _attr(node, "block_size", 0)
    experts, two_inter, packed_hidden = (int(d) for d in fc1.shape.numpy())  # type: ignore[union-attr]
    hidden, inter = packed_hidden * 8 // bits, two_inter // 2
    per_channel = len(fc1_scales.shape) == 2  # type: ignore[arg-type]
    block_size = _BLOCK if per_channel else int(block)  # type: ignore[call-overload]
    if hidden % block_size or inter % block_size:
        return  # a K no MatMulNBits block divides: left to QMoE

    def node_(op: str, inputs: list[ir.Value | None], out: str, domain: str = "", outputs: int = 1,
              **attributes: Any) -> ir.Node:
        made = ir.node(op, inputs, attributes or None, domain=domain, num_outputs=outputs, name=f"{prefix}/{out}")
        for i, value in enumerate(made.outputs):
            value.name = f"{prefix}/{out}" + (f"_{i}" if outputs > 1 else "")
        return made

    def const(stem: str, array: np.ndarray) -> ir.Value:
        return add_initializer(graph, f"{prefix}.{stem}", array)

    codes1, scales1 = _experts(fc1.const_value), _experts(fc1_scales.const_value)  # type: ignore[arg-type]
    codes2, scales2 = _experts(fc2.const_value), _experts(fc2_scales.const_value)  # type: ignore[arg-type]

    def weights(codes: Callable[[int], np.ndarray], scales: Callable[[int], np.ndarray], e: int, n: int, k: int,
                stem: str, deinterleave: bool) -> tuple[ir.Value, ir.Value]:
        """MatMulNBits' B [N, K/bs, bs*bits/8] and scales [N, K/bs] of expert ``e``, computed when written."""
        def rows(array: np.ndarray) -> np.ndarray:  # gate rows first, then up rows (fc1 interleaves g0, u0, g1, ...)
            return np.concatenate([array[0::2], array[1::2]]) if deinterleave else array

        def b() -> np.ndarray:
            return np.ascontiguousarray(rows(codes(e)).reshape(n, k // block_size, block_size * bits // 8))

        def s() -> np.ndarray:
            scale = rows(np.asarray(scales(e), np.float32))
            if per_channel:
                scale = np.repeat(scale[:, None], k // block_size, axis=1)
            return np.ascontiguousarray(scale.reshape(n, k // block_size), np.float32)

        b_shape, s_shape = (n, k // block_size, block_size * bits // 8), (n, k // block_size)
        b_tensor = ir.LazyTensor(lambda: ir.tensor(b()), ir.DataType.UINT8, ir.Shape(b_shape))
        s_tensor = ir.LazyTensor(lambda: ir.tensor(s()), ir.DataType.FLOAT, ir.Shape(s_shape))
        return (add_initializer(graph, f"{stem}.expert{e}.B", b_tensor),
                add_initializer(graph, f"{stem}.expert{e}.scales", s_tensor))

    new: list[ir.Node] = []
    softmax = node_("Softmax", [probs], "softmax", axis=-1)
    nan = node_("IsNaN", [softmax.outputs[0]], "isnan")
    w = node_("Where", [nan.outputs[0], const("zero", np.zeros((), np.float32)), softmax.outputs[0]], "weights")
    column_max = node_("ReduceMax", [w.outputs[0], const("axis0", np.array([0], np.int64))], "column_max",
                       keepdims=0)
    hit = node_("Greater", [column_max.outputs[0], const("zero_e", np.zeros((), np.float32))], "hit")  # [E]
    zeros = node_("Mul", [x, const("zero_x", np.zeros((), np.float32))], "acc_0")  # [T, H] (x is finite)
    new += [softmax, nan, w, column_max, hit, zeros]
    acc = zeros.outputs[0]
    last = const("last_axis", np.array([-1], np.int64))
    zero_t = const("zero_t", np.zeros((), np.float32))
    stem1, stem2 = fc1.name or f"{prefix}.fc1", fc2.name or f"{prefix}.fc2"
    for e in range(experts):
        tag = f"e{e}"
        index = const(f"{tag}.index", np.array(e, np.int64))
        cond = node_("Gather", [hit.outputs[0], index], f"{tag}/cond", axis=0)
        b1, s1 = weights(codes1, scales1, e, two_inter, hidden, stem1, deinterleave=True)
        b2, s2 = weights(codes2, scales2, e, hidden, inter, stem2, deinterleave=False)
        # the then-branch: the expert over the tokens routed to it
        column = node_("Gather", [w.outputs[0], index], f"{tag}/w", axis=1)  # [T]
        chosen = node_("Greater", [column.outputs[0], zero_t], f"{tag}/chosen")
        nonzero = node_("NonZero", [chosen.outputs[0]], f"{tag}/nonzero")  # [1, n]
        rows = node_("Reshape", [nonzero.outputs[0], last], f"{tag}/rows")  # [n]
        xe = node_("Gather", [x, rows.outputs[0]], f"{tag}/x", axis=0)  # [n, H]
        gate_up = node_("MatMulNBits", [xe.outputs[0], b1, s1], f"{tag}/gate_up", domain=MS_DOMAIN, K=hidden,
                        N=two_inter, bits=bits, block_size=block_size, accuracy_level=accuracy)
        split = node_("Split", [gate_up.outputs[0]], f"{tag}/split", outputs=2, num_outputs=2, axis=-1)
        gate, up = split.outputs
        sig = node_("Sigmoid", [gate], f"{tag}/sigmoid")
        silu = node_("Mul", [gate, sig.outputs[0]], f"{tag}/silu")
        h = node_("Mul", [silu.outputs[0], up], f"{tag}/h")  # [n, I]
        down = node_("MatMulNBits", [h.outputs[0], b2, s2], f"{tag}/down", domain=MS_DOMAIN, K=inter, N=hidden,
                     bits=bits, block_size=block_size, accuracy_level=accuracy)  # [n, H]
        we = node_("Gather", [column.outputs[0], rows.outputs[0]], f"{tag}/w_rows", axis=0)  # [n]
        we2 = node_("Unsqueeze", [we.outputs[0], last], f"{tag}/w_col")  # [n, 1]
        weighted = node_("Mul", [down.outputs[0], we2.outputs[0]], f"{tag}/weighted")
        where = node_("Unsqueeze", [rows.outputs[0], last], f"{tag}/where")  # [n, 1]
        scatter = node_("ScatterND", [acc, where.outputs[0], weighted.outputs[0]], f"{tag}/acc", reduction="add")
        then_nodes = [column, chosen, nonzero, rows, xe, gate_up, split, sig, silu, h, down, we, we2, weighted,
                      where, scatter]
        then_branch = ir.Graph([], [scatter.outputs[0]], nodes=then_nodes, name=f"{prefix}/{tag}/then")
        keep = node_("Identity", [acc], f"{tag}/keep")
        else_branch = ir.Graph([], [keep.outputs[0]], nodes=[keep], name=f"{prefix}/{tag}/else")
        branch = node_("If", [cond.outputs[0]], f"{tag}/If", then_branch=then_branch, else_branch=else_branch)
        branch.outputs[0].dtype, branch.outputs[0].shape = ir.DataType.FLOAT, x.shape
        new += [cond, branch]
        acc = branch.outputs[0]
    out = node.outputs[0]
    graph.insert_before(node, new)
    name = out.name
    out.replace_all_uses_with(acc, replace_graph_outputs=True)
    out.name = None
    graph.remove(node, safe=True)
    acc.name = name
    for value in (fc1, fc1_scales, fc2, fc2_scales):
        if not value.uses() and value.name is not None and value.name in graph.initializers:
            graph.initializers.pop(value.name)
