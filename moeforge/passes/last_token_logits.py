"""Logits for the last tokens only: an optional graph input ``logits_to_keep`` in front of the LM head.

    hidden [B, S, H] -> Slice(starts = -logits_to_keep, ends = end, axis 1) -> LM head -> logits [B, S', V]

``logits_to_keep`` (transformers' name for the same idea) is an int64 [1] input backed by an initializer 0, and 0
keeps every position (Slice from -0 = 0): callers that do not feed it -- teacher-forced parity, onnxruntime-genai,
plain ``InferenceSession.run`` -- see the graph they always saw. The engine feeds 1 when it runs a prefill chunk and
needs only the last token's logits, so a 512-token prompt costs one row of the vocabulary projection (the largest
matrix of a small model: 49152 x 576 for SmolLM2) and a [1, 1, V] output, not 512 of each.

On a tensor-parallel rank the LM head's logits [B, S, V/N] reach ``logits`` through an AllGather; the Slice goes
in front of the LM head all the same. Paged graphs select their logits rows with ``logits_indices`` already and
are left alone, as is a graph whose ``logits`` output does not come straight from a MatMul-like LM head.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from moeforge.core.kv_layout import LOGITS_TO_KEEP
from moeforge.passes.base import PassContext, add_initializer

# The ops an LM head is after export and quantisation: its input 0 is the hidden state [B, S, H].
LM_HEAD_OPS = {("", "MatMul"), ("com.microsoft", "MatMulNBits"), ("", "Gemm")}


class LastTokenLogits:
    """Insert the ``logits_to_keep`` input and the Slice in front of the LM head (0 or 1 match)."""

    name = "last_token_logits"

    def apply(self, model: ir.Model, ctx: PassContext) -> int:
        graph = model.graph
        names = {value.name for value in graph.inputs}
        if LOGITS_TO_KEEP in names or "logits_indices" in names:
            return 0
        logits = next((value for value in graph.outputs if value.name == "logits"), None)
        head = logits.producer() if logits is not None else None
        if head is not None and (head.domain, head.op_type) == ("com.microsoft", "AllGather") and head.inputs[0]:
            head = head.inputs[0].producer()  # a tensor-parallel rank: its vocabulary rows, then the gather
        if head is None or (head.domain, head.op_type) not in LM_HEAD_OPS or head.inputs[0] is None:
            return 0
        hidden = head.inputs[0]
        keep = ir.Value(name=LOGITS_TO_KEEP, type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([1]),
                        const_value=ir.tensor(np.zeros(1, np.int64), name=LOGITS_TO_KEEP))
        graph.inputs.append(keep)
        graph.register_initializer(keep)  # an input with a default: overridable, never required
        ends = add_initializer(graph, "logits_to_keep/ends", np.array([np.iinfo(np.int64).max], np.int64))
        axes = add_initializer(graph, "logits_to_keep/axes", np.array([1], np.int64))
        neg = ir.Node("", "Neg", [keep], name="logits_to_keep/Neg")
        neg.outputs[0].name = "logits_to_keep/starts"
        sliced = ir.Node("", "Slice", [hidden, neg.outputs[0], ends, axes], name="logits_to_keep/Slice")
        sliced.outputs[0].name = "logits_to_keep/hidden"  # [B, S', H]
        if hidden.dtype is not None:
            sliced.outputs[0].dtype = hidden.dtype
        graph.insert_before(head, [neg, sliced])
        head.replace_input_with(0, sliced.outputs[0])
        return 1
