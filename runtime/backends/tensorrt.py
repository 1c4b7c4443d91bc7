"""TensorRT backend: runs a ``--target trt`` artifact's engine plan on a GPU with device-resident KV caches.

Dimension letters: B batch, S new tokens, L cache length (static in the engine), Hkv/D cache heads and
head size, V vocabulary.

Device buffers are torch CUDA tensors. Per layer cache buffer [num_slots, Hkv, L, D] (half type); slot s
is row s. TensorRT's KV-cache update layer writes in place and requires the present output to share the
past input's address, so both are bound to the same rows of the buffer: nothing is copied between steps.
Profiles (moeforge/trt/build.py): 0 = decode (S = 1, B <= max_batch), 1 = prefill (B = 1, S <=
max_prefill_tokens); a prefill chunk runs alone on its slot, decode rows run together over the smallest
contiguous slot range holding them (idle rows in the range get a dummy token written at their next free
position, which their own next token overwrites, as in the ONNX Runtime backend). Optional CUDA graphs
replay decode steps per slot range.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from moeforge.errors import MoeforgeError
from moeforge.runtime.backends.base import PoolInfo, RowInput, StepInput

PAST_PREFIX, PRESENT_PREFIX = "past_key_values.", "present."
DECODE_PROFILE, PREFILL_PROFILE = 0, 1


class NoGpuError(MoeforgeError):
    """The TensorRT backend needs a CUDA GPU (building needs none; running does)."""


def _torch_cuda() -> Any:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        raise NoGpuError("the TensorRT backend needs torch with CUDA") from None
    if not torch.cuda.is_available():
        raise NoGpuError("the TensorRT backend needs a CUDA GPU and none is visible (torch.cuda.is_available() "
                         "is False); run the artifact's model.onnx with ONNX Runtime instead, or use a GPU host")
    return torch


class TrtEngine:
    """A deserialised plan, one execution context, and the cache buffers of ``num_slots`` sequences."""

    def __init__(self, plan_path: Path, engine_info: dict[str, Any], num_slots: int, cuda_graphs: bool = False) -> None:
        from moeforge.trt.adapter import load_tensorrt

        self.torch = torch = _torch_cuda()
        self.trt = load_tensorrt(engine_info["impl"])
        self.info = engine_info
        self.runtime = self.trt.module.Runtime(self.trt.logger())
        self.engine = self.runtime.deserialize_cuda_engine(plan_path.read_bytes())
        if self.engine is None:
            raise MoeforgeError(f"{plan_path} did not deserialise: built for {engine_info['compute_capability']} "
                                f"with {engine_info['impl']} {engine_info['tensorrt_version']}; rebuild it for this GPU"
                                )
        self.context = self.engine.create_execution_context()
        self.stream = torch.cuda.Stream()
        self.profile = -1
        self.num_slots = num_slots
        dtypes = {"half": torch.float16, "bf16": torch.bfloat16, "float": torch.float32}
        self.caches: dict[str, Any] = {}
        for spec in engine_info["inputs"]:
            if spec["name"].startswith(PAST_PREFIX):
                shape = [num_slots, *spec["shape"][1:]]
                self.caches[spec["name"]] = torch.zeros(shape, dtype=dtypes.get(spec["dtype"], torch.float16),
                                                        device="cuda")
        self.vocab = int(next(o for o in engine_info["outputs"] if o["name"] == "logits")["shape"][-1])
        profiles = engine_info["profiles"]
        self.max_decode_batch = int(profiles[DECODE_PROFILE]["batch"][2])
        self.max_prefill_tokens = int(profiles[PREFILL_PROFILE]["tokens"][2])
        self.cuda_graphs = cuda_graphs
        self._graphs: dict[tuple[int, int], tuple[Any, dict[str, Any], Any]] = {}

    @classmethod
    def from_artifact(cls, artifact: Any, num_slots: int = 1, cuda_graphs: bool = False) -> TrtEngine:
        if artifact.manifest.engine is None:
            raise MoeforgeError(f"{artifact.root} has no engine plan; compile it with --target trt")
        if artifact.manifest.kv_cache.paged:  # --kv-cache paged: pools + block tables, not slot caches
            raise MoeforgeError(f"{artifact.root} is a paged TensorRT engine (block pools); this backend runs "
                                "contiguous-cache engines only: compile without --kv-cache paged to serve it here")
        return cls(artifact.root / artifact.manifest.engine["plan_file"], artifact.manifest.engine, num_slots,
                   cuda_graphs)

    def _bind(self, lo: int, hi: int, ids: Any, positions: Any, past: Any, logits: Any) -> None:
        batch, seq = ids.shape
        profile = DECODE_PROFILE if seq == 1 and batch <= self.max_decode_batch else PREFILL_PROFILE
        if profile != self.profile:
            self.context.set_optimization_profile_async(profile, self.stream.cuda_stream)
            self.profile = profile
        for name, tensor in (("input_ids", ids), ("position_ids", positions), ("past_lengths", past)):
            self.context.set_input_shape(name, tuple(tensor.shape))
            self.context.set_tensor_address(name, tensor.data_ptr())
        for name, buffer in self.caches.items():
            view = buffer[lo:hi]  # rows of the slot dimension: contiguous, no copy
            self.context.set_input_shape(name, tuple(view.shape))
            self.context.set_tensor_address(name, view.data_ptr())
            self.context.set_tensor_address(PRESENT_PREFIX + name[len(PAST_PREFIX):], view.data_ptr())  # in place
        self.context.set_tensor_address("logits", logits.data_ptr())

    def run(self, lo: int, hi: int, ids: np.ndarray, positions: np.ndarray, past_lengths: np.ndarray) -> np.ndarray:
        """One step on slots lo..hi-1: ids/positions [B, S] int64, past_lengths [B] -> logits [B, S, V] float32."""
        torch = self.torch
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
        torch = self.torch
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
                buffer[0:1].copy_(self.torch.as_tensor(np.ascontiguousarray(feeds[name])))
        return self.run(0, 1, feeds["input_ids"], feeds["position_ids"], feeds["past_lengths"])


class TensorRTBackend:
    """The ``Backend`` of a TensorRT artifact (see the module docstring)."""

    def __init__(self, engine: TrtEngine, max_seq_len: int, vocab_size: int) -> None:
        self._engine = engine
        self._max_seq_len, self._vocab = max_seq_len, vocab_size
        self.lengths = [0] * engine.num_slots

    @classmethod
    def from_artifact(cls, path: str | Path, num_slots: int, cuda_graphs: bool = False) -> TensorRTBackend:
        from moeforge.artifact import load_artifact

        artifact = load_artifact(path)
        engine = TrtEngine.from_artifact(artifact, num_slots, cuda_graphs)
        return cls(engine, artifact.manifest.kv_cache.max_seq_len, int(artifact.manifest.model_config["vocab_size"]))

    @property
    def num_slots(self) -> int:
        return self._engine.num_slots

    @property
    def max_seq_len(self) -> int:
        return self._max_seq_len

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def kv_pool(self) -> PoolInfo | None:
        """None: per-slot caches of static length, no block pools."""
        return None

    def release(self, slot: int) -> None:
        self.lengths[slot] = 0

    def op_time_shares(self) -> dict[str, float] | None:
        return None

    def execute(self, step: StepInput) -> np.ndarray:
        out = np.empty((len(step.rows), self._vocab), np.float32)
        decodes = []
        for index, row in enumerate(step.rows):
            self._check(row)
            if len(row.token_ids) == 1:
                decodes.append((index, row))
                continue
            tokens = row.token_ids
            chunk = self._engine.max_prefill_tokens
            for begin in range(0, len(tokens), chunk):  # longer than the prefill profile: consecutive chunks
                part = tokens[begin:begin + chunk]
                logits = self._run(row.slot, row.slot + 1, {row.slot: part})
                self.lengths[row.slot] += len(part)
            out[index] = logits[0, len(part) - 1]
        by_slot = sorted(decodes, key=lambda item: item[1].slot)
        while by_slot:
            lo = by_slot[0][1].slot
            group = [d for d in by_slot if d[1].slot < lo + self._engine.max_decode_batch]
            by_slot = by_slot[len(group):]
            hi = group[-1][1].slot + 1
            logits = self._run(lo, hi, {r.slot: r.token_ids for _, r in group})
            for index, row in group:
                out[index] = logits[row.slot - lo, 0]
                self.lengths[row.slot] += 1
        return out

    def _check(self, row: RowInput) -> None:
        if not 0 <= row.slot < self.num_slots:
            raise ValueError(f"slot {row.slot} is outside 0..{self.num_slots - 1}")
        if row.start != self.lengths[row.slot]:
            raise ValueError(f"slot {row.slot} holds {self.lengths[row.slot]} tokens, the row starts at {row.start}")
        if not row.token_ids:
            raise ValueError(f"slot {row.slot}: a row needs at least one token")
        if row.start + len(row.token_ids) > self._max_seq_len:
            raise ValueError(f"slot {row.slot}: {row.start + len(row.token_ids)} tokens exceed max_seq_len "
                             f"{self._max_seq_len}")

    def _run(self, lo: int, hi: int, work: dict[int, tuple[int, ...]]) -> np.ndarray:
        width = max(len(t) for t in work.values())
        batch = hi - lo
        ids = np.zeros((batch, width), np.int64)
        positions = np.zeros((batch, width), np.int64)
        past = np.array([self.lengths[s] for s in range(lo, hi)], np.int64)
        for b, slot in enumerate(range(lo, hi)):
            tokens = work.get(slot, (0,))  # idle row: dummy token at its next free position
            ids[b, :len(tokens)] = tokens
            positions[b] = np.arange(past[b], past[b] + width)
        return self._engine.run(lo, hi, ids, positions, past)
