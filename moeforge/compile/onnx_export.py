"""torch -> ONNX: the stateless graph (input_ids, position_ids -> logits) that the passes start from.

Exported with the dynamo exporter at opset 23: SDPA becomes ``Attention``, ``F.rms_norm``
becomes ``RMSNormalization``; MLA is exported in its absorbed form (so the cache pass can keep only
the latent); each MoE layer is a ``moeforge.MoERouter`` node (routing) feeding a ``moeforge.MoEExperts``
node, both carrying local functions.
Dynamic axes: batch and sequence. Weights are stored as external data by the artifact writer.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import warnings
from collections.abc import Callable, Iterator

import numpy as np
import onnx_ir as ir
import torch
import torch.nn.functional as F
from onnxscript import rewriter
from torch import nn

from moeforge.core.config import V4_FAMILIES
from moeforge.core.errors import MoeforgeError
from moeforge.core.log_filters import without_records
from moeforge.model import moe_op
from moeforge.model.lazy_weights import LazyWeights
from moeforge.model.mla import MLAttention
from moeforge.model.model import V4_COMPILE_REFUSAL, CausalLM, ModelOutput
from moeforge.model.moe import MoEBlock
from moeforge.model.pipeline_stages import HIDDEN_INPUT, HIDDEN_OUTPUT, StageLM
from moeforge.model.routing import router_attributes
from moeforge.ops.collectives import torch_op as collectives
from moeforge.ops.expert_stack import ExpertStack
from moeforge.ops.moe_router import function as router_function
from moeforge.ops.moe_router import torch_op as router_op
from moeforge.ops.sparse_mla import function as sparse_mla_function
from moeforge.ops.sparse_mla import torch_op as sparse_mla_op
from moeforge.ops.sparse_mla.schema import SparseMLAAttrs
from moeforge.passes.cleanup import quiet_multi_output_folding

log = logging.getLogger(__name__)

OPSET = 23
INPUT_NAMES = ("input_ids", "position_ids")


LAYER_OUTPUT = "layer_output.{}"


class _StatelessLM(nn.Module):
    """(input_ids [B, S], position_ids [B, S]) -> logits [B, S, V] (+ each layer's output [B, S, H])."""

    def __init__(self, model: CausalLM, mark_layers: bool) -> None:
        super().__init__()
        self.model = model
        self.mark_layers = mark_layers

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        out: ModelOutput = self.model(input_ids, position_ids, output_hidden_states=self.mark_layers)
        if out.hidden_states is not None:
            if isinstance(self.model, StageLM) and not self.model.spec.has_head:
                # A stage's output IS its last layer's output: one tensor named twice confuses the exporter's
                # output names, so that layer's marker is added after the export (``_mark_stage_output``).
                return (out.logits, *out.hidden_states[:-1])
            return (out.logits, *out.hidden_states)
        return out.logits


class _MoEBoundary(nn.Module):
    """Replaces a MoEBlock during export: routed experts as one custom op, shared experts as usual."""

    def __init__(self, block: MoEBlock) -> None:
        super().__init__()
        self.block = block
        self.router = router_attributes(block.gate.moe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # [T, H]
        gate = self.block.gate
        logits = F.linear(flat.to(torch.float32), gate.weight.to(torch.float32))  # [T, E]
        expert_ids, weights = router_op.call(logits, gate.e_score_correction_bias, self.router)  # [T, K] each
        expert_ids, weights = self.block.local_routing(expert_ids, weights)  # an expert-parallel rank: its own
        experts = self.block.experts
        routed: torch.Tensor = torch.ops.moeforge.moe_experts(flat, expert_ids, weights, experts.gate_proj,
                                                              experts.up_proj, experts.down_proj)
        out = routed.view_as(x)
        if self.block.shared_experts is not None:
            out = out + self.block.shared_experts(x)
        return out if self.block.reduce is None else self.block.reduce(out)


# torch.onnx logs one warning per torchvision op it cannot register (torchvision is not a dependency here).
_REGISTRATION_LOGGER = "torch.onnx._internal.exporter._registration"


def _is_torchvision_skip(record: logging.LogRecord) -> bool:
    return str(record.msg).startswith("torchvision is not installed")


def _quiet_torchvision_skips() -> contextlib.AbstractContextManager[None]:
    """Drop exactly the exporter's "torchvision is not installed. Skipping torchvision::..." warnings."""
    return without_records(_REGISTRATION_LOGGER, _is_torchvision_skip)


# onnxscript's default rewrite rule that replaces Slice(x, 0, n/2), Slice(x, n/2, n) by a Split.
_SLICES_SPLIT = "SlicesSplit"


@contextlib.contextmanager
def _without_slices_split() -> Iterator[None]:
    """Leave SlicesSplit out of the rules the exporter's optimizer applies (``optimize_ir`` reads
    ``onnxscript.rewriter._DEFAULT_REWRITE_RULES`` when it runs).

    Its pattern has two output nodes, which onnxscript (0.7) matches by scanning the whole graph for every node:
    quadratic in the graph size, a third of SmolLM2's export time. And it never fires here: its pattern is the
    4-input Slice, the exporter writes 5-input ones (with steps). Without the attribute this changes nothing.
    """
    rules = getattr(rewriter, "_DEFAULT_REWRITE_RULES", None)
    if not isinstance(rules, tuple):
        yield
        return
    rewriter._DEFAULT_REWRITE_RULES = tuple(r for r in rules if getattr(r, "name", None) != _SLICES_SPLIT)
    try:
        yield
    finally:
        rewriter._DEFAULT_REWRITE_RULES = rules


@contextlib.contextmanager
def _sparse_mla_nodes(model: CausalLM) -> Iterator[None]:
    """DSA layers (DeepSeek-V3.2) export their selection + sparse attention as one moeforge.SparseMLA node."""
    attns = [m for m in model.modules() if isinstance(m, MLAttention) and m.indexer is not None]
    try:
        for attn in attns:
            attn.export_op = True
        yield
    finally:
        for attn in attns:
            attn.export_op = False


@contextlib.contextmanager
def _moe_boundaries(model: CausalLM) -> Iterator[None]:
    # Swap in place (no model copy: a copy would double memory) and always restore.
    swapped: list[tuple[nn.Module, MoEBlock]] = []
    try:
        for layer in model.model.layers:
            if isinstance(layer.mlp, MoEBlock):
                swapped.append((layer, layer.mlp))
                layer.mlp = _MoEBoundary(layer.mlp)
        yield
    finally:
        for layer, block in swapped:
            layer.mlp = block


def export_stateless(model: CausalLM, mark_layers: bool = False, weights: LazyWeights | None = None) -> ir.Model:
    """Export ``model`` (absorbed MLA) to an in-memory onnx-ir model at opset 23.

    ``mark_layers``: also output each decoder layer's result as ``layer_output.{i}``, through a marker
    ``Add(x, 0)`` so that the residual value itself stays an ordinary intermediate the passes can fuse
    (a graph output would pin it); ``unmark_layers`` removes the markers after the passes.
    ``weights``: ``model`` is on the meta device and these are its tensors; each initializer becomes a lazy
    tensor that reads its source when the artifact is written (the streamed compile: ``lazy_weights.py``).
    """
    if model.config.model_type in V4_FAMILIES:  # before torch.export, which would wrap the model's own refusal
        raise MoeforgeError(V4_COMPILE_REFUSAL)
    if model.config.mla is not None and model.mla_impl != "absorb":
        raise ValueError("export MLA in its absorbed form (CausalLM(config, 'absorb')) so the cache holds the latent")
    model = model.eval()
    own_names = _tensor_names(model)
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("sequence")
    # Example sizes must not be 0 or 1: torch.export specialises such dims to constants. A meta model (the streamed
    # compile) is traced with meta inputs.
    device = torch.device("meta") if weights is not None else torch.device("cpu")
    positions = torch.arange(3, dtype=torch.int64, device=device).expand(2, 3).contiguous()
    # A later pipeline stage starts from the hidden state [B, S, H]; every other graph from token ids [B, S].
    takes_hidden = isinstance(model, StageLM) and not model.spec.has_embedding
    first_input = HIDDEN_INPUT if takes_hidden else INPUT_NAMES[0]
    tokens = (torch.zeros(2, 3, model.config.hidden_size, dtype=torch.float32, device=device) if takes_hidden
              else torch.zeros(2, 3, dtype=torch.int64, device=device))
    example = (tokens, positions)
    output = HIDDEN_OUTPUT if isinstance(model, StageLM) and not model.spec.has_head else "logits"
    with (_moe_boundaries(model), _sparse_mla_nodes(model), _quiet_torchvision_skips(), _without_slices_split(),
          quiet_multi_output_folding(), warnings.catch_warnings(), torch.no_grad()):
        warnings.simplefilter("ignore")  # the exporter is chatty about deprecated pytree APIs
        wrapper = _StatelessLM(model, mark_layers)
        program = torch.onnx.export(
            wrapper, example, dynamo=True, opset_version=OPSET, verbose=False,
            input_names=[first_input, INPUT_NAMES[1]],
            output_names=[output] + [LAYER_OUTPUT.format(i) for i in range(model.config.num_hidden_layers)
                                     if mark_layers and not (output == HIDDEN_OUTPUT
                                                             and i == model.config.num_hidden_layers - 1)],
            dynamic_shapes=({0: batch, 1: seq}, {0: batch, 1: seq}),
            custom_translation_table={torch.ops.moeforge.moe_experts.default: moe_op.moe_experts_to_onnx,
                                      torch.ops.moeforge.moe_router.default: router_op.onnx_translation,
                                      torch.ops.moeforge.sparse_mla.default: sparse_mla_op.onnx_translation,
                                      **collectives.TRANSLATIONS},
            optimize=weights is None,  # lazy weights first: the optimizer reads the small ones
        )
        assert program is not None  # dynamo=True always returns the program
        if weights is not None:
            attach_lazy_weights(program.model, weights, _source_names(wrapper, own_names))
            fold_weight_transposes(program.model)  # as the optimizer would, without reading the weights
            program.optimize()
    onnx_model = program.model
    if model.config.moe is not None:
        # Each MoE layer: MatMul (router logits) -> moeforge.MoERouter -> moeforge.MoEExperts, both with functions.
        moe = model.config.moe
        router_function.attach_function(onnx_model, router_attributes(moe), moe.has_correction_bias)
        router_function.check_nodes(onnx_model)
        fn = ir.serde.deserialize_function(moe_op.experts_local_function(OPSET))
        onnx_model.functions[fn.identifier()] = fn
    config = model.config
    if config.dsa is not None and config.mla is not None:
        attrs = SparseMLAAttrs(config.dsa.index_topk, config.softmax_scale, config.dsa.index_head_dim**-0.5,
                               config.mla.kv_lora_rank)
        sparse_mla_function.attach_function(onnx_model, attrs, "stateless")
    if mark_layers:
        if output == HIDDEN_OUTPUT:
            _mark_stage_output(onnx_model, model.config.num_hidden_layers - 1)
        _add_layer_markers(onnx_model)
    _name_dims(onnx_model)
    _forget_former_inputs(onnx_model.graph)
    return onnx_model


def _tensor_names(model: nn.Module) -> dict[int, str]:
    """id(tensor) -> its name in ``model`` (read before ``_moe_boundaries`` rewires the module tree)."""
    return {id(t): name for name, t in [*model.named_parameters(remove_duplicate=False),
                                        *model.named_buffers(remove_duplicate=False)]}


def _source_names(exported: nn.Module, own: dict[int, str]) -> dict[str, str]:
    """The exported module's tensor paths (the initializers' names, e.g. "model.model.layers.1.mlp.block.gate.weight"
    while ``_MoEBoundary`` wraps a block) -> the model's own names ("model.layers.1.mlp.gate.weight"), by identity."""
    return {path: own[id(t)] for path, t in [*exported.named_parameters(remove_duplicate=False),
                                            *exported.named_buffers(remove_duplicate=False)] if id(t) in own}


def attach_lazy_weights(model: ir.Model, weights: LazyWeights, sources: dict[str, str]) -> int:
    """Make each initializer that is one of the (meta) model's tensors (``sources``: initializer name -> the
    model's tensor name) a ``LazyTensor`` over ``weights.read``; returns how many. Nothing is read here."""
    attached = 0
    for name, value in model.graph.initializers.items():
        source = sources.get(name)
        if source is None or value.const_value is None:
            continue
        if value.dtype not in (ir.DataType.FLOAT, ir.DataType.INT64):  # INT64: DeepSeek-V4's tid2eid tables
            raise MoeforgeError(f"{name}: the streamed compile handles float32 weights and int64 tables, the graph has "
                                f"{value.dtype}")
        shape = ir.Shape(weights.shape(source))  # the model's (meta) shape: the graph's too
        if weights.is_expert_stack(source):  # written (and read) one expert at a time
            value.const_value = ExpertStack(_expert_reader(weights, source), ir.DataType.FLOAT, shape.numpy(), name)
        else:
            value.const_value = ir.LazyTensor(_reader(weights, source), value.dtype, shape, name=name)
        attached += 1
    return attached


def _reader(weights: LazyWeights, name: str) -> Callable[[], ir.TensorProtocol]:
    return lambda: ir.tensor(weights.read(name), name=name)


def _expert_reader(weights: LazyWeights, name: str) -> Callable[[int], np.ndarray]:
    return lambda e: weights.read_expert(name, e)


def fold_weight_transposes(model: ir.Model) -> int:
    """Replace each ``Transpose`` of a lazy initializer read by nothing else with a ``Constant`` holding the lazy
    transposed tensor; returns how many. The optimizer folds such Transposes whatever their size (nn.Linear exports
    as MatMul(x, Transpose(W))), which on a lazy weight would read it now and hold the copy until the artifact is
    written. It folds them into Constant nodes in place, then lifts those to initializers in node order: so does
    this, so the artifact's tensors keep their names and order."""
    graph = model.graph
    folded = 0
    for node in list(graph):
        if node.op_type != "Transpose" or node.domain not in ("", "ai.onnx"):
            continue
        source, out = node.inputs[0], node.outputs[0]
        if (source is None or not source.is_initializer() or not isinstance(source.const_value, ir.LazyTensor)
                or len(source.uses()) != 1 or out.is_graph_output() or source.shape is None):
            continue
        perm_attr = node.attributes.get("perm")
        perm = tuple(perm_attr.as_ints()) if perm_attr is not None else tuple(reversed(range(len(source.shape))))
        dims = ir.Shape([source.shape[i] for i in perm])
        name = out.name
        dtype = source.const_value.dtype  # float32, or int64 (DeepSeek-V4's tid2eid, when indexed through a Transpose)
        lazy = ir.LazyTensor(_transposed(source.const_value, perm), dtype, dims, name=name)
        constant = ir.node("Constant", [], attributes={"value": lazy})
        graph.insert_before(node, constant)
        out.name = None
        constant.outputs[0].name = name
        constant.outputs[0].shape, constant.outputs[0].type = dims, ir.TensorType(dtype)
        ir.convenience.replace_all_uses_with(out, constant.outputs[0])
        graph.remove(node, safe=True)
        if not source.uses() and source.name is not None and source.name in graph.initializers:
            graph.initializers.pop(source.name)
        folded += 1
    return folded


def _transposed(tensor: ir.TensorProtocol, perm: tuple[int, ...]) -> Callable[[], ir.TensorProtocol]:
    # A view, as onnxscript's folder makes it: a later pass that sums over it adds in the same order.
    return lambda: ir.tensor(np.transpose(tensor.numpy(), perm), name=tensor.name)


def _forget_former_inputs(graph: ir.Graph) -> None:
    """Drop the references onnx-ir (1.1) keeps to values that are no longer graph inputs.

    ``GraphInputs`` counts each input in a ``Counter`` that keeps a zero entry for every value ever removed. The
    exporter makes every weight an input, then moves it to the initializers as a new value, so without this each
    original weight stays pinned until the graph dies: the torch copy of weights the passes replace (packing's
    concatenations), and the graph's own weights while ONNX Runtime loads the saved artifact.
    """
    counter = getattr(graph.inputs, "_ref_counter", None)
    if isinstance(counter, collections.Counter):
        for value in [value for value, count in counter.items() if count <= 0]:
            del counter[value]


def _mark_stage_output(model: ir.Model, last: int) -> None:
    """A pipeline stage without the head: its last layer's output is the ``hidden_states`` output; list it as
    ``layer_output.{last}`` too (through an Identity, which ``_add_layer_markers`` turns into the usual marker)."""
    graph = model.graph
    hidden = next(value for value in graph.outputs if value.name == HIDDEN_OUTPUT)
    alias = ir.node("Identity", [hidden])
    alias.outputs[0].name = LAYER_OUTPUT.format(last)
    alias.outputs[0].shape, alias.outputs[0].type = hidden.shape, hidden.type
    graph.append(alias)
    graph.outputs.append(alias.outputs[0])


def _add_layer_markers(model: ir.Model) -> None:
    graph = model.graph
    zero = None
    for index, value in enumerate(list(graph.outputs)):
        if not (value.name or "").startswith("layer_output."):
            continue
        if zero is None:
            assert value.dtype is not None
            zero = ir.Value(name="layer_output.zero", shape=ir.Shape([]), type=value.type,
                            const_value=ir.tensor(np.zeros((), dtype=value.dtype.numpy())))
            graph.register_initializer(zero)
        name = value.name
        value.name = f"{name}.source"
        marker = ir.node("Add", [value, zero])
        marker.outputs[0].name = name
        marker.outputs[0].shape, marker.outputs[0].type = value.shape, value.type
        graph.append(marker)
        graph.outputs[index] = marker.outputs[0]


def unmark_layers(model: ir.Model) -> list[str]:
    """Drop the ``layer_output.{i}`` graph outputs; return the names of the values they mirrored."""
    graph = model.graph
    names = []
    for value in list(graph.outputs):
        if not (value.name or "").startswith("layer_output."):
            continue
        graph.outputs.remove(value)
        marker = value.producer()
        assert marker is not None and marker.op_type == "Add", f"{value.name}: its Add(x, 0) marker is gone"
        source = marker.inputs[0]
        assert source is not None
        graph.remove(marker, safe=True)
        alias = source.producer()
        if alias is not None and alias.op_type == "Identity" and not source.uses() and alias.inputs[0] is not None:
            source = alias.inputs[0]  # a pipeline stage's last layer (``_mark_stage_output``): the output itself
            graph.remove(alias, safe=True)
        names.append(source.name or "")
    if "layer_output.zero" in graph.initializers and not graph.initializers["layer_output.zero"].uses():
        graph.initializers.pop("layer_output.zero")
    return names


def _name_dims(model: ir.Model) -> None:
    # Stable, readable names for the dynamic axes (the exporter invents s0, s1, ...).
    names = {}
    for value in model.graph.inputs:
        assert value.shape is not None  # the exporter gives every input a shape
        for axis, label in ((0, "batch_size"), (1, "sequence_length")):
            dim = value.shape[axis]
            if isinstance(dim, ir.SymbolicDim):
                names[dim.value] = label
    for value in [*model.graph.inputs, *model.graph.outputs]:
        if value.shape is None:
            continue
        value.shape = ir.Shape([
            ir.SymbolicDim(names.get(d.value, d.value)) if isinstance(d, ir.SymbolicDim) else d for d in value.shape
        ])
