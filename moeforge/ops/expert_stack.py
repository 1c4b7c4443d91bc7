"""A stacked-experts weight [E, ...] that can be computed one expert at a time.

The streamed compile's MoE weights are the largest tensors of a DeepSeek-scale model: one layer's gate/up/down
experts at tp 1 are 3 x E x I x H floats (DeepSeek-V3: 43 GiB fp32). Reading, transforming and writing such a tensor
whole would bound the compile's memory by a layer; an ``ExpertStack`` bounds it by one expert. ``expert(e)`` makes
expert e's values (shape ``shape[1:]``); ``tofile`` (what onnx-ir's external-data writer calls) writes expert after
expert, so the artifact writer holds one expert at a time; ``numpy()``/``tobytes()`` stack them all for a consumer
that wants the whole tensor (nothing in a streamed compile's writing path does). Transforms that act expert by
expert (the gate/up interleave, the routed scaling, per-expert quantisation and int4 row packing) chain as
``ExpertStack(lambda e: f(source.expert(e)))``; the bytes equal those of the whole-tensor transform.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import IO

import numpy as np
import onnx_ir as ir

ExpertFn = Callable[[int], np.ndarray]


class ExpertStack(ir.LazyTensor):
    """A lazy [E, ...] tensor whose experts are made one at a time (see the module docstring)."""

    def __init__(self, expert: ExpertFn, dtype: ir.DataType, shape: Sequence[int], name: str | None = None) -> None:
        dims = [int(d) for d in shape]
        self.expert = expert
        self.count = dims[0]
        self._expert_shape = tuple(dims[1:])
        if dtype.bitwidth < 8 and (int(np.prod(self._expert_shape)) * dtype.bitwidth) % 8:
            raise ValueError(f"{name}: one expert of {dtype} {dims} does not end on a byte; it cannot be written alone")
        super().__init__(self._stacked, dtype, ir.Shape(dims), name=name)

    def _stacked(self) -> ir.TensorProtocol:
        return ir.tensor(np.stack([self.checked(e) for e in range(self.count)]), dtype=self.dtype, name=self.name)

    def checked(self, e: int) -> np.ndarray:
        """Expert ``e``, its shape checked."""
        array = self.expert(e)
        if tuple(array.shape) != self._expert_shape:
            raise AssertionError(f"{self.name}: expert {e} has shape {array.shape}, expected {self._expert_shape}")
        return array

    def tofile(self, file: IO[bytes]) -> None:
        for e in range(self.count):
            file.write(ir.tensor(self.checked(e), dtype=self.dtype).tobytes())


def experts_of(tensor: ir.TensorProtocol | None) -> ExpertFn | None:
    """``tensor``'s per-expert maker when it is an ``ExpertStack``, else None (use the whole-tensor path)."""
    return tensor.checked if isinstance(tensor, ExpertStack) else None


def map_tensor(source: ir.TensorProtocol, fn: Callable[[np.ndarray], np.ndarray], dtype: ir.DataType,
               shape: Sequence[int], name: str | None = None) -> ir.TensorProtocol:
    """``fn(source)`` computed when read: expert by expert (an ``ExpertStack``) when ``source`` is one, else
    whole. ``fn`` must act on each expert alone (elementwise, or along the trailing axes), so both give the same
    bytes."""
    experts = experts_of(source)
    if experts is not None:
        return ExpertStack(lambda e: fn(experts(e)), dtype, shape, name)
    return ir.LazyTensor(lambda: ir.tensor(fn(source.numpy()), name=name), dtype, ir.Shape(list(shape)), name=name)
