"""ONNX Runtime (CPU) on a TensorRT-lowered graph: how the lowering is checked without a GPU.

Dimension letters: B batch, T tokens, S tokens of one step, V vocabulary.

The lowered graph is standard ONNX (TensorScatter, Attention, RotaryEmbedding, RMSNormalization and
the MoE node's local function), so ONNX Runtime runs the very file TensorRT builds from. Caches are
numpy arrays carried from one step's present outputs to the next step's past inputs. Each step feeds what
the graph takes: the cached lengths (``past_lengths`` [B]) or, DeepSeek-V4's step graph (its ring and entry buffers
``past_key_values.{i}.{kind}`` [B, rows, w]), an ``attention_mask`` [B, cached + new] of ones.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from moeforge.core.ort_session import make_session

PAST_PREFIX, PRESENT_PREFIX = "past_key_values.", "present."


def run_steps(model_path: str | Path, ids: np.ndarray, boundaries: Sequence[int]) -> np.ndarray:
    """Feed ids [B, T] int64 in steps split at ``boundaries`` (e.g. [0, 6, 7, 9] = prefill 6, then 1, then 2);
    return the logits [B, T', V] of every fed token (T' = boundaries[-1]), all rows at the same position."""
    session = make_session(model_path, providers=["CPUExecutionProvider"])
    batch = ids.shape[0]
    caches = {}
    for value in session.get_inputs():
        if value.name.startswith(PAST_PREFIX):
            dtype = {"tensor(float16)": np.float16, "tensor(float)": np.float32}[value.type]
            caches[value.name] = np.zeros([batch, *value.shape[1:]], dtype)
    names = [o.name for o in session.get_outputs()]
    wanted = {i.name for i in session.get_inputs()}
    logits = []
    for start, stop in itertools.pairwise(boundaries):
        feeds = {"input_ids": ids[:, start:stop].astype(np.int64),
                 "position_ids": np.tile(np.arange(start, stop, dtype=np.int64), (batch, 1)),
                 "past_lengths": np.full(batch, start, np.int64),
                 "attention_mask": np.ones((batch, stop), np.int64), **caches}
        outputs = dict(zip(names, session.run(names, {k: v for k, v in feeds.items() if k in wanted}), strict=True))
        for name in caches:
            caches[name] = outputs[PRESENT_PREFIX + name[len(PAST_PREFIX):]]
        logits.append(outputs["logits"].astype(np.float32))
    return np.concatenate(logits, axis=1)
