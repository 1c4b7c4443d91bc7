"""ONNX -> TensorRT engine plan: parse, optimisation profiles, timing cache, build.

Dimension letters: B batch, S new tokens, L cache length (static in the graph, see
moeforge/passes/trt_kv_cache.py).

Two optimisation profiles cover the engine's work: ``decode`` (S = 1, B up to ``max_batch``) and
``prefill`` (S up to ``max_prefill_tokens``, B up to ``max_prefill_batch``). A runtime picks the
profile by S. The cache length is static (TensorRT's KV-cache update layer needs it), so each
profile records L but does not vary it. Full TensorRT's timing cache is saved beside the plan and read
by the next build pointed at it; TensorRT-RTX tunes at run time and ignores timing caches (noted).

Memory: the parser is handed the graph without its weights (``load_model_proto``) and each external initializer
as a pointer into a copy-on-write mapping of the data file (``load_initializer``), so weights the builder only reads
stay clean file pages the kernel can reclaim (``parse_from_file`` reads them all into the parser's heap); the plan
goes to its file through a stream writer (``build_serialized_network_to_stream``) instead of one host buffer of
the plan's size. (A read-only mapping fails TensorRT-RTX 1.7's build: it writes into some weights; only those pages
become private memory. Weight-stripped plans, ``STRIP_PLAN``, would keep the weights out of the plan, but TensorRT-RTX
1.7 cannot build them without a GPU: "graph_jit.cpp: CHECK(status == CUDA_SUCCESS)".)
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from moeforge.compile.trt.paged_profiles import paged_profiles
from moeforge.compile.trt.profiles import ProfileSpec
from moeforge.compile.trt.v4_profiles import v4_paged_profiles, v4_profiles
from moeforge.core.artifact import external_initializers
from moeforge.core.errors import MoeforgeError
from moeforge.ops.collectives.tensorrt import insert_collectives, placeholder_graph
from moeforge.runtime.backends.trt_adapter import TensorRT, load_tensorrt


class EngineBuildError(MoeforgeError):
    """TensorRT could not parse or build the graph."""


class PluginNotRegistered(EngineBuildError):
    """A node needs a plugin that no loaded library or Python module registered."""


@dataclass(frozen=True)
class BuildOptions:
    impl: str = "auto"
    sm: int | None = 89
    max_batch: int = 8
    # 2, not 1: TensorRT-RTX 1.7's compiler fails ("Graph contains more than one op named ..._iota") on a
    # profile whose batch is pinned to 1 with at most ~32 tokens; a batch range avoids it.
    max_prefill_batch: int = 2
    max_prefill_tokens: int = 256
    timing_cache: Path | None = None  # read if it exists, written after the build
    verbose: bool = False
    optimization_level: int | None = None  # builder optimisation level 0..5 (None: TensorRT's default, 3)
    paged_block_size: int | None = None  # paged graph (--kv-cache paged): profiles by dimension name
    max_seq_len: int | None = None  # paged: the longest sequence (block-table width = ceil(max_seq_len / Bs))
    num_ranks: int = 1  # > 1: one rank of a sharded artifact (collectives -> IDistCollectiveLayer)
    v4_step: bool = False  # DeepSeek-V4's step graph (compile/v4_export.py): profiles by dimension name

    def profiles(self) -> list[ProfileSpec]:
        """Decode and prefill profiles: by batch and tokens, or by dimension name for a paged or V4 graph."""
        if self.paged_block_size:
            if self.max_seq_len is None:
                raise ValueError("paged profiles need max_seq_len")
            paged = v4_paged_profiles if self.v4_step else paged_profiles
            return paged(self.paged_block_size, self.max_seq_len, self.max_batch, self.max_prefill_tokens)
        if self.v4_step:
            if self.max_seq_len is None:
                raise ValueError("DeepSeek-V4 profiles need max_seq_len")
            return v4_profiles(self.max_seq_len, self.max_batch, self.max_prefill_batch, self.max_prefill_tokens)
        decode_opt = max(1, self.max_batch // 2)
        prefill_opt = max(1, self.max_prefill_tokens // 2)
        return [ProfileSpec("decode", (1, decode_opt, self.max_batch), (1, 1, 1)),
                ProfileSpec("prefill", (1, 1, self.max_prefill_batch), (1, prefill_opt, self.max_prefill_tokens))]


@dataclass
class EngineInfo:
    """What the manifest records about a built engine (``Manifest.engine``)."""

    plan_file: str
    impl: str
    tensorrt_version: str
    compute_capability: str
    inputs: list[dict[str, Any]]
    outputs: list[dict[str, Any]]
    profiles: list[dict[str, Any]]
    layer_types: dict[str, int]
    plan_bytes: int
    build_seconds: float
    timing_cache_file: str | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class ParsedNetwork:
    """A parsed INetworkDefinition with the builder and parser that must outlive it."""

    def __init__(self, trt: TensorRT, onnx_path: Path, verbose: bool = False, num_ranks: int = 1) -> None:
        """``num_ranks`` > 1: the graph is one rank of a sharded artifact; its AllReduce / AllGather nodes become
        TensorRT distributed collective layers (``trt/collectives.py``)."""
        self.trt = trt
        self.logger = trt.logger(verbose)
        self.builder = trt.module.Builder(self.logger)
        self.network = self.builder.create_network(trt.network_flags())
        self.parser = trt.module.OnnxParser(self.network, self.logger)
        self.collectives = 0
        graph = onnx.load(str(onnx_path), load_external_data=False)
        placeholders = placeholder_graph(graph) if num_ranks > 1 else {}
        # The mappings must outlive the parser and the network (TensorRT reads the weights until the build ends).
        self.weights: list[np.ndarray] = []
        if hasattr(self.parser, "load_model_proto"):  # TensorRT-RTX 1.x, TensorRT >= 10.13
            parsed = self.parser.load_model_proto(graph.SerializeToString(), str(onnx_path))
            self.weights = _load_initializers(self.parser, graph, onnx_path.parent) if parsed else []
            parsed = parsed and self.parser.parse_model_proto()
        else:  # older TensorRT: the parser reads the external weights into its own memory
            parsed = self.parser.parse(graph.SerializeToString(), str(onnx_path))
        if not parsed:
            errors = [str(self.parser.get_error(i)) for i in range(self.parser.num_errors)]
            raise _parse_error(onnx_path, errors)
        if num_ranks > 1:
            self.collectives = insert_collectives(trt, self.network, placeholders, num_ranks)

    def layers(self) -> list[tuple[str, str]]:
        """(name, type) of every layer, e.g. ("node_RotaryEmbedding_12", "ROTARY_EMBEDDING")."""
        net = self.network
        return [(net.get_layer(i).name, str(net.get_layer(i).type).split(".")[-1]) for i in range(net.num_layers)]

    def layer_types(self) -> dict[str, int]:
        counts = Counter(kind for _, kind in self.layers())
        return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))

    def io(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Inputs and outputs: name, dtype (TensorRT's name), shape (-1 = dynamic)."""
        net = self.network

        def spec(t: Any) -> dict[str, Any]:
            return {"name": t.name, "dtype": str(t.dtype).split(".")[-1].lower(), "shape": list(t.shape)}

        return ([spec(net.get_input(i)) for i in range(net.num_inputs)],
                [spec(net.get_output(i)) for i in range(net.num_outputs)])


def _load_initializers(parser: Any, graph: onnx.ModelProto, folder: Path) -> list[np.ndarray]:
    """Hand every external initializer of ``graph`` to ``parser`` as a pointer into a copy-on-write mapping of its
    data file; returns the views (keep them alive while the parser's network is in use)."""
    views = []
    for tensor, data in external_initializers(graph, folder, mode="c"):
        if not parser.load_initializer(tensor.name, data.ctypes.data, data.nbytes):
            errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
            raise EngineBuildError(f"TensorRT refused initializer {tensor.name}: {'; '.join(errors)[:500]}")
        views.append(data)
    return views


class _PlanFile:
    """A TensorRT stream writer into an open file (the plan is written as the builder serialises it)."""

    def __init__(self, trt: TensorRT, path: Path) -> None:
        class Writer(trt.module.IStreamWriter):  # type: ignore[name-defined, misc]
            def __init__(self, handle: Any) -> None:
                trt.module.IStreamWriter.__init__(self)
                self.handle = handle

            def write(self, data: Any) -> int:
                return int(self.handle.write(data))

        self.path = path
        self.handle = path.open("wb")
        self.writer = Writer(self.handle)

    def close(self) -> None:
        self.handle.close()


def _parse_error(onnx_path: Path, errors: list[str]) -> EngineBuildError:
    text = "\n".join(errors)
    lowered = text.lower()
    if "plugin" in lowered and ("creator" in lowered or "not found" in lowered or "failed to load" in lowered):
        op = _op_of(text)
        return PluginNotRegistered(
            f"{onnx_path.name}: node {op or '?'} needs a TensorRT plugin that is not registered "
            f"(and carries no ONNX local function to inline). Load its library first "
            f"(trt.get_plugin_registry().load_library(path), trtexec --dynamicPlugins) or register it in Python; "
            f"parser said: {errors[0].splitlines()[0][:300]}")
    return EngineBuildError(f"TensorRT could not parse {onnx_path}: {text[:2000]}")


def _op_of(text: str) -> str | None:
    marker = "operator: "
    if marker in text:
        return text.split(marker, 1)[1].split()[0].strip("()")
    return None


def _dim_names(onnx_path: Path) -> dict[str, list[str]]:
    """Symbolic dimension names of every graph input ("" for a fixed dimension), without the weights."""
    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    return {v.name: [d.dim_param for d in v.type.tensor_type.shape.dim] for v in graph.input}


def _profile_shapes(network: Any, spec: ProfileSpec, dim_names: dict[str, list[str]] | None = None
                    ) -> dict[str, list[tuple[int, ...]]]:
    """min/opt/max shape of every input: by dimension name when ``spec.dims`` is set (paged graphs), else
    axis 0 is the batch, a dynamic axis 1 the new tokens."""
    shapes = {}
    for i in range(network.num_inputs):
        tensor = network.get_input(i)
        dims = list(tensor.shape)
        names = (dim_names or {}).get(tensor.name, [])
        triple = []
        for k in range(3):
            shape = []
            for axis, dim in enumerate(dims):
                if dim != -1:
                    shape.append(dim)
                elif spec.dims:
                    name = names[axis] if axis < len(names) else ""
                    if name not in spec.dims:
                        raise EngineBuildError(f"input {tensor.name} axis {axis} ({name or 'unnamed'}) has no range "
                                               f"in profile {spec.name}: {sorted(spec.dims)}")
                    shape.append(spec.dims[name][k])
                elif axis == 0:
                    shape.append(spec.batch[k])
                elif axis == 1:
                    shape.append(spec.tokens[k])
                else:
                    raise EngineBuildError(f"input {tensor.name} has a dynamic axis {axis} no profile covers: {dims}")
            triple.append(tuple(shape))
        shapes[tensor.name] = triple
    return shapes


def build_engine(onnx_path: Path, plan_path: Path, options: BuildOptions, trt: TensorRT | None = None) -> EngineInfo:
    """Parse ``onnx_path`` (weights as external data beside it), build, write the plan; return its description."""
    trt = trt or load_tensorrt(options.impl)
    start = time.perf_counter()
    parsed = ParsedNetwork(trt, onnx_path, options.verbose, options.num_ranks)
    config = parsed.builder.create_builder_config()
    target = trt.set_target(config, options.sm)
    if options.optimization_level is not None:
        config.builder_optimization_level = options.optimization_level
    # Layer types and names in the plan, so EngineInspector (moeforge inspect on a GPU) can list them.
    config.profiling_verbosity = trt.module.ProfilingVerbosity.DETAILED

    profiles = []
    specs = options.profiles()
    dim_names = _dim_names(onnx_path) if any(spec.dims for spec in specs) else None
    for spec in specs:
        profile = parsed.builder.create_optimization_profile()
        shapes = _profile_shapes(parsed.network, spec, dim_names)
        for name, (lo, opt, hi) in shapes.items():
            profile.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(profile)
        profiles.append({"name": spec.name, "batch": list(spec.batch), "tokens": list(spec.tokens),
                         **({"dims": {n: list(r) for n, r in spec.dims.items()}} if spec.dims else {}),
                         "shapes": {n: [list(s) for s in triple] for n, triple in shapes.items()}})

    notes = []
    if parsed.collectives:
        notes.append(f"{parsed.collectives} DistCollective layers over {options.num_ranks} ranks (NCCL at run time): "
                     "the graph's AllReduce / AllGather")
    timing_cache = None
    if trt.aot:  # TensorRT-RTX tunes kernels at run time; its timing-cache calls are documented no-ops
        notes.append(f"no timing cache: timing-cache operations are no-ops in {trt.impl} {trt.version}")
    elif options.timing_cache is not None:
        cache_bytes = options.timing_cache.read_bytes() if options.timing_cache.is_file() else b""
        timing_cache = config.create_timing_cache(cache_bytes)
        config.set_timing_cache(timing_cache, ignore_mismatch=False)

    if hasattr(parsed.builder, "build_serialized_network_to_stream"):  # the plan never in one host buffer
        plan = _PlanFile(trt, plan_path)
        try:
            built = parsed.builder.build_serialized_network_to_stream(parsed.network, config, plan.writer)
        finally:
            plan.close()
    else:
        serialized = parsed.builder.build_serialized_network(parsed.network, config)
        built = serialized is not None
        if built:
            plan_path.write_bytes(memoryview(serialized))
    if not built:
        plan_path.unlink(missing_ok=True)
        raise EngineBuildError(f"TensorRT ({trt.impl} {trt.version}) could not build {onnx_path.name} for {target}; "
                               "rerun with --verbose for the builder log")
    if timing_cache is not None and options.timing_cache is not None:
        options.timing_cache.write_bytes(memoryview(timing_cache.serialize()))
    inputs, outputs = parsed.io()
    return EngineInfo(
        plan_file=plan_path.name, impl=trt.impl, tensorrt_version=trt.version, compute_capability=target,
        inputs=inputs, outputs=outputs, profiles=profiles, layer_types=parsed.layer_types(),
        plan_bytes=plan_path.stat().st_size, build_seconds=round(time.perf_counter() - start, 3),
        timing_cache_file=options.timing_cache.name if timing_cache is not None and options.timing_cache else None,
        notes=notes,
    )


def plan_diagnostics(trt: TensorRT, plan: bytes) -> tuple[str, list[str]]:
    """Read a plan's header without deserialising the engine (works without a GPU): TensorRT's validity
    verdict and its diagnostics, e.g. ("INVALID", ["MALFORMED_ENGINE"]). Without a GPU the verdict is
    INVALID because the local compute capability cannot be read; a well-formed plan of this TensorRT
    version then has no diagnostic flags (no MALFORMED_ENGINE, no VERSION_MISMATCH)."""
    module = trt.module
    runtime = module.Runtime(trt.logger())
    size = getattr(runtime, "engine_header_size", 64)
    validity, flags = runtime.get_engine_validity(plan[:size])
    names = [name for name in dir(module.EngineInvalidityDiagnostics) if name.isupper()
             and int(flags) & int(getattr(module.EngineInvalidityDiagnostics, name))]
    return str(validity).split(".")[-1], sorted(names)
