"""The compile pipeline: checkpoint -> torch model -> stateless ONNX -> passes -> artifact directory.

Stages run in a fixed order with a progress bar; the artifact is written to a temporary directory
and renamed at the end, so a failed or interrupted compile leaves nothing behind.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import onnx_ir as ir
from tqdm import tqdm

from moeforge.artifact import (
    Manifest,
    TensorSpec,
    check_output_dir,
    kv_cache_spec,
    tool_versions,
    write_artifact,
)
from moeforge.errors import MoeforgeError
from moeforge.export.config import ModelConfig
from moeforge.export.loader import LoadedModel, load_model
from moeforge.export.onnx_export import export_stateless, unmark_layers
from moeforge.genai_config import genai_config
from moeforge.golden import write_golden
from moeforge.graph_passes.base import PassContext, PassReport
from moeforge.graph_passes.paged_kv import PAGED_BLOCK_SIZE_NOTE, paged_kv_cache_spec
from moeforge.graph_passes.pipeline import ort_pipeline, run_passes
from moeforge.parity import ParityReport, default_prompt, run_parity
from moeforge.quantize import QuantOptions, check_block_size, checkpoint_is_fp8, in_features, quantize_model
from moeforge.quantize import validate as validate_quant

MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"
TARGETS = ("ort", "trt")
KV_CACHE_KINDS = ("contiguous", "paged")
DEFAULT_MAX_SEQ_LEN = 2048


class ParityCheckFailed(MoeforgeError):
    """``compile --check`` found the artifact outside its precision's thresholds (exit code 1)."""

    def __init__(self, report: ParityReport) -> None:
        super().__init__("parity check failed: " + "; ".join(report.failures))
        self.report = report


@dataclass(frozen=True)
class CompileOptions:
    """What ``moeforge compile`` was asked for."""

    model: str
    output_dir: Path
    target: str = "ort"
    max_seq_len: int | None = None  # None: min(2048, the model's max_position_embeddings)
    force: bool = False
    check: bool = False
    check_steps: int = 16
    progress: bool = True
    kv_cache: str = "contiguous"  # "paged": block pools + moeforge::PagedAttention (graph_passes/paged_kv.py)
    kv_block_size: int = 16  # tokens per pool block (paged only)
    # --target trt (moeforge/trt/compile_target.py)
    trt_impl: str = "auto"
    sm: int | None = None  # trt: TensorRT-RTX target SM (default 89); full TensorRT: the local GPU
    dtype: str | None = None  # trt: fp16 (default) | bf16
    max_batch: int = 8
    max_prefill_tokens: int = 256
    trt_optimization_level: int | None = None  # TensorRT builder level 0..5 (None: its default, 3)
    quant: str | None = None  # int8 | int4 | int4-awq | fp8 | w8a8 | w8a8-fp8 (moeforge/quantize.py); None = fp32
    block_size: int | None = None
    calib: Path | None = None
    kv_quant: str | None = None
    keep_fp: float = 0.0
    lm_head: str | None = None  # --lm-head: the LM head's precision under --quant (moeforge/quantize.py)
    accuracy_level: int | None = None  # --accuracy-level: MatMulNBits/QMoE compute (None: the scheme's default)
    calib_method: str | None = None  # w8a8: minmax | percentile
    percentile: float | None = None
    smooth_alpha: float | None = None  # w8a8: SmoothQuant alpha
    act_keep_fp32: str | None = None  # w8a8: weight-label patterns whose activations stay fp32


@dataclass
class CompileResult:
    output_dir: Path
    manifest: Manifest
    parity: ParityReport | None


def compile_model(options: CompileOptions) -> CompileResult:
    """Run every stage; raise MoeforgeError (bad input) or ParityCheckFailed, leaving nothing written."""
    if options.target not in TARGETS:
        raise MoeforgeError(f"target {options.target!r} is not supported here; targets: {', '.join(TARGETS)}")
    if options.max_seq_len is not None and options.max_seq_len < 2:
        raise MoeforgeError(f"--max-seq-len must be >= 2, got {options.max_seq_len}")
    paged = _check_kv_options(options)
    quant = _quant_options(options)
    if paged and quant is not None and quant.calibration_use is not None:
        from moeforge.quantize import QuantError

        what = quant.calibration_use if quant.calibration_use == "--keep-fp" else f"--quant {quant.calibration_use}"
        raise QuantError(f"{what} calibrates on the contiguous-cache graph, which a paged artifact does not have; "
                         "use --kv-cache contiguous, or a scheme without calibration (int8, int8-asym, int4, "
                         "int4-asym, fp8)")
    if options.kv_quant is not None:
        from moeforge.kv_quant import check_kv_quant

        check_kv_quant(options.kv_quant, calib=options.calib, paged=paged, target=options.target)
    if options.target == "trt":
        from moeforge.trt.compile_target import compile_trt

        return compile_trt(options, quant)
    # Refuse bad output locations before the expensive stages.
    check_output_dir(options.output_dir, force=options.force)

    bar = tqdm(total=4 + len(ort_pipeline(options.kv_cache)) + (1 if options.check else 0), desc="compile",
               unit="stage", disable=not options.progress, leave=False)

    def stage(label: str) -> None:
        bar.set_postfix_str(label)

    try:
        stage("load checkpoint")
        loaded = load_model(options.model, mla_impl="absorb")
        config = loaded.config
        if quant is not None:  # before the export: a block size that does not fit fails fast
            check_block_size(quant, in_features(config), config.name or options.model)
        max_seq_len = options.max_seq_len or min(DEFAULT_MAX_SEQ_LEN, config.max_position_embeddings)
        if max_seq_len > config.max_position_embeddings:
            raise MoeforgeError(
                f"--max-seq-len {max_seq_len} exceeds the model's max_position_embeddings "
                f"({config.max_position_embeddings})"
            )
        bar.update()
        stage("export to ONNX")
        model = export_stateless(loaded.model, mark_layers=True)
        bar.update()

        ctx = PassContext(config=config, max_seq_len=max_seq_len, target="ort",
                          notes={PAGED_BLOCK_SIZE_NOTE: options.kv_block_size} if paged else {})

        def pass_done(report: PassReport) -> None:
            stage(f"pass {report.name}: {report.matches}")
            bar.update()

        reports = run_passes(model, ctx, ort_pipeline(options.kv_cache), on_pass_done=pass_done)
        quantized = None
        if quant is not None:
            stage(f"quantise {quant.scheme}")
            quantized = quantize_model(model, ctx, quant, loaded.tokenizer,
                                       fp8_source=checkpoint_is_fp8(loaded.source.location))
            reports += quantized.reports
        kv_summary = None
        if options.kv_quant is not None:
            stage(f"quantise KV cache {options.kv_quant}")
            kv_report, kv_summary = _quantize_kv(model, ctx, options, loaded)
            reports.append(kv_report)
        layer_outputs = unmark_layers(model)  # names kept in the manifest for parity --per-layer
        manifest = _manifest(model, loaded, options, reports, max_seq_len)
        if quantized is not None:
            manifest.precision, manifest.quantization = quantized.precision, quantized.summary
        if kv_summary is not None:
            from moeforge.parity import KV_INT8_SUFFIX

            manifest.precision += KV_INT8_SUFFIX
            manifest.quantization = {**(manifest.quantization or {"scheme": None, "weights": "fp32"}),
                                     "kv_cache": kv_summary}
            manifest.kv_cache = kv_cache_spec(config, max_seq_len=max_seq_len, dtype="int8")
        manifest.layer_outputs = layer_outputs
        stage("write artifact")

        def payload(tmp: Path) -> None:
            ir.save(model, tmp / MODEL_FILE, external_data=DATA_FILE)
            bar.update()
            if loaded.tokenizer is not None:
                loaded.tokenizer.save(tmp)
            # onnxruntime-genai allocates fp32/fp16 caches: it cannot drive block pools or an int8 cache.
            genai = None if paged or kv_summary is not None else genai_config(
                config, manifest.kv_cache, context_length=max_seq_len, filename=MODEL_FILE)
            if genai is not None:
                import json

                (tmp / "genai_config.json").write_text(json.dumps(genai, indent=2))
            # Golden logits (Polygraphy JSON) for checking another backend, e.g. TensorRT, later.
            write_golden(tmp, tmp / MODEL_FILE, default_prompt(config.vocab_size, 16, seed=1))
            if options.check:
                stage("parity check")
                report = run_parity(tmp / MODEL_FILE, loaded.model, default_prompt(config.vocab_size, 16),
                                    decode_steps=options.check_steps, precision=manifest.precision)
                result_holder.append(report)
                bar.update()
                if not report.passed:
                    raise ParityCheckFailed(report)

        result_holder: list[ParityReport] = []
        out = write_artifact(options.output_dir, write_payload=payload, manifest=manifest, force=options.force)
        bar.update()
        return CompileResult(out, manifest, result_holder[0] if result_holder else None)
    finally:
        bar.close()


def _check_kv_options(options: CompileOptions) -> bool:
    """Validate --kv-cache / --kv-block-size; True for a paged compile."""
    if options.kv_cache not in KV_CACHE_KINDS:
        raise MoeforgeError(f"--kv-cache {options.kv_cache!r} is not one of {', '.join(KV_CACHE_KINDS)}")
    if options.kv_block_size < 1:
        raise MoeforgeError(f"--kv-block-size must be >= 1, got {options.kv_block_size}")
    return options.kv_cache == "paged"


def _quant_options(options: CompileOptions) -> QuantOptions | None:
    if options.quant is None:
        # --kv-quant alone (fp32 weights, int8 cache) is fine; it brings its own --calib.
        calib = None if options.kv_quant is not None else options.calib
        for flag, value in (("--block-size", options.block_size), ("--calib", calib),
                            ("--keep-fp", options.keep_fp or None), ("--lm-head", options.lm_head),
                            ("--accuracy-level", options.accuracy_level),
                            ("--calib-method", options.calib_method), ("--percentile", options.percentile),
                            ("--smooth-alpha", options.smooth_alpha), ("--act-keep-fp32", options.act_keep_fp32)):
            if value is not None:
                which = "w8a8 or w8a8-fp8" if flag in ("--calib-method", "--percentile", "--smooth-alpha",
                                                       "--act-keep-fp32") else \
                    "int8, int8-asym, int4, int4-asym, int4-awq, fp8, w8a8 or w8a8-fp8"
                raise MoeforgeError(f"{flag} needs --quant ({which})")
        return None
    quant = QuantOptions(options.quant, options.block_size, options.calib, keep_fp=options.keep_fp,
                         lm_head=options.lm_head, calib_method=options.calib_method, percentile=options.percentile,
                         smooth_alpha=options.smooth_alpha, act_keep_fp32=options.act_keep_fp32,
                         **({} if options.accuracy_level is None else {"accuracy_level": options.accuracy_level}))
    validate_quant(quant)
    return quant


def _quantize_kv(model: ir.Model, ctx: PassContext, options: CompileOptions, loaded: LoadedModel):  # type: ignore[no-untyped-def]
    """Calibrate per-head scales on --calib and make the GroupQueryAttention caches int8."""
    from moeforge.calibration import read_prompts, tokenize_prompts
    from moeforge.kv_quant import quantize_kv_cache
    from moeforge.quantize import CALIB_MAX_TOKENS

    assert options.calib is not None  # check_kv_quant refused it otherwise
    prompts = tokenize_prompts(read_prompts(options.calib), loaded.tokenizer, min(CALIB_MAX_TOKENS, ctx.max_seq_len))
    return quantize_kv_cache(model, ctx, prompts)


def _tensor_specs(values: list[ir.Value]) -> list[TensorSpec]:
    specs = []
    for value in values:
        shape = [d if isinstance(d, int) else str(d.value if isinstance(d, ir.SymbolicDim) else d)
                 for d in (value.shape or [])]
        dtype = str(value.dtype.numpy()) if value.dtype is not None else "unknown"  # numpy names: float32
        specs.append(TensorSpec(name=value.name or "", dtype=dtype, shape=shape))
    return specs


def _manifest(
    model: ir.Model, loaded: LoadedModel, options: CompileOptions, reports: list[PassReport], max_seq_len: int
) -> Manifest:
    config: ModelConfig = loaded.config
    if options.kv_cache == "paged":
        kv = paged_kv_cache_spec(config, max_seq_len=max_seq_len, block_size=options.kv_block_size, dtype="float32")
    else:
        kv = kv_cache_spec(config, max_seq_len=max_seq_len, dtype="float32")
    return Manifest(
        model_config=config.to_dict(),
        inputs=_tensor_specs(list(model.graph.inputs)),
        outputs=_tensor_specs(list(model.graph.outputs)),
        kv_cache=kv,
        passes=[r.to_dict() for r in reports],
        target=options.target,
        precision="fp32",
        tool_versions=tool_versions(),
        files={},
        source=options.model if loaded.source.kind == "preset" else str(Path(loaded.source.location).resolve()),
        created_utc=datetime.now(UTC).isoformat(timespec="seconds"),
    )

