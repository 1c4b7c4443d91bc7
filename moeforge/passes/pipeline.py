"""The ordered pass pipelines. Order is data, not a comment: each list is what runs, top to bottom.

Why this order (ONNX Runtime target):
1. cleanup        constant folding / CSE first, so the patterns below see canonical graphs.
2. rms_norm       RMSNormalization (+ weight Mul) -> SimplifiedLayerNormalization.
3. skip_rms_norm  needs (2): residual Add + norm -> SkipSimplifiedLayerNormalization.
4. rotary         rope arithmetic -> RotaryEmbedding with a cos/sin cache sized by max_seq_len.
5. kv_cache       Attention -> GroupQueryAttention with in-place cache I/O; takes q/k after (4) and,
                  for GQA with head size % 16 == 0, folds their RotaryEmbedding into the kernel.
   (paged_kv      with ``kv_cache="paged"`` instead: Attention -> moeforge::PagedAttention over block
                  pools, packed-token inputs; RoPE stays a RotaryEmbedding node before the op.)
6. packing        sibling projections (q/k/v, q_a/kv_a, gate/up) -> one MatMul + Split.
7. moe_lowering   moeforge.MoERouter -> MoEExperts -> routing in standard ops + com.microsoft.MoE.
8. cleanup        drops what the rewrites left dead (old masks, cos/sin math, transposes).
   absorbed_einsum  MLA's absorbed per-head Einsums over a view of kv_b_proj -> MatMul over the view, made once
                  when written (after cleanup, which leaves the view's Reshape/Slice on the initializer).
9. gqa_packed_qkv needs (5), (6) and (8) (no dead readers left on the Split): GroupQueryAttention reads the
                  packed q/k/v, its Split dropped.
10. expert_load   MoE graphs: an ``expert_hits`` output (which experts each token chose per layer, read from the
                  lowered router), for the expert-load metrics.
11. last_token_logits  an optional ``logits_to_keep`` input slicing the LM head's input (contiguous graphs; paged
                  ones select rows with ``logits_indices``); after cleanup, whose constant folding must not
                  see the input's default initializer as a constant.
Quantisation passes follow (``moeforge/quant/plan.py``), then ``argmax_head`` (``moeforge/passes/argmax_head.py``,
``moeforge/compile/targets/ort.py``): last, because it matches only an LM head they left float32.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import onnx_ir as ir

from moeforge.core.kv_layout import DEFAULT_BLOCK_SIZE
from moeforge.passes.absorbed_einsum import AbsorbedEinsum
from moeforge.passes.base import GraphPass, PassContext, PassReport
from moeforge.passes.cleanup import Cleanup
from moeforge.passes.expert_load import ExpertLoadOutput
from moeforge.passes.gqa_packed_qkv import GqaPackedQkv
from moeforge.passes.kv_cache_io import KVCacheInsertion
from moeforge.passes.last_token_logits import LastTokenLogits
from moeforge.passes.moe_lowering import MoELowering
from moeforge.passes.packing import ProjectionPacking
from moeforge.passes.paged_kv import PagedKVInsertion
from moeforge.passes.rms_norm import RmsNormFusion, SkipRmsNormFusion
from moeforge.passes.rotary import RotaryFusion
from moeforge.passes.weight_matmuls import WeightMatMuls


def ort_pipeline(kv_cache: str = "contiguous", block_size: int = DEFAULT_BLOCK_SIZE) -> list[GraphPass]:
    """Passes for the ONNX Runtime target, in order; ``kv_cache``: "contiguous" or "paged" (pools of
    ``block_size`` tokens). Quantisation passes (``moeforge.quant.plan``) follow these."""
    return [
        Cleanup(),
        RmsNormFusion(),
        SkipRmsNormFusion(),
        RotaryFusion(),
        PagedKVInsertion(block_size) if kv_cache == "paged" else KVCacheInsertion(),
        ProjectionPacking(),
        MoELowering(),
        Cleanup(),
        AbsorbedEinsum(),
        GqaPackedQkv(),
        ExpertLoadOutput(),
        LastTokenLogits(),
    ]


def v4_pipeline() -> list[GraphPass]:
    """DeepSeek-V4 (``moeforge/compile/v4_export.py``): its graph already reads and writes its cache, so no cache
    insertion; the rewrites that keep the math (folding, RMSNorm fusion, sibling projections packed), then every
    weight as a 2-D MatMul initializer for the quantisation passes (``weight_matmuls``: its Gemms, routed experts and
    grouped o_a_proj), after packing so that the indexer's projections stay apart from the ones quantised; last the
    ``expert_hits`` output read from the routed experts' per-expert loops (``expert_load``)."""
    return [Cleanup(), RmsNormFusion(), ProjectionPacking(), WeightMatMuls(), Cleanup(),
            ExpertLoadOutput(per_expert_loops=True)]


def run_passes(
    model: ir.Model,
    ctx: PassContext,
    passes: Sequence[GraphPass],
    on_pass_done: Callable[[PassReport], None] | None = None,
) -> list[PassReport]:
    """Apply ``passes`` in order; report each pass's match count and time."""
    reports = []
    for graph_pass in passes:
        start = time.perf_counter()
        matches = graph_pass.apply(model, ctx)
        report = PassReport(graph_pass.name, matches, time.perf_counter() - start)
        reports.append(report)
        if on_pass_done is not None:
            on_pass_done(report)
    return reports
