"""A tied embedding table stored as the LM head's quantised codes when those hold exactly its values.

A tied model keeps two copies of one matrix: the fp32 table the input Gather reads ([V, K]: SmolLM2's 49152 x
576 is 113 MB, half of an int4 artifact) and the LM head's MatMulNBits codes. When dequantising the head's codes
gives back the table itself -- a GGUF's Q8_0 ``token_embd`` under the int8 head, whose blocks of 32 reproduce
Q8_0 -- the lookup becomes ``com.microsoft.GatherBlockQuantized`` over a copy of those codes (ONNX Runtime
dequantises the gathered rows only), 4x smaller than the fp32 table, with the same numbers. Any other table (an
fp32 checkpoint's, which the head rounds) stays fp32: the lookup is never made less exact.

    Gather(table [V, K] fp32, ids)  ->  Reshape(GatherBlockQuantized(codes [V, K/bs, bs*bits/8], ids,
        scales [V, K/bs, 1]; gather_axis 0, quantize_axis 2, block_size bs, bits), [ids dims..., K])

The codes are a copy, not the head's tensor: ONNX Runtime frees a MatMulNBits weight after prepacking it only
when no other node reads it, and keeps an external initializer memory-mapped, so the lookup's copy costs disk
(a quarter of the table's) but only the looked-up rows of memory. The saving is on disk, not in the process.
"""

from __future__ import annotations

import functools

import numpy as np
import onnx_ir as ir

from moeforge.ops.node_builder import lazy_tensor
from moeforge.passes.base import MS_DOMAIN, PassContext, add_initializer, ensure_opset


class SharedEmbedding:
    """Rewrite the embedding Gather of a tied model onto a copy of its LM head's MatMulNBits codes when they
    reproduce the table exactly; returns the number of lookups rewritten (0 or 1)."""

    name = "shared_embedding"

    def apply(self, model: ir.Model, ctx: PassContext) -> int:
        if not ctx.config.tie_word_embeddings:  # an untied table is its own tensor: no head holds it
            return 0
        graph = model.graph
        heads = [n for n in graph if n.op_type == "MatMulNBits" and n.domain == MS_DOMAIN and len(n.inputs) == 3]
        for gather in list(graph):
            table = gather.inputs[0] if gather.op_type == "Gather" and gather.domain == "" else None
            axis = gather.attributes.get("axis")
            if table is None or table.const_value is None or (axis is not None and axis.as_int() != 0):
                continue
            if len(table.shape or ()) != 2 or table.dtype != ir.DataType.FLOAT or len(list(table.uses())) != 1:
                continue
            array = table.const_value.numpy()  # [V, K]
            head = next((h for h in heads if _holds(h, array)), None)
            if head is None:
                continue
            codes, scales = head.inputs[1], head.inputs[2]
            assert codes is not None and scales is not None and codes.const_value is not None and \
                scales.const_value is not None  # _holds read both
            bits, block = head.attributes["bits"].as_int(), head.attributes["block_size"].as_int()
            vocab, hidden = array.shape
            ids = gather.inputs[1]
            if ids is None or ids.shape is None:  # the output Reshape keeps the ids' dims: their rank is needed
                continue
            rank = len(ids.shape)
            # Copies of the head's codes [V, K/bs, bs*bits/8] and scales [V, K/bs, 1], not the head's own tensors:
            # ONNX Runtime releases a MatMulNBits weight once prepacked unless another node reads it, and keeps an
            # external initializer memory-mapped, so only the rows looked up are ever resident.
            # Lazy: a streamed compile (or lazily quantised codes) computes them when the artifact is written.
            codes_tensor, scales_tensor = codes.const_value, scales.const_value
            scale_shape = (vocab, hidden // block, 1)
            codes_copy = add_initializer(graph, f"{table.name}.rows_nbits", lazy_tensor(
                functools.partial(_reshaped, codes_tensor, tuple(codes_tensor.shape.numpy())), codes_tensor.dtype,
                codes_tensor.shape.numpy()))
            scales_copy = add_initializer(graph, f"{table.name}.rows_scale", lazy_tensor(
                functools.partial(_reshaped, scales_tensor, scale_shape), scales_tensor.dtype, scale_shape))
            rows = ir.node("GatherBlockQuantized", [codes_copy, ids, scales_copy], domain=MS_DOMAIN,
                           attributes={"gather_axis": 0, "quantize_axis": 2, "block_size": block, "bits": bits})
            lookup = ir.node("Reshape", [rows.outputs[0], add_initializer(  # [..., K/bs, bs] -> [..., K]
                graph, f"{table.name}.rows_shape", np.array([0] * rank + [hidden], np.int64))])
            out = gather.outputs[0]
            lookup.outputs[0].shape, lookup.outputs[0].type, name = out.shape, out.type, out.name
            out.replace_all_uses_with(lookup.outputs[0], replace_graph_outputs=True)
            out.name = None
            lookup.outputs[0].name = name
            for node in (rows, lookup):
                graph.insert_before(gather, node)
            graph.remove(gather, safe=True)
            if table.name is not None and table.name in graph.initializers and not table.uses():
                graph.initializers.pop(table.name)
            ensure_opset(model, MS_DOMAIN, 1)
            return 1
        return 0


def _reshaped(tensor: ir.TensorProtocol, shape: tuple[int, ...]) -> np.ndarray:
    """A contiguous copy of ``tensor``'s values in ``shape``."""
    return np.ascontiguousarray(tensor.numpy().reshape(shape)).copy()


def _holds(head: ir.Node, table: np.ndarray) -> bool:
    """Whether MatMulNBits ``head`` (default zero point, no g_idx) dequantises to ``table`` [V, K] transposed: its
    N x K weight row n is table row n, to fp32 rounding of code * scale."""
    codes_v, scales_v = head.inputs[1], head.inputs[2]
    if codes_v is None or scales_v is None or codes_v.const_value is None or scales_v.const_value is None:
        return False
    bits, block = head.attributes["bits"].as_int(), head.attributes["block_size"].as_int()
    n, k = head.attributes["N"].as_int(), head.attributes["K"].as_int()
    if (n, k) != table.shape or bits not in (4, 8) or k % block:
        return False
    packed_all = codes_v.const_value.numpy().reshape(n, -1)  # [N, K * bits / 8] uint8
    scales_all = scales_v.const_value.numpy().reshape(n, k // block)
    for lo in range(0, n, _ROWS):  # a block of rows at a time: the temporaries stay small; the first miss returns
        packed = packed_all[lo:lo + _ROWS]
        rows = packed.shape[0]
        if bits == 4:  # element 2j in the low nibble, 2j + 1 in the high one
            codes = np.empty((rows, k), np.int16)
            codes[:, 0::2], codes[:, 1::2] = packed & 0xF, packed >> 4
        else:
            codes = packed.astype(np.int16)
        scales = scales_all[lo:lo + _ROWS].astype(np.float32)
        weight = (codes - (1 << (bits - 1))).astype(np.float32).reshape(rows, k // block, block) * scales[:, :, None]
        if not np.allclose(weight.reshape(rows, k), table[lo:lo + _ROWS], rtol=2**-20, atol=0.0):
            return False
    return True


_ROWS = 4096  # rows compared at once
