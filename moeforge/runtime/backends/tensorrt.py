"""TensorRT backend: runs a ``--target trt`` artifact's engine plan on a GPU with device-resident KV caches.

Dimension letters: B batch, S new tokens, L cache length (static in the engine), Hkv/D cache heads and
head size, V vocabulary.

Device buffers are torch CUDA tensors: one [num_slots, Hkv, L, D] (half type) per past input the artifact's
``manifest.kv_cache`` names (the engine's recorded I/O is only cross-checked); slot s is row s. TensorRT's
KV-cache update layer writes in place and requires the present output to share the past input's address, so
both are bound to the same rows of the buffer: nothing is copied between steps. Profiles
(compile/trt/engine_build.py): 0 = decode (S = 1, B <= max_batch), 1 = prefill (B = 1, S <= max_prefill_tokens);
the slot bookkeeping and batching are the ONNX Runtime backend's (``contiguous.py``) within those limits: a
prefill chunk runs alone on its slot, in pieces of the prefill profile, decode rows together over the smallest
contiguous slot range holding them, at most the decode profile's batch. Optional CUDA graphs replay decode
steps per slot range.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from moeforge.core.artifact import Artifact, load_artifact
from moeforge.core.errors import MoeforgeError
from moeforge.core.kv_layout import KVCacheSpec
from moeforge.runtime.backends.contiguous import ContiguousBackend, SlotBatch
from moeforge.runtime.backends.kv_bindings import CacheBinding, GraphTensor, cache_bindings, check_graph
from moeforge.runtime.backends.trt_adapter import load_tensorrt

DECODE_PROFILE, PREFILL_PROFILE = 0, 1
# TensorRT's type names (EngineInfo inputs) -> numpy names (the manifest's) -> torch dtypes of the cache buffers.
TRT_DTYPES = {"half": "float16", "bf16": "bfloat16", "float": "float32"}
TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


class NoGpuError(MoeforgeError):
    """The TensorRT backend needs a CUDA GPU (building needs none; running does)."""


def _require_cuda() -> None:
    if not torch.cuda.is_available():
        raise NoGpuError("the TensorRT backend needs a CUDA GPU and none is visible (torch.cuda.is_available() "
                         "is False); use a GPU host, or compile the model with --target ort to run it on CPU")


def cache_length(kv: KVCacheSpec) -> int:
    """L of a contiguous engine's cache [B, Hkv, L, D]: static (TensorRT's KV-cache update needs it)."""
    length = kv.shape[2]
    if not isinstance(length, int):
        raise MoeforgeError(f"kv_cache.shape {kv.shape}: a TensorRT engine's cache length must be a number")
    return length


def engine_cache_bindings(kv: KVCacheSpec, engine_info: dict[str, Any]) -> list[CacheBinding]:
    """The cache buffers of a contiguous engine as ``kv`` names them, cross-checked with the engine's recorded I/O
    (names, dtypes, static dims). Its cache length is static: ``kv.shape`` holds it as a number."""
    if kv.paged:
        raise MoeforgeError("a paged TensorRT engine (block pools, kv_cache.block_size set) does not run on "
                            "per-slot caches: compile without --kv-cache paged to serve it here")
    cache_length(kv)
    inputs = {t["name"]: GraphTensor(TRT_DTYPES.get(t["dtype"], t["dtype"]), tuple(t["shape"]))
              for t in engine_info["inputs"]}
    check_graph(kv, inputs, {t["name"] for t in engine_info["outputs"]}, f"the engine plan {engine_info['plan_file']}")
    return cache_bindings(kv)


class TrtEngine:
    """A deserialised plan, one execution context, and the cache buffers of ``num_slots`` sequences, bound as the
    artifact's ``kv_cache`` names them (one buffer [num_slots, Hkv, L, D] per past input, its present outputs
    aliased)."""

    def __init__(self, plan_path: Path, engine_info: dict[str, Any], *, kv_cache: KVCacheSpec, num_slots: int,
                 cuda_graphs: bool = False) -> None:
        self.kv_cache = kv_cache
        self.bindings = engine_cache_bindings(kv_cache, engine_info)
        _require_cuda()
        self.trt = load_tensorrt(engine_info["impl"])
        self.info = engine_info
        self.runtime = self.trt.module.Runtime(self.trt.logger())
        self.engine = self.runtime.deserialize_cuda_engine(plan_path.read_bytes())
        if self.engine is None:
            raise MoeforgeError(f"{plan_path} did not deserialise: built for {engine_info['compute_capability']} "
                                f"with {engine_info['impl']} {engine_info['tensorrt_version']}; rebuild it for this GPU"
                                )
        self.context = self.engine.create_execution_context()
        self.stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # torch leaves Stream unannotated
        self.profile = -1
        self.num_slots = num_slots
        length = cache_length(kv_cache)
        self.caches: dict[str, torch.Tensor] = {
            b.input_name: torch.zeros((num_slots, b.heads, length, b.head_dim), dtype=TORCH_DTYPES[b.dtype],
                                      device="cuda")
            for b in self.bindings}
        self.vocab = int(next(o for o in engine_info["outputs"] if o["name"] == "logits")["shape"][-1])
        profiles = engine_info["profiles"]
        self.max_decode_batch = int(profiles[DECODE_PROFILE]["batch"][2])
        self.max_prefill_tokens = int(profiles[PREFILL_PROFILE]["tokens"][2])
        self.cuda_graphs = cuda_graphs
        self._graphs: dict[tuple[int, int], tuple[Any, dict[str, Any], Any]] = {}

    @classmethod
    def from_artifact(cls, artifact: Artifact, num_slots: int = 1, cuda_graphs: bool = False) -> TrtEngine:
        manifest = artifact.manifest
        if manifest.engine is None:
            raise MoeforgeError(f"{artifact.root} has no engine plan; compile it with --target trt")
        if manifest.kv_cache.paged:  # --kv-cache paged: pools + block tables, not slot caches
            raise MoeforgeError(f"{artifact.root} is a paged TensorRT engine (block pools); this backend runs "
                                "contiguous-cache engines only: compile without --kv-cache paged to serve it here")
        if manifest.kv_cache.layer_buffers is not None:  # DeepSeek-V4 (v4_hybrid): rings, entries, attention_mask
            raise MoeforgeError(f"{artifact.root} is a DeepSeek-V4 TensorRT engine (ring and entry buffers, layout "
                                "v4_hybrid); this backend binds per-head caches and past_lengths only: compile the "
                                "model with --target ort to run it")
        return cls(artifact.root / manifest.engine["plan_file"], manifest.engine, kv_cache=manifest.kv_cache,
                   num_slots=num_slots, cuda_graphs=cuda_graphs)

    def _bind(self, lo: int, hi: int, ids: Any, positions: Any, past: Any, logits: Any) -> None:
        batch, seq = ids.shape
        profile = DECODE_PROFILE if seq == 1 and batch <= self.max_decode_batch else PREFILL_PROFILE
        if profile != self.profile:
            self.context.set_optimization_profile_async(profile, self.stream.cuda_stream)
            self.profile = profile
        for name, tensor in (("input_ids", ids), ("position_ids", positions), ("past_lengths", past)):
            self.context.set_input_shape(name, tuple(tensor.shape))
            self.context.set_tensor_address(name, tensor.data_ptr())
        for binding in self.bindings:
            view = self.caches[binding.input_name][lo:hi]  # rows of the slot dimension: contiguous, no copy
            self.context.set_input_shape(binding.input_name, tuple(view.shape))
            self.context.set_tensor_address(binding.input_name, view.data_ptr())
            for output in binding.output_names:
                self.context.set_tensor_address(output, view.data_ptr())  # the same buffer: written in place
        self.context.set_tensor_address("logits", logits.data_ptr())

    def run(self, lo: int, hi: int, ids: np.ndarray, positions: np.ndarray, past_lengths: np.ndarray) -> np.ndarray:
        """One step on slots lo..hi-1: ids/positions [B, S] int64, past_lengths [B] -> logits [B, S, V] float32."""
        batch, seq = ids.shape
        if self.cuda_graphs and seq == 1:
            return self._run_graph(lo, hi, ids, positions, past_lengths)
        with torch.cuda.stream(self.stream):
            t_ids = torch.as_tensor(ids, dtype=torch.int64).cuda(non_blocking=True)
            t_pos = torch.as_tensor(positions, dtype=torch.int64).cuda(non_blocking=True)
            t_past = torch.as_tensor(past_lengths, dtype=torch.int64).cuda(non_blocking=True)
            logits = torch.empty((batch, seq, self.vocab), dtype=torch.float32, device="cuda")
            self._bind(lo, hi, t_ids, t_pos, t_past, logits)
            if not self.context.execute_async_v3(self.stream.cuda_stream):
                raise RuntimeError("TensorRT execution failed")
        self.stream.synchronize()
        return logits.cpu().numpy()

    def _run_graph(self, lo: int, hi: int, ids: np.ndarray, positions: np.ndarray,
                   past_lengths: np.ndarray) -> np.ndarray:
        """Decode with a CUDA graph captured once per slot range (static input/output buffers)."""
        key = (lo, hi)
        first = key not in self._graphs
        if first:
            batch = hi - lo
            static = {"ids": torch.zeros((batch, 1), dtype=torch.int64, device="cuda"),
                      "pos": torch.zeros((batch, 1), dtype=torch.int64, device="cuda"),
                      "past": torch.zeros((batch,), dtype=torch.int64, device="cuda"),
                      "logits": torch.empty((batch, 1, self.vocab), dtype=torch.float32, device="cuda")}
            self._graphs[key] = (None, static, None)
        graph, static, _ = self._graphs[key]
        with torch.cuda.stream(self.stream):
            static["ids"].copy_(torch.as_tensor(ids, dtype=torch.int64))
            static["pos"].copy_(torch.as_tensor(positions, dtype=torch.int64))
            static["past"].copy_(torch.as_tensor(past_lengths, dtype=torch.int64))
            if first:
                # TensorRT allocates lazily on its first run, so this step runs for real outside capture;
                # the capture afterwards records the same kernels (capturing executes nothing).
                self._bind(lo, hi, static["ids"], static["pos"], static["past"], static["logits"])
                if not self.context.execute_async_v3(self.stream.cuda_stream):
                    raise RuntimeError("TensorRT execution failed")
                self.stream.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=self.stream):
                    self.context.execute_async_v3(self.stream.cuda_stream)
                self._graphs[key] = (graph, static, None)
            else:
                graph.replay()
        self.stream.synchronize()
        return static["logits"].cpu().numpy()

    def run_once(self, feeds: dict[str, np.ndarray]) -> np.ndarray:
        """Run the golden feeds (batch 1, caches given as arrays) on slot 0; logits [1, S, V]."""
        for name, buffer in self.caches.items():
            if name in feeds:
                buffer[0:1].copy_(torch.as_tensor(np.ascontiguousarray(feeds[name])))
        return self.run(0, 1, feeds["input_ids"], feeds["position_ids"], feeds["past_lengths"])


class TensorRTBackend(ContiguousBackend):
    """The ``Backend`` of a TensorRT artifact (see the module docstring): the slot bookkeeping of
    ``contiguous.py`` over ``engine``, whose profiles cap the prefill and decode runs. The KV spec is the one the
    engine bound its caches with (``engine.kv_cache``), so the two cannot disagree."""

    # Its decode profile is one token per row (W = 1): no speculative verification rows.
    multi_logit_rows = False

    def __init__(self, engine: TrtEngine, *, vocab_size: int) -> None:
        super().__init__(engine.kv_cache, num_slots=engine.num_slots, max_seq_len=engine.kv_cache.max_seq_len,
                         vocab_size=vocab_size, max_prefill_tokens=engine.max_prefill_tokens,
                         max_decode_batch=engine.max_decode_batch)
        self._engine = engine

    @classmethod
    def from_artifact(cls, path: str | Path, num_slots: int, cuda_graphs: bool = False) -> TensorRTBackend:
        artifact = load_artifact(path)
        engine = TrtEngine.from_artifact(artifact, num_slots, cuda_graphs)
        return cls(engine, vocab_size=int(artifact.manifest.model_config["vocab_size"]))

    def _forward(self, batch: SlotBatch) -> np.ndarray:
        return self._engine.run(batch.lo, batch.hi, batch.ids, batch.positions, batch.past)
