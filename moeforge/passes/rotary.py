"""Rotary fusion: each exporter ``apply_rotary`` subgraph -> one com.microsoft.RotaryEmbedding.

Dimension letters: B batch, S new tokens, H heads of the rotated tensor (Hq or Hkv for GQA; H for
MLA's q_pe, 1 for its shared k_pe), D rotary dims (``config.rope_dim``: head_dim for GQA,
qk_rope_head_dim for MLA), M = ``ctx.max_seq_len`` (rows of the cos/sin caches).

What the exporter emits (moeforge/model/rope.py), for x [B, S, H, D] and angles = position_ids x inv_freq:
    cos, sin   = Cos(angles) [* amplitude], Sin(angles) [* amplitude]         # [B, S, D/2], shared
    c, s       = Unsqueeze(cos, 2), Unsqueeze(sin, 2)                         # [B, S, 1, D/2]
    half:        x1, x2 = Slice(x, 0:D/2), Slice(x, D/2:)                     # last axis, step 1
                 y = Concat(x1*c - x2*s, x2*c + x1*s, axis=-1)
    interleaved: x1, x2 = Slice(x, 0::2), Slice(x, 1::2)                      # last axis, step 2
                 y = Reshape(Concat(Unsqueeze(x1*c - x2*s, -1), Unsqueeze(x2*c + x1*s, -1), axis=-1),
                             [B, S, H, D])                                    # stack + flatten(-2)

What this pass emits instead (one RotaryEmbedding per application):
    x3 = Reshape(x, [0, 0, H*D])                                              # [B, S, H*D]
    y3 = com.microsoft.RotaryEmbedding(x3, position_ids [B, S] int64,
                                       cos_cache [M, D/2] f32, sin_cache [M, D/2] f32,
                                       interleaved=config.rope.interleaved, num_heads=H,
                                       rotary_embedding_dim=D)
    y  = Reshape(y3, [0, 0, H, D])                                            # [B, S, H, D], as before
The contrib op takes 3D [B, S, H*D] or 4D [B, H, S, D] (heads before sequence), not our [B, S, H, D],
hence the two Reshapes (no data movement). ``cos_cache``/``sin_cache`` are two graph
initializers shared by every node, computed by the PyTorch model's own RotaryEmbedding (float32,
as the reference does), with the YaRN amplitude folded in (the op's ``scale`` attribute is ignored
by the CPU kernel).
The old angle computation (Unsqueeze/Cast/Mul of position_ids, Cos, Sin, amplitude Muls) becomes dead
and is removed here.

Partial rotary (GLM: RoPE on the first R < D dims of each head, rotate_half within them) is exported as
``Concat(rotate(Slice(x, 0:R)), Slice(x, R:), axis=-1)``; after the rewrite above the rotated slice is one
RotaryEmbedding over R dims, and ``_fold_partial_rotary`` then makes the whole head one node, as the contrib
op rotates the first ``rotary_embedding_dim`` dims and passes the rest through:
    y = Reshape(RotaryEmbedding(Reshape(x, [0, 0, H*D]), ..., num_heads=H, rotary_embedding_dim=R), [0, 0, H, D])
(two Slices and a Concat fewer per application; half layout only, the one partial-rotary family uses).

A match is rewritten only when its cos/sin provably come from ``position_ids`` and the configured
rope (inverse frequencies and amplitude equal the config's), its layout equals
``config.rope.interleaved`` and D equals ``config.rope_dim``; otherwise it is left untouched (the
failed check records why, as an onnxscript ``MatchResult.fail`` reason).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx_ir as ir
import torch
from onnxscript.rewriter import MatchContext, MatchResult, pattern

from moeforge.model.rope import RotaryEmbedding, rope_inverse_frequencies
from moeforge.passes.base import MS_DOMAIN, PassContext, ensure_opset, required, rewrite_rule

# Names of the two shared graph initializers [M, D/2] float32.
COS_CACHE = "cos_cache"
SIN_CACHE = "sin_cache"


class RotaryFusion:
    """Exporter rope arithmetic -> com.microsoft.RotaryEmbedding with shared cos/sin caches.

    Returns the number of rope applications rewritten: 2 per layer (q and k; MLA: q_pe and k_pe).

    The caches hold positions 0 .. ``ctx.max_seq_len`` - 1 only. A position >= max_seq_len has no
    row: ONNX Runtime 1.32's CPU kernel then fails the run with INVALID_ARGUMENT ("position_ids value
    ... is out of range"); other execution providers may not check. The runtime enforces
    max_seq_len and the artifact's manifest records it.
    """

    name = "rotary"

    def apply(self, model: ir.Model, ctx: PassContext) -> int:
        graph = model.graph
        state = _FusionState.from_context(ctx)
        cos_cache, cos_created = _shared_initializer(graph, COS_CACHE, state.cos_table)
        sin_cache, sin_created = _shared_initializer(graph, SIN_CACHE, state.sin_table)
        state.cos_cache, state.sin_cache = cos_cache, sin_cache
        rules = pattern.RewriteRuleSet([rewrite_rule(_HalfRotary, state), rewrite_rule(_InterleavedRotary, state)])
        used_before = {v for v in graph.initializers.values() if v.uses()}
        count = rules.apply_to_model(model)
        if count == 0:
            # Leave the graph as we found it: no caches, no opset import.
            for name, created in ((COS_CACHE, cos_created), (SIN_CACHE, sin_created)):
                if created:
                    graph.initializers.pop(name)
            return 0
        ensure_opset(model, MS_DOMAIN, 1)
        _remove_dead(graph, state.replaced)
        if ctx.config.mla is None and state.rope_dim < ctx.config.head_dim and not state.interleaved:
            _fold_partial_rotary(graph, state.rope_dim)
        # Constants only the replaced arithmetic read (inv_freq, slice bounds, amplitude).
        for value in used_before:
            if not value.uses() and not value.is_graph_input() and not value.is_graph_output():
                graph.initializers.pop(required(value.name, "initializer name"))
        return count


@dataclass
class _FusionState:
    """What the rules share: the expected rope, the caches, and the nodes the rewrites made dead."""

    interleaved: bool
    rope_dim: int
    inv_freq: np.ndarray  # [D/2] float32, as the exporter stored it
    amplitude: float
    cos_table: np.ndarray  # [M, D/2] float32
    sin_table: np.ndarray
    cos_cache: ir.Value | None = None
    sin_cache: ir.Value | None = None
    replaced: list[ir.Node] = field(default_factory=list)  # angle nodes of matched applications

    @classmethod
    def from_context(cls, ctx: PassContext) -> _FusionState:
        config = ctx.config
        inv_freq_t, amplitude = rope_inverse_frequencies(config.rope, config.rope_dim, config.max_position_embeddings)
        inv_freq = inv_freq_t.numpy()
        # The tables come from the PyTorch model's own RotaryEmbedding (float32 angles, torch's cos/sin),
        # so the artifact reproduces the reference it is checked against. Float64 tables are closer to
        # the ideal rotation, but differ from PyTorch/transformers by up to half an ulp of the angle,
        # which moved SmolLM2's logits by 5e-4 after 30 layers.
        with torch.no_grad():
            cos, sin = RotaryEmbedding(config)(torch.arange(ctx.max_seq_len, dtype=torch.int64)[None])  # [1, M, D/2]
        return cls(
            interleaved=config.rope.interleaved,
            rope_dim=config.rope_dim,
            inv_freq=inv_freq,
            amplitude=float(amplitude),
            cos_table=cos[0].numpy().astype(np.float32),
            sin_table=sin[0].numpy().astype(np.float32),
        )


@dataclass
class _Angles:
    """Where an application's cos/sin come from: positions [B, S] int64 and the nodes computing them."""

    positions: ir.Value
    inv_freq: np.ndarray
    amplitude: float
    nodes: list[ir.Node]


class _RotaryRule(pattern.RewriteRuleClassBase):
    """Shared check and rewrite; subclasses give the pattern and the slice layout they expect."""

    interleaved: bool

    def __init__(self, state: _FusionState) -> None:
        super().__init__(name=type(self).__name__.lstrip("_"))
        self.state = state
        # Set by a successful check, read by the rewrite that immediately follows it.
        self._angles: _Angles | None = None
        self._shape_node: ir.Node | None = None

    def _check_slices(self, d: int, first: tuple[ir.Value, ...], second: tuple[ir.Value, ...]) -> str | None:
        raise NotImplementedError

    def check(  # type: ignore[override]  # onnxscript's PatternBase.check names this parameter op; it is passed positionally
        self, context: MatchContext, x: ir.Value, cos: ir.Value, sin: ir.Value, start1: ir.Value, end1: ir.Value,
        axis1: ir.Value, step1: ir.Value, start2: ir.Value, end2: ir.Value, axis2: ir.Value, step2: ir.Value, **_: Any,
    ) -> MatchResult:
        result = pattern.MatchResult()
        if self.interleaved != self.state.interleaved:
            layout = "interleaved" if self.interleaved else "half"
            return result.fail(f"graph rotates {layout} pairs, config.rope.interleaved={self.state.interleaved}")
        if x.shape is None or len(x.shape) != 4 or not all(isinstance(x.shape[i], int) for i in (2, 3)):
            return result.fail(f"rotated tensor must be [B, S, H, D] with static H and D, got {x.shape}", x)
        if x.dtype != ir.DataType.FLOAT:
            return result.fail(f"rotated tensor is {x.dtype}; the caches are float32", x)
        d = x.shape[3]
        assert isinstance(d, int)  # static: checked above
        if d != self.state.rope_dim:
            return result.fail(f"rotates {d} dims, config.rope_dim is {self.state.rope_dim}", x)
        reason = self._check_slices(d, (start1, end1, axis1, step1), (start2, end2, axis2, step2))
        if reason is not None:
            return result.fail(reason, x)
        angles = _trace_angles(cos, sin)
        if isinstance(angles, str):
            return result.fail(angles, cos)
        expected = self.state.inv_freq
        if angles.inv_freq.shape != expected.shape or not np.allclose(angles.inv_freq, expected, rtol=1e-6, atol=0):
            return result.fail("the graph's inverse frequencies differ from the config's rope", cos)
        if not np.isclose(angles.amplitude, self.state.amplitude, rtol=1e-6, atol=0):
            return result.fail(f"cos/sin amplitude {angles.amplitude} != config's {self.state.amplitude}", cos)
        self._angles = angles
        return result

    def _emit(self, op: Any, x: ir.Value) -> ir.Value:
        assert self._angles is not None and x.shape is not None
        h, d = x.shape[2], x.shape[3]
        assert isinstance(h, int) and isinstance(d, int)  # static: check() required it
        self.state.replaced.extend(self._angles.nodes)
        x3 = op.Reshape(x, _int64s(op, [0, 0, h * d]))
        x3.shape, x3.type = ir.Shape([x.shape[0], x.shape[1], h * d]), x.type
        y3 = op.RotaryEmbedding(
            x3, self._angles.positions, self.state.cos_cache, self.state.sin_cache,
            interleaved=int(self.interleaved), num_heads=h, rotary_embedding_dim=d, _domain=MS_DOMAIN,
        )
        y3.shape, y3.type = x3.shape, x3.type
        y: ir.Value = op.Reshape(y3, _int64s(op, [0, 0, h, d]))
        return y


class _HalfRotary(_RotaryRule):
    """rotate_half layout: pairs (x_i, x_{i+D/2})."""

    interleaved = False

    def pattern(
        self, op: Any, x: Any, cos: Any, sin: Any, start1: Any, end1: Any, axis1: Any, step1: Any, start2: Any,
        end2: Any, axis2: Any, step2: Any, concat_axis: Any,
    ) -> Any:
        real, imag = _rotation(op, x, cos, sin, (start1, end1, axis1, step1), (start2, end2, axis2, step2))
        return op.Concat(real, imag, axis=concat_axis)

    def check(  # type: ignore[override]  # as _RotaryRule.check; takes concat_axis, then delegates
        self, context: MatchContext, concat_axis: ir.Attr, **kwargs: Any,
    ) -> MatchResult:
        if concat_axis.value not in (-1, 3):
            return pattern.MatchResult().fail(f"halves are concatenated on axis {concat_axis.value}")
        return super().check(context, **kwargs)

    def _check_slices(self, d: int, first: tuple[ir.Value, ...], second: tuple[ir.Value, ...]) -> str | None:
        if _slice_of(first) != (0, d // 2, 1) or _slice_of(second, open_end=d) != (d // 2, d, 1):
            return f"slices {_slice_of(first)}, {_slice_of(second)} are not the halves of {d} dims"
        return None

    def rewrite(self, op: Any, x: ir.Value, **_: Any) -> ir.Value:
        return self._emit(op, x)


class _InterleavedRotary(_RotaryRule):
    """Interleaved layout (DeepSeek): pairs (x_2i, x_2i+1), restacked with Unsqueeze/Concat/Reshape."""

    interleaved = True

    def pattern(
        self, op: Any, x: Any, cos: Any, sin: Any, start1: Any, end1: Any, axis1: Any, step1: Any, start2: Any,
        end2: Any, axis2: Any, step2: Any, axis_real: Any, axis_imag: Any, shape: Any,
    ) -> Any:
        real, imag = _rotation(op, x, cos, sin, (start1, end1, axis1, step1), (start2, end2, axis2, step2))
        pairs = op.Concat(op.Unsqueeze(real, axis_real), op.Unsqueeze(imag, axis_imag), axis=-1)  # [B, S, H, D/2, 2]
        return op.Reshape(pairs, shape, _outputs=["rotated"])

    def check(  # type: ignore[override]  # as _RotaryRule.check; takes the stacking bindings, then delegates
        self, context: MatchContext, x: ir.Value, axis_real: ir.Value, axis_imag: ir.Value, shape: ir.Value,
        rotated: ir.Value, **kwargs: Any,
    ) -> MatchResult:
        result = pattern.MatchResult()
        if _ints(axis_real) not in ([-1], [4]) or _ints(axis_imag) not in ([-1], [4]):
            return result.fail("rotated pairs are not stacked on a new last axis")
        # The flatten's target shape is computed from dynamic dims; trust the exporter's shape
        # annotation that it gives back x's shape [B, S, H, D].
        if rotated.shape is None or x.shape is None or rotated.shape != x.shape:
            return result.fail(f"restacked shape {rotated.shape} is not the input's {x.shape}", rotated)
        self._shape_node = shape.producer()
        return super().check(context, x=x, **kwargs)

    def _check_slices(self, d: int, first: tuple[ir.Value, ...], second: tuple[ir.Value, ...]) -> str | None:
        if _slice_of(first, open_end=d) != (0, d, 2) or _slice_of(second, open_end=d) != (1, d, 2):
            return f"slices {_slice_of(first)}, {_slice_of(second)} are not the even/odd dims of {d}"
        return None

    def rewrite(self, op: Any, x: ir.Value, **_: Any) -> ir.Value:
        if self._shape_node is not None:
            self.state.replaced.append(self._shape_node)  # the flatten's shape computation
        return self._emit(op, x)


def _rotation(op: Any, x: Any, cos: Any, sin: Any, first: tuple[Any, ...], second: tuple[Any, ...]) -> tuple[Any, Any]:
    """The arithmetic both layouts share: (x1*c - x2*s, x2*c + x1*s) for x1, x2 = two slices of x."""
    x1 = op.Slice(x, *first)
    x2 = op.Slice(x, *second)
    return op.Sub(op.Mul(x1, cos), op.Mul(x2, sin)), op.Add(op.Mul(x2, cos), op.Mul(x1, sin))


def _trace_angles(cos_u: ir.Value, sin_u: ir.Value) -> _Angles | str:
    """Follow c/s [B, S, 1, D/2] back to position_ids; a string says why they are not rope angles.

    Expected: c = Unsqueeze(cos, 2), cos = Cos(angles) or Mul(Cos(angles), amplitude), same for sin
    with the same angles and amplitude, angles = Mul(Cast<float>(Unsqueeze(position_ids, 2)), inv_freq).
    """
    nodes: list[ir.Node] = []
    sources = []
    for value, trig in ((cos_u, "Cos"), (sin_u, "Sin")):
        unsqueeze = _producer(value, "Unsqueeze")
        if unsqueeze is None or _ints(unsqueeze.inputs[1]) not in ([2], [-2]):
            return f"{trig.lower()} is not unsqueezed on the head axis"
        inner = unsqueeze.inputs[0]
        amplitude = 1.0
        scaled = _producer(inner, "Mul")
        if scaled is not None:
            trig_value, scale = _split_constant(scaled)
            if trig_value is None or scale is None or scale.size != 1:
                return f"{trig.lower()} is multiplied by something other than a scalar amplitude"
            amplitude = float(scale.reshape(-1)[0])
            nodes.append(scaled)
            inner = trig_value
        trig_node = _producer(inner, trig)
        if trig_node is None:
            return f"no {trig} node under the rotation"
        nodes += [unsqueeze, trig_node]
        sources.append((trig_node.inputs[0], amplitude))
    (angles, cos_amplitude), (sin_angles, sin_amplitude) = sources
    if angles is not sin_angles or cos_amplitude != sin_amplitude:
        return "cos and sin are not taken of the same angles with the same amplitude"

    angle_mul = _producer(angles, "Mul")
    if angle_mul is None:
        return "angles are not positions x inv_freq"
    positions_f, inv_freq = _split_constant(angle_mul)
    if positions_f is None or inv_freq is None:
        return "angles are not positions x a constant inv_freq"
    chain = [angle_mul]
    value = positions_f
    # position_ids [B, S] int64 -> Unsqueeze(2) and Cast(float), in either order.
    for _ in range(2):
        node = value.producer()
        if node is None or node.op_type not in ("Cast", "Unsqueeze"):
            break
        if node.op_type == "Unsqueeze" and _ints(node.inputs[1]) not in ([2], [-1]):
            return "positions are unsqueezed on an unexpected axis"
        if node.op_type == "Cast" and node.attributes.get_int("to") != ir.DataType.FLOAT:
            return "positions are not cast to float32"
        chain.append(node)
        value = required(node.inputs[0], f"{node.name}: input 0")
    if [n.op_type for n in chain[1:]] not in (["Cast", "Unsqueeze"], ["Unsqueeze", "Cast"]):
        return "angles are not computed from integer positions"
    if value.dtype != ir.DataType.INT64 or value.shape is None or len(value.shape) != 2:
        return f"positions {value.name} are not int64 [B, S]"
    return _Angles(value, inv_freq.reshape(-1), cos_amplitude, nodes + chain)


def _producer(value: ir.Value | None, op_type: str) -> ir.Node | None:
    node = value.producer() if value is not None else None
    return node if node is not None and node.op_type == op_type and node.domain == "" else None


def _split_constant(node: ir.Node) -> tuple[ir.Value | None, np.ndarray | None]:
    """For a binary node with one constant input: (the other input, the constant as an array)."""
    a, b = node.inputs[0], node.inputs[1]
    for value, other in ((b, a), (a, b)):
        tensor = ir.convenience.get_const_tensor(value) if value is not None else None
        if tensor is not None:
            return other, tensor.numpy()
    return None, None


def _ints(value: ir.Value | None) -> list[int] | None:
    tensor = ir.convenience.get_const_tensor(value) if value is not None else None
    if tensor is None or tensor.dtype not in (ir.DataType.INT64, ir.DataType.INT32):
        return None
    return [int(v) for v in np.asarray(tensor.numpy()).reshape(-1)]


def _slice_of(params: tuple[ir.Value | None, ...], open_end: int | None = None) -> tuple[int, int, int] | None:
    """(start, end, step) of a Slice on the last axis of a 4D tensor; an end >= open_end reads as open_end.

    torch exports an open-ended slice (x[..., D/2:], x[..., 1::2]) with end INT64_MAX.
    """
    starts, ends, axes, steps = (_ints(v) for v in params)
    if starts is None or ends is None or axes is None or steps is None:
        return None
    if any(len(v) != 1 for v in (starts, ends, axes, steps)) or axes[0] not in (3, -1):
        return None
    end = ends[0]
    if open_end is not None and end >= open_end:
        end = open_end
    return starts[0], end, steps[0]


def _int64s(op: Any, values: list[int]) -> ir.Value:
    const: ir.Value = op.Constant(value=ir.tensor(np.array(values, dtype=np.int64)))
    return const


def _shared_initializer(graph: ir.Graph, name: str, table: np.ndarray) -> tuple[ir.Value, bool]:
    """The graph initializer ``name`` holding ``table``; (value, True) when this call created it."""
    existing = graph.initializers.get(name)
    if existing is not None:
        current = existing.const_value.numpy() if existing.const_value is not None else None
        if current is None or current.shape != table.shape or not np.array_equal(current, table):
            raise ValueError(f"initializer {name!r} exists with other contents (another rope or max_seq_len?)")
        return existing, False
    value = ir.Value(name=name, shape=ir.Shape(table.shape), type=ir.TensorType(ir.DataType.FLOAT),
                     const_value=ir.tensor(table, name=name))
    graph.register_initializer(value)
    return value, True


def _fold_partial_rotary(graph: ir.Graph, rotary_dim: int) -> int:
    """Concat(Reshape(RotaryEmbedding(Reshape(Slice(x, 0:R)))), Slice(x, R:)) -> one RotaryEmbedding over the whole
    head [B, S, H, D] with rotary_embedding_dim=R; returns the applications folded (a shape that does not fit is
    left as it is: the unfolded form is exact too)."""
    folded = 0
    for concat in [n for n in graph if n.op_type == "Concat" and n.domain == ""]:
        match = _partial_rotary_match(concat, rotary_dim)
        if match is None:
            continue
        x, rotary, chain = match
        assert x.shape is not None  # checked by the match
        h, d = x.shape[2], x.shape[3]
        assert isinstance(h, int) and isinstance(d, int)
        shape3 = ir.node("Constant", [], attributes={"value": ir.tensor(np.array([0, 0, h * d], np.int64))})
        flat = ir.node("Reshape", [x, shape3.outputs[0]])
        flat.outputs[0].shape, flat.outputs[0].type = ir.Shape([x.shape[0], x.shape[1], h * d]), x.type
        attributes = {"interleaved": 0, "num_heads": h, "rotary_embedding_dim": rotary_dim}
        rotated = ir.node("RotaryEmbedding", [flat.outputs[0], *rotary.inputs[1:]], attributes=attributes,
                          domain=MS_DOMAIN)
        rotated.outputs[0].shape, rotated.outputs[0].type = flat.outputs[0].shape, x.type
        shape4 = ir.node("Constant", [], attributes={"value": ir.tensor(np.array([0, 0, h, d], np.int64))})
        y = ir.node("Reshape", [rotated.outputs[0], shape4.outputs[0]])
        old = concat.outputs[0]
        y.outputs[0].shape, y.outputs[0].type = old.shape, old.type
        graph.insert_before(concat, [shape3, flat, rotated, shape4, y])
        ir.convenience.replace_all_uses_with(old, y.outputs[0], replace_graph_outputs=True)
        name, old.name = old.name, None
        y.outputs[0].name = name
        _remove_dead(graph, [concat, *chain])
        folded += 1
    return folded


def _partial_rotary_match(concat: ir.Node, rotary_dim: int) -> tuple[ir.Value, ir.Node, list[ir.Node]] | None:
    """(x [B, S, H, D], its RotaryEmbedding node over x[..., :R], the nodes the fold replaces), or None."""
    if len(concat.inputs) != 2 or concat.attributes.get_int("axis", 0) not in (-1, 3):
        return None
    head, tail = concat.inputs
    back = _single_use_producer(head, "Reshape")
    rotary = _single_use_producer(back.inputs[0] if back is not None else None, "RotaryEmbedding", MS_DOMAIN)
    flat = _single_use_producer(rotary.inputs[0] if rotary is not None else None, "Reshape")
    first = _single_use_producer(flat.inputs[0] if flat is not None else None, "Slice")
    second = _single_use_producer(tail, "Slice")
    if back is None or rotary is None or flat is None or first is None or second is None:
        return None
    if len(first.inputs) != 5 or len(second.inputs) != 5:  # data, starts, ends, axes, steps
        return None
    x = first.inputs[0]
    if x is None or second.inputs[0] is not x or x.shape is None or len(x.shape) != 4:
        return None
    d = x.shape[3]
    if not isinstance(x.shape[2], int) or not isinstance(d, int) or x.dtype != ir.DataType.FLOAT:
        return None
    if (rotary.attributes.get_int("interleaved", 0) != 0
            or rotary.attributes.get_int("rotary_embedding_dim", 0) != rotary_dim
            or _slice_of(tuple(first.inputs[1:5]), open_end=d) != (0, rotary_dim, 1)
            or _slice_of(tuple(second.inputs[1:5]), open_end=d) != (rotary_dim, d, 1)):
        return None
    return x, rotary, [back, rotary, flat, first, second]


def _single_use_producer(value: ir.Value | None, op_type: str, domain: str = "") -> ir.Node | None:
    # The fold removes the chain, so each value in it must feed only the next node of it.
    if value is None or len(value.uses()) != 1 or value.is_graph_output():
        return None
    node = value.producer()
    return node if node is not None and node.op_type == op_type and node.domain == domain else None


def _remove_dead(graph: ir.Graph, candidates: list[ir.Node]) -> None:
    # Consumers before producers (reverse graph order), so a chain dies in one sweep. A candidate
    # still used elsewhere (e.g. cos feeding something else) stays.
    pending = set(candidates)
    for node in reversed(list(graph)):
        if node in pending and all(not out.uses() and not out.is_graph_output() for out in node.outputs):
            graph.remove(node, safe=True)
