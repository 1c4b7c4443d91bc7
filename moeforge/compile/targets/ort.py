"""The ONNX Runtime target (``--target ort``, the default): ``ort_pipeline`` + quantisation passes; the artifact
holds the graph, golden logits and, for float GQA caches, an onnxruntime-genai config; ``--check`` runs parity
against PyTorch before the artifact is published."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tqdm import tqdm

from moeforge.compile.genai_config import genai_config
from moeforge.compile.options import CompileOptions
from moeforge.compile.targets.base import GOLDEN_PROMPT_LEN, GOLDEN_PROMPT_SEED, CompileJob
from moeforge.core.kv_layout import DEFAULT_DTYPE, KVCacheSpec, contiguous_spec, paged_spec
from moeforge.core.manifest import GENAI_CONFIG_FILE, MODEL_FILE, Manifest
from moeforge.passes.argmax_head import ArgmaxHead
from moeforge.passes.base import GraphPass, PassReport
from moeforge.passes.pipeline import ort_pipeline, v4_pipeline
from moeforge.quant.kv_calibration import CalibratedKVQuantization
from moeforge.quant.plan import QuantPlan, checkpoint_is_fp8, quant_passes
from moeforge.quant.schemes import KV_SCHEMES, precision_name
from moeforge.verify.golden import write_golden
from moeforge.verify.parity import (
    ParityCheckFailed,
    ParityReport,
    TorchReference,
    compare_with_reference,
    default_prompt,
    streamed_parity,
    torch_reference,
)


class OrtTarget:
    """ONNX Runtime artifacts (CPU by default): contiguous GroupQueryAttention caches or paged block pools."""

    name = "ort"

    def __init__(self, options: CompileOptions) -> None:
        self.options = options
        self.plan: QuantPlan | None = None
        self.kv_quant: CalibratedKVQuantization | None = None
        self.parity: ParityReport | None = None  # set by --check
        self.reference: TorchReference | None = None  # --check: PyTorch's logits, taken in passes()

    def check(self) -> None:
        """Nothing beyond the shared checks (``quant.spec.validate``, the KV options)."""

    def passes(self, job: CompileJob) -> list[GraphPass]:
        """The pass list; with ``--check`` also the PyTorch reference, taken now: ``compile_model`` releases the
        torch weights once the passes are known, so that they never sit beside ONNX Runtime's copy."""
        if self.options.check and job.weights is None:  # streamed: PyTorch runs layer by layer after the write
            job.stages.stage("check: PyTorch reference")
            prompt = default_prompt(job.config.vocab_size, GOLDEN_PROMPT_LEN)
            self.reference = torch_reference(job.loaded.model, prompt, self.options.check_steps)
        kv = self.options.kv
        quant, self.plan, self.kv_quant = quant_passes(
            self.options.quant, job.prompts, fp8_source=checkpoint_is_fp8(job.loaded.source.location))
        # Last: it matches only a head the quantisation passes left float32.
        argmax = [ArgmaxHead()] if self.options.argmax_head else []
        if job.config.compressed_attention is not None:  # DeepSeek-V4: the cache is in the exported graph
            return v4_pipeline() + quant + argmax
        return ort_pipeline(kv.layout, kv.tokens_per_block) + quant + argmax

    def kv_spec(self, job: CompileJob) -> KVCacheSpec:
        kv = self.options.kv
        if kv.paged:
            return paged_spec(job.config, max_seq_len=job.max_seq_len, block_size=kv.tokens_per_block)
        kv_quant = self.options.quant.kv_cache
        dtype = KV_SCHEMES[kv_quant].dtype if kv_quant else DEFAULT_DTYPE
        return contiguous_spec(job.config, max_seq_len=job.max_seq_len, dtype=dtype)

    def precision(self) -> str:
        return precision_name(self.options.quant.weights, self.options.quant.kv_cache)

    def quantization(self, reports: list[PassReport]) -> dict[str, Any] | None:
        summary = self.plan.summary() if self.plan is not None else None
        if self.kv_quant is not None:
            summary = {**(summary or {"scheme": None, "weights": "fp32"}), "kv_cache": self.kv_quant.summary}
        return summary

    def write_payload(self, job: CompileJob, folder: Path, manifest: Manifest) -> None:
        model_path = folder / MODEL_FILE
        # onnxruntime-genai allocates fp32/fp16 caches: it cannot drive block pools or an int8 cache.
        if not manifest.kv_cache.paged and manifest.kv_cache.dtype == DEFAULT_DTYPE:
            genai = genai_config(job.config, manifest.kv_cache, context_length=job.max_seq_len, filename=MODEL_FILE)
            if genai is not None:  # None: a layout onnxruntime-genai cannot run (absorbed MLA)
                (folder / GENAI_CONFIG_FILE).write_text(json.dumps(genai, indent=2))
        # Golden logits (Polygraphy JSON) for checking another backend, e.g. TensorRT, later.
        job.stages.stage("golden logits")
        write_golden(folder, model_path, manifest.kv_cache,
                     default_prompt(job.config.vocab_size, GOLDEN_PROMPT_LEN, seed=GOLDEN_PROMPT_SEED))
        if self.options.check:
            job.stages.stage("check: ONNX Runtime vs PyTorch")
            if job.weights is not None:  # a model larger than memory: one PyTorch layer resident at a time
                prompt = default_prompt(job.config.vocab_size, GOLDEN_PROMPT_LEN)
                with tqdm(total=job.config.num_hidden_layers, desc="check: PyTorch layers", unit="layer",
                          leave=False, position=1, disable=not self.options.progress) as layers:
                    self.parity, _ = streamed_parity(model_path, manifest.kv_cache, job.weights, prompt,
                                                     self.options.check_steps, precision=manifest.precision,
                                                     on_layer=lambda _i: layers.update())
            else:
                assert self.reference is not None, "passes() takes the reference"
                self.parity = compare_with_reference(model_path, manifest.kv_cache, self.reference,
                                                     precision=manifest.precision)
            if not self.parity.passed:
                raise ParityCheckFailed(self.parity)
