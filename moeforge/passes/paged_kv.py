"""Paged KV-cache I/O: the graph takes a packed batch of new tokens and reads/writes per-layer block pools
through ``moeforge::PagedAttention`` (ops/paged_attention), so one step mixes prefills and decodes.

Letters: T packed new tokens (all sequences), B sequences, M block-table width, N pool blocks,
Bs block size, K logits rows, Hq/Hkv heads, D head size, R kv_lora_rank, Dr rope dims.

Graph I/O after this pass (before it: input_ids/position_ids [batch, seq] -> logits [batch, seq, V]):
  input_ids [T] int64, position_ids [T] int64 (RoPE positions; RotaryEmbedding runs before the op)
  block_tables [B, M] int32, seq_lens [B] int32 (tokens after this step), query_start_loc [B+1] int32
  logits_indices [K] int64: which of the T tokens are projected to the vocabulary (the last token of each
    sequence that samples), so a prefill does not pay T x V
  GQA: kv_pool.{i}.key / .value [N, Bs, Hkv, D] -> kv_pool_out.{i}.key / .value
  absorbed MLA: kv_pool.{i}.latent [N, Bs, 1, R+Dr] -> kv_pool_out.{i}.latent  (value = first R dims)
  DSA (DeepSeek-V3.2): + kv_pool.{i}.index [N, Bs, 1, Di], around moeforge.SparseMLAPaged (dsa_cache.py)
  logits [K, V]
Everything but attention is per token, so the rest of the graph runs unchanged with the packed tokens as
the batch: [T, 1, ...] (batch T, one token each; not [1, T], which would make ONNX Runtime's
RotaryEmbedding refuse T > its cos/sin cache length, and T is bounded by the step budget, not positions).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from moeforge.core.kv_layout import DEFAULT_BLOCK_SIZE, POOL_AXIS, pool_names
from moeforge.model.pipeline_stages import HIDDEN_INPUT, HIDDEN_OUTPUT
from moeforge.ops.paged_attention.function import OPSET, build_function
from moeforge.ops.paged_attention.schema import DOMAIN, INPUTS, OP_TYPE, PagedAttentionAttrs
from moeforge.passes.base import PassContext, required
from moeforge.passes.dsa_cache import insert_dsa_pools
from moeforge.passes.kv_cache_io import (
    _is_prefix_slice_of,
    _replace_bhsd_output,
    _static,
    attention_qkv,
    layer_attentions,
)

TOKENS_AXIS = "num_tokens"
BLOCK_TABLES, SEQ_LENS, QUERY_START_LOC, LOGITS_INDICES = INPUTS[5], INPUTS[6], INPUTS[7], "logits_indices"
LOGITS_3D = "logits_3d"  # the LM head MatMul's output once a Squeeze produces ``logits`` [P, V]


class PagedKVInsertion:
    """Attention -> moeforge::PagedAttention over block pools; packed-token graph inputs; returns the number
    of layers rewritten. ``block_size``: tokens per pool block (``--kv-block-size``)."""

    name = "paged_kv"

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        self.block_size = block_size

    def apply(self, model: ir.Model, ctx: PassContext) -> int:
        graph = model.graph
        if ctx.config.dsa is not None:  # DeepSeek-V3.2: moeforge.SparseMLA nodes, not Attention (dsa_cache.py)
            return insert_dsa_pools(model, ctx, self.block_size, self.pack_token_inputs, self.select_logits)
        attentions = layer_attentions(model, ctx.config.num_hidden_layers, {DOMAIN: 1, "": OPSET})
        if not attentions:
            return 0
        block_size = self.block_size
        mla = ctx.config.mla is not None
        int32 = ir.TensorType(ir.DataType.INT32)
        step = [ir.Value(name=BLOCK_TABLES, shape=ir.Shape(["num_seqs", "max_blocks"]), type=int32),
                ir.Value(name=SEQ_LENS, shape=ir.Shape(["num_seqs"]), type=int32),
                ir.Value(name=QUERY_START_LOC, shape=ir.Shape(["num_seqs_plus_1"]), type=int32)]
        self.pack_token_inputs(graph)
        graph.inputs.extend(step)
        for layer, node in enumerate(attentions):
            self._rewrite(graph, node, layer, block_size, mla, step, ctx.config.sliding_window or 0)
        self.select_logits(graph)
        opset = model.opset_imports.get("", OPSET)
        model.functions[(DOMAIN, OP_TYPE, "")] = ir.serde.deserialize_function(
            build_function(latent=mla, core="matmul", opset=opset))
        return len(attentions)

    def pack_token_inputs(self, graph: ir.Graph) -> None:
        """input_ids / position_ids [batch, seq] -> [T], unsqueezed to [T, 1] for the per-token graph."""
        for index, value in enumerate(list(graph.inputs)):
            if value.name not in ("input_ids", "position_ids", HIDDEN_INPUT):
                continue
            # A later pipeline stage's hidden state: [batch, seq, H] -> [T, H], unsqueezed to [T, 1, H].
            trailing = list(required(value.shape, f"{value.name}: shape"))[2:]
            packed = ir.Value(name=value.name, shape=ir.Shape([TOKENS_AXIS, *trailing]), type=value.type)
            value.name = value.name + "_2d"
            axes = ir.node("Constant", [], attributes={"value": ir.tensor(np.array([1], np.int64))})
            unsqueeze = ir.node("Unsqueeze", [packed, axes.outputs[0]])
            unsqueeze.outputs[0].shape, unsqueeze.outputs[0].type = ir.Shape([TOKENS_AXIS, 1, *trailing]), value.type
            graph.insert_before(graph.node(0), [axes, unsqueeze])
            ir.convenience.replace_all_uses_with(value, unsqueeze.outputs[0])
            graph.inputs[index] = packed

    def _rewrite(self, graph: ir.Graph, node: ir.Node, layer: int, block_size: int, mla: bool,
                 step: list[ir.Value], window: int) -> None:
        q4, k4, v4 = attention_qkv(node)  # [T, H, 1, D]
        hq, dk, hkv, dv = _static(q4, 1), _static(q4, 3), _static(k4, 1), _static(v4, 3)
        scale = node.attributes["scale"].as_float() if "scale" in node.attributes else dk**-0.5
        if mla and (hkv != 1 or not _is_prefix_slice_of(v4, k4, dv)):
            raise ValueError("absorbed MLA attention must be MQA whose value is a prefix slice of the key")
        attrs = PagedAttentionAttrs(scale=scale, num_heads=hq, num_kv_heads=hkv, block_size=block_size,
                                    head_size_v=dv, sliding_window=int(window), latent=mla)
        names = pool_names(layer, mla)
        inputs_names, output_names = names.past, names.present
        dtype = ir.TensorType(required(q4.dtype, f"{q4.name}: dtype"))
        pools = [ir.Value(name=inputs_names[0], shape=ir.Shape([POOL_AXIS, block_size, hkv, dk]), type=dtype)]
        if not mla:
            pools.append(ir.Value(name=inputs_names[1], shape=ir.Shape([POOL_AXIS, block_size, hkv, dv]), type=dtype))
        graph.inputs.extend(pools)

        tape = ir.tape.Tape()
        packed = [_to_thd(tape, v, h, d) for v, h, d in ((q4, hq, dk), (k4, hkv, dk), (v4, hkv, dv))]
        op_inputs: list[ir.Value | None] = [packed[0], packed[1], None if mla else packed[2], pools[0],
                                            None if mla else pools[1], *step]
        outs = tape.op_multi_out(OP_TYPE, op_inputs, attributes=attrs.node_attributes(), domain=DOMAIN,
                                 num_outputs=2 if mla else 3)
        out = outs[0]
        out.name = f"/layers.{layer}/paged_attention/output"
        out.shape, out.type = ir.Shape([TOKENS_AXIS, hq, dv]), dtype
        for value, name, pool in zip(outs[1:], output_names, pools, strict=True):
            value.name, value.shape, value.type = name, pool.shape, dtype
        bshd = tape.op("Unsqueeze", [out, tape.op("Constant", [], attributes={
            "value": ir.tensor(np.array([1], np.int64))})])  # [T, 1, Hq, Dv]
        graph.insert_before(node, tape.nodes)
        _replace_bhsd_output(graph, node.outputs[0], bshd)
        graph.outputs.extend(outs[1:])
        graph.remove(node, safe=True)  # the old causal mask becomes dead code (cleanup drops it)

    def select_logits(self, graph: ir.Graph) -> None:
        """logits = lm_head(hidden[logits_indices]) [K, V] instead of [T, 1, V]. A pipeline stage without the head
        returns every token's hidden state instead: [T, 1, H] -> [T, H] (the next stage computes all their KV)."""
        logits = next((v for v in graph.outputs if v.name == "logits"), None)
        if logits is None:
            self._pack_hidden_output(graph)
            return
        head = logits.producer()
        matmul = head
        if head is not None and (head.domain, head.op_type) == ("com.microsoft", "AllGather") and head.inputs[0]:
            matmul = head.inputs[0].producer()  # a tensor-parallel rank: its vocabulary rows, then the gather
        if head is None or matmul is None or matmul.op_type != "MatMul":
            raise ValueError(f"expected logits to come from the lm_head MatMul, found {head and head.op_type}")
        indices = ir.Value(name=LOGITS_INDICES, shape=ir.Shape(["num_logits"]), type=ir.TensorType(ir.DataType.INT64))
        graph.inputs.append(indices)
        gather = ir.node("Gather", [matmul.inputs[0], indices], attributes={"axis": 0})  # [K, 1, H]
        graph.insert_before(matmul, gather)
        matmul.replace_input_with(0, gather.outputs[0])
        vocab = logits.shape[-1] if logits.shape is not None else "vocab_size"
        logits.name = LOGITS_3D
        axes = ir.node("Constant", [], attributes={"value": ir.tensor(np.array([1], np.int64))})
        squeeze = ir.node("Squeeze", [logits, axes.outputs[0]])
        graph.insert_after(head, [axes, squeeze])
        squeeze.outputs[0].name = "logits"
        squeeze.outputs[0].shape, squeeze.outputs[0].type = ir.Shape(["num_logits", vocab]), logits.type
        graph.outputs[list(graph.outputs).index(logits)] = squeeze.outputs[0]


    def _pack_hidden_output(self, graph: ir.Graph) -> None:
        hidden = next(v for v in graph.outputs if v.name == HIDDEN_OUTPUT)
        producer = required(hidden.producer(), f"{HIDDEN_OUTPUT}: its producer")
        hidden.name = f"{HIDDEN_OUTPUT}_3d"
        axes = ir.node("Constant", [], attributes={"value": ir.tensor(np.array([1], np.int64))})
        squeeze = ir.node("Squeeze", [hidden, axes.outputs[0]])
        graph.insert_after(producer, [axes, squeeze])
        squeeze.outputs[0].name = HIDDEN_OUTPUT
        width = hidden.shape[-1] if hidden.shape is not None else "hidden_size"
        squeeze.outputs[0].shape, squeeze.outputs[0].type = ir.Shape([TOKENS_AXIS, width]), hidden.type
        graph.outputs[list(graph.outputs).index(hidden)] = squeeze.outputs[0]


def _to_thd(tape: ir.tape.Tape, value4: ir.Value, heads: int, dim: int) -> ir.Value:
    """[T, H, 1, D] -> [T, H, D], reusing the [T, 1, H, D] tensor when the exporter transposed it."""
    producer = value4.producer()
    if producer is not None and producer.op_type == "Transpose" and list(
            producer.attributes["perm"].as_ints()) == [0, 2, 1, 3]:
        bthd = producer.inputs[0]
    else:
        bthd = tape.op("Transpose", [value4], attributes={"perm": [0, 2, 1, 3]})
    shape = tape.op("Constant", [], attributes={"value": ir.tensor(np.array([-1, heads, dim], np.int64))})
    return tape.op("Reshape", [bthd, shape])
