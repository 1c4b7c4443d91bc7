"""Static activation quantisation (``--quant w8a8`` / ``w8a8-fp8``) as standard ONNX Q/DQ, and its ORT form.

Portable form (``ActivationQuantization``, what TensorRT's strongly typed networks and ORT's QDQ fusion take):
every MatMul whose weight is a per-channel ``DequantizeLinear`` (int8 or float8e4m3fn, ``axis=1``) and whose
activation ``x`` has a calibrated scale gets

    x -> QuantizeLinear(scale [], zero point 0: int8 | float8e4m3fn) -> DequantizeLinear -> MatMul(., DQ(W))

with one Q/DQ pair per activation tensor, shared by the MatMuls that read it (q/k/v read one norm output).
Left fp32 activations: the LM head (its weight-only int8 becomes MatMulNBits), the MoE router, and MoE
experts (com.microsoft.MoE / QMoE take no quantised activations: weight-only).

ONNX Runtime form (``OrtActivationLowering``, int8 only): ORT 1.32 CPU fuses Q/DQ(x) + DQ(W) + MatMul into
``com.microsoft.MatMulIntegerToFloat`` at session load. With int8 weights it picks the U8S8 kernel, which on
AVX2 without VNNI sums pairs of u8 x s8 products in saturating int16 (``vpmaddubsw``): measured 10% wrong
outputs on Gaussian weights. Re-encoding both sides as uint8 with zero point 128 (x + 128, W + 128) is exact
and makes ORT pick the U8U8 kernel, which does not saturate. float8 Q/DQ runs on ORT CPU unfused (fake
quant: the values are rounded to float8, the GEMM is fp32).
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np
import onnx_ir as ir

from moeforge.passes.base import PassContext, add_initializer, required
from moeforge.passes.quant_weights import is_lm_head_node

ZERO_POINT = {"int8": np.int8, "fp8": ml_dtypes.float8_e4m3fn}
U8_ZERO = 128  # ORT form: int8 code c becomes uint8 c + 128


@dataclass(frozen=True)
class ActivationTarget:
    """A MatMul whose activation input ``x`` (``node.inputs[0]``) gets static Q/DQ."""

    node: ir.Node
    weight_dq: ir.Node  # the per-channel DequantizeLinear feeding ``node.inputs[1]``

    @property
    def x(self) -> ir.Value:
        return required(self.node.inputs[0], f"{self.node.name}: activation input")


def activation_targets(model: ir.Model, dtype: str) -> list[ActivationTarget]:
    """MatMuls with a per-channel ``dtype`` (int8 | fp8) weight DequantizeLinear, except the LM head."""
    want = {"int8": ir.DataType.INT8, "fp8": ir.DataType.FLOAT8E4M3FN}[dtype]
    found = []
    for node in model.graph:
        if node.op_type != "MatMul" or node.domain != "" or is_lm_head_node(node):
            continue
        dq = node.inputs[1].producer() if node.inputs[1] is not None else None
        if dq is None or dq.op_type != "DequantizeLinear" or dq.domain != "":
            continue
        codes = dq.inputs[0]
        axis = dq.attributes.get("axis")
        per_channel = axis is not None and axis.as_int() in (1, -1) and "block_size" not in dq.attributes
        if codes is not None and codes.const_value is not None and codes.dtype == want and per_channel:
            found.append(ActivationTarget(node, dq))
    return found


class ActivationQuantization:
    """Insert QuantizeLinear -> DequantizeLinear on each target's activation; returns the tensors quantised.

    ``scales``: activation value name -> per-tensor scale (from ``moeforge.act_calibration``)."""

    name = "quant_activations"

    def __init__(self, scales: dict[str, float], dtype: str) -> None:
        self.scales, self.dtype = scales, dtype

    def apply(self, model: ir.Model, ctx: PassContext) -> int:
        graph = model.graph
        groups: dict[str, list[ActivationTarget]] = {}
        for target in activation_targets(model, self.dtype):
            if target.x.name in self.scales:
                groups.setdefault(target.x.name, []).append(target)
        for name, targets in groups.items():
            x = targets[0].x
            stem = f"{name}.act"
            scale = add_initializer(graph, f"{stem}_scale", ir.tensor(np.array(self.scales[name], np.float32)))
            zero = add_initializer(graph, f"{stem}_zero_point", ir.tensor(np.zeros((), ZERO_POINT[self.dtype])))
            q = ir.node("QuantizeLinear", [x, scale, zero])
            dq = ir.node("DequantizeLinear", [q.outputs[0], scale, zero])
            q.outputs[0].name, q.outputs[0].shape, q.outputs[0].type = f"{stem}_q", x.shape, zero.type
            dq.outputs[0].name, dq.outputs[0].shape, dq.outputs[0].type = f"{stem}_dq", x.shape, x.type
            graph.insert_before(targets[0].node, [q, dq])  # targets are in graph order
            for target in targets:
                target.node.replace_input_with(0, dq.outputs[0])
        return len(groups)


class OrtActivationLowering:
    """int8 activation Q/DQ and their MatMuls' int8 weights -> uint8 with zero point 128 (exact; see above).

    Returns the MatMuls re-encoded. ORT fuses each into MatMulIntegerToFloat (U8U8) at session load."""

    name = "quant_act_lowering"

    def apply(self, model: ir.Model, ctx: PassContext) -> int:
        graph = model.graph
        count = 0
        for q in [n for n in graph if n.op_type == "QuantizeLinear" and n.domain == ""]:
            zero = q.inputs[2] if len(q.inputs) > 2 else None
            if zero is None or zero.const_value is None or zero.dtype != ir.DataType.INT8:
                continue
            dqs = [use.node for use in q.outputs[0].uses()]
            consumers = [use for dq in dqs for use in dq.outputs[0].uses()]
            if not all(dq.op_type == "DequantizeLinear" for dq in dqs) or not consumers:
                continue
            weight_dqs = [_int8_weight_dq(use.node) if use.idx == 0 else None for use in consumers]
            if any(w is None for w in weight_dqs):
                continue  # some reader is not a per-channel int8 MatMul: leave this pair as is
            u8 = add_initializer(graph, f"{zero.name}_u8", ir.tensor(np.full((), U8_ZERO, np.uint8)))
            for node in (q, *dqs):
                node.replace_input_with(2, u8)
            q.outputs[0].type = u8.type
            for wdq in weight_dqs:
                assert wdq is not None
                _to_uint8_weight(graph, wdq)
                count += 1
        _drop_unused_initializers(graph)
        return count


def _int8_weight_dq(matmul: ir.Node) -> ir.Node | None:
    """The MatMul's per-channel int8 weight DQ (used by this MatMul only), else None."""
    if matmul.op_type != "MatMul" or matmul.domain != "" or matmul.inputs[1] is None:
        return None
    dq = matmul.inputs[1].producer()
    if dq is None or dq.op_type != "DequantizeLinear" or len(dq.outputs[0].uses()) != 1:
        return None
    codes = dq.inputs[0]
    axis = dq.attributes.get("axis")
    if codes is None or codes.const_value is None or codes.dtype != ir.DataType.INT8 or codes.shape is None:
        return None
    if len(codes.shape) != 2 or axis is None or axis.as_int() not in (1, -1) or "block_size" in dq.attributes:
        return None
    if len(dq.inputs) > 2 and dq.inputs[2] is not None:
        return None  # already has a zero point
    return dq


def _to_uint8_weight(graph: ir.Graph, dq: ir.Node) -> None:
    codes = dq.inputs[0]
    assert codes is not None and codes.const_value is not None
    unsigned = (codes.const_value.numpy().astype(np.int16) + U8_ZERO).astype(np.uint8)  # [K, N]
    stem = codes.name or "w"
    new_codes = add_initializer(graph, f"{stem}_u8", ir.tensor(unsigned))
    zero = add_initializer(graph, f"{stem}_u8_zero_point", ir.tensor(np.full(unsigned.shape[1], U8_ZERO, np.uint8)))
    dq.replace_input_with(0, new_codes)
    if len(dq.inputs) < 3:
        dq.resize_inputs(3)
    dq.replace_input_with(2, zero)


def fake_quantize_activation(x: np.ndarray, scale: float, dtype: str) -> np.ndarray:
    """numpy reference of QuantizeLinear -> DequantizeLinear (zero point 0, round half to even, saturate)."""
    scaled = np.asarray(x, np.float32) / np.float32(scale)
    if dtype == "int8":
        codes = np.clip(np.rint(scaled), -128, 127)
    else:
        codes = np.clip(scaled, -448.0, 448.0).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    out: np.ndarray = (codes * np.float32(scale)).astype(np.float32)
    return out


def _drop_unused_initializers(graph: ir.Graph) -> None:
    for name, value in list(graph.initializers.items()):
        if not value.uses() and value not in graph.outputs:
            graph.initializers.pop(name)
