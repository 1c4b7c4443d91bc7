"""KV-cache I/O for DeepSeek-V3.2 sparse attention (DSA): each ``moeforge.SparseMLA`` node (stateless) becomes a
``moeforge.SparseMLACache`` node over two contiguous buffers per layer, written in place (past and present share
one buffer, as for GroupQueryAttention); or, paged (``insert_dsa_pools``), a ``moeforge.SparseMLAPaged`` node over
two block pools per layer with paged_kv.py's packed-token inputs.

Graph inputs / outputs added per layer i (names from ``kv_layout.cache_names``; B batch, L max sequence length,
C = kv_lora_rank + qk_rope_head_dim, Di index_head_dim):
  past_key_values.{i}.latent [B, 1, L, C]  -> present.{i}.latent
  past_key_values.{i}.index  [B, 1, L, Di] -> present.{i}.index   (the lightning indexer's keys)
The node writes the new rows at their positions and attends over the top-k rows the indexer picks among rows
0..position (moeforge/ops/sparse_mla/); attention_mask [B, T] (as for GroupQueryAttention) gives T, the rows read back.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from moeforge.core.kv_layout import MAX_SEQ_AXIS, POOL_AXIS, cache_names, pool_names
from moeforge.ops.paged_attention.schema import INPUTS as PAGED_ATTENTION_INPUTS
from moeforge.ops.sparse_mla import function as sparse_mla_function
from moeforge.ops.sparse_mla.schema import CACHED_OP_TYPE, DOMAIN, OP_TYPE, PAGED_OP_TYPE
from moeforge.passes.base import PassContext, required, token_input

ATTENTION_MASK = "attention_mask"  # as kv_cache.py: [B, T], T = cached + new tokens of the longest row
# PagedAttention's step inputs, shared by SparseMLAPaged (the engine feeds them the same way).
BLOCK_TABLES, SEQ_LENS, QUERY_START_LOC = PAGED_ATTENTION_INPUTS[5:8]


def sparse_mla_nodes(model: ir.Model, ctx: PassContext) -> list[ir.Node]:
    """The stateless ``moeforge.SparseMLA`` nodes in layer order: none (not a DSA model), or one per layer."""
    nodes = [n for n in model.graph if n.op_type == OP_TYPE and n.domain == DOMAIN]
    if nodes and len(nodes) != ctx.config.num_hidden_layers:
        raise ValueError(f"expected one SparseMLA node per layer ({ctx.config.num_hidden_layers}), found {len(nodes)}")
    return nodes


def insert_dsa_caches(model: ir.Model, ctx: PassContext, static_len: int | None = None,
                      past_lengths: ir.Value | None = None) -> int:
    """Rewrite every SparseMLA node to its cached form with contiguous buffers; returns the layers rewritten.

    ``static_len`` and ``past_lengths`` [B] (the TensorRT target's contract, see trt_kv_cache.py): buffers of that
    fixed length and no ``attention_mask`` input; the rows read back are 0 .. max(past_lengths) + S - 1 (the
    indexer's position mask keeps each query to its own rows 0..position)."""
    nodes = sparse_mla_nodes(model, ctx)
    if not nodes:
        return 0
    graph = model.graph
    ids = token_input(graph)
    batch = required(ids.shape, f"{ids.name}: shape")[0]
    if static_len is None:
        mask = ir.Value(name=ATTENTION_MASK, shape=ir.Shape([batch, "total_sequence_length"]),
                        type=ir.TensorType(ir.DataType.INT64))
        graph.inputs.append(mask)
    else:  # ones [B, max(past_lengths) + S]: only its width is read
        assert past_lengths is not None, "a static cache needs past_lengths"
        tape = ir.tape.Tape()
        longest = tape.op("Add", [tape.op("ReduceMax", [past_lengths], attributes={"keepdims": 1}),
                                  tape.op("Shape", [ids], attributes={"start": 1, "end": 2})])  # [1]
        rows = tape.op("Concat", [tape.op("Shape", [ids], attributes={"start": 0, "end": 1}), longest],
                       attributes={"axis": 0})
        mask = tape.op("ConstantOfShape", [rows], attributes={"value": ir.tensor(np.array([1], np.int64))})
        mask.name = "dsa/rows_read"
        graph.insert_before(nodes[0], tape.nodes)
    for layer, node in enumerate(nodes):
        latent, index_k = required(node.inputs[1], "SparseMLA latent"), required(node.inputs[4], "SparseMLA index_k")
        names = cache_names(layer, mla=True, indexed=True)
        past = []
        for name, value in zip(names.past, (latent, index_k), strict=True):
            width = required(value.shape, f"{value.name}: shape")[2]
            dtype = required(value.dtype, f"{value.name}: dtype")
            past.append(ir.Value(name=name, shape=ir.Shape([batch, 1, static_len or MAX_SEQ_AXIS, width]),
                                 type=ir.TensorType(dtype)))
        graph.inputs.extend(past)
        cached = ir.Node(DOMAIN, CACHED_OP_TYPE, [*node.inputs, *past, mask], attributes=list(node.attributes.values()),
                         num_outputs=3)
        _swap_in(graph, node, cached, past, names.present)
    stateless = model.functions.get((DOMAIN, OP_TYPE, ""))
    attrs = sparse_mla_function.node_attrs(next(n for n in graph if n.op_type == CACHED_OP_TYPE))
    if stateless is not None:
        del model.functions[(DOMAIN, OP_TYPE, "")]
    sparse_mla_function.attach_function(model, attrs, "contiguous")
    return len(nodes)


def insert_dsa_pools(model: ir.Model, ctx: PassContext, block_size: int, pack_tokens: Callable[[ir.Graph], None],
                     select_logits: Callable[[ir.Graph], None]) -> int:
    """Paged form: every SparseMLA node -> ``moeforge.SparseMLAPaged`` over a latent pool [N, Bs, 1, C] and an
    indexer pool [N, Bs, 1, Di] per layer (``kv_pool.{i}.latent|index`` -> ``kv_pool_out.{i}.*``), with the
    packed-token inputs of ``paged_kv.py`` (its ``pack_token_inputs`` and ``select_logits``, passed in)."""
    nodes = sparse_mla_nodes(model, ctx)
    if not nodes:
        return 0
    graph = model.graph
    int32 = ir.TensorType(ir.DataType.INT32)
    step = [ir.Value(name=BLOCK_TABLES, shape=ir.Shape(["num_seqs", "max_blocks"]), type=int32),
            ir.Value(name=SEQ_LENS, shape=ir.Shape(["num_seqs"]), type=int32),
            ir.Value(name=QUERY_START_LOC, shape=ir.Shape(["num_seqs_plus_1"]), type=int32)]
    pack_tokens(graph)
    graph.inputs.extend(step)
    for layer, node in enumerate(nodes):
        names = pool_names(layer, mla=True, indexed=True)
        pools = []
        for name, value in zip(names.past, (node.inputs[1], node.inputs[4]), strict=True):
            value = required(value, "SparseMLA input")
            width = required(value.shape, f"{value.name}: shape")[2]
            pools.append(ir.Value(name=name, shape=ir.Shape([POOL_AXIS, block_size, 1, width]),
                                  type=ir.TensorType(required(value.dtype, f"{value.name}: dtype"))))
        graph.inputs.extend(pools)
        op = ir.Node(DOMAIN, PAGED_OP_TYPE, [*node.inputs, *pools, *step], attributes=list(node.attributes.values()),
                     num_outputs=3)
        _swap_in(graph, node, op, pools, names.present)
    select_logits(graph)
    attrs = sparse_mla_function.node_attrs(next(n for n in graph if n.op_type == PAGED_OP_TYPE))
    model.functions.pop((DOMAIN, OP_TYPE, ""), None)
    sparse_mla_function.attach_function(model, attrs, "paged")
    return len(nodes)


def _swap_in(graph: ir.Graph, node: ir.Node, cached: ir.Node, buffers: list[ir.Value],
             present: tuple[str, ...] | list[str]) -> None:
    """Put ``cached`` (the cache-carrying form of ``node``) in ``node``'s place: its output 0 takes over the
    attention output, outputs 1.. become the graph outputs ``present`` shaped like ``buffers``."""
    graph.insert_before(node, cached)
    node.outputs[0].replace_all_uses_with(cached.outputs[0])
    cached.outputs[0].shape, cached.outputs[0].type = node.outputs[0].shape, node.outputs[0].type
    for value, buffer, name in zip(cached.outputs[1:], buffers, present, strict=True):
        value.name, value.shape, value.type = name, buffer.shape, buffer.type
        graph.outputs.append(value)
    graph.remove(node, safe=True)
