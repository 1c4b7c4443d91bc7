"""The TensorRT lowering: passes that turn the stateless export into a graph TensorRT-RTX parses into
native layers, and the ordered ``trt_pipeline``.

Why this order (TensorRT target; the ORT pipeline's reasons for cleanup and rotary hold here too):
1. cleanup         constant folding / CSE.
2. rotary          rope arithmetic -> com.microsoft.RotaryEmbedding with cos/sin caches (shared pass).
3. onnx_rotary     -> ONNX RotaryEmbedding (opset 23): the parser maps it to a ROTARY_EMBEDDING layer.
4. trt_kv_cache    Attention -> TensorScatter (KV_CACHE_UPDATE) + masked Attention (ATTENTION) on a
                   static-length cache (moeforge/passes/trt_kv_cache.py).
   (paged_kv       with ``kv_cache="paged"`` instead: the ORT paged pass, moeforge::PagedAttention over block
                   pools with its local function; ``trt_paged_inputs`` after precision binds latent mode's
                   unset inputs to empty tensors, see moeforge/passes/trt_paged.py.)
5. packing         q/k/v and gate/up projections -> one MatMul + Split (shared pass).
6. cleanup         drops the dead mask/angle arithmetic before precision sees it.
   (quant_weights  with ``--quant int8|int4|fp8``: symmetric weight DequantizeLinear, no zero points.)
7. precision       fp16/bf16 with fp32 norms, softmax and MoE (moeforge/passes/precision.py); last, so
                   every pass above matches fp32 patterns.
DeepSeek-V4 (``trt_v4_pipeline``): its step graph reads and writes its own cache (moeforge/compile/v4_export.py,
exported for TensorRT with its routed experts dense, moeforge/model/dense_experts.py), so no rotary or cache pass:
cleanup, packing, ``sums_as_matmul`` (its Sinkhorn sums as MatMuls, which TensorRT-RTX's Myelin otherwise fuses into
an exponentially large kernel: moeforge/passes/trt_normalize_sums.py), cleanup, precision (last, as above; its
router, plain ops here, kept fp32 by the module that made its nodes, as the other families' MoERouter node).
RMSNorm stays ONNX RMSNormalization (a NORMALIZATION layer); the ORT-only ops (GroupQueryAttention,
SimplifiedLayerNormalization, com.microsoft.MoE) are never introduced; ``moeforge.MoERouter`` and
``moeforge.MoEExperts`` keep their local functions, which the parser inlines (or registered plugins replace).
"""

from __future__ import annotations

import onnx_ir as ir

from moeforge.core.kv_layout import DEFAULT_BLOCK_SIZE
from moeforge.passes.base import MS_DOMAIN, GraphPass, PassContext, ensure_opset
from moeforge.passes.cleanup import Cleanup
from moeforge.passes.packing import ProjectionPacking
from moeforge.passes.paged_kv import PagedKVInsertion
from moeforge.passes.precision import HalfPrecision
from moeforge.passes.quant_weights import QuantConfig, WeightQuantization
from moeforge.passes.rotary import RotaryFusion
from moeforge.passes.trt_kv_cache import TrtKVCache
from moeforge.passes.trt_normalize_sums import SumsAsMatMul
from moeforge.passes.trt_paged import TrtPagedInputs

ROTARY_OPSET = 23
V4_ROUTER = "moeforge.model.deepseek_v4_moe.V4Router"  # the exporter's class-hierarchy name of V4's router


class OnnxRotary:
    """com.microsoft.RotaryEmbedding(x, position_ids, cos, sin) -> ONNX RotaryEmbedding(x, cos, sin, position_ids).

    Same semantics (3D x [B, S, H*D] with num_heads, caches [M, D/2], half or interleaved layout); the
    contrib op's ``scale`` is not carried (the rotary pass folds amplitudes into the caches).
    """

    name = "onnx_rotary"

    def apply(self, model: ir.Model, ctx: PassContext) -> int:
        nodes = [n for n in model.graph if n.op_type == "RotaryEmbedding" and n.domain == MS_DOMAIN]
        if not nodes:
            return 0
        ensure_opset(model, "", ROTARY_OPSET)
        for node in nodes:
            x, position_ids, cos, sin = node.inputs[:4]
            attributes = {k: node.attributes[k].value for k in ("interleaved", "num_heads", "rotary_embedding_dim")
                          if k in node.attributes}
            new = ir.node("RotaryEmbedding", [x, cos, sin, position_ids], attributes=attributes, name=node.name)
            new.outputs[0].name, new.outputs[0].shape, new.outputs[0].type = (
                node.outputs[0].name, node.outputs[0].shape, node.outputs[0].type)
            model.graph.insert_before(node, new)
            node.outputs[0].name = None
            ir.convenience.replace_all_uses_with(node.outputs[0], new.outputs[0])
            model.graph.remove(node, safe=True)
        return len(nodes)


def trt_pipeline(dtype: str = "fp16", kv_cache: str = "contiguous", block_size: int = DEFAULT_BLOCK_SIZE,
                 weights: QuantConfig | None = None) -> list[GraphPass]:
    """Passes for the TensorRT target, in order; ``dtype`` fp16 | bf16 (fp32 skips the precision pass);
    ``kv_cache`` "paged": the paged pass (pools of ``block_size`` tokens + moeforge::PagedAttention) instead of
    trt_kv_cache;
    ``weights``: symmetric weight Q/DQ (``--quant int8|int4|fp8``) before the precision pass, which then
    gives the DequantizeLinear scales the half type (TensorRT's strongly typed weight-only quantisation)."""
    paged = kv_cache == "paged"
    passes: list[GraphPass] = [
        Cleanup(),
        RotaryFusion(),
        OnnxRotary(),
        PagedKVInsertion(block_size) if paged else TrtKVCache(),
        ProjectionPacking(),
        Cleanup(),
    ]
    if weights is not None:
        passes.append(WeightQuantization(weights))
    if dtype != "fp32":
        passes.append(HalfPrecision(dtype))
    if paged:
        passes.append(TrtPagedInputs())
    return passes


def trt_v4_pipeline(dtype: str = "fp16") -> list[GraphPass]:
    """Passes for DeepSeek-V4's step graph on the TensorRT target, in order; ``dtype`` fp16 | bf16 (fp32 skips the
    precision pass)."""
    passes: list[GraphPass] = [Cleanup(), ProjectionPacking(), SumsAsMatMul(), Cleanup()]
    if dtype != "fp32":  # its router is plain ops: kept fp32 as the other families' MoERouter node
        passes.append(HalfPrecision(dtype, keep_fp32_modules=(V4_ROUTER,)))
    return passes
