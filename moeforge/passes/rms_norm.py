"""RMSNorm fusions for ONNX Runtime: one ``SimplifiedLayerNormalization`` per norm site, then the
residual add folded in as ``com.microsoft.SkipSimplifiedLayerNormalization``.

Glossary of dimension letters used in the shape comments:

    B  batch size
    S  sequence length
    H  size of the normalised (last) axis: hidden_size for input_layernorm,
       post_attention_layernorm and the final norm; q_lora_rank / kv_lora_rank for the MLA
       latent norms (q_a_layernorm, kv_a_layernorm)

What the exporter (torch 2.13, opset 23) makes of ``weight * F.rms_norm(x.float(), eps).to(x.dtype)``::

    x [B, S, H] -> Cast(to=float)?   (only when x is not fp32)   = xf
    xf -> Shape -> ConstantOfShape(value=1.0)                    = ones [B, S, H]  (built at run time!)
    RMSNormalization(xf, ones, axis=-1, epsilon, stash_type=1)   = normed
    normed -> Cast(to=x.dtype)?      (only when x is not fp32)
    Mul(weight [H], .)                                           = y [B, S, H]

``F.rms_norm`` without a weight still has to give ``RMSNormalization`` its required scale, so the
exporter builds a ones tensor of the input's FULL shape at run time, and the weight is a separate Mul.
On ORT 1.32 CPU that form (4 kernels, 2 extra [B, S, H] tensors) took 862 us for 512 tokens of
H=576 where one SimplifiedLayerNormalization took 92 us (RMSNormalization with a [H] scale: 94 us).
ORT's own optimiser (checked at EXTENDED) leaves it as is. ORT's CPU RMSNormalization has no bfloat16
kernel (it falls back to the function body, which fails); SimplifiedLayerNormalization has one.

Passes, to run in this order (SkipRmsNormFusion matches what RmsNormFusion emits):

``RmsNormFusion`` ("rms_norm") rewrites each norm site to
``SimplifiedLayerNormalization(X, scale, axis=-1, epsilon, stash_type=1)``, an ORT op registered in the
DEFAULT domain. Two rule sets, applied one after the other:
  1. weighted: the pattern above -> ``SLN(x, weight)``; the casts go (SLN computes in fp32 with
     stash_type=1 and returns the scale's dtype), and the now-dead Cast/Shape/ConstantOfShape
     feeding the norm are removed.
  2. bare: an ``RMSNormalization`` whose output does not go (only) to a weight Mul is still renamed
     1:1 to ``SLN(x, scale)`` (a ones scale becomes a constant ones[H]): same numbers, no run-time
     ones tensor, a bfloat16 kernel, and the skip fusion can see it. It counts as a site.

``SkipRmsNormFusion`` ("skip_rms_norm") rewrites ``SLN(Add(a, b), gamma)`` into
``SkipSimplifiedLayerNormalization(a, b, gamma, epsilon)`` (domain com.microsoft, opset 1). Outputs:
0 = normalised value, 1 = mean, 2 = inv_std_var, 3 = input_skip_bias_sum (a + b). When the sum is
also used elsewhere (the residual stream) output 3 replaces it; when it is not (the final norm), the
fused node has output 0 only and a + b is never written out. Output 3 is numerically the Add.
Speed caveat, measured on ORT 1.32 CPU (H=576, one thread): the fused kernel ties Add + SLN at one
token but is slower for more (14 tokens 22 vs 16 us, 512 tokens 387 vs 157 us), and ORT's own
optimiser does not make this fusion for the CPU provider. Its case is memory traffic on GPU
providers (not measured here); whether to run it for a CPU artifact is the pipeline's choice.

A site that fails a check (unknown shapes, unsupported dtype or axis, a broadcasting Add, ...) is
left as it is and not counted; checks run before anything is rewritten.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import MatchContext, MatchResult, pattern

from moeforge.passes.base import MS_DOMAIN, PassContext, ensure_opset, required, rewrite_rule

log = logging.getLogger(__name__)

_FLOAT = ir.DataType.FLOAT
_F16 = ir.DataType.FLOAT16
_BF16 = ir.DataType.BFLOAT16
_DOUBLE = ir.DataType.DOUBLE

# (X dtype, scale dtype) pairs for which ORT's CPU SimplifiedLayerNormalization kernel exists
# (checked on ORT 1.32); e.g. (double, float) has no kernel, so such a site is left alone.
_SLN_DTYPES = frozenset({(_FLOAT, _FLOAT), (_F16, _F16), (_BF16, _BF16), (_DOUBLE, _DOUBLE),
                         (_F16, _FLOAT), (_FLOAT, _F16)})
# Input dtypes whose Cast to float in front of the norm is exact, so the fused node may read x itself.
_UPCASTABLE = frozenset({_FLOAT, _F16, _BF16})
# SkipSimplifiedLayerNormalization's type constraint T (one dtype for input, skip and gamma).
_SKIP_DTYPES = frozenset({_FLOAT, _F16, _BF16})
_SKIP_RANKS = (2, 3)  # ORT's kernel rejects any other rank ("expected to have 3 or 2 dimensions")


# ---------------------------------------------------------------------------------------------- passes
class RmsNormFusion:
    """RMSNormalization (+ ones scale, optional casts, weight Mul) -> SimplifiedLayerNormalization.

    Returns the number of norm sites rewritten (weighted and bare together).
    """

    name = "rms_norm"

    def apply(self, model: ir.Model, ctx: PassContext) -> int:
        leftovers: list[ir.Node] = []  # producers of the exporter's ones scale / input cast
        # Two sets, not one: a set tries its rules node by node in graph order, so the bare rule
        # (rooted at RMSNormalization) would claim every norm before the weighted rule (rooted at
        # the later Mul) got to see it.
        weighted_rules = pattern.RewriteRuleSet([rewrite_rule(_WeightedRmsNorm, leftovers)], commute=True)
        weighted = weighted_rules.apply_to_model(model)
        bare = pattern.RewriteRuleSet([rewrite_rule(_BareRmsNorm, leftovers)]).apply_to_model(model)
        _remove_dead(leftovers)
        log.debug("rms_norm: %d weighted, %d bare sites", weighted, bare)
        return weighted + bare


class SkipRmsNormFusion:
    """Add + SimplifiedLayerNormalization -> com.microsoft.SkipSimplifiedLayerNormalization.

    Run after ``RmsNormFusion``. Returns the number of residual-add + norm sites rewritten.
    """

    name = "skip_rms_norm"

    def apply(self, model: ir.Model, ctx: PassContext) -> int:
        # The sum-unused rule goes first: its single-output pattern only matches when the Add
        # feeds the norm alone (the matcher refuses to delete a value used elsewhere), so every
        # other site falls through to the rule that wires output 3.
        rules = pattern.RewriteRuleSet([rewrite_rule(_SkipRmsNormSumUnused), rewrite_rule(_SkipRmsNormSumReused)])
        count = rules.apply_to_model(model)
        if count:
            ensure_opset(model, MS_DOMAIN, 1)
            _drop_unused_stat_outputs(model.graph)
        return count


# ----------------------------------------------------------------------------------- RmsNormFusion rules
class _WeightedRmsNorm(pattern.RewriteRuleClassBase):
    """Mul(weight [H], Cast?(RMSNormalization(x, ones))) -> SLN(uncast(x), weight)."""

    def __init__(self, leftovers: list[ir.Node]) -> None:
        super().__init__("WeightedRmsNorm")
        self._leftovers = leftovers

    def pattern(self, op: Any, x: Any, scale: Any, weight: Any, out_dtype: Any) -> Any:
        normed = op.RMSNormalization(x, scale, _allow_other_attributes=True, _outputs=["normed"])
        normed = pattern.OrValue([op.Cast(normed, to=out_dtype, _allow_other_attributes=True), normed])
        return op.Mul(weight, normed, _outputs=["y"])

    def check(  # type: ignore[override]  # onnxscript's PatternBase.check names this parameter op; it is passed positionally
        self, context: MatchContext, x: ir.Value, scale: ir.Value, weight: ir.Value, normed: ir.Value, y: ir.Value,
        **_: Any,
    ) -> MatchResult:
        result = _norm_match(normed, x)
        if not result:
            return result
        source = _uncast(x)
        hidden = _last_dim(source)
        if hidden is None:
            return result.fail("the normalised axis has no static size", source)
        if not _is_ones(scale, x, hidden):
            return result.fail("the RMSNormalization scale is not a ones tensor; it stays a bare norm", scale)
        if weight.shape is None or weight.shape.dims != (hidden,):
            return result.fail(f"the Mul operand is not a weight of shape [{hidden}]", weight)
        if y.dtype != weight.dtype:
            return result.fail("the Mul output dtype differs from the weight dtype", y)
        if (source.dtype, weight.dtype) not in _SLN_DTYPES:
            return result.fail(f"no ORT kernel for SLN({source.dtype}, {weight.dtype})", source)
        return result

    def rewrite(self, op: Any, x: ir.Value, scale: ir.Value, weight: ir.Value, normed: ir.Value,
                **_: Any) -> ir.Value:
        node = _producer(normed)
        self._leftovers.extend(p for p in (scale.producer(), x.producer()) if p is not None)
        y: ir.Value = op.SimplifiedLayerNormalization(
            _uncast(x), weight, axis=-1, epsilon=_epsilon(node), stash_type=1,  # stash 1: fp32 statistics
        )
        return y


class _BareRmsNorm(pattern.RewriteRuleClassBase):
    """RMSNormalization(x, scale) with no weight Mul to absorb -> SLN(x, scale), same numbers."""

    def __init__(self, leftovers: list[ir.Node]) -> None:
        super().__init__("BareRmsNorm")
        self._leftovers = leftovers

    def pattern(self, op: Any, x: Any, scale: Any) -> Any:
        return op.RMSNormalization(x, scale, _allow_other_attributes=True, _outputs=["normed"])

    def check(  # type: ignore[override]  # onnxscript's PatternBase.check names this parameter op; it is passed positionally
        self, context: MatchContext, x: ir.Value, scale: ir.Value, normed: ir.Value, **_: Any,
    ) -> MatchResult:
        result = _norm_match(normed, x)
        if not result:
            return result
        hidden = _last_dim(x)
        if hidden is None:
            return result.fail("the normalised axis has no static size", x)
        if scale.dtype is None or (x.dtype, scale.dtype) not in _SLN_DTYPES:
            return result.fail(f"no ORT kernel for SLN({x.dtype}, {scale.dtype})", x)
        # ORT's SLN reads scale[0:H] without broadcasting: only a ones scale (rebuilt as ones[H])
        # or a scale that is already [H] can be passed on.
        if not _is_ones(scale, x, hidden) and (scale.shape is None or scale.shape.dims != (hidden,)):
            return result.fail(f"the scale is neither ones nor of shape [{hidden}]", scale)
        return result

    def rewrite(self, op: Any, x: ir.Value, scale: ir.Value, normed: ir.Value, **_: Any) -> ir.Value:
        hidden = _last_dim(x)
        assert hidden is not None  # guaranteed by check
        if _is_ones(scale, x, hidden):
            scale_producer = scale.producer()
            if scale_producer is not None:
                self._leftovers.append(scale_producer)
            assert scale.dtype is not None  # guaranteed by check (a known SLN dtype pair)
            scale = op.Constant(value=ir.tensor(np.ones(hidden, dtype=scale.dtype.numpy())))
        y: ir.Value = op.SimplifiedLayerNormalization(
            x, scale, axis=-1, epsilon=_epsilon(_producer(normed)), stash_type=1)
        return y


# ------------------------------------------------------------------------------ SkipRmsNormFusion rules
class _SkipRmsNormBase(pattern.RewriteRuleClassBase):
    """Shared checks: SLN over the last axis with fp32 statistics, Add of two same-shape tensors."""

    def check(  # type: ignore[override]  # onnxscript's PatternBase.check names this parameter op; it is passed positionally
        self, context: MatchContext, a: ir.Value, b: ir.Value, gamma: ir.Value, normed: ir.Value, **_: Any,
    ) -> MatchResult:
        result = pattern.MatchResult()
        node = _producer(normed)
        if node.attributes.get_int("stash_type", 1) != 1:
            return result.fail("SkipSimplifiedLayerNormalization always keeps fp32 statistics", node)
        if len(node.outputs) > 1 and (node.outputs[1].uses() or node.outputs[1].is_graph_output()):
            return result.fail("the SLN's inv_std_var output is used", node)
        # The fused kernel has no broadcasting beyond (1, S, H) skips; demand equal shapes so any
        # operand can be "input" (a + b == b + a bit for bit).
        if not _same_static_shape(a, b):
            return result.fail("the Add operands do not have one known shape", a)
        assert a.shape is not None  # _same_static_shape checked it
        rank = a.shape.rank()
        if rank not in _SKIP_RANKS:
            return result.fail(f"ORT's kernel takes rank 2 or 3 inputs, not {rank}", a)
        axis = node.attributes.get_int("axis", -1)
        if axis not in (-1, rank - 1):
            return result.fail(f"SLN normalises from axis {axis}, not the last one", node)
        hidden = a.shape[-1]
        if gamma.shape is None or gamma.shape.dims != (hidden,):
            return result.fail(f"gamma is not of shape [{hidden}]", gamma)
        if not (a.dtype == b.dtype == gamma.dtype) or a.dtype not in _SKIP_DTYPES:
            return result.fail("input, skip and gamma need one dtype among float, float16, bfloat16", a)
        return result


class _SkipRmsNormSumUnused(_SkipRmsNormBase):
    """SLN(Add(a, b), gamma) where a + b feeds the norm only (the final norm) -> Skip..., output 0 only."""

    def __init__(self) -> None:
        super().__init__("SkipRmsNormSumUnused")

    def pattern(self, op: Any, a: Any, b: Any, gamma: Any) -> Any:
        return op.SimplifiedLayerNormalization(op.Add(a, b), gamma, _allow_other_attributes=True, _outputs=["normed"])

    def rewrite(self, op: Any, a: ir.Value, b: ir.Value, gamma: ir.Value, normed: ir.Value,
                **_: Any) -> ir.Value:
        y: ir.Value = op.SkipSimplifiedLayerNormalization(
            a, b, gamma, epsilon=_epsilon(_producer(normed)), _domain=MS_DOMAIN, _version=1,
        )
        return y


class _SkipRmsNormSumReused(_SkipRmsNormBase):
    """SLN(Add(a, b), gamma) where a + b is also the residual stream -> Skip..., outputs 0 and 3."""

    def __init__(self) -> None:
        super().__init__("SkipRmsNormSumReused")

    def pattern(self, op: Any, a: Any, b: Any, gamma: Any) -> Any:
        total = op.Add(a, b)
        normed = op.SimplifiedLayerNormalization(total, gamma, _allow_other_attributes=True, _outputs=["normed"])
        return normed, total

    def rewrite(self, op: Any, a: ir.Value, b: ir.Value, gamma: ir.Value, normed: ir.Value,
                **_: Any) -> tuple[ir.Value, ir.Value]:
        out, _mean, _inv_std_var, total = op.SkipSimplifiedLayerNormalization(
            a, b, gamma, epsilon=_epsilon(_producer(normed)), _domain=MS_DOMAIN, _version=1, _outputs=4,
        )
        return out, total


# ---------------------------------------------------------------------------------------------- helpers
def _producer(normed: ir.Value) -> ir.Node:
    """The node that computes ``normed``: the matched norm node, which the pattern itself provides."""
    return required(normed.producer(), f"{normed.name}: producer")


def _norm_match(normed: ir.Value, x: ir.Value) -> MatchResult:
    """A match result for the RMSNormalization producing ``normed`` over ``x``: failed with the reason when its
    attributes do not fit SLN."""
    result = pattern.MatchResult()
    node = _producer(normed)
    reason = _norm_attribute_problem(node, x)
    return result.fail(reason, node) if reason else result


def _norm_attribute_problem(node: ir.Node, x: ir.Value) -> str | None:
    """Why an RMSNormalization node cannot become SLN(axis=-1, stash_type=1), or None."""
    axis = node.attributes.get_int("axis", -1)
    rank = x.shape.rank() if x.shape is not None else None
    if axis != -1 and (rank is None or axis != rank - 1):
        return f"normalises from axis {axis}, not only the last one"
    # stash_type 1 = statistics in fp32, what SLN is emitted with; another type would change numbers.
    if node.attributes.get_int("stash_type", 1) != 1:
        return "stash_type is not float"
    return None


def _epsilon(node: ir.Node) -> float:
    return node.attributes.get_float("epsilon", 1e-5)  # 1e-5: the ONNX default when absent


def _uncast(x: ir.Value) -> ir.Value:
    """The value in front of an exact upcast to float (the exporter's ``x.float()``), else x."""
    node = x.producer()
    if node is None or node.op_type != "Cast" or node.domain != "" or x.dtype != _FLOAT:
        return x
    source = node.inputs[0]
    return source if source is not None and source.dtype in _UPCASTABLE else x


def _last_dim(x: ir.Value) -> int | None:
    if x.shape is None or x.shape.rank() == 0:
        return None
    dim = x.shape[-1]
    return dim if isinstance(dim, int) else None


def _is_ones(scale: ir.Value, x: ir.Value, hidden: int) -> bool:
    """True when ``scale`` is all ones and broadcasting it against x [..., H] changes no shape."""
    tensor = ir.convenience.get_const_tensor(scale)
    if tensor is not None:
        array = tensor.numpy()
        shape_ok = (array.ndim <= 1 or all(d == 1 for d in array.shape[:-1])) and (
            array.ndim == 0 or array.shape[-1] in (1, hidden))
        fits = x.shape is not None and array.ndim <= x.shape.rank()
        return bool(shape_ok and fits and np.all(array == 1))
    # The exporter's form: ConstantOfShape(Shape(x), value=1): ones with exactly x's shape.
    node = scale.producer()
    if node is None or node.op_type != "ConstantOfShape" or node.domain != "":
        return False
    value = node.attributes.get("value")
    if value is None or not np.all(value.as_tensor().numpy() == 1):
        return False  # no value attribute means zeros
    shape_node = node.inputs[0].producer() if node.inputs[0] is not None else None
    return (shape_node is not None and shape_node.op_type == "Shape" and shape_node.domain == ""
            and shape_node.inputs[0] is x and shape_node.attributes.get_int("start", 0) == 0
            and "end" not in shape_node.attributes)


def _same_static_shape(a: ir.Value, b: ir.Value) -> bool:
    """Both shapes known and equal dim by dim (ints equal, or the same named symbolic dim)."""
    if a.shape is None or b.shape is None or a.shape.rank() != b.shape.rank():
        return False
    for da, db in zip(a.shape, b.shape, strict=True):
        if isinstance(da, int) or isinstance(db, int):
            if da != db:
                return False
        elif da.value is None or da.value != db.value:  # an anonymous dim proves nothing
            return False
    return True


def _remove_dead(candidates: list[ir.Node]) -> None:
    """Remove the candidates (and their producers, transitively) whose outputs nothing reads.

    Only the norm's own plumbing is visited (the ones scale, its Shape, the input Cast), so dead
    code elsewhere in the graph is left to the cleanup pass.
    """
    work = list(candidates)
    while work:
        node = work.pop()
        if node.graph is None:
            continue  # already removed
        if any(out.uses() or out.is_graph_output() for out in node.outputs):
            continue
        producers = [p for v in node.inputs if v is not None and (p := v.producer()) is not None]
        node.graph.remove(node, safe=True)
        work.extend(producers)


def _drop_unused_stat_outputs(graph: ir.Graph) -> None:
    # Blank the unused mean / inv_std_var outputs (an empty name = "not requested" for ORT) so the
    # kernel does not write them. A later NameFixPass may name them again: harmless, just unused.
    for node in graph:
        if node.domain == MS_DOMAIN and node.op_type == "SkipSimplifiedLayerNormalization" and len(node.outputs) == 4:
            for out in node.outputs[1:3]:
                if not out.uses() and not out.is_graph_output():
                    out.name = ""
