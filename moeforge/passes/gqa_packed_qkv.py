"""GroupQueryAttention reads the packed q/k/v projection directly: one Split per layer fewer.

    X @ W_qkv [K, (H + 2 Hkv) D] -> Split(H D, Hkv D, Hkv D) -> GQA(q, k, v, ...)
        ->  X @ W_qkv -> GQA(qkv, "", "", ...)

ONNX Runtime's GroupQueryAttention takes a packed [B, S, (H + 2 Hkv) D] query when key and value are absent (the
layout onnxruntime-genai's builder emits), and applies its rotary embedding to the packed input as to separate ones.
At decode every node costs a dispatch, and this removes one of the dozen per layer. Only a Split that cuts its
input's last axis into exactly the head sizes the node's attributes give, whose outputs nothing else reads, is
removed; anything else (MLA's latent attention, a Split shared with another consumer) is left alone.
"""

from __future__ import annotations

import onnx_ir as ir

from moeforge.ops.node_builder import const_array
from moeforge.passes.base import MS_DOMAIN, PassContext


class GqaPackedQkv:
    """Feed GroupQueryAttention the packed q/k/v; returns the number of Splits removed."""

    name = "gqa_packed_qkv"

    def apply(self, model: ir.Model, ctx: PassContext) -> int:
        rewritten = 0
        for node in list(model.graph):
            if node.domain != MS_DOMAIN or node.op_type != "GroupQueryAttention" or len(node.inputs) < 3:
                continue
            split = _packed_split(node)
            if split is None:
                continue
            node.replace_input_with(0, split.inputs[0])
            node.replace_input_with(1, None)
            node.replace_input_with(2, None)
            model.graph.remove(split, safe=True)
            rewritten += 1
        return rewritten


def _packed_split(node: ir.Node) -> ir.Node | None:
    """The Split feeding ``node``'s q, k, v in order with the head sizes of its attributes, else None."""
    q, k, v = node.inputs[0], node.inputs[1], node.inputs[2]
    split = q.producer() if q is not None else None
    if split is None or split.op_type != "Split" or split.domain != "" or len(split.outputs) != 3:
        return None
    if [q, k, v] != list(split.outputs) or any(len(out.uses()) != 1 for out in split.outputs):
        return None
    packed = split.inputs[0]
    rank = packed.shape.rank() if packed is not None and packed.shape is not None else None
    axis = split.attributes.get_int("axis", 0)
    if not (axis == -1 or (rank is not None and axis == rank - 1)) or len(split.inputs) < 2 or split.inputs[1] is None:
        return None
    sizes = const_array(split.inputs[1])
    heads, kv_heads = node.attributes.get_int("num_heads", 0), node.attributes.get_int("kv_num_heads", 0)
    if sizes is None or sizes.shape != (3,) or not heads or not kv_heads:
        return None
    head_size = int(sizes[0]) // heads
    if sizes.tolist() != [heads * head_size, kv_heads * head_size, kv_heads * head_size]:
        return None
    return split
