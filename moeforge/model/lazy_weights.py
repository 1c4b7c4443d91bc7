"""A model whose weights stay in the checkpoint: the streamed compile's source (issue 34's first stage).

``open_lazy_model`` builds the ``CausalLM`` on the meta device (no weight memory), checks every checkpoint tensor's
name and shape against it from the safetensors headers alone, and returns ``LazyWeights``: each tensor read (FP8 and
FP4 dequantised, cast to float32, checked finite; DeepSeek-V4's hash-routing tables as int64, their expert ids checked)
only when asked, through the checkpoint's memory map. The exporter
traces the meta model and makes each initializer an ``onnx_ir.LazyTensor`` over ``LazyWeights.read``; the artifact
writer then reads, transforms and writes one tensor at a time (``moeforge/compile/onnx_export.py``).

Derived buffers (RoPE's ``inv_freq``) are not in a checkpoint: ``LazyWeights`` computes them from the config on a
CPU copy of their module, as ``CausalLM.reset_buffers`` does after an eager load. DeepSeek-V4's multi-token-prediction
tensors (``mtp.*``) are not read: the model keeps them unrun (``DeepseekV4ForCausalLM.mtp``) and no graph holds them.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from moeforge.core.config import ModelConfig
from moeforge.core.errors import CheckpointError, MoeforgeError
from moeforge.model.deepseek_v4_names import MTP_PREFIX
from moeforge.model.loader import LoadedModel, check_index_table, new_model, resolve_source
from moeforge.model.mla import MLAImpl
from moeforge.model.model import CausalLM
from moeforge.model.rank_model import TensorSlice
from moeforge.model.safetensors_loader import HFCheckpoint, read_hf_checkpoint
from moeforge.model.tokenizer import TOKENIZER_FILE, Tokenizer

_EXPERT_STACKS = ("gate_proj", "up_proj", "down_proj")  # moe.Experts' stacked parameters [E, ...]


def is_expert_stack_name(name: str, ndim: int) -> bool:
    """Whether the model tensor ``name`` of ``ndim`` dimensions is a stacked routed-experts weight [E, ...]
    (``moe.Experts``'s gate/up/down): the streamed compile reads and writes it one expert at a time."""
    owner, _, attr = name.rpartition(".")
    return owner.endswith(".experts") and attr in _EXPERT_STACKS and ndim == 3


@dataclass
class LazyWeights:
    """The tensors of a meta-device model by state-dict name: ``read(name)`` -> float32 array (int64 for an integer
    tensor: DeepSeek-V4's tid2eid), from the checkpoint (or, for a derived buffer, computed from the config). Nothing is
    cached: each read is fresh, so a caller that drops the array frees it."""

    model: CausalLM
    checkpoint: HFCheckpoint
    check_finite: bool = True
    # Called with (name, bytes) the first time each tensor is read: a progress bar over the weights' bytes.
    on_first_read: Callable[[str, int], None] | None = None
    # One rank of a streamed sharded compile (``for_rank``): ``model`` is the rank's, and each of its tensors is a
    # slice of a checkpoint tensor (``rank_model.rank_sources``), read alone. None: the names are the checkpoint's.
    sources: Callable[[str], TensorSlice | None] | None = None

    def __post_init__(self) -> None:
        self._read_once: set[str] = set()  # the stored tensors read so far (len: tensors done)
        self._experts_read: dict[str, set[int]] = {}  # stacked experts weight -> the experts read so far
        self.bytes_read_once = 0  # float32 bytes of the distinct checkpoint tensors read so far
        # Taken now: the exporter rewires the module tree for a while (moeforge/compile/onnx_export.py).
        self._tensors = {name: t for name, t in [*self.model.named_parameters(), *self.model.named_buffers()]}
        self._modules = dict(self.model.named_modules())

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape, from the model (no read)."""
        return tuple(self._meta_tensor(name).shape)

    def for_rank(self, model: CausalLM, sources: Callable[[str], TensorSlice | None]) -> LazyWeights:
        """The tensors of a rank model (``shard_model`` of this meta model), each read as its slice of the
        checkpoint tensor ``sources`` names: a rank reads only what it holds."""
        return LazyWeights(model, self.checkpoint, self.check_finite, sources=sources)

    @property
    def tensors_read_once(self) -> int:
        """How many distinct stored tensors have been read."""
        return len(self._read_once)

    def stored(self, name: str) -> TensorSlice | None:
        """What of the checkpoint ``name`` holds (None: a derived buffer, computed from the config)."""
        if self.sources is not None:
            return self.sources(name)
        return TensorSlice(name) if name in self.checkpoint else None

    def stored_names(self) -> list[str]:
        """The model's tensors that are read from the checkpoint (derived buffers excluded)."""
        return [name for name in self._tensors if self.stored(name) is not None]

    def total_bytes(self) -> int:
        """The bytes of every stored tensor as read (float32; int64 tables), what a streamed compile reads once at
        least."""
        return sum(self._meta_tensor(name).element_size() * math.prod(self.shape(name)) for name in self.stored_names())

    def read(self, name: str) -> np.ndarray:
        """``name``'s values as a float32 array, int64 for an integer tensor (a fresh copy)."""
        piece = self.stored(name)
        array = self._derived_buffer(name) if piece is None else self._read(piece, name)
        if name not in self._read_once and piece is not None:
            self._read_once.add(name)
            self.bytes_read_once += array.nbytes
            if self.on_first_read is not None:
                self.on_first_read(name, array.nbytes)
        return array

    def is_expert_stack(self, name: str) -> bool:
        """Whether ``name`` is a stacked routed-experts weight [E, ...] (``moe.Experts``'s gate/up/down), which
        ``read_expert`` reads one expert at a time."""
        return is_expert_stack_name(name, len(self.shape(name))) and self.stored(name) is not None

    def read_expert(self, name: str, e: int) -> np.ndarray:
        """Expert ``e`` of the stacked experts weight ``name`` as a float32 array [shape[1:]], reading only that
        expert's part of the checkpoint (FP8: its blocks): a streamed compile writes MoE weights expert by expert
        (``ops/expert_stack.py``). A placement's empty slot is zeros."""
        piece = self.stored(name)
        assert piece is not None and self.is_expert_stack(name), f"{name} is not a stacked experts weight"
        if piece.indices is not None:
            source = piece.indices[e]
            tensor = torch.zeros(self.shape(name)[1:]) if source < 0 else \
                self.checkpoint.read_slice(piece.source, 0, source, source + 1)[0]
        elif piece.dim is None or piece.dim == 0:
            first = piece.start if piece.dim == 0 else 0
            tensor = self.checkpoint.read_slice(piece.source, 0, first + e, first + e + 1)[0]
        else:  # tp within each expert: its rows or columns of expert e
            whole = self.checkpoint.read_slice(piece.source, 0, e, e + 1)[0]
            tensor = whole.narrow(piece.dim - 1, piece.start, piece.stop - piece.start).clone()
        array = self._checked(tensor.to(torch.float32), piece.source)
        done = self._experts_read.setdefault(name, set())
        if e not in done and name not in self._read_once:
            done.add(e)
            self.bytes_read_once += array.nbytes
            if len(done) == self.shape(name)[0]:
                self._read_once.add(name)  # every expert read: the tensor counts as done
            if self.on_first_read is not None:
                self.on_first_read(name, array.nbytes)
        return array

    def _checked(self, tensor: torch.Tensor, source: str) -> np.ndarray:
        if self.check_finite and not math.isfinite(float(tensor.sum())) and not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(
                f"tensor {source!r} holds NaN or Inf values: the weights are corrupt or diverged; re-download "
                "or re-export the checkpoint, or skip this check with --no-weight-check")
        result: np.ndarray = tensor.numpy()
        return result

    def _read(self, piece: TensorSlice, name: str) -> np.ndarray:
        if not self._meta_tensor(name).is_floating_point():  # DeepSeek-V4's tid2eid [V, K]: replicated, read whole
            table = self.checkpoint.read(piece.source).to(torch.int64)
            check_index_table(piece.source, table, self.model.config)
            result: np.ndarray = table.numpy()
            return result
        if piece.indices is not None:  # an expert placement's slots: whole experts by index, zeros for an empty slot
            experts = {e: self.checkpoint.read_slice(piece.source, 0, e, e + 1)[0].to(torch.float32)
                       for e in sorted(set(piece.indices)) if e >= 0}
            blank = torch.zeros(self.checkpoint.shape(piece.source)[1:])
            tensor = torch.stack([experts[e] if e >= 0 else blank for e in piece.indices])
        elif piece.dim is None:
            tensor = self.checkpoint.read(piece.source).to(torch.float32)
        else:
            tensor = self.checkpoint.read_slice(piece.source, piece.dim, piece.start, piece.stop).to(torch.float32)
        return self._checked(tensor, piece.source)

    def _meta_tensor(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def _derived_buffer(self, name: str) -> np.ndarray:
        module_name, _, attr = name.rpartition(".")
        module = self._modules[module_name]
        reset = getattr(module, "reset_buffers", None)
        if attr not in module._buffers or reset is None:
            raise KeyError(f"{name} is neither in the checkpoint nor a derived buffer")
        real = copy.deepcopy(module).to_empty(device="cpu")  # its own small copy: the model stays on meta
        real.reset_buffers()
        buffer: np.ndarray = real._buffers[attr].to(torch.float32).numpy().copy()
        return buffer


def check_streamable(spec: str) -> None:
    """Refuse (``MoeforgeError``) a ``spec`` that is not a Hugging Face safetensors folder: it loads whole."""
    source = resolve_source(spec)
    if source.kind != "hf":
        raise MoeforgeError(f"--stream reads a Hugging Face safetensors folder; {spec} is a {source.kind} model, "
                            "which loads whole: drop --stream")


def open_lazy_model(spec: str, *, mla_impl: MLAImpl = "absorb", check_finite: bool = True
                    ) -> tuple[LoadedModel, LazyWeights]:
    """A meta-device model of the HF checkpoint folder ``spec`` and its weights, read on demand. Every tensor's
    name and shape is checked now, from the headers; values are read (and checked finite) when the artifact is
    written. Other sources (presets, GGUF files) are refused: they load whole (``load_model``)."""
    check_streamable(spec)
    source = resolve_source(spec)
    folder = Path(source.location)
    config = ModelConfig.from_hf_json(folder / "config.json")
    checkpoint = read_hf_checkpoint(folder, config)
    with torch.device("meta"):
        model = new_model(config, mla_impl)  # DeepSeek-V4: its own subclass
    _check_against(model, checkpoint, config)
    tokenizer = Tokenizer.from_file(folder) if (folder / TOKENIZER_FILE).is_file() else None
    return LoadedModel(model.eval(), config, tokenizer, source), LazyWeights(model, checkpoint, check_finite)


def _check_against(model: CausalLM, checkpoint: HFCheckpoint, config: ModelConfig) -> None:
    """Every model tensor is in the checkpoint with the model's shape (derived buffers excepted), and the
    checkpoint holds nothing else: the checks ``build_from_tensors`` makes, without reading a value."""
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    for name in checkpoint.keys():
        if name.startswith(MTP_PREFIX) and config.compressed_attention is not None:
            continue  # DeepSeek-V4's MTP module: not compiled, never read
        if name not in expected:
            raise CheckpointError(f"checkpoint tensor {name!r} has no place in a {config.model_type} model")
        if tuple(checkpoint.shape(name)) != expected[name]:
            raise CheckpointError(
                f"tensor {name!r} has shape {tuple(checkpoint.shape(name))} but the config implies {expected[name]}: "
                "the config and the weights disagree (wrong config.json, or a corrupted checkpoint)")
    missing = sorted(set(expected) - set(checkpoint.keys()))
    if missing:
        shown = ", ".join(missing[:5]) + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else "")
        raise CheckpointError(f"checkpoint is missing {len(missing)} tensor(s): {shown}")
