"""The TensorRT form of a paged graph (``--target trt --kv-cache paged``): the last pass of the paged TRT lowering.

Letters: T packed tokens, N pool blocks, Bs block size, Hkv KV heads, Dv value head size (latent mode: R).

``moeforge::PagedAttention`` stays one node per layer in TensorRT plugin conventions (op type = plugin name,
``plugin_version`` "1", ``plugin_namespace`` "moeforge") carrying its ONNX local function, which
TensorRT-RTX inlines (it loads no Python plugins; a registered plugin replaces the node under full
TensorRT). Latent mode (absorbed MLA) omits ``value`` and ``value_cache``; TensorRT-RTX 1.7's local-function
importer rejects a node with an unset optional input ("Invalid Node", before any body node is parsed), so
this pass binds both to EMPTY tensors instead: ``value`` [0, Hkv, Dv] and ``value_cache`` [0, Bs, Hkv, Dv]
of the pool's type. The latent body never reads them, and the plugin in moeforge/ops/paged_attention/tensorrt.py
already detects latent mode by ``value.numel() == 0``, so the node keeps its meaning on every backend.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from moeforge.ops.paged_attention.schema import DOMAIN, KC, OP_TYPE, VC, V
from moeforge.passes.base import PassContext, required
from moeforge.passes.kv_cache_io import _static

EMPTY_VALUE, EMPTY_VALUE_CACHE = "paged_empty_value", "paged_empty_value_cache"


class TrtPagedInputs:
    """Bind the unset value/value_cache inputs of latent-mode PagedAttention nodes to empty initializers;
    returns the number of nodes changed. Runs after the precision pass (the empties take the pool's type)."""

    name = "paged_inputs"

    def apply(self, model: ir.Model, ctx: PassContext) -> int:
        graph = model.graph
        nodes = [n for n in graph if n.op_type == OP_TYPE and n.domain == DOMAIN
                 and (len(n.inputs) <= V or n.inputs[V] is None)]
        empties: dict[tuple[str, tuple[int, ...], ir.DataType], ir.Value] = {}
        for node in nodes:
            pool = required(node.inputs[KC], f"{node.name}: key_cache input")  # [N, Bs, 1, R+Dr]
            block_size, heads = _static(pool, 1), _static(pool, 2)
            dv = node.attributes["head_size_v"].as_int()
            dtype = required(pool.dtype, f"{pool.name}: dtype")
            for index, name, shape in ((V, EMPTY_VALUE, (0, heads, dv)),
                                       (VC, EMPTY_VALUE_CACHE, (0, block_size, heads, dv))):
                key = (name, shape, dtype)
                if key not in empties:
                    array = np.zeros(shape, dtype.numpy())
                    value = ir.Value(name=f"{name}_{'x'.join(map(str, shape))}", shape=ir.Shape(shape),
                                     type=ir.TensorType(dtype), const_value=ir.tensor(array, dtype=dtype))
                    graph.register_initializer(value)
                    empties[key] = value
                node.replace_input_with(index, empties[key])
        return len(nodes)
