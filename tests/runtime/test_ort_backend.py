"""The ONNX Runtime backend runs mixed steps (prefill chunks + batched decodes over non-adjacent
slots) and every row's logits equal PyTorch's for that sequence alone; it binds the caches the manifest's
kv_cache names and refuses a spec the graph contradicts, naming the tensor."""

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from moeforge.compile.driver import CompileOptions, compile_model
from moeforge.core.artifact import load_artifact
from moeforge.core.errors import ArtifactError
from moeforge.core.manifest import KVCacheSpec
from moeforge.model.loader import load_model
from moeforge.runtime.backends.base import RowInput, StepInput
from moeforge.runtime.backends.onnxruntime import OrtBackend, OrtSession


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-deepseek-v3"])
def compiled(request, tmp_path_factory) -> tuple[str, Path]:
    out = tmp_path_factory.mktemp(request.param) / "artifact"
    compile_model(CompileOptions(model=request.param, output_dir=out, max_seq_len=128, progress=False))
    return request.param, out


def _reference_logits(model, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([tokens]), torch.arange(len(tokens))[None]).logits[0, -1].numpy()


def _kv(path: Path) -> KVCacheSpec:
    return load_artifact(path).manifest.kv_cache


def test_mixed_steps_match_solo_pytorch(compiled):
    name, path = compiled
    model = load_model(name).model
    backend = OrtBackend(path / "model.onnx", kv_cache=_kv(path), num_slots=4, max_seq_len=64, vocab_size=512)
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
    backend = OrtBackend(path / "model.onnx", kv_cache=_kv(path), num_slots=2, max_seq_len=16, vocab_size=512)
    with pytest.raises(ValueError, match="slot 5"):
        backend.execute(StepInput((RowInput(5, (1,), 0),)))
    with pytest.raises(ValueError, match="starts at 3"):
        backend.execute(StepInput((RowInput(0, (1,), 3),)))
    with pytest.raises(ValueError, match="max_seq_len"):
        backend.execute(StepInput((RowInput(0, tuple(range(17)), 0),)))
    backend.execute(StepInput((RowInput(0, (1, 2), 0),)))
    backend.release(0)
    assert backend.lengths[0] == 0


def test_buffers_follow_the_kv_spec(compiled):
    """One buffer per past input the spec names, bound to its present outputs (an MLA latent to all of them)."""
    _, path = compiled
    kv = _kv(path)
    session = OrtSession(path / "model.onnx", kv_cache=kv)
    assert [b.input_name for b in session.bindings] == [n for layer in kv.past_input_names for n in layer]
    for layer, (past, present) in enumerate(zip(kv.past_input_names, kv.present_output_names, strict=True)):
        outputs = [b.output_names for b in session.bindings if b.input_name in past]
        assert outputs == ([tuple(present)] if kv.layout == "mla_latent" else [(name,) for name in present]), layer
    session.allocate(batch=2, max_len=8)
    assert {buffer.shape for buffer in session.buffers} == {(2, kv.shape[1], 8, kv.shape[3])}


def test_a_spec_the_graph_contradicts_is_refused_by_name(compiled):
    _, path = compiled
    kv = _kv(path)
    first = re.escape(kv.past_input_names[0][0])
    with pytest.raises(ArtifactError, match=f"{first}' is float32 in the graph, float16 in the manifest"):
        OrtSession(path / "model.onnx", kv_cache=dataclasses.replace(kv, dtype="float16"))
    renamed = [[name.replace("past_key_values", "past") for name in layer] for layer in kv.past_input_names]
    with pytest.raises(ArtifactError, match=re.escape("has no input 'past.0.")):
        OrtSession(path / "model.onnx", kv_cache=dataclasses.replace(kv, past_input_names=renamed))
    wider = [kv.shape[0], kv.shape[1], kv.shape[2], int(kv.shape[3]) + 1]
    with pytest.raises(ArtifactError, match=f"{first}' has shape"):
        OrtBackend(path / "model.onnx", kv_cache=dataclasses.replace(kv, shape=wider), num_slots=1, max_seq_len=8,
                   vocab_size=512)
    paged = dataclasses.replace(kv, block_size=16, shape=["num_blocks", 16, kv.shape[1], kv.shape[3]])
    with pytest.raises(ArtifactError, match="paged"):
        OrtBackend(path / "model.onnx", kv_cache=paged, num_slots=1, max_seq_len=8, vocab_size=512)


def test_steady_decode_reuses_one_binding_and_matches_pytorch(compiled):
    """Decodes on slots lo..hi-1 in order run through one cached IOBinding (caches bound once) and return its
    logits buffer without a copy; every step's logits still equal PyTorch's for each sequence alone."""
    name, path = compiled
    model = load_model(name).model
    backend = OrtBackend(path / "model.onnx", kv_cache=_kv(path), num_slots=3, max_seq_len=64, vocab_size=512)
    rng = np.random.default_rng(1)
    seqs = {slot: rng.integers(0, 512, length).tolist() for slot, length in ((0, 7), (1, 3), (2, 11))}
    for slot, prompt in seqs.items():  # prefills alone: the graph projects only the last token (logits_to_keep)
        got = backend.execute(StepInput((RowInput(slot, tuple(prompt), 0),)))
        np.testing.assert_allclose(got[0], _reference_logits(model, prompt), atol=1e-4, rtol=0)
    bindings = []
    for _ in range(4):
        rows = tuple(RowInput(slot, (int(rng.integers(0, 512)),), len(seqs[slot])) for slot in (0, 1, 2))
        logits = backend.execute(StepInput(rows))
        for row, got in zip(rows, logits, strict=True):
            seqs[row.slot] += list(row.token_ids)
            np.testing.assert_allclose(got, _reference_logits(model, seqs[row.slot]), atol=1e-4, rtol=0)
        bindings.append(backend._session.decode_binding(0, 3))
        assert np.shares_memory(logits, bindings[-1].logits)  # the bound buffer itself, no copy
    assert all(b is bindings[0] for b in bindings)


def test_equal_fresh_prompts_on_adjacent_slots_prefill_as_one_batch(compiled):
    """Fresh prompts of one length on consecutive slots run as one [B, S] batch (one run, not B); others alone.
    Every row's logits still equal PyTorch's for that sequence alone, and decoding continues from them."""
    name, path = compiled
    model = load_model(name).model
    backend = OrtBackend(path / "model.onnx", kv_cache=_kv(path), num_slots=6, max_seq_len=64, vocab_size=512)
    runs: list[tuple[int, int, tuple[int, ...]]] = []
    forward = backend._forward
    backend._forward = lambda batch: runs.append((batch.lo, batch.hi, batch.ids.shape)) or forward(batch)  # type: ignore[method-assign]
    rng = np.random.default_rng(1)
    prompts = {0: rng.integers(0, 512, 7).tolist(), 1: rng.integers(0, 512, 7).tolist(),
               2: rng.integers(0, 512, 7).tolist(), 3: rng.integers(0, 512, 4).tolist(),
               5: rng.integers(0, 512, 7).tolist()}
    logits = backend.execute(StepInput(tuple(RowInput(slot, tuple(p), 0) for slot, p in prompts.items())))
    assert sorted(runs) == [(0, 3, (3, 7)), (3, 4, (1, 4)), (5, 6, (1, 7))]
    for got, tokens in zip(logits, prompts.values(), strict=True):
        np.testing.assert_allclose(got, _reference_logits(model, tokens), atol=1e-4, rtol=1e-4)
    nxt = {slot: int(row.argmax()) for slot, row in zip(prompts, logits, strict=True)}
    step = StepInput(tuple(RowInput(slot, (token,), len(prompts[slot])) for slot, token in nxt.items()))
    for slot, got in zip(nxt, backend.execute(step), strict=True):
        np.testing.assert_allclose(got, _reference_logits(model, prompts[slot] + [nxt[slot]]), atol=1e-4, rtol=1e-4)
