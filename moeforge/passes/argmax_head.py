"""A certified argmax head: greedy steps skip most of a float LM head's weight traffic, with the same tokens.

A float32 LM head streams V x H x 4 bytes every decode step (SmolLM2: 49152 x 576, 113 MB: a fifth of the model),
yet a greedy step needs only the argmax. This pass puts the head in an ``If`` on a new optional input
``argmax_only`` (bool, default false, like ``logits_to_keep`` an input backed by an initializer):

    false (the default): logits = hidden @ W                                       every caller so far
    true:  q      = MatMulNBits(hidden, int8 W, blocks of 32 along H)             a quarter of the bytes
           u      = q + [|h|_1, sum_b amax_b(|h|) / 254] @ [alpha; beta]          an upper bound per token
           C, t   = TopK(u, k + 1): the k highest bounds, and the (k+1)-th value t
           exact  = W[:, C]^T . h                                                 k rows of W, float32
           logits = q with exact scattered into C;  logits_certified = max(exact) > t

Every token r outside C has logit_r <= u_r <= t, so when ``logits_certified`` holds the argmax of ``logits`` is the
argmax of the float head (up to float32 summation order: the candidates' logits are the same dot products,
summed in another order). The other values of ``logits`` are approximate: only an argmax may be taken. The
runtime feeds ``argmax_only`` on steps whose every row is plain greedy and reruns the step with the default
(in-place cache writes are idempotent) when a row is not certified -- about 1 step in 100 on SmolLM2 text.

Why u bounds the logit. With w the float weights of token r, w' = s * c its int8 blocks (error <= alpha_r per
element) and h' the int8 activations ONNX Runtime's ``accuracy_level`` 4 kernel computes with (blocks of 32 along
H, scale amax_b / 127, error <= amax_b / 254 per element):
    |w.h - w'.h'| <= sum |w - w'| |h| + sum |w'| |h - h'| <= alpha_r |h|_1 + sum_b beta_r,b amax_b / 254
where beta_r,b = sum over block b of |w'|, bounded by beta_r = max_b beta_r,b. Both constants are per token [V],
scaled by ``SAFETY`` (1.25) for float rounding. A kernel that keeps float activations only tightens it.

Applies to a float32 MatMul head behind ``logits_to_keep`` (contiguous graphs) or ``logits_indices`` (paged graphs,
whose logits [T', V] and flag [T', 1] are squeezed; the pass runs after quantisation, so quantised heads, already
MatMulNBits, are left alone) when V >= 64, with k = min(64, V / 16). The int8 copy adds
V x H bytes (+ scales); a tied head gathers its candidate rows from the embedding table, an untied one from its
[H, V] weight.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from moeforge.core.kv_layout import ARGMAX_ONLY, LOGITS_CERTIFIED, LOGITS_TO_KEEP
from moeforge.passes.base import PassContext, add_initializer
from moeforge.passes.quant_math import pack_nbits

BLOCK = 32  # int8 blocks along H (MatMulNBits' block_size; also the activation blocks of accuracy_level 4)
CANDIDATES = 64  # k: exact logits per row; SmolLM2: 5 of 1030 runs uncertified at 64 (argmax_head.json), ~20% at 8
SAFETY = 1.25  # margin on the bound for float rounding in q, the candidates' dot products and the bound itself
ROWS_PER_CHUNK = 8192  # head rows quantised at a time (bounds the compile-time temporaries)


def quantize_head(table: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Head rows ``table`` [V, H] float32 (row r: token r's weights) -> (MatMulNBits B [V, H/32, 32] uint8,
    scales [V * H/32] float32, bound constants [2, V] float32 = SAFETY * [alpha; beta / 254])."""
    vocab, hidden = table.shape
    packed = np.empty((vocab, hidden // BLOCK, BLOCK), np.uint8)
    scales = np.empty((vocab, hidden // BLOCK), np.float32)
    bound = np.empty((2, vocab), np.float32)
    for lo in range(0, vocab, ROWS_PER_CHUNK):
        rows = np.asarray(table[lo:lo + ROWS_PER_CHUNK], np.float32).reshape(-1, hidden // BLOCK, BLOCK)
        scale = np.abs(rows).max(axis=-1) / 127.0  # [r, H/32]
        scale[scale == 0] = 1.0
        codes = np.clip(np.rint(rows / scale[..., None]), -127, 127)
        dequantized = codes * scale[..., None]
        hi = lo + len(rows)
        packed[lo:hi] = pack_nbits(codes.astype(np.int8).reshape(len(rows), hidden), 8, BLOCK)
        scales[lo:hi] = scale
        bound[0, lo:hi] = np.abs(rows - dequantized).max(axis=(1, 2))  # alpha_r
        bound[1, lo:hi] = np.abs(dequantized).sum(axis=-1).max(axis=-1) / 254.0  # beta_r / 254
    return packed, scales.reshape(-1), (SAFETY * bound).astype(np.float32)


class ArgmaxHead:
    """Put a float32 LM head behind ``If(argmax_only)`` with the certified int8 argmax path (0 or 1 match)."""

    name = "argmax_head"

    def __init__(self, candidates: int = CANDIDATES) -> None:
        self.candidates = candidates

    def apply(self, model: ir.Model, ctx: PassContext) -> int:
        graph = model.graph
        names = {value.name for value in graph.inputs}
        logits = next((value for value in graph.outputs if value.name == "logits"), None)
        if logits is None or ARGMAX_ONLY in names:
            return 0
        # Contiguous graphs: logits [B, S', V] = MatMul(hidden behind logits_to_keep). Paged graphs: logits [T', V] =
        # Squeeze(MatMul(hidden [1, T', H] of the logits_indices rows), 0); the flag then squeezes the same way.
        out, squeeze = logits, None
        head = logits.producer()
        if head is not None and head.op_type == "Squeeze" and "logits_indices" in names and head.inputs[0] is not None:
            squeeze, out = head, head.inputs[0]
            head = out.producer()
        elif LOGITS_TO_KEEP not in names:
            return 0
        if (head is None or (head.domain, head.op_type) != ("", "MatMul") or head.inputs[0] is None
                or head.inputs[1] is None or len(out.uses()) != (1 if squeeze is not None else 0)):
            return 0
        hidden, weight = head.inputs[0], head.inputs[1]
        if out.dtype not in (None, ir.DataType.FLOAT) or out.shape is None or len(out.shape) != 3:
            return 0  # (hidden [B, S', H] may carry no type here: the weight's dtype is MatMul's)
        table, tied = _head_table(weight)
        if table is None or table.dtype != np.float32:
            return 0
        vocab, width = table.shape
        if width % BLOCK or vocab < 64:
            return 0
        packed, scales, bound = quantize_head(table)
        k = min(self.candidates, vocab // 16)

        def const(name: str, data: np.ndarray) -> ir.Value:
            return add_initializer(graph, f"argmax_head.{name}", data)

        last = const("last_axis", np.array([-1], np.int64))
        zero = const("zero", np.array([0], np.int64))
        cut = const("k", np.array([k], np.int64))
        k_plus_1 = const("k_plus_1", np.array([k + 1], np.int64))
        source = tied if tied is not None else weight

        def op(op_type: str, inputs: list[ir.Value | None], out: str, num_outputs: int = 1, domain: str = "",
               **attributes: int | list[int]) -> ir.Node:
            node = ir.node(op_type, inputs, attributes or None, domain=domain, num_outputs=num_outputs,
                           name=f"argmax_head/{out}")
            for i, value in enumerate(node.outputs):
                value.name = f"argmax_head/{out}" + (f"_{i}" if num_outputs > 1 else "")
            return node

        # The certified branch. Shapes: h [B, S', H]; q, u, logits [B, S', V]; C, exact [B, S', k].
        q = op("MatMulNBits", [hidden, const("weight", packed), const("scales", scales)], "draft",
               domain="com.microsoft", K=width, N=vocab, bits=8, block_size=BLOCK, accuracy_level=4)
        absolute = op("Abs", [hidden], "abs")
        norm1 = op("ReduceSum", [absolute.outputs[0], last], "l1", keepdims=1)  # [B, S', 1]
        blocks = op("Reshape", [absolute.outputs[0], const("blocks", np.array([0, 0, width // BLOCK, BLOCK],
                                                                              np.int64))], "blocks")
        amax = op("ReduceMax", [blocks.outputs[0], last], "amax", keepdims=0)  # [B, S', H/32]
        amax_sum = op("ReduceSum", [amax.outputs[0], last], "amax_sum", keepdims=1)  # [B, S', 1]
        features = op("Concat", [norm1.outputs[0], amax_sum.outputs[0]], "features", axis=-1)  # [B, S', 2]
        slack = op("MatMul", [features.outputs[0], const("bound", bound)], "slack")  # [B, S', V]
        upper = op("Add", [q.outputs[0], slack.outputs[0]], "upper")
        top = op("TopK", [upper.outputs[0], k_plus_1], "top", num_outputs=2, axis=-1)
        threshold = op("Slice", [top.outputs[0], cut, k_plus_1, last], "threshold")  # [B, S', 1]
        candidates = op("Slice", [top.outputs[1], zero, cut, last], "candidates")
        if tied is not None:  # the table [V, H]: candidate rows [B, S', k, H]
            rows = [op("Gather", [source, candidates.outputs[0]], "rows", axis=0)]
        else:  # the weight [H, V]: columns [H, B, S', k] -> [B, S', k, H]
            gathered = op("Gather", [source, candidates.outputs[0]], "columns", axis=1)
            rows = [gathered, op("Transpose", [gathered.outputs[0]], "rows", perm=[1, 2, 3, 0])]
        column = op("Unsqueeze", [hidden, last], "column")  # [B, S', H, 1]
        dots = op("MatMul", [rows[-1].outputs[0], column.outputs[0]], "dots")  # [B, S', k, 1]
        exact = op("Squeeze", [dots.outputs[0], last], "exact")
        best = op("ReduceMax", [exact.outputs[0], last], "best", keepdims=1)
        certified = op("Greater", [best.outputs[0], threshold.outputs[0]], "certified")  # [B, S', 1] bool
        merged = op("ScatterElements", [q.outputs[0], candidates.outputs[0], exact.outputs[0]], "logits", axis=-1)
        draft_nodes = [q, absolute, norm1, blocks, amax, amax_sum, features, slack, upper, top, threshold,
                       candidates, *rows, column, dots, exact, best, certified, merged]
        then_branch = ir.Graph([], [merged.outputs[0], certified.outputs[0]], nodes=draft_nodes,
                               name="argmax_head_certified")

        # The default branch: the float head as it was, every row certified. [B, S', 1] true = (0 * h[..., :1]) == 0
        full = op("MatMul", [hidden, weight], "full")
        first = op("Slice", [hidden, zero, const("one", np.array([1], np.int64)), last], "first")
        zeros = op("Mul", [first.outputs[0], const("zero_f", np.zeros(1, np.float32))], "zeros")
        finite = op("Equal", [zeros.outputs[0], zeros.outputs[0]], "all_true")  # a NaN row: false, as in the draft
        else_branch = ir.Graph([], [full.outputs[0], finite.outputs[0]], nodes=[full, first, zeros, finite],
                               name="argmax_head_full")

        flag = ir.Value(name=ARGMAX_ONLY, type=ir.TensorType(ir.DataType.BOOL), shape=ir.Shape([]),
                        const_value=ir.tensor(np.array(False), name=ARGMAX_ONLY))
        graph.inputs.append(flag)
        graph.register_initializer(flag)  # an input with a default: overridable, never required
        branch = ir.node("If", [flag], {"then_branch": then_branch, "else_branch": else_branch}, num_outputs=2,
                         name="argmax_head/If")
        shape = out.shape if out.shape is not None else ir.Shape([None, None, vocab])
        graph.insert_after(head, branch)
        out.replace_all_uses_with(branch.outputs[0], replace_graph_outputs=True)
        graph.remove(head, safe=True)
        name, out.name = out.name, None
        result, certified_out = branch.outputs
        result.name, result.dtype, result.shape = name, ir.DataType.FLOAT, shape
        certified_out.dtype, certified_out.shape = ir.DataType.BOOL, ir.Shape([*list(shape)[:-1], 1])
        if squeeze is not None:  # [1, T', 1] -> [T', 1], as the logits
            squeezed = ir.node("Squeeze", [certified_out, *squeeze.inputs[1:]], name="argmax_head/squeeze")
            graph.insert_after(branch, squeezed)
            certified_out.name = "argmax_head/certified_3d"
            certified_out = squeezed.outputs[0]
            certified_out.dtype = ir.DataType.BOOL
            certified_out.shape = ir.Shape([*list(logits.shape or [None, None])[:-1], 1])
        certified_out.name = LOGITS_CERTIFIED
        graph.outputs.append(certified_out)
        return 1


def _head_table(weight: ir.Value) -> tuple[np.ndarray | None, ir.Value | None]:
    """The head's rows [V, H] as numpy, and the [V, H] table value when the weight is Transpose(table) (a tied
    embedding); (None, None) when the weight is not a constant."""
    if weight.const_value is not None:
        array = weight.const_value.numpy()
        return (array.T if array.ndim == 2 else None), None
    producer = weight.producer()
    if (producer is not None and producer.op_type == "Transpose" and producer.domain == ""
            and producer.inputs[0] is not None and producer.inputs[0].const_value is not None):
        perm = producer.attributes.get_ints("perm", None)
        table = producer.inputs[0].const_value.numpy()
        if table.ndim == 2 and perm in (None, [1, 0], (1, 0)):
            return table, producer.inputs[0]
    return None, None
