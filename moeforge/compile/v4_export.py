"""torch -> ONNX for DeepSeek-V4: one inference step over its KV cache, exported whole (``model/v4_step.py``).

Other families export a stateless graph and the passes insert the cache (Attention -> GroupQueryAttention or
PagedAttention). V4's cache is not one K/V per token: each layer keeps rings (the sliding window, the compressors'
pending tokens) and compressed entries (``core/kv_layout_v4.py``), so the step that reads and writes them is written
in torch (``model/v4_cache.py``, checked eagerly against the reference) and exported as it is, its writes as
ScatterND nodes whose outputs the backends bind to the input buffers (in place). The graph I/O is the backends'
usual one:

    contiguous: input_ids, position_ids [B, S], attention_mask [B, L] (only its width is read: the longest row's
                cached + new tokens), every buffer [B, rows, w] -> logits [B, S, V], every buffer
    paged:      input_ids, position_ids [T], block_tables [N, M], query_start_loc [N+1], logits_indices [K], every
                pool [num_blocks, rows, w] -> logits [K, V], every pool
A pipeline stage (``model/pipeline_stages.py`` ``v4_stage_model``, paged only): after stage 0 ``hidden_states_in``
[T, N * H] (the mHC streams) follows position_ids; before the last stage the output ``hidden_states`` [T, N * H]
replaces logits.
Buffer names: ``kv_layout.v4_names`` (``past_key_values.{i}.{kind}`` -> ``present.{i}.{kind}``, paged
``kv_pool.{i}.{kind}`` -> ``kv_pool_out.{i}.{kind}``).
"""

from __future__ import annotations

import contextlib
import warnings

import onnx_ir as ir
import torch

from moeforge.compile.onnx_export import (
    LAYER_OUTPUT,
    OPSET,
    _add_layer_markers,
    _forget_former_inputs,
    _quiet_torchvision_skips,
    _source_names,
    _tensor_names,
    _without_slices_split,
    attach_lazy_weights,
    fold_weight_transposes,
)
from moeforge.core.kv_layout import KVCacheSpec
from moeforge.core.kv_layout_v4 import compress_rates, layer_buffers
from moeforge.model.deepseek_v4 import DeepseekV4ForCausalLM
from moeforge.model.dense_experts import dense_routed_experts
from moeforge.model.lazy_weights import LazyWeights
from moeforge.model.pipeline_stages import HIDDEN_INPUT, HIDDEN_OUTPUT, StageSpec, boundary_width
from moeforge.model.v4_step import CacheKind, V4StepLM
from moeforge.ops.collectives import torch_op as collectives
from moeforge.passes.cleanup import quiet_multi_output_folding

PAGED_STEP_INPUTS = ("block_tables", "query_start_loc", "logits_indices")


def export_v4_step(model: DeepseekV4ForCausalLM, kv: KVCacheSpec, weights: LazyWeights | None = None, *,
                   dense_experts: bool = False) -> ir.Model:
    """Export one step of ``model`` over the cache ``kv`` describes (contiguous or paged) at opset 23.
    ``weights``: ``model`` is on the meta device and its initializers become lazy reads of these. ``dense_experts``:
    the routed experts run dense over experts, with no NonZero (TensorRT-RTX has none: ``model/dense_experts.py``)."""
    config = model.config
    model = model.eval()
    own_names = _tensor_names(model)
    device = torch.device("meta") if weights is not None else torch.device("cpu")
    kind: CacheKind = "paged" if kv.paged else "contiguous"
    stage: StageSpec | None = model.pipeline_stage
    # Each layer's streams are marked (``layer_output.{i}``, for parity --per-layer) where a stage is the whole model.
    mark_layers = stage is None
    step = V4StepLM(model, kind, max_seq_len=kv.max_seq_len, block_size=kv.block_size, stage=stage,
                    mark_layers=mark_layers)
    marked = [LAYER_OUTPUT.format(i) for i in range(config.num_hidden_layers)] if mark_layers else []
    streams_in = [HIDDEN_INPUT] if step.takes_streams else []  # a later pipeline stage's input [T, N * H]
    buffers = [b for i in range(config.num_hidden_layers) for b in layer_buffers(config, i)]
    names = [n for layer in kv.past_input_names for n in layer]
    outputs = [n for layer in kv.present_output_names for n in layer]
    f32, i64, i32 = torch.float32, torch.int64, torch.int32
    if kv.paged:
        assert kv.block_size is not None
        tokens, seqs, width = torch.export.Dim("tokens", min=1), torch.export.Dim("num_seqs"), torch.export.Dim(
            "max_blocks")
        # Example sizes: 5 tokens of 2 sequences over 3 blocks (none may be 0 or 1: export would specialise them).
        blocks = 4
        example: tuple[torch.Tensor, ...] = (
            torch.zeros(5, dtype=i64, device=device), torch.arange(5, dtype=i64, device=device),
            *(torch.zeros(5, boundary_width(config), dtype=f32, device=device) for _ in streams_in),
            torch.zeros(2, 3, dtype=i32, device=device), torch.tensor([0, 2, 5], dtype=i32, device=device),
            torch.tensor([1, 4], dtype=i64, device=device),
            *(torch.zeros(blocks, b.rows_per_block(kv.block_size), b.width, dtype=f32, device=device)
              for b in buffers))
        pool = torch.export.Dim("num_blocks")
        # forward(input_ids, position_ids, *rest): the exporter wants the star-args' shapes as one tuple
        dynamic: tuple[object, ...] = ({0: tokens}, {0: tokens}, (*({0: tokens} for _ in streams_in),
                                       {0: seqs, 1: width}, {0: seqs + 1}, {0: torch.export.Dim("num_logits")},
                                       *({0: pool} for _ in buffers)))
        input_names = ["input_ids", "position_ids", *streams_in, *PAGED_STEP_INPUTS, *names]
    else:
        batch, seq = torch.export.Dim("batch"), torch.export.Dim("sequence")
        length = kv.max_seq_len
        # The entries read follow attention_mask's width L (ceil(L / m) of each compressed layer). An example width
        # that gives every rate at least 2 entries, and a dim that may take guards (Dim.DYNAMIC): a named Dim would
        # refuse the exporter's "at least 2 entries" assumptions, which the ONNX graph does not need (no guards).
        total = torch.export.Dim.DYNAMIC
        mask_width = min(2 * max(compress_rates(config), default=1) + 1, length)
        example = (torch.zeros(2, 3, dtype=i64, device=device),
                   torch.arange(3, dtype=i64, device=device).expand(2, 3).contiguous(),
                   torch.ones(2, mask_width, dtype=i64, device=device),
                   *(torch.zeros(2, b.rows_per_sequence(length), b.width, dtype=f32, device=device) for b in buffers))
        dynamic = ({0: batch, 1: seq}, {0: batch, 1: seq}, ({0: batch, 1: total}, *({0: batch} for _ in buffers)))
        input_names = ["input_ids", "position_ids", "attention_mask", *names]
    experts = dense_routed_experts(model) if dense_experts else contextlib.nullcontext(0)
    with (_quiet_torchvision_skips(), quiet_multi_output_folding(), _without_slices_split(), warnings.catch_warnings(),
          torch.no_grad(), experts):
        warnings.simplefilter("ignore")
        program = torch.onnx.export(step, example, dynamo=True, opset_version=OPSET, verbose=False,
                                    input_names=input_names,
                                    output_names=[HIDDEN_OUTPUT if step.returns_streams else "logits", *outputs,
                                                  *marked],
                                    dynamic_shapes=dynamic, optimize=weights is None,
                                    custom_translation_table=dict(collectives.TRANSLATIONS))
        assert program is not None
        if weights is not None:
            attach_lazy_weights(program.model, weights, _source_names(step, own_names))
            fold_weight_transposes(program.model)
            program.optimize()
    onnx_model = program.model
    if not kv.paged:  # the exporter names a Dim.DYNAMIC axis s<N>: the usual name of the mask's width
        mask = onnx_model.graph.inputs[2]
        assert mask.shape is not None
        mask.shape = ir.Shape([mask.shape[0], "total_sequence_length"])
    if marked:
        _add_layer_markers(onnx_model)  # Add(x, 0) markers the passes keep; the compile records and drops them
    _forget_former_inputs(onnx_model.graph)
    return onnx_model
