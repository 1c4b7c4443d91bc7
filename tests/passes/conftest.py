"""Shared fixtures for pass tests: exported stateless graphs of the tiny presets, and an ORT runner
with ONNX Runtime's own graph optimisations off (so a parity test sees only our rewrite)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest

from moeforge.compile.onnx_export import export_stateless
from moeforge.model.loader import load_model

PRESET_NAMES = ("tiny-llama", "tiny-deepseek-v3", "tiny-deepseek-v2")


@pytest.fixture(scope="session")
def stateless_models() -> dict[str, tuple[object, ir.Model]]:
    """name -> (LoadedModel, exported stateless ir.Model). Copy before mutating (``fresh_model``)."""
    out = {}
    for name in PRESET_NAMES:
        loaded = load_model(name)
        out[name] = (loaded, export_stateless(loaded.model))
    return out


@pytest.fixture
def fresh_model(stateless_models) -> Callable[[str], tuple[object, ir.Model]]:
    def get(name: str) -> tuple[object, ir.Model]:
        loaded, model = stateless_models[name]
        # onnx-ir models do not deepcopy (recursion); a serialise round trip is a true copy.
        return loaded, ir.serde.deserialize_model(ir.serde.serialize_model(model))

    return get


def run_ort(model: ir.Model, feeds: dict[str, np.ndarray], optimize: bool = False) -> list[np.ndarray]:
    """Run an in-memory model in a fresh CPU session; ORT optimisations off unless asked."""
    proto = ir.serde.serialize_model(model)
    options = ort.SessionOptions()
    if not optimize:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def random_feeds(vocab: int, batch: int = 2, seq: int = 7, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "input_ids": rng.integers(0, vocab, (batch, seq)).astype(np.int64),
        "position_ids": np.tile(np.arange(seq, dtype=np.int64), (batch, 1)),
    }


def artifact_feeds(session: ort.InferenceSession, ids: np.ndarray) -> dict[str, np.ndarray]:
    """Feeds of a contiguous artifact's graph for a fresh prompt ``ids`` [B, S]: positions 0..S-1, all-ones mask,
    empty caches [B, H, 0, D]."""
    feeds = {"input_ids": ids, "position_ids": np.arange(ids.shape[1])[None].repeat(len(ids), 0),
             "attention_mask": np.ones_like(ids)}
    for item in session.get_inputs():
        if item.name.startswith("past_key_values."):
            shape = [len(ids) if i == 0 else 0 if i == 2 else d for i, d in enumerate(item.shape)]
            feeds[item.name] = np.zeros(shape, np.float32)
    return {k: v for k, v in feeds.items() if k in {i.name for i in session.get_inputs()}}
