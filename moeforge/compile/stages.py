"""One artifact's stages after loading: export, the target's passes, the manifest, the atomic write.

``driver.py`` runs them once for an unsharded compile; ``sharded_compile.py`` once per rank. Memory: never two full
copies of the weights at once. The graph's initializers view the torch tensors; the torch model is released once
``target.passes(job)`` returns (a target takes what it needs of it there, e.g. ``--check``'s PyTorch reference),
and the graph's weights once it is saved, before ONNX Runtime loads its own.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import cast

import onnx_ir as ir
from tqdm import tqdm

from moeforge.compile.onnx_export import export_stateless, unmark_layers
from moeforge.compile.options import DEFAULT_MAX_SEQ_LEN, CompileOptions
from moeforge.compile.targets import CompileJob, Target
from moeforge.compile.v4_export import export_v4_step
from moeforge.core.artifact import write_artifact
from moeforge.core.errors import MoeforgeError
from moeforge.core.manifest import MODEL_FILE, Manifest, TensorSpec, tool_versions
from moeforge.core.progress import QUIET, StageBar, Stages
from moeforge.model.deepseek_v4 import DeepseekV4ForCausalLM
from moeforge.model.lazy_weights import LazyWeights, open_lazy_model
from moeforge.model.loader import LoadedModel, load_model, release_weights, source_argument
from moeforge.passes.base import PassReport
from moeforge.passes.pipeline import run_passes
from moeforge.quant.calibration import read_prompts, tokenize_prompts
from moeforge.quant.plan import CALIB_MAX_TOKENS, check_block_size, in_features
from moeforge.quant.spec import QuantSpec

DATA_FILE = "model.onnx.data"
# glibc's malloc_trim(pad): returns freed heap pages to the OS. None elsewhere (freed memory then stays ours).
_MALLOC_TRIM = getattr(ctypes.CDLL(None), "malloc_trim", None) if sys.platform.startswith("linux") else None


# One artifact is ARTIFACT_STAGES stages on the compile's bar (``core/progress.StageBar``): export, the passes (one
# stage, each pass named as it starts), the graph and weights saved, the target's files (golden logits, --check, an
# engine: each named by the target), the install (hashes, rename).
ARTIFACT_STAGES = 5


def stage_bar(total: int, desc: str, enabled: bool) -> StageBar:
    """The compile's progress display over ``total`` stages: the running stage named, its clock kept moving."""
    return StageBar(total, desc, enabled)


def open_source(options: CompileOptions) -> tuple[LoadedModel, LazyWeights | None]:
    """The (unsharded) model to compile: loaded whole, or with ``options.stream`` on the meta device with its weights
    read on demand (``LazyWeights``)."""
    if options.stream:
        return open_lazy_model(options.model, mla_impl="absorb", check_finite=options.check_weights)
    return load_model(options.model, mla_impl="absorb", check_finite=options.check_weights), None


def make_job(options: CompileOptions, loaded: LoadedModel, weights: LazyWeights | None = None,
             stages: Stages = QUIET) -> CompileJob:
    """The ``CompileJob`` of ``loaded`` (on the meta device when ``weights`` holds its tensors): its sequence length
    and calibration prompts; a quantisation block size that does not fit fails here, before the export. ``stages``:
    where the job's stages are shown (the target names its own there: golden logits, --check)."""
    max_seq_len = _max_seq_len(options, loaded)
    job = CompileJob(options, loaded, max_seq_len, _prompts(options.quant, loaded, max_seq_len), weights, stages)
    if options.quant.scheme is not None:
        check_block_size(options.quant, in_features(job.config), job.config.name or options.model)
    return job


def build_artifact(job: CompileJob, target: Target, output_dir: Path,
                   sharding: dict[str, object] | None = None) -> tuple[Path, Manifest]:
    """Export ``job``'s model, run ``target``'s passes and write the artifact to ``output_dir`` (atomically), each
    stage shown on ``job.stages``. ``sharding``: the rank's entry for the manifest when the model is one rank of a
    sharded compile. With ``job.weights`` the model is on the meta device and its tensors are read one at a time as
    the artifact is written."""
    options, loaded, weights, stages = job.options, job.loaded, job.weights, job.stages
    stages.stage("export to ONNX")
    if job.config.compressed_attention is not None:  # DeepSeek-V4: the step over its cache, exported whole
        # TensorRT-RTX parses no NonZero: for it the routed experts are exported dense over experts.
        model = export_v4_step(cast(DeepseekV4ForCausalLM, loaded.model), target.kv_spec(job), weights=weights,
                               dense_experts=target.name == "trt")
    else:
        model = export_stateless(loaded.model, mark_layers=True, weights=weights)
    stages.advance()

    stages.stage("plan the passes")
    passes = target.passes(job)
    # The graph holds what it needs of the weights (its initializers view them); the torch copy of the rest
    # (e.g. the q/k/v and gate/up weights packing concatenates) would only add to the peak from here on.
    release_weights(loaded.model)

    done = [0]

    def pass_starts() -> None:  # the passes are one stage (the total is known from the start), each named
        if done[0] < len(passes):
            stages.stage(f"pass {done[0] + 1}/{len(passes)} {passes[done[0]].name}")

    def pass_done(_report: PassReport) -> None:
        done[0] += 1
        pass_starts()

    pass_starts()
    reports = run_passes(model, job.context, passes, on_pass_done=pass_done)
    stages.advance()
    manifest = _manifest(model, job, target, reports)
    manifest.sharding = sharding
    stages.stage("save graph and weights")

    def payload(folder: Path) -> None:
        if weights is None:
            ir.save(model, folder / MODEL_FILE, external_data=DATA_FILE)
        else:  # the streamed compile reads, transforms and writes its weights now: a bar with rate and ETA
            with _weights_bar(weights, options.progress):
                ir.save(model, folder / MODEL_FILE, external_data=DATA_FILE)
        _release_initializers(model.graph)  # saved: ONNX Runtime (golden, --check) loads its own copy
        if loaded.tokenizer is not None:
            loaded.tokenizer.save(folder)
        stages.advance()
        stages.stage(f"{target.name} files")  # the target names what it writes: golden logits, --check, an engine
        target.write_payload(job, folder, manifest)
        stages.advance()
        stages.stage("hash and install")  # write_artifact: every file hashed and fsynced, then renamed into place

    out = write_artifact(output_dir, write_payload=payload, manifest=manifest, force=options.force)
    stages.advance()
    return out, manifest


@contextlib.contextmanager
def _weights_bar(weights: LazyWeights, enabled: bool) -> Iterator[None]:
    """A bar over the bytes of the checkpoint tensors not read yet (rate, ETA), advanced as the writer reads each
    one, with the tensors done in its postfix."""
    tensors = len(weights.stored_names())
    with tqdm(total=weights.total_bytes() - weights.bytes_read_once, desc="weights", unit="B", unit_scale=True,
              unit_divisor=1024, disable=not enabled, leave=False, position=1) as bar:
        def advance(_name: str, nbytes: int) -> None:
            bar.set_postfix_str(f"{weights.tensors_read_once}/{tensors} tensors", refresh=False)
            bar.update(nbytes)

        weights.on_first_read = advance
        try:
            yield
        finally:
            weights.on_first_read = None


def _release_initializers(graph: ir.Graph) -> None:
    """Free the weights of a graph that is saved and no longer needed. Explicitly: dropping our reference is not
    enough, as onnxscript's rewrite rules keep the last graph they matched. Then hand the pages back to the OS:
    glibc keeps freed heap blocks (most weights are heap blocks, below its adaptive mmap threshold) otherwise."""
    for value in graph.initializers.values():
        value.const_value = None
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def _max_seq_len(options: CompileOptions, loaded: LoadedModel) -> int:
    limit = loaded.config.max_position_embeddings
    max_seq_len = options.max_seq_len or min(DEFAULT_MAX_SEQ_LEN, limit)
    if max_seq_len > limit:
        raise MoeforgeError(f"--max-seq-len {max_seq_len} exceeds the model's max_position_embeddings ({limit})")
    return max_seq_len


def _prompts(spec: QuantSpec, loaded: LoadedModel, max_seq_len: int) -> list[list[int]]:
    """The ``--calib`` prompts, tokenised once for every calibration pass ([] without ``--calib``). DeepSeek-V4's
    calibration graph is its step over a cache of ``max_seq_len`` tokens (its entries buffers hold no more): its
    prompts are cut there too."""
    if spec.calib is None:
        return []
    limit = CALIB_MAX_TOKENS if loaded.config.compressed_attention is None else min(CALIB_MAX_TOKENS, max_seq_len)
    return tokenize_prompts(read_prompts(spec.calib), loaded.tokenizer, limit)


def _tensor_specs(values: list[ir.Value]) -> list[TensorSpec]:
    specs = []
    for value in values:
        shape = [d if isinstance(d, int) else str(d.value if isinstance(d, ir.SymbolicDim) else d)
                 for d in (value.shape or [])]
        dtype = str(value.dtype.numpy()) if value.dtype is not None else "unknown"  # numpy names: float32
        specs.append(TensorSpec(name=value.name or "", dtype=dtype, shape=shape))
    return specs


def _manifest(model: ir.Model, job: CompileJob, target: Target, reports: list[PassReport]) -> Manifest:
    loaded = job.loaded
    layer_outputs = unmark_layers(model)  # first: the markers are graph outputs until then
    return Manifest(
        model_config=job.config.to_dict(),
        inputs=_tensor_specs(list(model.graph.inputs)),
        outputs=_tensor_specs(list(model.graph.outputs)),
        kv_cache=target.kv_spec(job),
        passes=[r.to_dict() for r in reports],
        target=target.name,
        precision=target.precision(),
        quantization=target.quantization(reports),
        tool_versions=tool_versions(),
        files={},
        source=source_argument(job.options.model, loaded.source),
        created_utc=datetime.now(UTC).isoformat(timespec="seconds"),
        layer_outputs=layer_outputs,  # values inside model.onnx, for parity --per-layer
    )
