"""KV-cache I/O for the TensorRT target, in standard ONNX (opset 24) that TensorRT-RTX maps to native layers.

Dimension letters: B batch, S new tokens, L cache length (static: ``ctx.max_seq_len``), Hq query heads,
Hkv key/value heads, D head dim, R kv_lora_rank, Dr rope dims.

Before (stateless export): Attention(Q [B,Hq,S,D], K [B,Hkv,S,D], V [B,Hkv,S,Dv], causal mask [S,S]).
After, per layer:
    present_k = TensorScatter(past_k [B,Hkv,L,D], K, past_lengths, axis=2)     -> KV_CACHE_UPDATE layer
    present_v = TensorScatter(past_v, V, past_lengths, axis=2)
    Y         = Attention(Q, present_k, present_v, mask [B,1,S,L], nonpad_kv_seqlen=past_lengths+S)
                                                                              -> ATTENTION layer
Absorbed MLA (MQA whose value is the first R dims of the key): one latent buffer [B,1,L,R+Dr];
TensorRT's attention wants key and value of one shape, so V = the whole latent and Y is sliced to R
afterwards (slicing S rows of Y, not L rows of the cache).

Why these choices (TensorRT-RTX 1.7, checked by parsing and building on CPU):
- com.microsoft.GroupQueryAttention needs a GroupQueryAttention plugin the RTX build does not ship.
- TensorScatter imports as IKVCacheUpdateLayer, which needs a static L: the cache length is fixed at
  compile time, so the KV buffers are graph inputs [B, Hkv, L, D] with L = max_seq_len.
- The mask is explicit (query i of row b sees key j iff j <= past_lengths[b] + i, and j > that - window
  with a sliding window): ``is_causal`` alignment with a cache differs between specs and runtimes,
  an explicit mask does not. nonpad_kv_seqlen still tells the kernel how many keys are real.
- Attention with ``softmax_precision`` is rejected by the parser; the fused kernels keep softmax in fp32.
The same graph runs in ONNX Runtime (CPU), which is how the lowering is checked without a GPU.

DeepSeek-V3.2 (DSA) has no Attention node: each ``moeforge.SparseMLA`` becomes ``SparseMLACache`` over two static
buffers per layer (latent, indexer keys) with the same ``past_lengths`` input (``dsa_cache.insert_dsa_caches``).

Graph inputs added: ``past_lengths`` [B] int64 (tokens already cached per row) and per layer
``past_key_values.{i}.key/.value`` (GQA) or ``past_key_values.{i}.latent`` (MLA); outputs
``present.{i}.*`` of the same shape, which alias the inputs (a backend binds one buffer to both).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from moeforge.core.kv_layout import cache_names
from moeforge.passes.base import PassContext, required
from moeforge.passes.dsa_cache import insert_dsa_caches
from moeforge.passes.kv_cache_io import _batch_dim, _const, _static, attention_qkv, layer_attentions

PAST_LENGTHS = "past_lengths"
TENSOR_SCATTER_OPSET = 24


class TrtKVCache:
    """Attention -> TensorScatter cache update + masked Attention over the whole cache; returns layers rewritten."""

    name = "trt_kv_cache"

    def apply(self, model: ir.Model, ctx: PassContext) -> int:
        graph = model.graph
        if ctx.config.dsa is not None:  # DeepSeek-V3.2: moeforge.SparseMLA nodes over static buffers (dsa_cache.py)
            ids = next(v for v in graph.inputs if v.name == "input_ids")
            lengths = ir.Value(name=PAST_LENGTHS, shape=ir.Shape([required(ids.shape, "input_ids")[0]]),
                               type=ir.TensorType(ir.DataType.INT64))
            graph.inputs.append(lengths)
            return insert_dsa_caches(model, ctx, static_len=ctx.max_seq_len, past_lengths=lengths)
        attentions = layer_attentions(model, ctx.config.num_hidden_layers, {"": TENSOR_SCATTER_OPSET})
        if not attentions:
            return 0
        batch = _batch_dim(graph)
        past_lengths = ir.Value(name=PAST_LENGTHS, shape=ir.Shape([batch]), type=ir.TensorType(ir.DataType.INT64))
        graph.inputs.append(past_lengths)
        ids = next(v for v in graph.inputs if v.name == "input_ids")
        tape = ir.tape.Tape()
        mask, nonpad = self._mask(tape, ids, past_lengths, ctx)
        graph.insert_before(attentions[0], tape.nodes)
        for layer, node in enumerate(attentions):
            self._rewrite(model, node, layer, ctx, batch, past_lengths, mask, nonpad)
        return len(attentions)

    @staticmethod
    def _mask(tape: ir.tape.Tape, ids: ir.Value, past_lengths: ir.Value, ctx: PassContext) -> tuple[ir.Value, ir.Value]:
        """mask [B,1,S,L] bool (key j visible to query i of row b) and nonpad [B] = past_lengths + S."""
        seq = tape.op("Shape", [ids], attributes={"start": 1, "end": 2})  # [1] = S
        nonpad = tape.op("Add", [past_lengths, seq])
        nonpad.name = "kv_lengths"
        zero, one = _const(tape, np.array(0, np.int64)), _const(tape, np.array(1, np.int64))
        seq_scalar = tape.op("Squeeze", [seq])
        rows = tape.op("Range", [zero, seq_scalar, one])  # [S]
        # query position of (b, i): past_lengths[b] + i   -> [B, S, 1]
        q_pos = tape.op("Add", [tape.op("Unsqueeze", [past_lengths, _const(tape, np.array([1], np.int64))]),
                                tape.op("Unsqueeze", [rows, _const(tape, np.array([0], np.int64))])])
        q_pos = tape.op("Unsqueeze", [q_pos, _const(tape, np.array([2], np.int64))])
        keys = _const(tape, np.arange(ctx.max_seq_len, dtype=np.int64).reshape(1, 1, -1))  # [1, 1, L]
        visible = tape.op("LessOrEqual", [keys, q_pos])  # [B, S, L]
        window = ctx.config.sliding_window
        if window:
            # Mistral/Qwen2 sliding window: key j is visible to query position p iff p - window < j <= p.
            low = tape.op("Sub", [q_pos, _const(tape, np.array(window, np.int64))])
            visible = tape.op("And", [visible, tape.op("Greater", [keys, low])])
        mask = tape.op("Unsqueeze", [visible, _const(tape, np.array([1], np.int64))])  # [B, 1, S, L]
        mask.name = "attention_mask_bsl"
        return mask, nonpad

    def _rewrite(self, model: ir.Model, node: ir.Node, layer: int, ctx: PassContext, batch: int | ir.SymbolicDim,
                 past_lengths: ir.Value, mask: ir.Value, nonpad: ir.Value) -> None:
        graph = model.graph
        q4, k4, v4 = attention_qkv(node)
        dk, hkv, dv = _static(q4, 3), _static(k4, 1), _static(v4, 3)
        scale = node.attributes["scale"].as_float() if "scale" in node.attributes else dk**-0.5
        mla = ctx.config.mla is not None
        if mla and hkv != 1:
            raise ValueError("absorbed MLA attention must be MQA (one latent head)")
        if not mla and dv != dk:
            raise ValueError(f"GQA needs equal key and value head sizes, got {dk} and {dv}")
        names = cache_names(layer, mla)
        cache_shape = ir.Shape([batch, hkv, ctx.max_seq_len, dk])
        cache_type = ir.TensorType(required(q4.dtype, f"{q4.name}: dtype"))
        past = [ir.Value(name=n, shape=cache_shape, type=cache_type) for n in names.past]
        graph.inputs.extend(past)

        tape = ir.tape.Tape()
        present = [tape.op("TensorScatter", [past[0], k4, past_lengths], attributes={"axis": 2})]
        if not mla:
            present.append(tape.op("TensorScatter", [past[1], v4, past_lengths], attributes={"axis": 2}))
        key = present[0]
        value = key if mla else present[1]
        out = tape.op("Attention", [q4, key, value, mask, None, None, nonpad],
                      attributes={"scale": float(scale), "is_causal": 0})
        out.name = f"/layers.{layer}/attention/output"
        if dv != dk:  # MLA: the latent's first R dims are the value
            out = tape.op("Slice", [out, _const(tape, np.array([0], np.int64)), _const(tape, np.array([dv], np.int64)),
                                    _const(tape, np.array([3], np.int64))])
        for value_out, name in zip(present, names.present, strict=False):
            value_out.name = name
            value_out.shape, value_out.type = cache_shape, cache_type
        graph.insert_before(node, tape.nodes)
        ir.convenience.replace_all_uses_with(node.outputs[0], out)
        graph.outputs.extend(present)
        graph.remove(node, safe=True)
