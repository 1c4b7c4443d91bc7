"""The ONNX Runtime backend runs mixed steps (prefill chunks + batched decodes over non-adjacent
slots) and every row's logits equal PyTorch's for that sequence alone."""

from pathlib import Path

import numpy as np
import pytest
import torch

from moeforge.compile import CompileOptions, compile_model
from moeforge.export.loader import load_model
from moeforge.runtime.backends.base import RowInput, StepInput
from moeforge.runtime.backends.onnxruntime import OrtBackend


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-deepseek-v3"])
def compiled(request, tmp_path_factory) -> tuple[str, Path]:
    out = tmp_path_factory.mktemp(request.param) / "artifact"
    compile_model(CompileOptions(model=request.param, output_dir=out, max_seq_len=128, progress=False))
    return request.param, out


def _reference_logits(model, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([tokens]), torch.arange(len(tokens))[None]).logits[0, -1].numpy()


def test_mixed_steps_match_solo_pytorch(compiled):
    name, path = compiled
    model = load_model(name).model
    backend = OrtBackend(path / "model.onnx", num_slots=4, max_seq_len=64, vocab_size=512)
    rng = np.random.default_rng(0)
    prompts = {0: rng.integers(0, 512, 9).tolist(), 2: rng.integers(0, 512, 5).tolist(),
               3: rng.integers(0, 512, 13).tolist()}
    seqs = {slot: [] for slot in prompts}  # tokens fed so far per slot

    def run(rows: list[tuple[int, list[int]]]) -> None:
        step = StepInput(tuple(RowInput(slot, tuple(t), len(seqs[slot])) for slot, t in rows))
        logits = backend.execute(step)
        for (slot, tokens), got in zip(rows, logits, strict=True):
            seqs[slot] += tokens
            np.testing.assert_allclose(got, _reference_logits(model, seqs[slot]), atol=1e-4, rtol=0)

    run([(0, prompts[0]), (2, prompts[2][:3])])  # two prefills (one chunked)
    run([(0, [7]), (2, prompts[2][3:])])  # a decode and the rest of a prefill
    run([(3, prompts[3][:6]), (0, [11]), (2, [12])])  # prefill chunk + decodes on slots 0 and 2
    run([(0, [13]), (3, prompts[3][6:]), (2, [14])])  # slot 3 mid-prefill sits between decodes
    for token in (21, 22, 23):  # decodes on slots 0, 2, 3 while slot 1 stays empty
        run([(0, [token]), (2, [token + 1]), (3, [token + 2])])
    assert backend.lengths == [len(seqs[0]), 0, len(seqs[2]), len(seqs[3])]


def test_bad_rows_are_refused(compiled):
    _, path = compiled
    backend = OrtBackend(path / "model.onnx", num_slots=2, max_seq_len=16, vocab_size=512)
    with pytest.raises(ValueError, match="slot 5"):
        backend.execute(StepInput((RowInput(5, (1,), 0),)))
    with pytest.raises(ValueError, match="starts at 3"):
        backend.execute(StepInput((RowInput(0, (1,), 3),)))
    with pytest.raises(ValueError, match="max_seq_len"):
        backend.execute(StepInput((RowInput(0, tuple(range(17)), 0),)))
    backend.execute(StepInput((RowInput(0, (1, 2), 0),)))
    backend.release(0)
    assert backend.lengths[0] == 0
