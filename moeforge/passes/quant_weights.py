"""Weight quantisation as standard ONNX Q/DQ: the portable form (TensorRT consumes it as is).

Each quantised weight becomes an initializer of codes plus a scale, and a ``DequantizeLinear`` feeds
the op that used the weight:

| weights | codes | scale | DequantizeLinear |
|---|---|---|---|
| MatMul W [K, N], int8 per channel | int8 [K, N] | [N] | axis=1 |
| MatMul W [K, N], int4/int8/fp8 blocks along K | int4/int8/float8e4m3fn [K, N] | [K/bs, N] | axis=0, block_size=bs |
| com.microsoft.MoE fc1/fc2/fc3 [E, N, K] | same kinds, [E, N, K] | [E, N, K/bs] (per channel: bs=K) | axis=2 |

All zero points are 0 (symmetric), except with ``QuantConfig.asymmetric`` (``--quant int4-asym`` /
``int8-asym``, ONNX Runtime only): each MatMul weight of the scheme's kind (not MoE experts; the LM head only
with ``head_asymmetric``) becomes min-max blocks with a float offset, which ``DequantizeLinear``'s integer
zero point cannot carry, so the portable form is

    DequantizeLinear(uint4|uint8 codes [K, N], scale [K/bs, N], axis=0, block_size=bs) -> Reshape [K/bs, bs, N]
    -> Add(offset [K/bs, 1, N]) -> Reshape [K, N] -> MatMul

(standard ONNX; ``quant_lowering`` turns it into MatMulNBits with float zero points).
Not quantised: the embedding Gather (a table lookup), the MoE
router (its MatMul picks experts: kept fp32 like norms and softmax, which have no weights here), DSA's indexer
projections (they pick the tokens sparse attention reads; ``indexer_matmuls``), and
every weight named in ``QuantConfig.keep`` (mixed precision). AWQ scales ``s`` [K] multiply the
weight rows before quantising; a ``Mul(x, 1/s)`` on the activation keeps the product unchanged.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np
import onnx_ir as ir

from moeforge.passes.base import MS_DOMAIN, PassContext, add_initializer, required
from moeforge.passes.paged_kv import LOGITS_3D
from moeforge.passes.quant_math import QuantizedWeight, quantize, quantize_asym, quantize_fp8_exact

# The MoE router's weight (HF ``mlp.gate.weight``; not ``gate_proj``): experts are chosen from its logits.
ROUTER_WEIGHT = re.compile(r"(^|\.)gate\.weight")
MOE_WEIGHT_INPUTS = (2, 4, 6)  # com.microsoft.MoE: fc1_experts_weights, fc2_..., fc3_...


def is_lm_head_node(node: ir.Node) -> bool:
    """The LM head MatMul: it produces ``logits`` (paged graphs: ``logits_3d``, squeezed into ``logits``)."""
    return any(o.name in ("logits", LOGITS_3D) for o in node.outputs)


@dataclass(frozen=True)
class QuantTarget:
    """One quantisable weight: ``node.inputs[index]`` is the constant ``weight``."""

    name: str  # the initializer's name (unique in the graph)
    label: str  # readable: the PyTorch module path where the exporter recorded one
    node: ir.Node
    index: int
    shape: tuple[int, ...]

    @property
    def is_moe(self) -> bool:
        return self.node.op_type == "MoE"

    @property
    def is_lm_head(self) -> bool:
        return is_lm_head_node(self.node)

    @property
    def in_features(self) -> int:
        return self.shape[-1] if self.is_moe else self.shape[0]


@dataclass
class QuantConfig:
    """What to quantise and how. ``kind`` int8 | int4 | fp8; ``block_size`` None = per output channel."""

    kind: str
    block_size: int | None
    keep: frozenset[str] = frozenset()  # weight names left in fp32 (mixed precision)
    awq_scales: dict[str, np.ndarray] = field(default_factory=dict)  # weight name -> s [K]
    exact_fp8: bool = False  # FP8-checkpoint source: recover each block's stored FP8 codes exactly
    head_kind: str | None = None  # the LM head's kind (None: ``kind``), same block size
    asymmetric: bool = False  # MatMul weights of ``kind``: min-max blocks with float offsets (ORT only, see above)
    head_asymmetric: bool = False  # the LM head too (when it has ``kind``); else it is symmetric


def fold_transposed_weights(model: ir.Model) -> int:
    """MatMul(x, Transpose(W const)) -> MatMul(x, W^T const): a tied LM head reads the embedding table
    transposed at run time; its own constant can be quantised while the Gather keeps the fp32 table."""
    count = 0
    for node in model.graph:
        if node.op_type != "MatMul" or node.domain != "":
            continue
        producer = node.inputs[1].producer() if node.inputs[1] is not None else None
        if producer is None or producer.op_type != "Transpose":
            continue
        table = producer.inputs[0]
        array = _const(table)
        if table is None or array is None:
            continue
        perm = producer.attributes.get("perm")
        if len(table.shape or ()) != 2 or (perm is not None and list(perm.as_ints()) != [1, 0]):
            continue
        value = add_initializer(model.graph, f"{table.name}.T", ir.tensor(np.ascontiguousarray(array.T)))
        node.replace_input_with(1, value)
        if not any(o.uses() for o in producer.outputs):
            model.graph.remove(producer, safe=True)
        count += 1
    return count


def indexer_matmuls(model: ir.Model) -> set[ir.Node]:
    """The MatMuls feeding DSA's indexer (DeepSeek-V3.2: wq_b, wk, weights_proj, or the packed projection that
    holds them): the first MatMul up each path from a moeforge.SparseMLA* node's index_q / index_w / index_k.
    Kept fp32 like the router: their scores pick which tokens attention reads, and a flipped pick is no small
    error."""
    found: set[ir.Node] = set()
    for node in model.graph:
        if node.domain != "moeforge" or not node.op_type.startswith("SparseMLA"):
            continue
        stack = [v for v in node.inputs[2:5] if v is not None]
        seen: set[ir.Value] = set()
        while stack:
            value = stack.pop()
            producer = value.producer()
            if value in seen or producer is None:
                continue
            seen.add(value)
            if producer.op_type == "MatMul" and _const(producer.inputs[1]) is not None:
                found.add(producer)
            else:
                stack.extend(v for v in producer.inputs if v is not None)
    return found


def quant_targets(model: ir.Model) -> list[QuantTarget]:
    """The weights the pass quantises, in graph order (router and DSA indexer weights excluded)."""
    fold_transposed_weights(model)
    targets = []
    indexer = indexer_matmuls(model)
    for node in model.graph:
        if node.op_type == "MatMul" and node.domain == "":
            weight = node.inputs[1]
            if (weight is None or _const(weight) is None or weight.shape is None or len(weight.shape) != 2
                    or ROUTER_WEIGHT.search(weight.name or "") or node in indexer):
                continue
            name = required(weight.name, f"{node.name}: weight name")
            targets.append(QuantTarget(name, _label(node, weight), node, 1, weight.shape.numpy()))
        elif node.op_type == "MoE" and node.domain == MS_DOMAIN:
            for index in MOE_WEIGHT_INPUTS:
                weight = node.inputs[index] if index < len(node.inputs) else None
                if weight is not None and _const(weight) is not None:
                    name = required(weight.name, f"{node.name}: expert weight name")
                    shape = required(weight.shape, f"{name}: shape").numpy()
                    targets.append(QuantTarget(name, name, node, index, shape))
    return targets


class WeightQuantization:
    """Insert DequantizeLinear on every quantisable weight; returns the number of weights quantised."""

    name = "quant_weights"

    def __init__(self, config: QuantConfig) -> None:
        self.config = config

    def apply(self, model: ir.Model, ctx: PassContext) -> int:
        count = 0
        for target in quant_targets(model):
            if target.name in self.config.keep:
                continue
            self._quantize(model, target)
            count += 1
        return count

    def _quantize(self, model: ir.Model, target: QuantTarget) -> None:
        graph, cfg = model.graph, self.config
        weight = required(target.node.inputs[target.index], f"{target.name}: weight input")
        array = _const(weight)
        assert array is not None
        kind = (cfg.head_kind or cfg.kind) if target.is_lm_head else cfg.kind
        if target.is_moe:
            # [E, N, K]: quantise each expert as a [K, N] matrix, store codes back as [E, N, K].
            parts = [self._q(array[e].T, cfg.kind) for e in range(array.shape[0])]
            codes = np.stack([p.values.T for p in parts])
            if cfg.block_size is None:
                scale = np.stack([p.scale[:, None] for p in parts])  # [E, N, 1]: one block of K
                block = array.shape[2]
            else:
                scale = np.stack([p.scale.T for p in parts])  # [E, N, K/bs]
                block = cfg.block_size
            attributes = {"axis": 2, "block_size": block}
        else:
            s = cfg.awq_scales.get(target.name)
            source = array * s[:, None] if s is not None else array
            asymmetric = cfg.asymmetric and kind == cfg.kind and (not target.is_lm_head or cfg.head_asymmetric)
            if asymmetric and cfg.block_size is not None:
                if s is not None:
                    self._scale_activation(model, target, (1.0 / s).astype(np.float32))
                self._quantize_asym(model, target, source, 4 if kind == "int4" else 8)
                return
            q = self._q(source, kind)
            codes, scale = q.values, q.scale
            attributes = {"axis": 1} if cfg.block_size is None else {"axis": 0, "block_size": cfg.block_size}
            if s is not None:
                self._scale_activation(model, target, (1.0 / s).astype(np.float32))
        stem = target.name
        codes_value = add_initializer(graph, f"{stem}.q", _typed(codes, kind))
        scale_value = add_initializer(graph, f"{stem}.scale", ir.tensor(scale.astype(np.float32)))
        dq = ir.node("DequantizeLinear", [codes_value, scale_value], attributes=attributes)
        dq.outputs[0].name = f"{stem}.dq"
        dq.outputs[0].shape, dq.outputs[0].type = weight.shape, ir.TensorType(ir.DataType.FLOAT)
        graph.insert_before(target.node, dq)
        target.node.replace_input_with(target.index, dq.outputs[0])
        if not weight.uses() and weight.name is not None and weight.name in graph.initializers:
            graph.initializers.pop(weight.name)

    def _quantize_asym(self, model: ir.Model, target: QuantTarget, array: np.ndarray, bits: int) -> None:
        graph, bs = model.graph, self.config.block_size
        assert bs is not None
        weight = required(target.node.inputs[target.index], f"{target.name}: weight input")
        q = quantize_asym(array, bs, bits)
        k, n = array.shape
        stem = target.name
        codes = add_initializer(graph, f"{stem}.q", q.codes.astype(ml_dtypes.uint4) if bits == 4 else q.codes)
        scale = add_initializer(graph, f"{stem}.scale", ir.tensor(q.scale))
        offset = add_initializer(graph, f"{stem}.offset", ir.tensor(q.offset[:, None, :]))  # [K/bs, 1, N]
        blocked = add_initializer(graph, f"{stem}.blocked_shape", ir.tensor(np.array([k // bs, bs, n], np.int64)))
        flat = add_initializer(graph, f"{stem}.shape", ir.tensor(np.array([k, n], np.int64)))
        dq = ir.node("DequantizeLinear", [codes, scale], attributes={"axis": 0, "block_size": bs})
        split = ir.node("Reshape", [dq.outputs[0], blocked])
        add = ir.node("Add", [split.outputs[0], offset])
        merge = ir.node("Reshape", [add.outputs[0], flat])
        for node, suffix, shape in ((dq, "dq", (k, n)), (split, "blocks", (k // bs, bs, n)),
                                    (add, "blocks_offset", (k // bs, bs, n)), (merge, "dq_asym", (k, n))):
            node.outputs[0].name = f"{stem}.{suffix}"
            node.outputs[0].shape, node.outputs[0].type = ir.Shape(shape), ir.TensorType(ir.DataType.FLOAT)
            graph.insert_before(target.node, node)
        target.node.replace_input_with(target.index, merge.outputs[0])
        if not weight.uses() and weight.name is not None and weight.name in graph.initializers:
            graph.initializers.pop(weight.name)

    def _q(self, weight: np.ndarray, kind: str) -> QuantizedWeight:
        if self.config.exact_fp8 and kind == "fp8":
            return quantize_fp8_exact(weight, self.config.block_size)
        return quantize(weight, kind, self.config.block_size)

    @staticmethod
    def _scale_activation(model: ir.Model, target: QuantTarget, inverse: np.ndarray) -> None:
        graph = model.graph
        x = required(target.node.inputs[0], f"{target.node.name}: activation input")
        inv = add_initializer(graph, f"{target.name}.awq_inv_scale", ir.tensor(inverse))
        mul = ir.node("Mul", [x, inv])
        mul.outputs[0].name = f"{target.name}.awq_input"
        mul.outputs[0].shape, mul.outputs[0].type = x.shape, x.type
        graph.insert_before(target.node, mul)
        target.node.replace_input_with(0, mul.outputs[0])


def _typed(codes: np.ndarray, kind: str) -> ir.TensorProtocol:
    if kind == "int4":
        return ir.tensor(codes.astype(ml_dtypes.int4))
    if kind == "fp8":
        return ir.tensor(codes.astype(ml_dtypes.float8_e4m3fn))
    return ir.tensor(codes.astype(np.int8))


def _const(value: ir.Value | None) -> np.ndarray | None:
    if value is None or value.const_value is None or value.dtype != ir.DataType.FLOAT:
        return None
    return value.const_value.numpy()


def _label(node: ir.Node, weight: ir.Value) -> str:
    scopes = node.metadata_props.get("pkg.torch.onnx.name_scopes", "")
    found: list[str] = re.findall(r"'([^']+)'", scopes)
    modules = [s for s in found if s.startswith("model.")]
    if modules:
        return modules[-1]
    param = re.search(r"%p_model_(\w+?)_weight", node.metadata_props.get("pkg.torch.onnx.fx_node", ""))
    return param.group(1) if param else (weight.name or "")
