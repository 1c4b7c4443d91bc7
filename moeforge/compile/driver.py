"""The compile driver: checkpoint -> torch model -> stateless ONNX -> passes -> artifact directory, for every target.

The stages run once, in this order, each named on a progress bar whose clock keeps moving: check the options
(``quant.spec.validate``, the target's own ``check``) and the output location; load; export; the target's ordered
pass list (quantisation included); one manifest; write. The artifact is written to a temporary directory and
renamed at the end (``artifact.write_artifact``), so a failed or interrupted compile leaves nothing behind. What
differs between ONNX Runtime and TensorRT lives in ``moeforge/compile/targets/``.

The stages after loading are ``stages.py``'s (shared with ``sharded_compile.py``, which runs them once per rank
for ``--tp``). Memory: never two full copies of the weights at once (see ``stages.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from moeforge.compile.options import CompileOptions, KVOptions, TrtOptions
from moeforge.compile.plan import check_options, kv_layout_of, plan_compile, resolve_block_size, size_text
from moeforge.compile.sharded_compile import ShardedCompileResult, compile_sharded
from moeforge.compile.stages import ARTIFACT_STAGES, DATA_FILE, build_artifact, make_job, open_source, stage_bar
from moeforge.compile.targets import TARGETS, Target
from moeforge.core.artifact import check_output_dir
from moeforge.core.errors import MoeforgeError
from moeforge.core.host_memory import memory_limit
from moeforge.core.manifest import Manifest
from moeforge.model.loader import load_config, resolve_source
from moeforge.quant.spec import QuantSpec, validate
from moeforge.verify.parity import ParityCheckFailed, ParityReport

__all__ = ["DATA_FILE", "CompileOptions", "CompileResult", "KVOptions", "ParityCheckFailed", "QuantSpec",
           "ShardedCompileResult", "TrtOptions", "compile_model"]


@dataclass
class CompileResult:
    output_dir: Path
    manifest: Manifest
    parity: ParityReport | None


def compile_model(options: CompileOptions) -> CompileResult | ShardedCompileResult:
    """Run every stage; raise MoeforgeError (bad input) or ParityCheckFailed, leaving nothing written.
    With ``options.tp`` > 1 the artifact is sharded: one artifact per rank (``moeforge.compile.sharded_compile``)."""
    _target(options)  # an unknown target is the first refusal
    options = resolve_stream(options)
    check_options(options)
    config = load_config(options.model)
    options = resolve_block_size(options, config)  # DeepSeek-V4: blocks of whole windows
    target = _target(options)
    validate(options.quant, target=options.target, kv_cache=options.kv.layout, kv_layout=kv_layout_of(config))
    target.check()
    if options.tp > 1 or options.ep > 1 or options.pp > 1:
        check_memory(options)
        return compile_sharded(options)
    check_output_dir(options.output_dir, force=options.force)  # before the expensive stages
    check_memory(options)

    with stage_bar(1 + ARTIFACT_STAGES, "compile", options.progress) as bar:
        bar.stage("load checkpoint")
        loaded, weights = open_source(options)  # streamed: each weight read when the artifact is written
        job = make_job(options, loaded, weights, bar)
        bar.advance()
        out, manifest = build_artifact(job, target, options.output_dir)
        return CompileResult(out, manifest, target.parity)


def resolve_stream(options: CompileOptions) -> CompileOptions:
    """``options`` with ``stream`` decided: as given, or (None) streamed wherever the streamed compile applies -- a
    Hugging Face safetensors folder (every family, DeepSeek-V4 included; every target, every scheme); presets and
    GGUF files load whole."""
    if options.stream is not None:
        return options
    return dataclasses.replace(options, stream=resolve_source(options.model).kind == "hf")


def _target(options: CompileOptions) -> Target:
    if options.target not in TARGETS:
        raise MoeforgeError(f"target {options.target!r} is not supported here; targets: {', '.join(TARGETS)}")
    return TARGETS[options.target](options)


def check_memory(options: CompileOptions) -> None:
    """Refuse, before any weight is read, a compile whose planned memory exceeds ``--max-memory`` (default: the
    container's limit, else the physical memory): a streamed compile by its plan (``plan.py``); an in-memory one
    when the model's float32 weights alone exceed it (it holds them, and ~2.5x that at its peak)."""
    limit = options.max_memory if options.max_memory is not None else memory_limit()
    if limit is None:
        return
    config = load_config(options.model)
    plan = plan_compile(options.model, config, options.quant.weights, block_size=options.quant.block_size)
    where = "--max-memory" if options.max_memory is not None else "this machine's memory (its container's limit)"
    workers = min(options.workers, options.tp * options.pp)
    if options.stream and plan.peak_bytes * workers > limit:
        largest = max(r.largest_layer_fp32_bytes for r in plan.ranks)
        each = f" x {workers} workers" if workers > 1 else ""
        fix = f"use --workers {max(limit // plan.peak_bytes, 1)}" if workers > 1 and plan.peak_bytes <= limit else \
            "give it more memory (--max-memory), or run on a larger host"
        raise MoeforgeError(
            f"the streamed compile plans ~{size_text(plan.peak_bytes)}{each} (its largest layer alone is "
            f"{size_text(largest)} of float32 weights), more than {where}: {size_text(limit)}; {fix}")
    weights = 4 * plan.total_parameters
    if not options.stream and weights > limit:
        fix = (f"compile with --stream (it plans ~{size_text(plan.peak_bytes)}: one layer at a time)"
               if resolve_source(options.model).kind == "hf" else
               "give it more memory, or compile the model's Hugging Face safetensors folder, which streams")
        raise MoeforgeError(
            f"the in-memory compile holds the model's {size_text(weights)} of float32 weights, more than {where}: "
            f"{size_text(limit)}; {fix}")
