"""The KV-cache buffers a backend binds, read from the artifact's ``KVCacheSpec`` (``manifest.kv_cache``).

A layer has one buffer per past input (GQA: key, value; absorbed MLA: one latent; DSA: the latent and the
indexer's keys, each its own width from ``kv.buffer_widths``). Each buffer is bound as its
past input and as every present output aliasing it, so the graph writes new tokens in place: GQA pairs outputs
with inputs in order (key -> key, value -> value); an MLA latent takes all of its layer's outputs (ONNX
Runtime's GroupQueryAttention writes the latent twice, as present key and value). The graph is read only to
cross-check: a cache the spec names that the graph lacks, or a dtype or static dim they disagree on, is an
``ArtifactError`` naming the tensor.

Dimension letters: Hkv heads of one buffer (1 for an MLA latent), D values per head (R + Dr for a latent).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from moeforge.core.errors import ArtifactError
from moeforge.core.kv_layout import KVCacheSpec


@dataclass(frozen=True)
class CacheBinding:
    """One layer-cache buffer: the graph input it feeds and the outputs that alias it (written in place)."""

    input_name: str
    output_names: tuple[str, ...]
    heads: int  # Hkv
    head_dim: int  # D
    dtype: str = "float32"  # numpy name; "int8" for a quantised cache (--kv-quant int8)
    rows: int | None = None  # DeepSeek-V4 (v4_hybrid): a sequence's rows of this buffer, [B, rows, D]

    def contiguous_shape(self, batch: int, max_len: int) -> tuple[int, ...]:
        """The contiguous buffer of ``batch`` sequences of up to ``max_len`` tokens."""
        if self.rows is not None:
            return (batch, self.rows, self.head_dim)
        return (batch, self.heads, max_len, self.head_dim)


@dataclass(frozen=True)
class GraphTensor:
    """A graph input as a runtime reports it: numpy dtype name, shape (a str, None or -1 is a dynamic dim)."""

    dtype: str
    shape: tuple[int | str | None, ...]


def cache_bindings(kv: KVCacheSpec) -> list[CacheBinding]:
    """Every layer buffer of ``kv`` with the outputs bound to it, layer by layer in the spec's order."""
    if kv.layer_buffers is not None:  # V4: every buffer its own rows and width, one output each
        return [CacheBinding(name, (output,), 1, buffer.width, kv.dtype,
                             None if kv.paged else buffer.rows_per_sequence(kv.max_seq_len))
                for past, present, buffers in zip(kv.past_input_names, kv.present_output_names, kv.layer_buffers,
                                                  strict=True)
                for name, output, buffer in zip(past, present, buffers, strict=True)]
    # Contiguous buffers are [B, Hkv, L, D], paged pools [N, Bs, Hkv, D].
    heads, head_dim = (kv.shape[2 if kv.paged else 1], kv.shape[3]) if len(kv.shape) == 4 else (None, None)
    if not isinstance(heads, int) or not isinstance(head_dim, int):
        raise ArtifactError(f"kv_cache.shape {kv.shape} does not give the heads and head size of a buffer as numbers")
    widths = kv.buffer_widths or [head_dim] * len(kv.past_input_names[0] if kv.past_input_names else [])
    bindings = []
    for past, present in zip(kv.past_input_names, kv.present_output_names, strict=True):
        aliases = [tuple(present)] if len(past) == 1 else [(name,) for name in present]
        bindings += [CacheBinding(name, outputs, heads, width, kv.dtype)
                     for name, outputs, width in zip(past, aliases, widths, strict=True)]
    return bindings


def check_graph(kv: KVCacheSpec, inputs: Mapping[str, GraphTensor], outputs: Collection[str], graph: str) -> None:
    """Raise ``ArtifactError`` at the first cache tensor where ``kv`` and the graph (``graph`` names it in the
    message) disagree: a missing input or output, another dtype, another static dim after the first."""
    hint = "the manifest does not describe this graph: recompile the artifact"
    per_layer = max(1, len(kv.past_input_names[0])) if kv.past_input_names else 1
    places = [(layer, index) for layer, names in enumerate(kv.past_input_names) for index in range(len(names))]
    for position, binding in enumerate(cache_bindings(kv)):
        name = binding.input_name
        expected = (kv.buffer_shape(places[position][1], places[position][0]) if kv.layer_buffers is not None
                    else kv.buffer_shape(position % per_layer))
        tensor = inputs.get(name)
        if tensor is None:
            raise ArtifactError(f"{graph} has no input {name!r}, which the manifest's kv_cache names; {hint}")
        if tensor.dtype != kv.dtype:
            raise ArtifactError(f"{graph}: KV-cache input {name!r} is {tensor.dtype} in the graph, {kv.dtype} in the "
                                f"manifest's kv_cache; {hint}")
        same_rank = len(tensor.shape) == len(expected)
        if not same_rank or any(isinstance(g, int) and g >= 0 and isinstance(s, int) and g != s
                                for g, s in zip(tensor.shape[1:], expected[1:], strict=True)):
            raise ArtifactError(f"{graph}: KV-cache input {name!r} has shape {list(tensor.shape)} in the graph, "
                                f"{expected} in the manifest's kv_cache; {hint}")
        missing = [o for o in binding.output_names if o not in outputs]
        if missing:
            raise ArtifactError(f"{graph} has no output {missing[0]!r}, which the manifest's kv_cache names as "
                                f"{name!r}'s present output; {hint}")


def resident_zeros(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """A zeroed cache buffer whose pages are all mapped now. ``np.zeros`` maps them lazily, so their first-touch
    faults land inside ONNX Runtime's kernels: GroupQueryAttention's prompt path touches a row's whole
    [Hkv, L, D] region, and a one-row prefill on an 8-slot SmolLM2 buffer (L 2048) took 160-500 ms instead of
    25 ms. Costs one write of the buffer at allocation; the engine counts the caches as committed memory anyway."""
    buffer = np.empty(shape, dtype)
    buffer.fill(0)
    return buffer
