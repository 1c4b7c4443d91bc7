"""``logits_to_keep``: an input with a default that slices the LM head's input. Fed 1, the logits are the last
position's of the full run; not fed, the graph is the one every other caller (parity, onnxruntime-genai) knows.
Paged graphs keep their own ``logits_indices``."""

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from moeforge.compile.driver import CompileOptions, compile_model
from moeforge.core.kv_layout import LOGITS_TO_KEEP
from moeforge.quant.spec import QuantSpec

from .conftest import artifact_feeds


@pytest.fixture(scope="module", params=[("tiny-llama", None), ("tiny-deepseek-v3", None), ("tiny-llama", "int4")])
def artifact(request, tmp_path_factory) -> Path:
    model, quant = request.param
    out = tmp_path_factory.mktemp(model) / "artifact"
    compile_model(CompileOptions(model=model, output_dir=out, max_seq_len=64, progress=False,
                                 quant=QuantSpec(quant) if quant else QuantSpec()))
    return out


def test_logits_to_keep_slices_the_last_positions(artifact):
    graph = onnx.load(str(artifact / "model.onnx"), load_external_data=False).graph
    assert LOGITS_TO_KEEP in {i.name for i in graph.input} and LOGITS_TO_KEEP in {i.name for i in graph.initializer}
    session = ort.InferenceSession(str(artifact / "model.onnx"))
    assert LOGITS_TO_KEEP not in {i.name for i in session.get_inputs()}  # optional: nobody has to feed it
    ids = np.random.default_rng(0).integers(0, 512, (2, 9))
    full = session.run(["logits"], artifact_feeds(session, ids))[0]
    assert full.shape[:2] == (2, 9)
    for keep in (1, 3):
        part = session.run(["logits"], {**artifact_feeds(session, ids), LOGITS_TO_KEEP: np.array([keep])})[0]
        np.testing.assert_array_equal(part, full[:, -keep:])


def test_paged_graphs_keep_logits_indices(tmp_path):
    out = tmp_path / "paged"
    compile_model(CompileOptions.from_flags(model="tiny-llama", output_dir=out, max_seq_len=64, kv_cache="paged",
                                            progress=False))
    names = {i.name for i in onnx.load(str(out / "model.onnx"), load_external_data=False).graph.input}
    assert "logits_indices" in names and LOGITS_TO_KEEP not in names
