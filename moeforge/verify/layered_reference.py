"""The PyTorch reference of a model larger than memory: one forward pass, one decoder layer resident at a time.

``layered_forward`` runs the meta-device model of ``open_lazy_model`` over a whole token sequence (causal mask,
empty cache): the embedding, then for each decoder layer i: build a CPU copy of layer i, fill it from the checkpoint
(``LazyWeights.read``: FP8 dequantised, checked finite), run it on the hidden states [1, T, H], free it; then the
final norm and the LM head. Peak memory: one layer's float32 weights (or the largest single tensor, e.g. the
embedding table) plus activations of T tokens.

A greedy generation needs every layer at every step, so the streamed parity check (``parity.streamed_parity``)
lets the artifact generate first and then runs this once over the prompt and the artifact's tokens: row t of the
logits is PyTorch's teacher-forced prediction after tokens 0..t, the same numbers an incremental decode with a
cache computes, within float32 rounding (``tests/verify/test_layered_reference.py``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from moeforge.model.attention import causal_mask
from moeforge.model.lazy_weights import LazyWeights

EMBEDDING = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"


@dataclass(frozen=True)
class LayeredOutput:
    """logits [T, V] float32 of every position; hidden [T, H] float32 after each decoder layer."""

    logits: np.ndarray
    hidden: list[np.ndarray]


def materialise(meta_module: nn.Module, prefix: str, weights: LazyWeights) -> nn.Module:
    """A CPU copy of ``meta_module`` (a submodule of ``weights.model`` named ``prefix`` + '.') holding its tensors,
    read from the checkpoint one at a time (derived buffers computed from the config). The meta model is not
    touched: dropping the copy frees its weights."""
    real = copy.deepcopy(meta_module).to_empty(device="cpu")
    with torch.no_grad():
        for name, tensor in [*real.named_parameters(), *real.named_buffers()]:
            tensor.copy_(torch.from_numpy(weights.read(f"{prefix}.{name}")))
    return real


@torch.inference_mode()
def layered_forward(weights: LazyWeights, token_ids: list[int],
                    on_layer: Callable[[int], None] | None = None) -> LayeredOutput:
    """Logits of every position of ``token_ids`` (one sequence, from an empty cache) and each decoder layer's
    output, computed with one layer's weights resident at a time. ``on_layer(i)``: called after layer i ran and
    was freed (a progress bar)."""
    model = weights.model
    config = model.config
    ids = torch.tensor([token_ids], dtype=torch.int64)  # [1, T]
    positions = torch.arange(len(token_ids))[None]  # [1, T]
    x = F.embedding(ids, torch.from_numpy(weights.read(EMBEDDING)))  # [1, T, H]; the table freed after the gather
    cos, sin = materialise(model.model.rotary, "model.rotary", weights)(positions)  # [1, T, D/2] each
    mask = causal_mask(0, len(token_ids), config.sliding_window, ids.device)  # [T, T]
    hidden: list[np.ndarray] = []
    for i, meta_layer in enumerate(model.model.layers):
        layer = materialise(meta_layer, f"model.layers.{i}", weights)
        x, _ = layer(x, cos, sin, mask, None, positions)
        del layer  # layer i's weights go before layer i + 1's are read
        hidden.append(x[0].numpy().copy())
        if on_layer is not None:
            on_layer(i)
    x = materialise(model.model.norm, "model.norm", weights)(x)
    head = torch.from_numpy(weights.read(EMBEDDING if model.lm_head is None else LM_HEAD))  # [V, H]
    logits = F.linear(x, head).to(torch.float32)[0]  # [T, V]
    return LayeredOutput(logits.numpy().copy(), hidden)
