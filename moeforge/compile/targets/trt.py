"""The TensorRT target (``--target trt``): ``trt_pipeline`` (standard-op attention on a static-length cache or
paged pools, fp16/bf16 with fp32 islands, optional symmetric weight Q/DQ); the artifact holds the lowered graph,
golden logits from ONNX Runtime on that exact graph, and the engine plan built beside it. TensorRT-RTX builds
plans ahead of time on a machine without a GPU; full TensorRT builds for the local GPU. DeepSeek-V4: its step graph
(exported with dense routed experts) through ``trt_v4_pipeline``; no moeforge backend runs that plan yet, so the
compile needs ``--build-only`` (``compile/plan.check_v4_engine``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moeforge.compile.options import CompileOptions
from moeforge.compile.targets.base import GOLDEN_PROMPT_LEN, GOLDEN_PROMPT_SEED, CompileJob
from moeforge.compile.trt.engine_build import BuildOptions, build_engine
from moeforge.core.errors import MoeforgeError
from moeforge.core.kv_layout import KVCacheSpec, paged_spec, static_spec
from moeforge.core.manifest import MODEL_FILE, Manifest
from moeforge.passes.base import GraphPass, PassReport
from moeforge.passes.quant_weights import QuantConfig, WeightQuantization
from moeforge.passes.trt_lowering import trt_pipeline, trt_v4_pipeline
from moeforge.quant.plan import in_features, trt_weight_config
from moeforge.runtime.backends.trt_adapter import TensorRT, load_tensorrt
from moeforge.verify.golden import write_golden
from moeforge.verify.parity import ParityReport, default_prompt

PLAN_FILE = "model.plan"
TIMING_CACHE_FILE = "timing.cache"
DTYPES = {"fp16": "float16", "bf16": "bfloat16"}
DEFAULT_SM = 89  # Ada (RTX 40xx, L4, L40S): TensorRT-RTX's ahead-of-time default here


class TrtTarget:
    """TensorRT engines: the ONNX the plan was built from, the plan, and golden logits to check it on a GPU."""

    name = "trt"

    def __init__(self, options: CompileOptions) -> None:
        self.options = options
        self.weights: QuantConfig | None = None  # set by passes(), once the model's dimensions are known
        self.trt: TensorRT | None = None
        self.sm: int | None = None
        self.parity: ParityReport | None = None  # --check is refused: the engine runs only on a GPU

    def check(self) -> None:
        """Engine options, then TensorRT itself and the target SM: all before the export."""
        opts = self.options.trt
        if opts.dtype not in DTYPES:
            raise MoeforgeError(f"--dtype {opts.dtype!r} is not supported for --target trt; choose fp16 or bf16")
        if self.options.check:
            raise MoeforgeError("--check compares with ONNX Runtime artifacts; for --target trt run "
                                "`moeforge parity DIR --backend tensorrt` on a GPU host (golden logits are saved)")
        if opts.max_batch < 1 or opts.max_prefill_tokens < 1:
            raise MoeforgeError("--max-batch and the prefill token limit must be >= 1")
        trt = load_tensorrt(opts.impl)
        self.sm = opts.sm if opts.sm is not None else (DEFAULT_SM if trt.aot else None)
        probe = trt.module.Builder(trt.logger())
        trt.set_target(probe.create_builder_config(), self.sm)  # unsupported SM: fail before the export
        self.trt = trt

    def passes(self, job: CompileJob) -> list[GraphPass]:
        kv, config = self.options.kv, job.config
        if config.compressed_attention is not None:  # DeepSeek-V4: the exported step already holds its cache
            return trt_v4_pipeline(self.options.trt.dtype)
        self.weights = trt_weight_config(self.options.quant, in_features(config), config.name or self.options.model)
        return trt_pipeline(self.options.trt.dtype, kv.layout, kv.tokens_per_block, self.weights)

    def kv_spec(self, job: CompileJob) -> KVCacheSpec:
        kv, dtype = self.options.kv, DTYPES[self.options.trt.dtype]
        if kv.paged:
            return paged_spec(job.config, max_seq_len=job.max_seq_len, block_size=kv.tokens_per_block, dtype=dtype)
        return static_spec(job.config, max_seq_len=job.max_seq_len, dtype=dtype)

    def precision(self) -> str:
        return self.options.trt.dtype

    def quantization(self, reports: list[PassReport]) -> dict[str, Any] | None:
        weights, scheme = self.weights, self.options.quant.scheme
        if weights is None or scheme is None:
            return None
        return {
            "scheme": scheme.name, "weights": weights.kind, "block_size": weights.block_size, "symmetric": True,
            "lm_head": weights.head_kind, "activations": self.options.trt.dtype,
            "form": "DequantizeLinear on weights (TensorRT)",
            "quantized_weights": next(r.matches for r in reports if r.name == WeightQuantization.name),
            "always_fp32": ["norms", "softmax", "router", "MoE experts", "embedding lookup"],
        }

    def write_payload(self, job: CompileJob, folder: Path, manifest: Manifest) -> None:
        trt = self.trt
        assert trt is not None, "check() runs first"
        opts, kv = self.options.trt, self.options.kv
        model_path = folder / MODEL_FILE
        # A rank of a sharded or pipeline artifact runs only beside its peers: no golden of its own.
        if self.options.tp == 1 and self.options.pp == 1:
            job.stages.stage("golden logits")
            write_golden(folder, model_path, manifest.kv_cache,
                         default_prompt(job.config.vocab_size, GOLDEN_PROMPT_LEN, seed=GOLDEN_PROMPT_SEED),
                         for_engine=True)
        build = BuildOptions(impl=trt.impl, sm=self.sm, max_batch=opts.max_batch,
                             max_prefill_tokens=min(opts.max_prefill_tokens, job.max_seq_len),
                             optimization_level=opts.optimization_level,
                             paged_block_size=kv.tokens_per_block if kv.paged else None, max_seq_len=job.max_seq_len,
                             timing_cache=folder / TIMING_CACHE_FILE, num_ranks=self.options.tp,
                             v4_step=manifest.kv_cache.layer_buffers is not None)
        job.stages.stage(f"{trt.impl} engine")
        manifest.engine = build_engine(model_path, folder / PLAN_FILE, build, trt).to_dict()
        manifest.tool_versions[trt.impl] = trt.version
