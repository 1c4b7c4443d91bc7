"""Lowering of the portable Q/DQ weights to ONNX Runtime CPU's integer kernels.

- ``DequantizeLinear(int4|int8 const) -> MatMul``  ->  ``com.microsoft.MatMulNBits`` (bits 4/8).
  Per-channel int8 is block-wise int8 with every block of a column sharing its scale (exact), with
  the largest power-of-two block <= 256 that divides K. Codes are stored unsigned with MatMulNBits'
  default zero point 2^(bits-1), which is the same symmetric value.
- ``DequantizeLinear(uint4|uint8 const) -> Reshape -> Add(offset const) -> Reshape -> MatMul`` (``--quant
  int4-asym`` / ``int8-asym``)  ->  MatMulNBits (default zero point z = 8 / 128) + (block sums of x) @
  (offset + z * scale), which is exact like float ``zero_points`` = -offset / scale but keeps the fast integer
  kernel (ORT 1.32 CPU takes float zero points for bits=4 only, on a slow path). ``asym_offsets="digit"``
  (``--asym-offsets digit``) instead: one MatMulNBits over x' = [x, block sums of x] with integer zero points
  round(-offset / scale) and the residual offsets (< scale / 2) as one more code per block: one node fewer per
  projection and no float offsets, at the price of rounding the residual to 2^(bits-1) - 1 levels per column and
  block_size blocks (SmolLM2 int4-asym: ~9% faster decode, held-out KL 4.6e-3 vs 3.2e-3, top-1 0.955 vs 0.961).
- ``com.microsoft.MoE`` whose expert weights come from int4/int8 DequantizeLinear  ->
  ``com.microsoft.QMoE`` (same inputs and attributes; router_weights, if any, kept in its slot).
- float8 DequantizeLinear stays (ONNX Runtime CPU has no fp8 GEMM): fp8 artifacts are 4x smaller on
  disk and compute in fp32.

``accuracy_level`` 4 lets the kernels quantise activations to int8 on the fly (much faster on CPU,
~0.5% relative error per GEMM); 0 keeps fp32 activations.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

import numpy as np
import onnx_ir as ir

from moeforge.ops.expert_stack import map_tensor
from moeforge.ops.node_builder import lazy_tensor
from moeforge.passes.base import MS_DOMAIN, PassContext, add_initializer, ensure_opset, required
from moeforge.passes.quant_math import pack_nbits, pack_rows

# Code bits by DequantizeLinear input dtype: symmetric int codes, and the unsigned codes of the asymmetric chain.
_INT_BITS: Mapping[ir.DataType | None, int] = {ir.DataType.INT4: 4, ir.DataType.INT8: 8}
_UINT_BITS: Mapping[ir.DataType | None, int] = {ir.DataType.UINT4: 4, ir.DataType.UINT8: 8}


class QuantLowering:
    """Rewrite DQ + MatMul / MoE into MatMulNBits / QMoE; returns the number of nodes rewritten."""

    name = "quant_lowering"

    def __init__(self, accuracy_level: int = 4, asym_offsets: str = "exact") -> None:
        if asym_offsets not in ("exact", "digit"):
            raise ValueError(f"asym_offsets {asym_offsets!r}: exact or digit")
        self.accuracy_level = accuracy_level
        self.asym_offsets = asym_offsets

    def apply(self, model: ir.Model, ctx: PassContext) -> int:
        count = 0
        for node in list(model.graph):
            if node.op_type == "MatMul" and node.domain == "":
                count += self._matmul(model, node)
            elif node.op_type == "MoE" and node.domain == MS_DOMAIN:
                count += self._moe(model, node)
        if count:
            ensure_opset(model, MS_DOMAIN, 1)
            drop_dead_dequantize(model.graph)
        return count

    def _matmul(self, model: ir.Model, node: ir.Node) -> int:
        weight = node.inputs[1]
        if weight is None:  # (neither form below matches a missing input)
            return 0
        asym = _asym_dq(weight)
        if asym is not None:
            return self._matmul_asym(model, node, *asym)
        dq = _int_dq(weight)
        if dq is None:
            return 0
        codes, scale, bits, block, axis = dq
        k, n = codes.shape.numpy()
        if axis == 1:  # per channel: blocks of one column share its scale
            channel_block = next((b for b in (256, 128, 64, 32, 16) if k % b == 0), None)
            if channel_block is None:
                return 0
            block = channel_block
        elif block < 16 or block & (block - 1) or k % block:
            return 0
        graph = model.graph
        stem = weight.name or "w"
        blocks = k // block

        def scales_nk() -> np.ndarray:  # [N, K/bs]
            array = scale.numpy()
            return np.ascontiguousarray((np.broadcast_to(array[None, :], (blocks, n)) if axis == 1 else array).T,
                                        np.float32)

        # Lazy (computed when written): the codes packed as MatMulNBits reads them, [N, K/bs, bs * bits / 8].
        packed = add_initializer(graph, f"{stem}.nbits", lazy_tensor(
            lambda: pack_nbits(_int8_codes(codes).T, bits, block), ir.DataType.UINT8, (n, blocks, block * bits // 8)))
        scales = add_initializer(graph, f"{stem}.nbits_scale", lazy_tensor(scales_nk, ir.DataType.FLOAT, (n, blocks)))
        new = ir.node("MatMulNBits", [node.inputs[0], packed, scales], domain=MS_DOMAIN,
                      attributes={"K": k, "N": n, "bits": bits, "block_size": block,
                                  "accuracy_level": self.accuracy_level})
        _swap(graph, node, new)
        return 1

    def _matmul_asym(self, model: ir.Model, node: ir.Node, codes: ir.TensorProtocol, scale: ir.TensorProtocol,
                     offset: ir.TensorProtocol, block: int, bits: int) -> int:
        """W = scale * codes + offset per block, run as MatMulNBits(codes, scale; default zero point
        z = 2^(bits-1)) plus the offsets' share: y = MatMulNBits(x) + S(x) @ (offset + z * scale), S(x) [..., K/bs]
        x's sums over blocks. Exact like float zero points, but ORT 1.32 CPU runs float zero points on a slow
        path (7 vs 81 tok/s on SmolLM2; 8 bits refuses them), while this keeps the fast integer kernel.
        ``codes`` [K, N] uint, ``scale`` [K/bs, N], ``offset`` [K/bs, 1, N]: tensors, read when the new ones are
        written (lazy)."""
        k, n = codes.shape.numpy()  # codes uint8 0..2^bits-1 [K, N]; scale, offset [K/bs, N]
        if block < 16 or block & (block - 1) or k % block:
            return 0
        graph = model.graph
        stem = required(node.inputs[1], f"{node.name}: weight input").name or "w"  # _asym_dq matched it
        if self.asym_offsets == "digit":
            arrays = codes.numpy().astype(np.uint8), scale.numpy(), offset.numpy()[:, 0, :]
            return self._matmul_asym_digit(graph, node, *arrays, block, bits, stem)
        zero = 1 << (bits - 1)
        blocks = k // block

        def packed_codes() -> np.ndarray:  # unsigned codes back, packed [N, K/bs, *]
            return pack_nbits(codes.numpy().astype(np.uint8).T.astype(np.int16) - zero, bits, block)

        def shifted() -> np.ndarray:  # [K/bs, N]: the offsets with the zero point folded in
            folded: np.ndarray = (offset.numpy()[:, 0, :] + zero * scale.numpy()).astype(np.float32)
            return folded

        inputs = [node.inputs[0],
                  add_initializer(graph, f"{stem}.nbits",
                                  lazy_tensor(packed_codes, ir.DataType.UINT8, (n, blocks, block * bits // 8))),
                  add_initializer(graph, f"{stem}.nbits_scale", lazy_tensor(
                      lambda: np.ascontiguousarray(scale.numpy().T, np.float32), ir.DataType.FLOAT, (n, blocks)))]
        nbits = ir.node("MatMulNBits", inputs, domain=MS_DOMAIN,
                        attributes={"K": k, "N": n, "bits": bits, "block_size": block,
                                    "accuracy_level": self.accuracy_level})
        block_sums = _block_sums(graph, node.inputs[0], k, block, stem)  # [..., K/bs]
        correction = ir.node("MatMul", [block_sums[-1].outputs[0], add_initializer(
            graph, f"{stem}.block_offset", lazy_tensor(shifted, ir.DataType.FLOAT, (blocks, n)))])
        total = ir.node("Add", [nbits.outputs[0], correction.outputs[0]])
        for extra in (nbits, *block_sums, correction):
            graph.insert_before(node, extra)
        _swap(graph, node, total)
        return 1

    def _matmul_asym_digit(self, graph: ir.Graph, node: ir.Node, codes: np.ndarray, scale: np.ndarray,
                           offset: np.ndarray, block: int, bits: int, stem: str) -> int:
        """W = scale * (codes - z) + r per block, z = round(-offset / scale) (an integer zero point, native to
        MatMulNBits) and r = offset + z * scale the residual (|r| <= scale / 2 unless z was clipped). The residual's
        share, S(x) @ r with S(x) x's block sums, runs in the same MatMulNBits as extra K blocks: x' = [x, S(x)]
        [..., K + K/bs], each extra block of bs sums coded like a weight block (one scale per column, zero point
        2^(bits-1))."""
        k, n = codes.shape
        packed, scales, zeros = asym_digit_weights(codes, scale, offset, block, bits)
        sums = _block_sums(graph, node.inputs[0], k, block, stem)
        widened = ir.node("Concat", [node.inputs[0], sums[-1].outputs[0]], attributes={"axis": -1})
        inputs = [widened.outputs[0], add_initializer(graph, f"{stem}.nbits", packed),
                  add_initializer(graph, f"{stem}.nbits_scale", scales),
                  add_initializer(graph, f"{stem}.nbits_zero", zeros)]
        nbits = ir.node("MatMulNBits", inputs, domain=MS_DOMAIN,
                        attributes={"K": k + k // block, "N": n, "bits": bits, "block_size": block,
                                    "accuracy_level": self.accuracy_level})
        for extra in (*sums, widened):
            graph.insert_before(node, extra)
        _swap(graph, node, nbits)
        return 1

    def _moe(self, model: ir.Model, node: ir.Node) -> int:
        found = {i: _int_dq(node.inputs[i]) for i in (2, 4, 6) if i < len(node.inputs) and node.inputs[i] is not None}
        if not found or any(v is None for v in found.values()):
            return 0
        bits = {v[2] for v in found.values() if v is not None}
        blocks = {(v[3], v[0].shape.numpy()[2]) for v in found.values() if v is not None}
        if len(bits) != 1:
            return 0
        per_channel = all(block == k for block, k in blocks)
        block_sizes = {block for block, _ in blocks}
        if not per_channel and (len(block_sizes) != 1 or min(block_sizes) < 16):
            return 0
        graph = model.graph
        inputs: list[ir.Value | None] = [node.inputs[0], node.inputs[1]]
        for i in (2, 4, 6):
            entry = found.get(i)
            if entry is None:
                inputs += [None, None, node.inputs[i + 1] if i + 1 < len(node.inputs) else None]
                continue
            codes, scale, b, _, _ = entry  # codes [E, N, K], scale [E, N, K/bs]
            stem = required(node.inputs[i], f"{node.name}: input {i}").name or f"fc{i}"  # in ``found``: set
            e, n, k = codes.shape.numpy()
            scale_shape = tuple(scale.shape.numpy())
            # Lazy (computed when written): codes packed by rows [E, N, K * bits / 8], scales [E, N(, K/bs)];
            # expert by expert when the codes are (a streamed compile: ops/expert_stack.py).
            packed_shape = (e, n, k * b // 8)
            qmoe_scale_shape = scale_shape[:2] if per_channel else scale_shape
            packed = map_tensor(codes, partial(_qmoe_codes, bits=b), ir.DataType.UINT8, packed_shape)
            scales = map_tensor(scale, partial(_qmoe_scales, per_channel=per_channel), ir.DataType.FLOAT,
                                qmoe_scale_shape)
            inputs += [add_initializer(graph, f"{stem}.qmoe", packed),
                       add_initializer(graph, f"{stem}.qmoe_scale", scales),
                       node.inputs[i + 1] if i + 1 < len(node.inputs) else None]
        inputs += [None, None, None]  # fc1..fc3 zero points: defaults (symmetric)
        while inputs and inputs[-1] is None:
            inputs.pop()
        attributes = {a.name: a for a in node.attributes.values()}
        new_attrs: dict[str, Any] = {name: attr.value for name, attr in attributes.items()}
        new_attrs.update({"expert_weight_bits": bits.pop(), "accuracy_level": self.accuracy_level})
        if not per_channel:
            new_attrs["block_size"] = block_sizes.pop()
        new = ir.node("QMoE", inputs, domain=MS_DOMAIN, attributes=new_attrs)
        _swap(graph, node, new)
        return 1


def _int_dq(value: ir.Value | None) -> tuple[ir.TensorProtocol, ir.TensorProtocol, int, int, int] | None:
    """(codes, scale, bits, block_size, axis) of a constant int4/int8 symmetric DequantizeLinear, else None. The
    tensors are not read (they may be lazy: see quant_weights)."""
    producer = value.producer() if value is not None else None
    if producer is None or producer.op_type != "DequantizeLinear" or producer.domain != "":
        return None
    codes_v, scale_v = producer.inputs[0], producer.inputs[1]
    if codes_v is None or scale_v is None or codes_v.const_value is None or scale_v.const_value is None:
        return None
    if len(producer.inputs) > 2 and producer.inputs[2] is not None:
        zp = producer.inputs[2].const_value
        if zp is None or np.any(zp.numpy().astype(np.int32) != 0):
            return None
    bits = _INT_BITS.get(codes_v.dtype)
    if bits is None:
        return None
    axis_attr = producer.attributes.get("axis")
    block_attr = producer.attributes.get("block_size")
    codes = codes_v.const_value
    ndim = len(codes.shape)
    axis = (axis_attr.as_int() if axis_attr is not None else 1) % ndim
    block = block_attr.as_int() if block_attr is not None else 0
    if ndim == 2 and not ((axis == 1 and block == 0) or (axis == 0 and block > 0)):
        return None
    if ndim == 3 and not (axis == 2 and block > 0):
        return None
    return codes, scale_v.const_value, bits, block, axis


def _int8_codes(codes: ir.TensorProtocol) -> np.ndarray:
    return codes.numpy().astype(np.int8)


def _qmoe_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """QMoE's codes from the DequantizeLinear ones [(E,) N, K]: packed by rows [(E,) N, K * bits / 8]."""
    return pack_rows(codes.astype(np.int8), bits)


def _qmoe_scales(scale: np.ndarray, per_channel: bool) -> np.ndarray:
    """QMoE's scales from the DequantizeLinear ones [(E,) N, 1 or K/bs]: per channel [(E,) N], else as they are."""
    return np.ascontiguousarray(scale[..., 0] if per_channel else scale, np.float32)


def asym_digit_weights(codes: np.ndarray, scale: np.ndarray, offset: np.ndarray, block: int,
                       bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """MatMulNBits' (B, scales, zero_points) for ``--asym-offsets digit``: codes uint 0..2^bits-1 [K, N], scale and
    offset [K/bs, N] (W = scale * codes + offset) -> the layer over x' = [x, block sums of x] (K' = K + K/bs):
    B [N, K/bs + groups, bs*bits/8] uint8, scales [N, K/bs + groups] float32, zero points uint8 (4-bit: two per
    byte), groups = ceil(K/bs / bs) extra blocks holding the residual offsets as one code each."""
    k, n = codes.shape
    blocks = k // block
    groups = -(-blocks // block)  # extra blocks holding the block sums (the last one ragged)
    top, middle = (1 << bits) - 1, 1 << (bits - 1)
    safe = np.where(scale > 0, scale, 1.0)
    zero = np.where(scale > 0, np.clip(np.rint(-offset / safe), 0, top), 0)  # [K/bs, N]
    residual = np.zeros((groups * block, n))
    residual[:blocks] = offset.astype(np.float64) + zero * scale  # [K/bs, N] (padded)
    residual = residual.reshape(groups, block, n)
    step = np.abs(residual).max(axis=1) / (middle - 1)  # [groups, N]
    step[step == 0] = 1.0
    digits = np.clip(np.rint(residual / step[:, None]), 1 - middle, middle - 1)  # [groups, bs, N]
    all_codes = np.concatenate([codes.astype(np.int16) - middle, digits.reshape(-1, n).astype(np.int16)])
    zeros = np.concatenate([zero, np.full((groups, n), middle)]).T.astype(np.uint8)  # [N, K/bs + groups]
    if bits == 4:  # two 4-bit zero points per byte, each column padded to whole bytes
        zeros = np.pad(zeros, ((0, 0), (0, zeros.shape[1] % 2)))
        zeros = (zeros[:, 0::2] | (zeros[:, 1::2] << 4)).astype(np.uint8)
    scales = np.concatenate([scale, step]).T  # [N, K/bs + groups]
    return (pack_nbits(all_codes.T, bits, block), np.ascontiguousarray(scales, np.float32),
            np.ascontiguousarray(zeros.reshape(-1), np.uint8))


def _block_sums(graph: ir.Graph, x: ir.Value | None, k: int, block: int, stem: str) -> list[ir.Node]:
    """Nodes computing x [..., K] -> its sums over blocks of ``block`` [..., K/bs]; the last node's output is them.

    With x's rank known: ReduceSum(Reshape(x, [0, .., K/bs, bs]), -1), a free view plus ~1 us (SmolLM2, 2 cores);
    a MatMul against the [K, K/bs] block indicator costs ~5 us per projection in ORT 1.32 whatever its size, and a
    120-projection model pays that every decode step (docs/performance.md, "Where int4 stands"). Unknown rank: the
    indicator."""
    rank = _rank(x)
    if rank >= 2:
        view = ir.node("Reshape", [x, add_initializer(graph, f"{stem}.block_view",
                                                      np.array([0] * (rank - 1) + [k // block, block], np.int64))])
        sums = ir.node("ReduceSum", [view.outputs[0], add_initializer(graph, f"{stem}.block_axis",
                                                                      np.array([-1], np.int64))],
                       attributes={"keepdims": 0})
        return [view, sums]
    indicator = np.repeat(np.eye(k // block, dtype=np.float32), block, axis=0)  # [K, K/bs]
    return [ir.node("MatMul", [x, add_initializer(graph, f"{stem}.block_indicator", indicator)])]


_SAME_RANK = frozenset({"Slice", "Cast", "Identity", "Neg", "Sigmoid", "Tanh", "Relu"})  # unary: no broadcasting


def _rank(value: ir.Value | None, depth: int = 8) -> int:
    """``value``'s rank from its shape, else through ops that keep their first input's rank (the head's
    ``logits_to_keep`` Slice has none); 0 when unknown."""
    for _ in range(depth):
        if value is None:
            return 0
        if value.shape is not None:
            return len(value.shape)
        producer = value.producer()
        if producer is None or producer.op_type not in _SAME_RANK or producer.domain != "" or not producer.inputs:
            return 0
        value = producer.inputs[0]
    return 0


def _asym_chain(value: ir.Value | None, axis: int
                ) -> tuple[ir.TensorProtocol, ir.TensorProtocol, ir.TensorProtocol, int, int] | None:
    """(codes, scale, offset, bs, bits) of an asymmetric chain DQ(uint4|uint8, axis=``axis``) -> Reshape ->
    Add(offset) -> Reshape ending in ``value``, else None. The tensors are not read."""
    chain = []
    for op in ("Reshape", "Add", "Reshape", "DequantizeLinear"):
        node = value.producer() if value is not None else None
        if node is None or node.op_type != op or node.domain != "":
            return None
        chain.append(node)
        value = node.inputs[0]
    _, add, _, dq = chain
    offset = add.inputs[1].const_value if add.inputs[1] is not None else None
    codes_v, scale_v = dq.inputs[0], dq.inputs[1]
    bits = _UINT_BITS.get(codes_v.dtype) if codes_v is not None else None
    if offset is None or codes_v is None or scale_v is None or bits is None:
        return None
    if codes_v.const_value is None or scale_v.const_value is None or (len(dq.inputs) > 2 and dq.inputs[2] is not None):
        return None
    block_attr, axis_attr = dq.attributes.get("block_size"), dq.attributes.get("axis")
    if block_attr is None or axis_attr is None or axis_attr.as_int() != axis:
        return None
    return codes_v.const_value, scale_v.const_value, offset, block_attr.as_int(), bits


def _asym_dq(value: ir.Value | None
             ) -> tuple[ir.TensorProtocol, ir.TensorProtocol, ir.TensorProtocol, int, int] | None:
    """(codes [K, N], scale [K/bs, N], offset [K/bs, 1, N], bs, bits) of the asymmetric chain DQ(uint4|uint8) ->
    Reshape -> Add(offset) -> Reshape (see quant_weights), else None. The tensors are not read."""
    found = _asym_chain(value, axis=0)
    if found is None:
        return None
    codes, scale, offset = found[:3]
    scale_shape = tuple(scale.shape.numpy())
    if len(codes.shape) != 2 or len(scale_shape) != 2 or tuple(offset.shape.numpy()) != (scale_shape[0], 1,
                                                                                         scale_shape[1]):
        return None
    return found


def asym_expert_dq(value: ir.Value | None
                   ) -> tuple[ir.TensorProtocol, ir.TensorProtocol, ir.TensorProtocol, int, int] | None:
    """(codes [E, N, K], scale [E, N, K/bs], offset [E, N, K/bs, 1], bs, bits) of an MoE expert weight's asymmetric
    chain (quant_weights' ``_quantize_asym_experts``: DQ along axis 2), else None. The tensors are not read."""
    found = _asym_chain(value, axis=2)
    if found is None:
        return None
    codes, scale, offset, block, _ = found
    e, n, k = (int(d) for d in codes.shape.numpy()) if len(codes.shape) == 3 else (0, 0, 0)
    if not e or block <= 0 or k % block or tuple(scale.shape.numpy()) != (e, n, k // block) \
            or tuple(offset.shape.numpy()) != (e, n, k // block, 1):
        return None
    return found


def _swap(graph: ir.Graph, old: ir.Node, new: ir.Node) -> None:
    for out_old, out_new in zip(old.outputs, new.outputs, strict=False):
        out_new.shape, out_new.type, name = out_old.shape, out_old.type, out_old.name
        out_old.replace_all_uses_with(out_new, replace_graph_outputs=True)
        out_old.name = None
        out_new.name = name
    graph.insert_before(old, new)
    graph.remove(old, safe=True)


def drop_dead_dequantize(graph: ir.Graph) -> None:
    """Remove DequantizeLinear nodes (and int4-asym offset chains) and initializers nothing reads any more."""
    for node in reversed(list(graph)):  # consumers first: Reshape -> Add -> Reshape -> DequantizeLinear
        dead = not any(o.uses() or o in graph.outputs for o in node.outputs)
        chain = node.op_type in ("Reshape", "Add") and (node.outputs[0].name or "").endswith(
            (".dq_asym", ".blocks_offset", ".blocks"))
        if dead and (node.op_type == "DequantizeLinear" or chain):
            graph.remove(node, safe=True)
    for name, value in list(graph.initializers.items()):
        if not value.uses() and value not in graph.outputs:
            graph.initializers.pop(name)
