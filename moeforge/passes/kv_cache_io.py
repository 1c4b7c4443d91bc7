"""KV-cache I/O insertion: every attention node becomes com.microsoft.GroupQueryAttention with a
fixed-size cache buffer that ONNX Runtime updates in place (past and present share one buffer).

Dimension letters: B batch, S new tokens, T = past + S tokens seen, L buffer length (max
sequence length), Hq query heads, Hkv key/value heads, D head dim, R kv_lora_rank, Dr rope dims.

Before (stateless export): Attention(Q [B,Hq,S,D], K [B,Hkv,S,D], V [B,Hkv,S,Dv], causal mask).
After: GroupQueryAttention(q [B,S,Hq*D], k [B,S,Hkv*D], v, past_key, past_value, seqlens_k,
total_sequence_length) -> (out [B,S,Hq*D], present_key, present_value).

Graph inputs added (names follow onnxruntime-genai so it can run GQA artifacts):
  attention_mask [B, T] int64 (1 = real token; right padding)
  GQA: past_key_values.{i}.key / .value [B, Hkv, L, D]  ->  present.{i}.key / .value
  absorbed MLA: past_key_values.{i}.latent [B, 1, L, R+Dr] -> present.{i}.latent (+ present.{i}.latent_v)
  DSA (DeepSeek-V3.2): latent + past_key_values.{i}.index [B, 1, L, Di] around moeforge.SparseMLA (dsa_cache.py)
Absorbed MLA is multi-query attention whose value is the first R dims of the key, so K = V = the
latent and the output is sliced to R: the cache holds only R + Dr values per token. GQA wants a
separate value buffer, so the runtime binds ONE buffer to the latent input and both outputs (the
two writes are identical); the graph's cache input per layer is that single latent.
seqlens_k (= tokens in cache after this step - 1) and total_sequence_length are computed from
attention_mask inside the graph, as the onnxruntime-genai builder does.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from moeforge.core.kv_layout import MAX_SEQ_AXIS, cache_names
from moeforge.passes.base import MS_DOMAIN, PassContext, ensure_opset, required, token_input
from moeforge.passes.dsa_cache import insert_dsa_caches

ATTENTION_MASK = "attention_mask"


def layer_attentions(model: ir.Model, num_layers: int, opsets: dict[str, int]) -> list[ir.Node]:
    """The exported graph's ONNX Attention nodes, one per layer (empty if already rewritten; a different count
    means the export is not what the KV-cache passes expect). When there are some, declares ``opsets`` (domain ->
    version), which the cache rewrite about to replace them uses."""
    attentions = [n for n in model.graph if n.op_type == "Attention" and n.domain == ""]
    if attentions and len(attentions) != num_layers:
        raise ValueError(f"expected one Attention node per layer ({num_layers}), found {len(attentions)}")
    for domain, version in opsets.items() if attentions else ():
        ensure_opset(model, domain, version)
    return attentions


class KVCacheInsertion:
    """Attention -> GroupQueryAttention with in-place cache I/O; returns the number of layers rewritten."""

    name = "kv_cache"

    def apply(self, model: ir.Model, ctx: PassContext) -> int:
        graph = model.graph
        if ctx.config.dsa is not None:  # DeepSeek-V3.2: moeforge.SparseMLA nodes, not Attention (dsa_cache.py)
            return insert_dsa_caches(model, ctx)
        attentions = layer_attentions(model, ctx.config.num_hidden_layers, {MS_DOMAIN: 1})
        if not attentions:
            return 0
        batch = _batch_dim(graph)
        mask = ir.Value(name=ATTENTION_MASK, shape=ir.Shape([batch, "total_sequence_length"]),
                        type=ir.TensorType(ir.DataType.INT64))
        graph.inputs.append(mask)
        tape = ir.tape.Tape()
        # seqlens_k = sum(mask) - 1 per row; total = mask width (GenAI's convention for GQA).
        ones_sum = tape.op("ReduceSum", [mask, _const(tape, np.array([1], np.int64))], attributes={"keepdims": 0})
        seqlens = tape.op("Cast", [tape.op("Sub", [ones_sum, _const(tape, np.array(1, np.int64))])],
                          attributes={"to": ir.DataType.INT32})
        width = tape.op("Gather", [tape.op("Shape", [mask]), _const(tape, np.array(1, np.int64))],
                        attributes={"axis": 0})
        total = tape.op("Cast", [width], attributes={"to": ir.DataType.INT32})
        seqlens.name, total.name = "seqlens_k", "total_sequence_length"
        graph.insert_before(attentions[0], tape.nodes)

        for layer, node in enumerate(attentions):
            self._rewrite(model, node, layer, ctx, batch, seqlens, total)
        return len(attentions)

    def _rewrite(self, model: ir.Model, node: ir.Node, layer: int, ctx: PassContext, batch: int | ir.SymbolicDim,
                 seqlens: ir.Value, total: ir.Value) -> None:
        graph = model.graph
        q4, k4, v4 = attention_qkv(node)
        hq, dk = _static(q4, 1), _static(q4, 3)
        hkv, dv = _static(k4, 1), _static(v4, 3)
        scale = node.attributes["scale"].as_float() if "scale" in node.attributes else dk**-0.5
        mla = ctx.config.mla is not None
        if mla and (hkv != 1 or not _is_prefix_slice_of(v4, k4, dv)):
            raise ValueError("absorbed MLA attention must be MQA whose value is a prefix slice of the key")
        if not mla and dv != dk:
            raise ValueError(f"GQA needs equal key and value head sizes, got {dk} and {dv}")
        names = cache_names(layer, mla)
        cache_shape = ir.Shape([batch, hkv, MAX_SEQ_AXIS, dk])
        dtype = required(q4.dtype, f"{q4.name}: dtype")
        cache_type = ir.TensorType(dtype)
        past = [ir.Value(name=n, shape=cache_shape, type=cache_type) for n in names.past]
        graph.inputs.extend(past)
        past_key, past_value = (past[0], past[0]) if mla else (past[0], past[1])

        tape = ir.tape.Tape()
        q3 = _to_bsd(tape, q4, hq * dk)
        k3 = _to_bsd(tape, k4, hkv * dk)
        v3 = k3 if mla else _to_bsd(tape, v4, hkv * dk)  # MLA: the value is the latent itself
        window = ctx.config.sliding_window
        inputs: list[ir.Value | None] = [q3, k3, v3, past_key, past_value, seqlens, total]
        attributes = {"num_heads": hq, "kv_num_heads": hkv, "scale": float(scale), "do_rotary": 0,
                      "local_window_size": int(window) if window else -1}
        rotary = None if mla else _foldable_rotary(q3, k3, dk)
        if rotary is not None:
            # GQA rotates q and k itself (one kernel instead of two RotaryEmbedding nodes + reshapes).
            (q_raw, k_raw), position_ids, cos, sin, interleaved = rotary
            inputs[0], inputs[1] = q_raw, k_raw
            inputs += [cos, sin, position_ids]
            attributes.update(do_rotary=1, rotary_interleaved=interleaved)
        out, present_key, present_value = tape.op_multi_out(
            "GroupQueryAttention", inputs, attributes=attributes, domain=MS_DOMAIN, num_outputs=3,
        )
        out.name = f"/layers.{layer}/attention/output"
        if q4.shape is not None:  # [B, S, Hq*D]: lets cleanup see the Reshape round trip after it
            out.shape, out.type = ir.Shape([q4.shape[0], q4.shape[2], hq * dk]), ir.TensorType(dtype)
        present_key.name, present_value.name = names.present
        for value in (present_key, present_value):
            value.shape, value.type = cache_shape, cache_type
        # out [B, S, Hq*D] -> [B, S, Hq, D] (-> slice D to Dv for MLA) -> [B, Hq, S, Dv] as before.
        heads = tape.op("Reshape", [out, _const(tape, np.array([0, 0, hq, dk], np.int64))])
        if dv != dk:
            heads = tape.op("Slice", [heads, _const(tape, np.array([0], np.int64)),
                                      _const(tape, np.array([dv], np.int64)), _const(tape, np.array([3], np.int64))])
        graph.insert_before(node, tape.nodes)
        _replace_bhsd_output(graph, node.outputs[0], heads)
        graph.outputs.extend([present_key, present_value])
        graph.remove(node, safe=True)  # detaches its inputs, so what fed only it becomes dead code


# What _foldable_rotary finds: ((q_in, k_in), position_ids, cos_cache, sin_cache, interleaved).
_FoldableRotary = tuple[tuple[ir.Value | None, ir.Value | None], ir.Value | None, ir.Value | None, ir.Value | None, int]


def _foldable_rotary(q3: ir.Value, k3: ir.Value, head_dim: int) -> _FoldableRotary | None:
    """If q and k [B, S, H*D] come straight out of RotaryEmbedding nodes that share position_ids and
    cos/sin caches, return ((q_in, k_in), position_ids, cos, sin, interleaved); else None.

    GroupQueryAttention's CPU rotary needs a head size that is a multiple of 16.
    """
    if head_dim % 16:
        return None
    q_node, k_node = q3.producer(), k3.producer()
    if q_node is None or k_node is None:
        return None
    nodes = [q_node, k_node]
    if any(n.op_type != "RotaryEmbedding" or n.domain != MS_DOMAIN for n in nodes):
        return None
    if any(len(n.inputs) < 4 for n in nodes) or q_node.inputs[1:4] != k_node.inputs[1:4]:
        return None
    interleaved = {n.attributes.get_int("interleaved", 0) for n in nodes}
    rotated = {n.attributes.get_int("rotary_embedding_dim", head_dim) for n in nodes}
    if len(interleaved) != 1 or rotated != {head_dim}:
        return None  # (other users of the rotated q/k, if any, keep their RotaryEmbedding node)
    position_ids, cos, sin = q_node.inputs[1], q_node.inputs[2], q_node.inputs[3]
    return (q_node.inputs[0], k_node.inputs[0]), position_ids, cos, sin, interleaved.pop()


def _batch_dim(graph: ir.Graph) -> int | ir.SymbolicDim:
    ids = token_input(graph)
    return required(ids.shape, f"{ids.name}: shape")[0]


def attention_qkv(node: ir.Node) -> tuple[ir.Value, ir.Value, ir.Value]:
    """The query, key and value inputs of an ONNX Attention node (each required)."""
    return (required(node.inputs[0], f"{node.name}: Attention query input"),
            required(node.inputs[1], f"{node.name}: Attention key input"),
            required(node.inputs[2], f"{node.name}: Attention value input"))


def _static(value: ir.Value, axis: int) -> int:
    dim = value.shape[axis] if value.shape is not None else None
    if not isinstance(dim, int):
        raise ValueError(f"{value.name}: axis {axis} must be static for the cache layout, got {dim}")
    return dim


def _const(tape: ir.tape.Tape, array: np.ndarray) -> ir.Value:
    return tape.op("Constant", [], attributes={"value": ir.tensor(array)})


def _to_bsd(tape: ir.tape.Tape, value4: ir.Value, width: int) -> ir.Value:
    """[B, H, S, D] -> [B, S, H*D], reusing the [B, S, H, D] tensor when the exporter transposed it."""
    producer = value4.producer()
    if producer is not None and producer.op_type == "Transpose" and _perm(producer) == (0, 2, 1, 3):
        bshd = required(producer.inputs[0], f"{producer.name}: Transpose input")
    else:
        bshd = tape.op("Transpose", [value4], attributes={"perm": [0, 2, 1, 3]})
    # [B, S, H*D] -> Reshape -> [B, S, H, D] (e.g. around RotaryEmbedding): take the 3D tensor as is.
    reshape = bshd.producer()
    if reshape is not None and reshape.op_type == "Reshape":
        flat = reshape.inputs[0]
        if flat is not None and flat.shape is not None and len(flat.shape) == 3 and flat.shape[2] == width:
            return flat
    return tape.op("Reshape", [bshd, _const(tape, np.array([0, 0, width], np.int64))])


def _perm(node: ir.Node) -> tuple[int, ...]:
    return tuple(node.attributes["perm"].as_ints()) if "perm" in node.attributes else ()


def _is_prefix_slice_of(value: ir.Value, source: ir.Value, length: int) -> bool:
    producer = value.producer()
    if producer is None or producer.op_type != "Slice" or producer.inputs[0] is not source:
        return False
    starts = producer.inputs[1].const_value if len(producer.inputs) > 1 and producer.inputs[1] else None
    return starts is not None and int(np.asarray(starts.numpy()).reshape(-1)[0]) == 0


def _replace_bhsd_output(graph: ir.Graph, old: ir.Value, bshd: ir.Value) -> None:
    """Rewire users of the old [B, H, S, D] output; Transpose(0,2,1,3) users take [B, S, H, D] directly."""
    transpose_back = None
    for use in list(old.uses()):
        user = use.node
        if user.op_type == "Transpose" and _perm(user) == (0, 2, 1, 3):
            ir.convenience.replace_all_uses_with(user.outputs[0], bshd)
            graph.remove(user, safe=True)  # leave no node reading the removed attention output
            continue
        if transpose_back is None:
            transpose_back = ir.node("Transpose", [bshd], attributes={"perm": [0, 2, 1, 3]})
            graph.insert_after(required(bshd.producer(), f"{bshd.name}: producer"), transpose_back)
        user.replace_input_with(use.idx, transpose_back.outputs[0])
