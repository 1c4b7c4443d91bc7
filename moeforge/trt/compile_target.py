"""``moeforge compile --target trt``: export -> TensorRT lowering -> artifact with model.onnx + model.plan.

Stages: check TensorRT and the target SM first (cheap, before the export); load; export the stateless
graph; run ``trt_pipeline`` (graph_passes/trt_lowering.py); write model.onnx + weights, tokenizer,
golden logits from ONNX Runtime on that graph (moeforge/trt/golden.py), then build the engine plan
(moeforge/trt/build.py) beside it (with a timing cache under full TensorRT). ``--quant int8|int4|fp8`` adds
symmetric weight DequantizeLinear nodes before the precision pass (``trt_weight_quant``). The manifest's ``engine``
field describes the plan (inputs/outputs, profiles, compute capability, TensorRT version, layer types,
build time, size).
"""

from __future__ import annotations

from pathlib import Path

import onnx_ir as ir
from tqdm import tqdm

from moeforge.artifact import check_output_dir, kv_cache_spec
from moeforge.errors import MoeforgeError
from moeforge.export.loader import load_model
from moeforge.export.onnx_export import export_stateless, unmark_layers
from moeforge.graph_passes.base import PassContext, PassReport
from moeforge.graph_passes.paged_kv import PAGED_BLOCK_SIZE_NOTE, paged_kv_cache_spec
from moeforge.graph_passes.pipeline import run_passes
from moeforge.graph_passes.quant_weights import QuantConfig
from moeforge.graph_passes.trt_lowering import trt_pipeline
from moeforge.parity import default_prompt
from moeforge.quantize import check_block_size, in_features
from moeforge.trt.adapter import load_tensorrt
from moeforge.trt.build import BuildOptions, build_engine
from moeforge.trt.golden import write_trt_golden
from moeforge.trt.paged_golden import write_trt_paged_golden

PLAN_FILE = "model.plan"
TIMING_CACHE_FILE = "timing.cache"
DTYPES = {"fp16": "float16", "bf16": "bfloat16"}
DEFAULT_MAX_SEQ_LEN = 2048
GOLDEN_PROMPT_LEN = 16
DEFAULT_SM = 89  # Ada (RTX 40xx, L4, L40S): TensorRT-RTX's ahead-of-time default here


def compile_trt(options, quant=None):  # type: ignore[no-untyped-def]  (CompileOptions, QuantOptions|None)
    """Run every stage for the trt target; raise MoeforgeError on bad input, leaving nothing written."""
    from moeforge.compile import DATA_FILE, MODEL_FILE, CompileResult, _manifest

    weights = trt_weight_quant(quant)
    dtype = options.dtype or "fp16"
    if dtype not in DTYPES:
        raise MoeforgeError(f"--dtype {dtype!r} is not supported for --target trt; choose fp16 or bf16")
    if options.check:
        raise MoeforgeError("--check compares with ONNX Runtime artifacts; for --target trt run "
                            "`moeforge parity DIR --backend tensorrt` on a GPU host (golden logits are saved)")
    paged = options.kv_cache == "paged"  # block pools + moeforge::PagedAttention (moeforge/trt/paged_profiles.py)
    check_output_dir(options.output_dir, force=options.force)
    if options.max_batch < 1 or options.max_prefill_tokens < 1:
        raise MoeforgeError("--max-batch and the prefill token limit must be >= 1")
    trt = load_tensorrt(options.trt_impl)
    sm = options.sm if options.sm is not None else (DEFAULT_SM if trt.aot else None)
    probe = trt.module.Builder(trt.logger())
    trt.set_target(probe.create_builder_config(), sm)  # unsupported SM: fail before the export
    del probe

    bar = tqdm(total=4 + len(trt_pipeline(dtype, options.kv_cache, weights)), desc="compile", unit="stage",
               disable=not options.progress, leave=False)
    try:
        loaded = load_model(options.model, mla_impl="absorb")
        config = loaded.config
        max_seq_len = options.max_seq_len or min(DEFAULT_MAX_SEQ_LEN, config.max_position_embeddings)
        if max_seq_len > config.max_position_embeddings:
            raise MoeforgeError(f"--max-seq-len {max_seq_len} exceeds the model's max_position_embeddings "
                                f"({config.max_position_embeddings})")
        if quant is not None:  # before the export: a block size that does not fit fails fast
            check_block_size(quant, in_features(config), config.name or options.model)
        bar.update()
        model = export_stateless(loaded.model, mark_layers=True)
        bar.update()
        ctx = PassContext(config=config, max_seq_len=max_seq_len, target="trt",
                          notes={PAGED_BLOCK_SIZE_NOTE: options.kv_block_size} if paged else {})

        def pass_done(report: PassReport) -> None:
            bar.set_postfix_str(f"pass {report.name}: {report.matches}")
            bar.update()

        reports = run_passes(model, ctx, trt_pipeline(dtype, options.kv_cache, weights), on_pass_done=pass_done)
        layer_outputs = unmark_layers(model)
        manifest = _manifest(model, loaded, options, reports, max_seq_len)
        manifest.precision = dtype
        if weights is not None:
            manifest.quantization = {
                "scheme": quant.scheme, "weights": weights.kind, "block_size": weights.block_size, "symmetric": True,
                "lm_head": weights.head_kind, "activations": dtype, "form": "DequantizeLinear on weights (TensorRT)",
                "quantized_weights": next(r.matches for r in reports if r.name == "quant_weights"),
                "always_fp32": ["norms", "softmax", "router", "MoE experts", "embedding lookup"],
            }
        manifest.layer_outputs = layer_outputs
        if paged:
            manifest.kv_cache = paged_kv_cache_spec(config, max_seq_len=max_seq_len, block_size=options.kv_block_size,
                                                    dtype=DTYPES[dtype])
        else:
            manifest.kv_cache = _kv_spec(config, max_seq_len, DTYPES[dtype])
        manifest.tool_versions[trt.impl] = trt.version
        build = BuildOptions(impl=trt.impl, sm=sm, max_batch=options.max_batch,
                             max_prefill_tokens=min(options.max_prefill_tokens, max_seq_len),
                             optimization_level=options.trt_optimization_level,
                             paged_block_size=options.kv_block_size if paged else None, max_seq_len=max_seq_len)

        def payload(tmp: Path) -> None:
            ir.save(model, tmp / MODEL_FILE, external_data=DATA_FILE)
            if loaded.tokenizer is not None:
                loaded.tokenizer.save(tmp)
            golden = write_trt_paged_golden if paged else write_trt_golden
            golden(tmp, tmp / MODEL_FILE, default_prompt(config.vocab_size, GOLDEN_PROMPT_LEN, seed=1))
            bar.set_postfix_str("build engine")
            info = build_engine(tmp / MODEL_FILE, tmp / PLAN_FILE,
                                BuildOptions(**{**build.__dict__, "timing_cache": tmp / TIMING_CACHE_FILE}), trt)
            manifest.engine = info.to_dict()
            bar.update()

        from moeforge.artifact import write_artifact

        out = write_artifact(options.output_dir, write_payload=payload, manifest=manifest, force=options.force)
        bar.update()
        return CompileResult(out, manifest, None)
    finally:
        bar.close()


TRT_SCHEMES = ("int8", "int4", "fp8")


def trt_weight_quant(quant) -> QuantConfig | None:  # type: ignore[no-untyped-def]
    """``--quant`` for the TensorRT target: symmetric weight-only Q/DQ (what strongly typed TensorRT takes)."""
    if quant is None:
        return None
    if quant.scheme not in TRT_SCHEMES:
        raise MoeforgeError(f"--quant {quant.scheme} is built for ONNX Runtime (--target ort); --target trt takes "
                            f"the symmetric weight-only schemes {', '.join(TRT_SCHEMES)}")
    if quant.keep_fp or quant.lm_head == "fp32":
        raise MoeforgeError("--keep-fp / --lm-head fp32 are not wired for --target trt; drop them")
    kind = quant.kind
    head = quant.lm_head or ("int8" if kind == "int4" else kind)
    return QuantConfig(kind=kind, block_size=quant.block, head_kind=head)


def _kv_spec(config, max_seq_len: int, dtype: str):  # type: ignore[no-untyped-def]
    """The ORT spec's names and shapes, in the half type, with the static cache length; MLA has one
    present output per layer (no GroupQueryAttention duplicate)."""
    spec = kv_cache_spec(config, max_seq_len=max_seq_len, dtype=dtype)
    spec.shape = [max_seq_len if d == "max_sequence_length" else d for d in spec.shape]
    if spec.layout == "mla_latent":
        spec.present_output_names = [names[:1] for names in spec.present_output_names]
    return spec
