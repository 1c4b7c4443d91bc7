"""``moeforge compile --stream``: the model is traced on the meta device and each weight is read, transformed and
written one at a time. The artifact holds the same tensors, byte for byte, as the in-memory compile's (so the same
graph runs: checked against PyTorch here too); weights are read only while the artifact is written, so a bad
weight fails the compile then and leaves nothing; what needs the whole model is refused up front."""

from __future__ import annotations

import json
import re
import sys
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch
from safetensors.torch import load_file, save_file

from moeforge.compile.driver import CompileOptions, compile_model
from moeforge.core.errors import CheckpointError, MoeforgeError
from moeforge.model.lazy_weights import LazyWeights, open_lazy_model
from moeforge.model.loader import load_model
from moeforge.verify.parity import compare_with_reference, default_prompt, torch_reference

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import synthetic_deepseek as sd

MIB = 2**20
# DeepSeek-V3-shaped (MLA, MoE with a shared expert and a dense first layer, FP8 block-scaled weights), tiny.
DS3 = sd.deepseek_v3_shape(2, 256, 8, 2, vocab=600, intermediate=512)


def _llama_folder(folder: Path) -> Path:
    """A tiny Llama (GQA, tied embeddings) saved by transformers, as a Hub checkpoint is."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=300, max_position_embeddings=256, tie_word_embeddings=True)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.2)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("stream")
    ds3 = root / "ds3"
    sd.write_checkpoint(ds3, DS3, seed=5, shard_bytes=MIB)
    return {"deepseek-v3-fp8": ds3, "llama-tied": _llama_folder(root / "llama")}


def _compile(model: Path, out: Path, **flags: Any) -> Path:
    options = CompileOptions.from_flags(model=str(model), output_dir=out, max_seq_len=64, progress=False, **flags)
    return compile_model(options).output_dir


def _tensors(artifact: Path) -> tuple[list[tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """Every initializer's shape (sorted), and the shapes of those with a name of their own (not a generated
    ``val_N``, whose number depends on how many values were made before it)."""
    graph = onnx.load(str(artifact / "model.onnx"), load_external_data=False).graph
    named = {t.name: tuple(t.dims) for t in graph.initializer if not re.match(r"val_\d+", t.name)}
    return sorted(tuple(t.dims) for t in graph.initializer), named


def _ops(artifact: Path) -> list[str]:
    return [n.op_type for n in onnx.load(str(artifact / "model.onnx"), load_external_data=False).graph.node]


@pytest.mark.parametrize("flags", [{}, {"quant": "int8"}, {"quant": "int4-asym"}, {"kv_cache": "paged"}],
                         ids=["fp32", "int8", "int4-asym", "paged"])
@pytest.mark.parametrize("case", ["deepseek-v3-fp8", "llama-tied"])
def test_the_streamed_artifact_holds_the_in_memory_ones_bytes(checkpoints: dict[str, Path], tmp_path: Path,
                                                              case: str, flags: dict[str, Any]) -> None:
    """Same tensors (names, shapes) in the same external-data bytes, same ops, same manifest contract. (model.onnx
    itself differs only in generated names, ``node_MatMul_483`` / ``val_226``, and the initializer list's order.)"""
    eager = _compile(checkpoints[case], tmp_path / "eager", **flags)
    streamed = _compile(checkpoints[case], tmp_path / "stream", stream=True, **flags)
    assert (eager / "model.onnx.data").read_bytes() == (streamed / "model.onnx.data").read_bytes()
    assert _tensors(eager) == _tensors(streamed)
    assert _ops(eager) == _ops(streamed)
    manifests = [json.loads((a / "manifest.json").read_text()) for a in (eager, streamed)]
    for key in ("inputs", "outputs", "kv_cache", "precision", "quantization", "layer_outputs", "model_config"):
        assert manifests[0][key] == manifests[1][key], key


@pytest.mark.parametrize("case", ["deepseek-v3-fp8", "llama-tied"])
def test_the_streamed_artifact_matches_pytorch(checkpoints: dict[str, Path], tmp_path: Path, case: str) -> None:
    """Teacher-forced logits of the streamed artifact against the PyTorch model loaded whole (the same check
    ``--check`` makes)."""
    artifact = _compile(checkpoints[case], tmp_path / "stream", stream=True)
    manifest = json.loads((artifact / "manifest.json").read_text())
    loaded = load_model(str(checkpoints[case]))
    reference = torch_reference(loaded.model, default_prompt(loaded.config.vocab_size, 8), 8)
    from moeforge.core.manifest import Manifest

    kv_cache = Manifest.from_dict(manifest).kv_cache
    report = compare_with_reference(artifact / "model.onnx", kv_cache, reference, precision=manifest["precision"])
    assert report.passed, report


def test_weights_are_read_one_at_a_time_while_the_artifact_is_written(checkpoints: dict[str, Path],
                                                                      tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                      ) -> None:
    """While the artifact is written, the arrays read from the checkpoint that are alive at once never exceed one
    layer's weights (each transform reads what it combines, e.g. q/k/v or a layer's gate and up experts, and drops
    it before the next), whatever the number of layers. The in-memory compile holds every weight at once."""
    alive: dict[int, int] = {}
    peak = [0]
    names: set[str] = set()
    original = LazyWeights.read

    def tracked(self: LazyWeights, name: str) -> np.ndarray:
        array = original(self, name)
        names.add(name)
        alive[id(array)] = array.nbytes
        peak[0] = max(peak[0], sum(alive.values()))
        weakref.finalize(array, alive.pop, id(array), None)
        return array

    monkeypatch.setattr(LazyWeights, "read", tracked)
    folder = checkpoints["deepseek-v3-fp8"]
    _compile(folder, tmp_path / "stream", stream=True)
    _, weights = open_lazy_model(str(folder))
    sizes = {name: int(np.prod(weights.shape(name))) * 4 for name in weights.checkpoint.keys()}
    layers = [sum(b for n, b in sizes.items() if n.startswith(f"model.layers.{i}.")) for i in range(DS3.layers)]
    one_layer = max(max(layers), *(b for n, b in sizes.items() if not n.startswith("model.layers.")))
    assert 0 < peak[0] <= one_layer < sum(sizes.values()), (peak[0], one_layer, sum(sizes.values()))
    assert names >= set(weights.checkpoint.keys())  # every checkpoint tensor went into the artifact


def test_a_bad_weight_fails_the_streamed_compile_when_read_and_leaves_nothing(checkpoints: dict[str, Path],
                                                                            tmp_path: Path) -> None:
    source = checkpoints["llama-tied"]
    folder = tmp_path / "nan"
    folder.mkdir()
    for path in source.iterdir():
        if path.suffix != ".safetensors":
            (folder / path.name).write_bytes(path.read_bytes())
    tensors = load_file(str(source / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name] = tensors[name].clone()
    tensors[name][3, 5] = float("nan")
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match=r"layers\.1\.mlp\.down_proj\.weight.*NaN"):
        _compile(folder, out, stream=True)
    assert not out.exists()


@pytest.mark.parametrize(("model", "flags", "match"), [
    ("llama-tied", {"check": True}, "--check"),
    ("llama-tied", {"tp": 2}, "--tp/--ep"),
    ("tiny-llama", {}, "preset model"),
])
def test_what_needs_the_whole_model_is_refused_up_front(checkpoints: dict[str, Path], tmp_path: Path, model: str,
                                                        flags: dict[str, Any], match: str) -> None:
    source = checkpoints.get(model, model)
    with pytest.raises(MoeforgeError, match=match):
        _compile(Path(source), tmp_path / "out", stream=True, **flags)
    assert not (tmp_path / "out").exists()
