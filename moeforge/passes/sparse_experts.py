"""Quantised routed experts as one ``If`` per expert over MatMulNBits: a decode step reads its routed experts at the
speed of ONNX Runtime's int8/int4 GEMV kernels instead of QMoE's.

ONNX Runtime's CPU ``com.microsoft.QMoE`` dequantises each routed expert's weights to float blocks before its GEMM
(``moe_quantization_cpu.cc``): on this 2-core VM four int8 experts of a DeepSeek-V3-shaped layer (H 2048, I 768)
took 12.6 ms in QMoE against 3.2 ms as four MatMulNBits (accuracy_level 4) on the same codes -- 1.5 vs 5.8 GB/s.
MatMulNBits reads the codes as they are, so this pass rewrites each QMoE node (8-bit per channel or 4/8-bit blocks,
symmetric, SwiGLU with gate/up rows interleaved, no biases), and each float MoE node whose experts are asymmetric
min-max blocks (``--quant int4-asym`` / ``int8-asym``: quant_weights' DequantizeLinear -> Add(offset) chains, which
QMoE cannot carry), into:

    w       = Where(IsNaN(s), 0, s),  s = Softmax(router_probs)      [T, E]  the kernel's weights (-inf: not chosen;
                                                                             a row of -inf gives 0, as the kernel)
    hit     = ReduceMax(w, axis 0) > 0                               [E]     experts any token of the step chose
    acc_0   = 0                                                      [T, H]
    acc_e+1 = If(hit[e],
                 then: rows = NonZero(w[:, e] > 0)                   [n]     its tokens only
                       h    = SwiGLU(P(x[rows], fc1_e))              [n, I]  gate and up rows de-interleaved
                       ScatterND(acc_e, rows, w[rows, e] * P(h, fc2_e), reduction="add"),
                 else: acc_e)
    y       = acc_E

where P(x, W) is MatMulNBits(x, codes, scales) for symmetric blocks and, for asymmetric ones (W = scale * code +
offset per block of 32 of K: llama.cpp's Q4_1 exactly), MatMulNBits(x, codes, scales; default zero point z) +
block_sums(x) [n, K/bs] @ (offset + z * scale) [K/bs, N], as quant_lowering runs the dense layers (x's block sums
are computed once per layer and gathered per expert).

QMoE's codes and scales are used as they are (both store ``code + 2^(bits-1)`` with the low nibble first); a
per-channel scale is repeated over blocks of 32 of K, which dequantises to the same values. The softmax over the
finite entries is the kernel's renormalised top-k (``normalize_routing_weights=1``, k finite entries: moe_lowering
puts -inf on every other expert). A decode step runs ~K branches per layer and skips the rest for the cost of an
``If``; a long prefill runs every expert on its own tokens (NonZero/Gather/ScatterND), as QMoE does.

Each expert's weights are named ``<fc1/fc2 name>.expert<e>`` and built one expert at a time from the stack
(``ops/expert_stack``), so a streamed compile still holds one expert at a time. ``sparse_experts`` in an If's name
lets the roofline (moeforge/runtime/roofline.py) count those weights as routed, not dense.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx_ir as ir

from moeforge.ops.expert_stack import experts_of
from moeforge.ops.node_builder import lazy_tensor
from moeforge.passes.base import MS_DOMAIN, PassContext, add_initializer, ensure_opset
from moeforge.passes.quant_lowering import asym_expert_dq, drop_dead_dequantize
from moeforge.passes.quant_math import pack_nbits

IF_PREFIX = "sparse_experts/"
_BLOCK = 32  # the block a per-channel scale is repeated over (any power of two >= 16 that divides K would do)
_X, _PROBS, _FC1, _FC1_SCALES, _FC1_BIAS, _FC2, _FC2_SCALES, _FC2_BIAS = range(8)


class SparseExperts:
    """Rewrite each eligible ``com.microsoft.QMoE`` node, and each ``com.microsoft.MoE`` node whose experts are
    asymmetric blocks (int4-asym / int8-asym), into per-expert ``If`` + MatMulNBits; returns how many."""

    name = "sparse_experts"

    def __init__(self, accuracy_level: int = 4) -> None:
        self.accuracy_level = accuracy_level  # asymmetric MoE experts' MatMulNBits (a QMoE node carries its own)

    def apply(self, model: ir.Model, ctx: PassContext) -> int:
        graph = model.graph
        found = [(n, w) for n in graph if (w := _expert_weights(n, self.accuracy_level)) is not None]
        for layer, (node, weights) in enumerate(found):
            _rewrite(graph, node, weights, f"{IF_PREFIX}{layer}")
        if any(node.op_type == "MoE" for node, _ in found):
            ensure_opset(model, MS_DOMAIN, 1)
            drop_dead_dequantize(graph)  # the asymmetric experts' DequantizeLinear chains
        return len(found)


@dataclass(frozen=True)
class _Projection:
    """One expert projection's MatMulNBits weights, made per expert when written: ``b(e)`` [N, K/bs, bs*bits/8]
    uint8, ``scales(e)`` [N, K/bs] and, for asymmetric blocks, ``offsets(e)`` [K/bs, N] -- the block offsets with
    the default zero point 2^(bits-1) folded in, y = MatMulNBits(x) + block_sums(x) @ offsets."""

    n: int
    k: int
    b: Callable[[int], np.ndarray]
    scales: Callable[[int], np.ndarray]
    offsets: Callable[[int], np.ndarray] | None
    stem: str


@dataclass(frozen=True)
class _Experts:
    fc1: _Projection  # [2I, H]: gate rows, then up rows
    fc2: _Projection  # [H, I]
    bits: int
    block: int
    accuracy: int


def _attr(node: ir.Node, name: str, default: object = None) -> object:
    attribute = node.attributes.get(name)
    return default if attribute is None else attribute.value


def _swiglu_routing(node: ir.Node) -> bool:
    """SwiGLU with interleaved rows and softmax-renormalised routing: what the rewrite reproduces."""
    return (_attr(node, "activation_type") == "swiglu" and _attr(node, "swiglu_fusion") == 1
            and _attr(node, "normalize_routing_weights") == 1 and _attr(node, "use_sparse_mixer", 0) == 0
            and _attr(node, "activation_alpha", 1.0) == 1.0 and _attr(node, "activation_beta", 0.0) == 0.0
            and _attr(node, "swiglu_limit", None) is None)


def _present(node: ir.Node) -> set[int]:
    return {i for i, v in enumerate(node.inputs) if v is not None}


def _expert_weights(node: ir.Node, accuracy_level: int) -> _Experts | None:
    """The node's experts as MatMulNBits weights when the rewrite applies to it, else None."""
    if node.domain != MS_DOMAIN or not _swiglu_routing(node):
        return None
    if node.op_type == "QMoE":
        return _qmoe_weights(node)
    if node.op_type == "MoE":
        return _asym_moe_weights(node, accuracy_level)
    return None


def _deinterleave(array: np.ndarray) -> np.ndarray:
    """Gate rows first, then up rows (fc1 interleaves g0, u0, g1, u1, ...)."""
    return np.concatenate([array[0::2], array[1::2]])


def _qmoe_weights(node: ir.Node) -> _Experts | None:
    """Symmetric QMoE (8-bit per channel or 4/8-bit blocks), no biases, fc3, zero points or router_weights, static
    shapes. The expert's codes and scales are QMoE's own bytes (both store ``code + 2^(bits-1)`` with the low nibble
    first); a per-channel scale is repeated over blocks of 32 of K, which dequantises to the same values."""
    inputs = list(node.inputs)
    if _present(node) - {_X, _PROBS, _FC1, _FC1_SCALES, _FC2, _FC2_SCALES}:
        return None  # biases, fc3, zero points or router_weights: not what moe_lowering + quant_lowering emit
    for i in (_FC1, _FC1_SCALES, _FC2, _FC2_SCALES):
        value = inputs[i]
        if value is None or value.const_value is None or value.shape is None:
            return None
    fc1, fc1_scales, fc2, fc2_scales = (inputs[i] for i in (_FC1, _FC1_SCALES, _FC2, _FC2_SCALES))
    bits = int(_attr(node, "expert_weight_bits", 8))  # type: ignore[call-overload]
    _, two_inter, packed_hidden = (int(d) for d in fc1.shape.numpy())  # type: ignore[union-attr]
    hidden, inter = packed_hidden * 8 // bits, two_inter // 2
    per_channel = len(fc1_scales.shape) == 2  # type: ignore[union-attr,arg-type]
    block = _BLOCK if per_channel else int(_attr(node, "block_size", 0))  # type: ignore[call-overload]
    if not block or hidden % block or inter % block:
        return None  # a K no MatMulNBits block divides: left to QMoE

    def projection(codes_v: ir.Value, scales_v: ir.Value, n: int, k: int, stem: str, fc1_rows: bool) -> _Projection:
        codes, scales = _experts(codes_v.const_value), _experts(scales_v.const_value)  # type: ignore[arg-type]
        rows = _deinterleave if fc1_rows else (lambda a: a)

        def b(e: int) -> np.ndarray:
            return np.ascontiguousarray(rows(codes(e)).reshape(n, k // block, block * bits // 8))

        def s(e: int) -> np.ndarray:
            scale = rows(np.asarray(scales(e), np.float32))
            if per_channel:
                scale = np.repeat(scale[:, None], k // block, axis=1)
            return np.ascontiguousarray(scale.reshape(n, k // block), np.float32)
        return _Projection(n, k, b, s, None, stem)

    stem1, stem2 = fc1.name or f"{node.name}.fc1", fc2.name or f"{node.name}.fc2"  # type: ignore[union-attr]
    return _Experts(projection(fc1, fc1_scales, two_inter, hidden, stem1, True),  # type: ignore[arg-type]
                    projection(fc2, fc2_scales, hidden, inter, stem2, False),  # type: ignore[arg-type]
                    bits, block, int(_attr(node, "accuracy_level", 0)))  # type: ignore[call-overload]


def _asym_moe_weights(node: ir.Node, accuracy_level: int) -> _Experts | None:
    """A float MoE whose fc1 and fc2 are asymmetric expert chains of one bits and block (no biases, no fc3):
    W = scale * codes + offset per block of K, as MatMulNBits(codes, scale; default zero point z) plus the block
    sums of its input times (offset + z * scale), exact like the dense layers (quant_lowering)."""
    if _present(node) - {0, 1, 2, 4}:  # MoE: input, router_probs, fc1, (fc1 bias), fc2, (fc2 bias), fc3, ...
        return None
    found = [asym_expert_dq(node.inputs[i]) for i in (2, 4)]
    if found[0] is None or found[1] is None or {f[3:] for f in found if f is not None} != {found[0][3:]}:
        return None
    block, bits = found[0][3], found[0][4]
    if block < 16 or block & (block - 1):
        return None  # MatMulNBits blocks are powers of two >= 16
    zero = 1 << (bits - 1)

    def projection(entry: tuple[ir.TensorProtocol, ir.TensorProtocol, ir.TensorProtocol, int, int], stem: str,
                   fc1_rows: bool) -> _Projection:
        codes_t, scale_t, offset_t = entry[:3]
        _, n, k = (int(d) for d in codes_t.shape.numpy())
        # scales(e) is read twice per expert, for its scales and its folded offsets, written one after the other
        codes, scales, offsets = _experts(codes_t), functools.lru_cache(maxsize=1)(_experts(scale_t)), _experts(
            offset_t)
        rows = _deinterleave if fc1_rows else (lambda a: a)

        def b(e: int) -> np.ndarray:  # unsigned codes [N, K] -> signed for pack_nbits, which adds z back
            return pack_nbits(rows(np.asarray(codes(e)).astype(np.int16)) - zero, bits, block)

        def s(e: int) -> np.ndarray:
            return np.ascontiguousarray(rows(np.asarray(scales(e), np.float32)))

        def o(e: int) -> np.ndarray:  # [K/bs, N]
            folded = np.asarray(offsets(e), np.float32)[:, :, 0] + zero * np.asarray(scales(e), np.float32)
            return np.ascontiguousarray(rows(folded).T, np.float32)
        return _Projection(n, k, b, s, o, stem)

    fc1, fc2 = node.inputs[2], node.inputs[4]
    assert fc1 is not None and fc2 is not None
    return _Experts(projection(found[0], fc1.name or f"{node.name}.fc1", True),
                    projection(found[1], fc2.name or f"{node.name}.fc2", False), bits, block,
                    accuracy_level)


def _experts(tensor: ir.TensorProtocol) -> Callable[[int], np.ndarray]:
    """Expert e of a stacked constant: from its ``ExpertStack`` when it is one, else sliced from the whole array
    (computed once)."""
    per_expert = experts_of(tensor)
    if per_expert is not None:
        return per_expert
    whole = functools.cache(tensor.numpy)
    return lambda e: np.asarray(whole()[e])


def _rewrite(graph: ir.Graph, node: ir.Node, weights: _Experts, prefix: str) -> None:
    x, probs = node.inputs[_X], node.inputs[_PROBS]
    assert x is not None and probs is not None
    bits, block = weights.bits, weights.block
    experts = int(node.inputs[2].shape.numpy()[0])  # type: ignore[union-attr]

    def node_(op: str, inputs: list[ir.Value | None], out: str, domain: str = "", outputs: int = 1,
              **attributes: Any) -> ir.Node:
        made = ir.node(op, inputs, attributes or None, domain=domain, num_outputs=outputs, name=f"{prefix}/{out}")
        for i, value in enumerate(made.outputs):
            value.name = f"{prefix}/{out}" + (f"_{i}" if outputs > 1 else "")
        return made

    made_consts: dict[str, ir.Value] = {}

    def const(stem: str, array: np.ndarray) -> ir.Value:  # made once per name (the fc2 block view is per expert)
        if stem not in made_consts:
            made_consts[stem] = add_initializer(graph, f"{prefix}.{stem}", array)
        return made_consts[stem]

    def block_sums(value: ir.Value, k: int, tag: str) -> list[ir.Node]:
        """value [n, K] -> its sums over blocks [n, K/bs] (the last node's output): a Reshape view + ReduceSum."""
        view = node_("Reshape", [value, const(f"blocks{k}", np.array([-1, k // block, block], np.int64))],
                     f"{tag}/blocks")
        return [view, node_("ReduceSum", [view.outputs[0], last], f"{tag}/block_sums", keepdims=0)]

    def matmul(proj: _Projection, e: int, tag: str, xe: ir.Value, sums: ir.Value | None) -> list[ir.Node]:
        """Expert e's projection of xe [n, K] -> [n, N]; asymmetric blocks add sums [n, K/bs] @ offsets."""
        blocks = proj.k // block
        b = add_initializer(graph, f"{proj.stem}.expert{e}.B", lazy_tensor(
            functools.partial(proj.b, e), ir.DataType.UINT8, (proj.n, blocks, block * bits // 8)))
        s = add_initializer(graph, f"{proj.stem}.expert{e}.scales", lazy_tensor(
            functools.partial(proj.scales, e), ir.DataType.FLOAT, (proj.n, blocks)))
        mm = node_("MatMulNBits", [xe, b, s], tag, domain=MS_DOMAIN, K=proj.k, N=proj.n, bits=bits,
                   block_size=block, accuracy_level=weights.accuracy)
        if proj.offsets is None:
            return [mm]
        made = block_sums(xe, proj.k, tag) if sums is None else []  # the block sums of xe itself
        if sums is None:
            sums = made[-1].outputs[0]
        offsets = add_initializer(graph, f"{proj.stem}.expert{e}.offsets", lazy_tensor(
            functools.partial(proj.offsets, e), ir.DataType.FLOAT, (blocks, proj.n)))
        share = node_("MatMul", [sums, offsets], f"{tag}/offset_share")
        total = node_("Add", [mm.outputs[0], share.outputs[0]], f"{tag}/exact")
        return [mm, *made, share, total]

    new: list[ir.Node] = []
    last = const("last_axis", np.array([-1], np.int64))
    softmax = node_("Softmax", [probs], "softmax", axis=-1)
    nan = node_("IsNaN", [softmax.outputs[0]], "isnan")
    w = node_("Where", [nan.outputs[0], const("zero", np.zeros((), np.float32)), softmax.outputs[0]], "weights")
    column_max = node_("ReduceMax", [w.outputs[0], const("axis0", np.array([0], np.int64))], "column_max",
                       keepdims=0)
    hit = node_("Greater", [column_max.outputs[0], const("zero_e", np.zeros((), np.float32))], "hit")  # [E]
    zeros = node_("Mul", [x, const("zero_x", np.zeros((), np.float32))], "acc_0")  # [T, H] (x is finite)
    new += [softmax, nan, w, column_max, hit, zeros]
    x_sums = None  # [T, H/bs]: x's block sums, shared by every expert's fc1 offsets (asymmetric blocks)
    if weights.fc1.offsets is not None:
        summed = block_sums(x, weights.fc1.k, "x")
        new += summed
        x_sums = summed[-1].outputs[0]
    # each expert's If condition [1]: one Split per layer (a Gather per expert would cost E nodes, and ONNX Runtime
    # rewrites a scalar-index Gather into Slice + Squeeze: 2E dispatches a step)
    conds = node_("Split", [hit.outputs[0]], "conds", outputs=experts, num_outputs=experts, axis=0)
    new.append(conds)
    acc = zeros.outputs[0]
    zero_t = const("zero_t", np.zeros((), np.float32))
    for e in range(experts):
        tag = f"e{e}"
        index = const(f"{tag}.index", np.array(e, np.int64))
        cond = conds.outputs[e]
        # the then-branch: the expert over the tokens routed to it
        column = node_("Gather", [w.outputs[0], index], f"{tag}/w", axis=1)  # [T]
        chosen = node_("Greater", [column.outputs[0], zero_t], f"{tag}/chosen")
        nonzero = node_("NonZero", [chosen.outputs[0]], f"{tag}/nonzero")  # [1, n]
        rows = node_("Reshape", [nonzero.outputs[0], last], f"{tag}/rows")  # [n]
        xe = node_("Gather", [x, rows.outputs[0]], f"{tag}/x", axis=0)  # [n, H]
        then_nodes = [column, chosen, nonzero, rows, xe]
        if x_sums is not None:
            xe_sums = node_("Gather", [x_sums, rows.outputs[0]], f"{tag}/x_sums", axis=0)  # [n, H/bs]
            then_nodes.append(xe_sums)
        gate_up = matmul(weights.fc1, e, f"{tag}/gate_up", xe.outputs[0],
                         xe_sums.outputs[0] if x_sums is not None else None)
        split = node_("Split", [gate_up[-1].outputs[0]], f"{tag}/split", outputs=2, num_outputs=2, axis=-1)
        gate, up = split.outputs
        sig = node_("Sigmoid", [gate], f"{tag}/sigmoid")
        silu = node_("Mul", [gate, sig.outputs[0]], f"{tag}/silu")
        h = node_("Mul", [silu.outputs[0], up], f"{tag}/h")  # [n, I]
        down = matmul(weights.fc2, e, f"{tag}/down", h.outputs[0], None)  # [n, H]
        we = node_("Gather", [column.outputs[0], rows.outputs[0]], f"{tag}/w_rows", axis=0)  # [n]
        we2 = node_("Unsqueeze", [we.outputs[0], last], f"{tag}/w_col")  # [n, 1]
        weighted = node_("Mul", [down[-1].outputs[0], we2.outputs[0]], f"{tag}/weighted")
        where = node_("Unsqueeze", [rows.outputs[0], last], f"{tag}/where")  # [n, 1]
        scatter = node_("ScatterND", [acc, where.outputs[0], weighted.outputs[0]], f"{tag}/acc", reduction="add")
        then_nodes += [*gate_up, split, sig, silu, h, *down, we, we2, weighted, where, scatter]
        then_branch = ir.Graph([], [scatter.outputs[0]], nodes=then_nodes, name=f"{prefix}/{tag}/then")
        keep = node_("Identity", [acc], f"{tag}/keep")
        else_branch = ir.Graph([], [keep.outputs[0]], nodes=[keep], name=f"{prefix}/{tag}/else")
        branch = node_("If", [cond], f"{tag}/If", then_branch=then_branch, else_branch=else_branch)
        branch.outputs[0].dtype, branch.outputs[0].shape = ir.DataType.FLOAT, x.shape
        new.append(branch)
        acc = branch.outputs[0]
    out = node.outputs[0]
    graph.insert_before(node, new)
    name = out.name
    out.replace_all_uses_with(acc, replace_graph_outputs=True)
    out.name = None
    inputs = [v for v in node.inputs if v is not None]
    graph.remove(node, safe=True)
    acc.name = name
    for value in inputs:
        if not value.uses() and value.name is not None and value.name in graph.initializers:
            graph.initializers.pop(value.name)
