"""Weight quantisation as standard ONNX Q/DQ: the portable form (TensorRT consumes it as is).

Each quantised weight becomes an initializer of codes plus a scale, and a ``DequantizeLinear`` feeds
the op that used the weight:

| weights | codes | scale | DequantizeLinear |
|---|---|---|---|
| MatMul W [K, N], int8 per channel | int8 [K, N] | [N] | axis=1 |
| MatMul W [K, N], int4/int8/fp8 blocks along K | int4/int8/float8e4m3fn [K, N] | [K/bs, N] | axis=0, block_size=bs |
| com.microsoft.MoE fc1/fc2/fc3 [E, N, K] | same kinds, [E, N, K] | [E, N, K/bs] (per channel: bs=K) | axis=2 |

All zero points are 0 (symmetric), except with ``QuantConfig.asymmetric`` (``--quant int4-asym`` /
``int8-asym``, ONNX Runtime only): each MatMul weight of the scheme's kind (the LM head only with
``head_asymmetric``) and each MoE expert becomes min-max blocks with a float offset, which
``DequantizeLinear``'s integer zero point cannot carry, so the portable form is

    DequantizeLinear(uint4|uint8 codes [K, N], scale [K/bs, N], axis=0, block_size=bs) -> Reshape [K/bs, bs, N]
    -> Add(offset [K/bs, 1, N]) -> Reshape [K, N] -> MatMul

(standard ONNX; ``quant_lowering`` turns it into MatMulNBits plus the block sums' share of the offsets). Experts
[E, N, K] take the same chain along K (axis 2, offsets [E, N, K/bs, 1]); ``sparse_experts`` runs it per expert.
Not quantised: the embedding Gather (a table lookup), the MoE
router (its MatMul picks experts: kept fp32 like norms and softmax, which have no weights here), DSA's and
DeepSeek-V4's indexer projections (they pick the tokens sparse attention reads; ``indexer_matmuls``,
``INDEXER_WEIGHT``), DeepSeek-V4's hyper-connection weights (``HC_WEIGHT``: they mix the residual streams), and
every weight named in ``QuantConfig.keep`` (mixed precision). AWQ scales ``s`` [K] multiply the
weight rows before quantising; a ``Mul(x, 1/s)`` on the activation keeps the product unchanged.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np
import onnx_ir as ir

from moeforge.ops.expert_stack import ExpertStack, experts_of
from moeforge.ops.node_builder import lazy_tensor
from moeforge.passes.base import MS_DOMAIN, PassContext, add_initializer, required
from moeforge.passes.paged_kv import LOGITS_3D
from moeforge.passes.quant_math import QuantizedWeight, quantize, quantize_asym, quantize_fp8_exact
from moeforge.passes.weight_matmuls import ROUTED_EXPERT

# The MoE router's weight (HF ``mlp.gate.weight``; not ``gate_proj``): experts are chosen from its logits.
ROUTER_WEIGHT = re.compile(r"(^|\.)gate\.weight")
# DeepSeek-V4's hyper-connection (mHC) weights, HF ``attn_hc.fn`` / ``ffn_hc.fn`` / ``hc_head.hc_fn``: matched on the
# initializer's name or on the parameter the exporter recorded (``%p_model_model_layers_0_attn_hc_fn``: the export
# folds their transposes into unnamed constants). They mix the residual streams: fp32, like the router.
HC_WEIGHT = re.compile(r"(attn_hc|ffn_hc)[._]fn$|hc_head[._]hc_fn$")
# DeepSeek-V4's indexer projections (``...self_attn.compressor.indexer.*``), by name: like DSA's (``indexer_matmuls``)
# they pick the compressed entries attention reads.
INDEXER_WEIGHT = re.compile(r"(^|\.)indexer\.")
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
    def routed_expert(self) -> bool:
        """Routed experts' weights: a MoE op's stack, or one expert's MatMul (DeepSeek-V4, ``weight_matmuls``).
        Calibration leaves them alone (RTN weights, fp32 activations): a prompt set need not reach every expert."""
        return self.is_moe or ROUTED_EXPERT.search(self.name) is not None

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
        tensor = _const(table)
        if table is None or tensor is None:
            continue
        perm = producer.attributes.get("perm")
        if len(table.shape or ()) != 2 or (perm is not None and list(perm.as_ints()) != [1, 0]):
            continue
        rows, cols = tensor.shape.numpy()
        transposed = lazy_tensor(_transpose_of(tensor), ir.DataType.FLOAT, (cols, rows))
        value = add_initializer(model.graph, f"{table.name}.T", transposed)
        node.replace_input_with(1, value)
        if not any(o.uses() for o in producer.outputs):
            model.graph.remove(producer, safe=True)
        count += 1
    return count


def _transpose_of(tensor: ir.TensorProtocol) -> Callable[[], np.ndarray]:
    return lambda: np.ascontiguousarray(tensor.numpy().T)


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
                    or _fp32_kind(node, weight, indexer) is not None):
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


def always_fp32_weights(model: ir.Model) -> list[str]:
    """What kinds of MatMul weights ``quant_targets`` leaves fp32 in ``model``, beyond the router (always listed):
    ``hyper-connections (mHC)`` and ``indexer``, when it has them (for the manifest's ``always_fp32``)."""
    indexer = indexer_matmuls(model)
    kinds = {_fp32_kind(node, node.inputs[1], indexer) for node in model.graph
             if node.op_type == "MatMul" and node.domain == "" and node.inputs[1] is not None}
    return [kind for kind in ("hyper-connections (mHC)", "indexer") if kind in kinds]


def _fp32_kind(node: ir.Node, weight: ir.Value, indexer: set[ir.Node]) -> str | None:
    """Why the weight of MatMul ``node`` stays fp32 (router, hyper-connections (mHC), indexer), or None."""
    name = weight.name or ""
    if ROUTER_WEIGHT.search(name):
        return "router"
    params = re.findall(r"%p_(\w+)", node.metadata_props.get("pkg.torch.onnx.fx_node", ""))  # the parameters read
    if any(HC_WEIGHT.search(p) for p in (name, *params)):
        return "hyper-connections (mHC)"
    if node in indexer or INDEXER_WEIGHT.search(name):
        return "indexer"
    return None


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
        """Codes and scales are lazy tensors (``_Parts``): the weight is read and quantised when the artifact is
        written (or when a later pass reads them), never held whole beside the others."""
        cfg = self.config
        weight = required(target.node.inputs[target.index], f"{target.name}: weight input")
        tensor = _const(weight)
        assert tensor is not None
        kind = (cfg.head_kind or cfg.kind) if target.is_lm_head else cfg.kind
        shape = tuple(tensor.shape.numpy())
        if target.is_moe:
            # [E, N, K]: quantise each expert as a [K, N] matrix, store codes back as [E, N, K].
            experts, n, k = shape
            block = cfg.block_size
            if cfg.asymmetric and block is not None and kind in ("int4", "int8"):
                self._quantize_asym_experts(model, target, tensor, block, 4 if kind == "int4" else 8)
                return
            scale_shape: tuple[int, ...] = (experts, n, 1) if block is None else (experts, n, k // block)
            kind = cfg.kind

            def expert_scale(q: QuantizedWeight) -> np.ndarray:  # [N, 1] (one block of K) or [N, K/bs]
                scale: np.ndarray = (q.scale[:, None] if block is None else q.scale.T).astype(np.float32)
                return scale

            def compute() -> dict[str, np.ndarray]:
                array = tensor.numpy()
                quantized = [self._q(array[e].T, cfg.kind) for e in range(experts)]
                codes = np.stack([q.values.T for q in quantized])
                scale = np.stack([expert_scale(q) for q in quantized])  # [E, N, 1 or K/bs]
                return {"codes": _typed_array(codes, kind), "scale": scale}

            attributes = {"axis": 2, "block_size": k if block is None else block}
            source_of = experts_of(tensor)
            if source_of is not None:  # streamed: quantised and written expert by expert
                self._quantize_experts(model, target, source_of, expert_scale, shape, scale_shape, attributes)
                return
        else:
            s = cfg.awq_scales.get(target.name)
            asymmetric = cfg.asymmetric and kind == cfg.kind and (not target.is_lm_head or cfg.head_asymmetric)
            if asymmetric and cfg.block_size is not None:
                if s is not None:
                    self._scale_activation(model, target, (1.0 / s).astype(np.float32))
                self._quantize_asym(model, target, tensor, s, 4 if kind == "int4" else 8)
                return
            k, n = shape
            scale_shape = (n,) if cfg.block_size is None else (k // cfg.block_size, n)

            def compute() -> dict[str, np.ndarray]:
                array = tensor.numpy()
                q = self._q(array * s[:, None] if s is not None else array, kind)
                return {"codes": _typed_array(q.values, kind), "scale": q.scale.astype(np.float32)}

            attributes = {"axis": 1} if cfg.block_size is None else {"axis": 0, "block_size": cfg.block_size}
            if s is not None:
                self._scale_activation(model, target, (1.0 / s).astype(np.float32))
        parts = _Parts(compute, ("codes", "scale"))
        self._replace_with_dq(model, target, parts.tensor("codes", CODE_DTYPES[kind], shape),
                              parts.tensor("scale", ir.DataType.FLOAT, scale_shape), attributes)

    @staticmethod
    def _replace_with_dq(model: ir.Model, target: QuantTarget, codes: ir.TensorProtocol, scale: ir.TensorProtocol,
                         attributes: dict[str, int]) -> None:
        """``DequantizeLinear(codes, scale)`` in place of ``target``'s weight (dropped if nothing else reads it)."""
        graph = model.graph
        weight = required(target.node.inputs[target.index], f"{target.name}: weight input")
        stem = target.name
        codes_value = add_initializer(graph, f"{stem}.q", codes)
        scale_value = add_initializer(graph, f"{stem}.scale", scale)
        dq = ir.node("DequantizeLinear", [codes_value, scale_value], attributes=attributes)
        dq.outputs[0].name = f"{stem}.dq"
        dq.outputs[0].shape, dq.outputs[0].type = weight.shape, ir.TensorType(ir.DataType.FLOAT)
        graph.insert_before(target.node, dq)
        target.node.replace_input_with(target.index, dq.outputs[0])
        if not weight.uses() and weight.name is not None and weight.name in graph.initializers:
            graph.initializers.pop(weight.name)

    def _quantize_experts(self, model: ir.Model, target: QuantTarget, source_of: Callable[[int], np.ndarray],
                          expert_scale: Callable[[QuantizedWeight], np.ndarray], shape: tuple[int, ...],
                          scale_shape: tuple[int, ...], attributes: dict[str, int]) -> None:
        """The MoE branch of ``_quantize`` for an ``ExpertStack`` weight [E, N, K]: codes and scales are
        ``ExpertStack``s too, each expert quantised when its codes are written (its scales kept until they are)."""
        kind = self.config.kind
        kept = _KeptParts(lambda e: {"scale": expert_scale(self._q(source_of(e).T, kind))})

        def codes_of(e: int) -> np.ndarray:
            q = self._q(source_of(e).T, kind)
            kept.keep(e, {"scale": expert_scale(q)})
            return _typed_array(q.values.T, kind)

        self._replace_with_dq(model, target, ExpertStack(codes_of, CODE_DTYPES[kind], shape),
                              ExpertStack(kept.reader("scale"), ir.DataType.FLOAT, scale_shape), attributes)

    def _quantize_asym(self, model: ir.Model, target: QuantTarget, tensor: ir.TensorProtocol,
                       awq: np.ndarray | None, bits: int) -> None:
        graph, bs = model.graph, self.config.block_size
        assert bs is not None
        k, n = tensor.shape.numpy()

        def compute() -> dict[str, np.ndarray]:
            array = tensor.numpy()
            q = quantize_asym(array * awq[:, None] if awq is not None else array, bs, bits)
            return {"codes": q.codes.astype(ml_dtypes.uint4) if bits == 4 else q.codes,
                    "scale": q.scale.astype(np.float32), "offset": q.offset[:, None, :].astype(np.float32)}

        parts = _Parts(compute, ("codes", "scale", "offset"))
        stem = target.name
        code_dtype = ir.DataType.UINT4 if bits == 4 else ir.DataType.UINT8
        codes = add_initializer(graph, f"{stem}.q", parts.tensor("codes", code_dtype, (k, n)))
        scale = add_initializer(graph, f"{stem}.scale", parts.tensor("scale", ir.DataType.FLOAT, (k // bs, n)))
        offset = add_initializer(graph, f"{stem}.offset",  # [K/bs, 1, N]
                                 parts.tensor("offset", ir.DataType.FLOAT, (k // bs, 1, n)))
        _insert_asym_chain(graph, target, codes, scale, offset, axis=0, block=bs, whole=(k, n),
                           blocked=(k // bs, bs, n))

    def _quantize_asym_experts(self, model: ir.Model, target: QuantTarget, tensor: ir.TensorProtocol, bs: int,
                               bits: int) -> None:
        """Experts [E, N, K] as min-max blocks of ``bs`` along K (llama.cpp's Q4_1 at 4 bits), in the portable form

            DequantizeLinear(uint codes [E, N, K], scale [E, N, K/bs], axis=2, block_size=bs) -> Reshape
            [E, N, K/bs, bs] -> Add(offset [E, N, K/bs, 1]) -> Reshape [E, N, K]

        (``sparse_experts`` runs it as MatMulNBits + the block sums' share of the offsets). Codes, scales and offsets
        are ``ExpertStack``s: each expert is quantised when its codes are written, its scales and offsets kept until
        they are (up to PENDING_SCALE_BYTES, past which they are recomputed), one expert in memory at a time."""
        graph = model.graph
        experts, n, k = (int(d) for d in tensor.shape.numpy())
        if k % bs:
            raise ValueError(f"{target.label}: block size {bs} does not divide the experts' K={k}; "
                             "pick a --block-size that divides it")
        source_of = experts_of(tensor)
        if source_of is None:  # in memory: slice the whole array (read once)
            whole = functools.cache(tensor.numpy)

            def source_of(e: int) -> np.ndarray:
                return np.asarray(whole()[e])
        def parts_of(e: int) -> dict[str, np.ndarray]:  # codes [N, K], scale [N, K/bs], offset [N, K/bs, 1]
            q = quantize_asym(np.asarray(source_of(e), np.float32).T, bs, bits)
            return {"codes": np.ascontiguousarray(q.codes.T),
                    "scale": np.ascontiguousarray(q.scale.T, np.float32),
                    "offset": np.ascontiguousarray(q.offset.T[:, :, None], np.float32)}

        kept = _KeptParts(parts_of)

        def codes_of(e: int) -> np.ndarray:
            parts = parts_of(e)
            kept.keep(e, {name: parts[name] for name in ("scale", "offset")})
            codes = parts["codes"]
            return codes.astype(ml_dtypes.uint4) if bits == 4 else codes

        stem = target.name
        code_dtype = ir.DataType.UINT4 if bits == 4 else ir.DataType.UINT8
        codes = add_initializer(graph, f"{stem}.q", ExpertStack(codes_of, code_dtype, (experts, n, k)))
        scale = add_initializer(graph, f"{stem}.scale",
                                ExpertStack(kept.reader("scale"), ir.DataType.FLOAT, (experts, n, k // bs)))
        offset = add_initializer(graph, f"{stem}.offset",
                                 ExpertStack(kept.reader("offset"), ir.DataType.FLOAT, (experts, n, k // bs, 1)))
        _insert_asym_chain(graph, target, codes, scale, offset, axis=2, block=bs, whole=(experts, n, k),
                           blocked=(experts, n, k // bs, bs))

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


def _insert_asym_chain(graph: ir.Graph, target: QuantTarget, codes: ir.Value, scale: ir.Value, offset: ir.Value, *,
                       axis: int, block: int, whole: tuple[int, ...], blocked: tuple[int, ...]) -> None:
    """``DequantizeLinear(codes, scale, axis, block) -> Reshape(blocked) -> Add(offset) -> Reshape(whole)`` in place
    of ``target``'s weight (dropped if nothing else reads it): the asymmetric schemes' portable form."""
    weight = required(target.node.inputs[target.index], f"{target.name}: weight input")
    stem = target.name
    blocked_shape = add_initializer(graph, f"{stem}.blocked_shape", ir.tensor(np.array(blocked, np.int64)))
    flat = add_initializer(graph, f"{stem}.shape", ir.tensor(np.array(whole, np.int64)))
    dq = ir.node("DequantizeLinear", [codes, scale], attributes={"axis": axis, "block_size": block})
    split = ir.node("Reshape", [dq.outputs[0], blocked_shape])
    add = ir.node("Add", [split.outputs[0], offset])
    merge = ir.node("Reshape", [add.outputs[0], flat])
    for node, suffix, dims in ((dq, "dq", whole), (split, "blocks", blocked), (add, "blocks_offset", blocked),
                               (merge, "dq_asym", whole)):
        node.outputs[0].name = f"{stem}.{suffix}"
        node.outputs[0].shape, node.outputs[0].type = ir.Shape(dims), ir.TensorType(ir.DataType.FLOAT)
        graph.insert_before(target.node, node)
    target.node.replace_input_with(target.index, merge.outputs[0])
    if not weight.uses() and weight.name is not None and weight.name in graph.initializers:
        graph.initializers.pop(weight.name)


PENDING_SCALE_BYTES = 64 * 2**20  # per stacked experts weight: see _quantize_experts


class _KeptParts:
    """Per expert, the parts its quantisation made beside the codes (scales, offsets), kept from when its codes are
    written until each part is. The writer writes every expert's codes before the scales; keeping them saves
    quantising each expert again, up to PENDING_SCALE_BYTES per stacked weight (DeepSeek-V3 int4 fc1 at tp 1 would
    keep ~0.9 GiB), past which the rest are recomputed (``recompute(e)`` gives every part) when read."""

    def __init__(self, recompute: Callable[[int], dict[str, np.ndarray]]) -> None:
        self._recompute = recompute
        self._pending: dict[int, dict[str, np.ndarray]] = {}
        self._bytes = 0

    def keep(self, e: int, parts: dict[str, np.ndarray]) -> None:
        size = sum(a.nbytes for a in parts.values())
        if self._bytes + size <= PENDING_SCALE_BYTES:
            self._pending[e], self._bytes = dict(parts), self._bytes + size

    def reader(self, name: str) -> Callable[[int], np.ndarray]:
        """Expert e's part ``name``: the kept one (then forgotten), else recomputed."""
        def read(e: int) -> np.ndarray:
            parts = self._pending.get(e)
            if parts is None or name not in parts:
                return self._recompute(e)[name]
            array = parts.pop(name)
            self._bytes -= array.nbytes
            if not parts:
                del self._pending[e]
            return array
        return read
CODE_DTYPES = {"int4": ir.DataType.INT4, "fp8": ir.DataType.FLOAT8E4M3FN, "int8": ir.DataType.INT8}


def _typed_array(codes: np.ndarray, kind: str) -> np.ndarray:
    if kind == "int4":
        return codes.astype(ml_dtypes.int4)
    if kind == "fp8":
        return codes.astype(ml_dtypes.float8_e4m3fn)
    return codes.astype(np.int8)


def _const(value: ir.Value | None) -> ir.TensorProtocol | None:
    """The float32 constant's tensor (not read), else None."""
    if value is None or value.const_value is None or value.dtype != ir.DataType.FLOAT:
        return None
    return value.const_value


class _Parts:
    """One weight's quantisation, computed when the first of its tensors (codes, scale, offset) is read and
    forgotten once each has been read: the artifact writer reads them one after another, so one weight's codes are
    in memory at a time, and a weight is quantised once per write."""

    def __init__(self, compute: Callable[[], dict[str, np.ndarray]], names: tuple[str, ...]) -> None:
        self._compute = compute
        self._names = frozenset(names)
        self._value: dict[str, np.ndarray] | None = None
        self._served: set[str] = set()

    def get(self, *names: str) -> tuple[np.ndarray, ...]:
        if self._value is None:
            self._value, self._served = self._compute(), set()
        out = tuple(self._value[n] for n in names)
        self._served.update(names)
        if self._served >= self._names:
            self._value = None
        return out

    def tensor(self, name: str, dtype: ir.DataType, shape: tuple[int, ...]) -> ir.TensorProtocol:
        """The lazy tensor of part ``name``."""
        return lazy_tensor(lambda: self.get(name)[0], dtype, shape)



def _label(node: ir.Node, weight: ir.Value) -> str:
    scopes = node.metadata_props.get("pkg.torch.onnx.name_scopes", "")
    found: list[str] = re.findall(r"'([^']+)'", scopes)
    modules = [s for s in found if s.startswith("model.")]
    if modules:
        return modules[-1]
    param = re.search(r"%p_model_(\w+?)_weight", node.metadata_props.get("pkg.torch.onnx.fx_node", ""))
    return param.group(1) if param else (weight.name or "")
