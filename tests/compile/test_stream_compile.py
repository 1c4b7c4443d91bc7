"""``moeforge compile --stream``: the model is traced on the meta device and each weight is read, transformed and
written one at a time. The artifact holds the same tensors, byte for byte, as the in-memory compile's (so the same
graph runs: checked against PyTorch here too); weights are read only while the artifact is written, so a bad
weight fails the compile then and leaves nothing; what needs the whole model is refused up front."""

from __future__ import annotations

import hashlib
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
from moeforge.core.safe_paths import create_owned_dir
from moeforge.model.lazy_weights import LazyWeights, open_lazy_model
from moeforge.model.loader import load_model
from moeforge.model.tokenizer import Tokenizer
from moeforge.verify.layered_reference import layered_forward
from moeforge.verify.parity import compare_with_reference, default_prompt, torch_hidden_states, torch_reference

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
    Tokenizer.byte_level(300, 256, 257).save(folder)  # for the --calib prompts
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
    eager = _compile(checkpoints[case], tmp_path / "eager", stream=False, **flags)
    streamed = _compile(checkpoints[case], tmp_path / "stream", stream=True, **flags)
    assert (eager / "model.onnx.data").read_bytes() == (streamed / "model.onnx.data").read_bytes()
    assert _tensors(eager) == _tensors(streamed)
    assert _ops(eager) == _ops(streamed)
    manifests = [json.loads((a / "manifest.json").read_text()) for a in (eager, streamed)]
    for key in ("inputs", "outputs", "kv_cache", "precision", "quantization", "layer_outputs", "model_config"):
        assert manifests[0][key] == manifests[1][key], key


CALIBRATED = [({"quant": "int4-awq"}, "deepseek-v3-fp8"), ({"quant": "w8a8"}, "llama-tied"),
              ({"quant": "int8", "keep_fp": 0.25}, "llama-tied"), ({"kv_quant": "int8"}, "deepseek-v3-fp8"),
              ({"quant": "w8a8", "kv_quant": "int8", "calib_method": "percentile"}, "deepseek-v3-fp8")]


@pytest.fixture(scope="module")
def calib_prompts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("calib") / "prompts.txt"
    path.write_text("The quick brown fox jumps over the lazy dog.\nMixture of experts routes each token.\n"
                    "Pipelines stream weights from disk, one tensor at a time.\n")
    return path


@pytest.mark.parametrize(("flags", "case"), CALIBRATED, ids=["int4-awq", "w8a8", "keep-fp", "kv-int8", "w8a8-kv"])
def test_a_streamed_calibrated_compile_equals_the_in_memory_one(checkpoints: dict[str, Path], tmp_path: Path,
                                                                calib_prompts: Path, case: str,
                                                                flags: dict[str, Any]) -> None:
    """AWQ, SmoothQuant/static activation ranges, --keep-fp sensitivity and the int8 KV scales run the graph over
    the --calib prompts; streamed, ONNX Runtime maps the weights from a scratch file written one tensor at a time.
    The same numbers come out: the same bytes and the same manifest (scales, kept weights, AWQ alphas), and no
    scratch file is left beside the artifact."""
    flags = {**flags, "calib": str(calib_prompts)}
    eager = _compile(checkpoints[case], tmp_path / "eager", stream=False, **flags)
    streamed = _compile(checkpoints[case], tmp_path / "stream", stream=True, **flags)
    assert (eager / "model.onnx.data").read_bytes() == (streamed / "model.onnx.data").read_bytes()
    assert _tensors(eager) == _tensors(streamed)
    manifests = [json.loads((a / "manifest.json").read_text()) for a in (eager, streamed)]
    assert manifests[0]["quantization"] == manifests[1]["quantization"]
    summary = manifests[1]["quantization"]
    assert 3 in (summary.get("calibration_prompts"), summary.get("kv_cache", {}).get("calibration_prompts"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eager", "stream"]  # no .moeforge-calib-* left


def test_a_streamed_calibration_reads_one_layer_at_a_time(checkpoints: dict[str, Path], tmp_path: Path,
                                                          calib_prompts: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The calibration graph's weights go to the scratch file one tensor at a time, as the artifact's do: the
    arrays read from the checkpoint alive at once never exceed one layer's weights."""
    alive: dict[int, int] = {}
    peak = [0]
    original = LazyWeights.read

    def tracked(self: LazyWeights, name: str) -> np.ndarray:
        array = original(self, name)
        alive[id(array)] = array.nbytes
        peak[0] = max(peak[0], sum(alive.values()))
        weakref.finalize(array, alive.pop, id(array), None)
        return array

    from moeforge.quant import calibration

    saved = []
    original_save = calibration._save_with_bar
    monkeypatch.setattr(calibration, "_save_with_bar", lambda *a: (saved.append(a[1]), original_save(*a)))
    monkeypatch.setattr(LazyWeights, "read", tracked)
    folder = checkpoints["deepseek-v3-fp8"]
    _compile(folder, tmp_path / "stream", stream=True, quant="int4-awq", calib=str(calib_prompts))
    # Beside the artifact, named as the artifact writer's scratch: a killed compile's is removed by the next one.
    assert saved and all(path.parent.parent == tmp_path and path.parent.name.startswith(".stream.moeforge-tmp.")
                         for path in saved)
    _, weights = open_lazy_model(str(folder))
    sizes = {name: int(np.prod(weights.shape(name))) * 4 for name in weights.checkpoint.keys()}
    layers = [sum(b for n, b in sizes.items() if n.startswith(f"model.layers.{i}.")) for i in range(DS3.layers)]
    one_layer = max(max(layers), *(b for n, b in sizes.items() if not n.startswith("model.layers.")))
    assert 0 < peak[0] <= one_layer < sum(sizes.values()), (peak[0], one_layer, sum(sizes.values()))


@pytest.mark.parametrize("flags", [{"dtype": "fp16"}, {"dtype": "bf16", "quant": "int8"}], ids=["fp16", "bf16-int8"])
def test_a_streamed_tensorrt_compile_equals_the_in_memory_one(checkpoints: dict[str, Path], tmp_path: Path,
                                                              flags: dict[str, Any]) -> None:
    """--target trt streamed: the precision pass converts each weight when it is written (no serialised copy of
    the graph), the engine's golden run maps the weights (bf16: an fp32 copy written one tensor at a time, then
    removed) and TensorRT-RTX reads them through a mapping. Same ONNX bytes and golden logits as the in-memory
    compile, a plan built, nothing left over."""
    pytest.importorskip("tensorrt_rtx_bindings")
    eager = _compile(checkpoints["llama-tied"], tmp_path / "eager", stream=False, target="trt", **flags)
    streamed = _compile(checkpoints["llama-tied"], tmp_path / "stream", stream=True, target="trt", **flags)
    assert (eager / "model.onnx.data").read_bytes() == (streamed / "model.onnx.data").read_bytes()
    assert _tensors(eager) == _tensors(streamed)
    from moeforge.verify.golden import load_golden

    np.testing.assert_array_equal(load_golden(eager)[1], load_golden(streamed)[1])
    for artifact in (eager, streamed):
        manifest = json.loads((artifact / "manifest.json").read_text())
        assert (artifact / "model.plan").stat().st_size == manifest["engine"]["plan_bytes"] > 0
        assert not [p.name for p in artifact.iterdir() if "fp32" in p.name]  # the bf16 golden's copy is gone


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


@pytest.mark.parametrize("flags", [{}, {"quant": "int4"}], ids=["fp32", "int4"])
def test_weights_are_read_one_at_a_time_while_the_artifact_is_written(checkpoints: dict[str, Path], tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch,
                                                                      flags: dict[str, Any]) -> None:
    """While the artifact is written, the arrays read from the checkpoint that are alive at once never exceed one
    layer's weights (each transform reads what it combines, e.g. q/k/v, and drops it before the next), whatever the
    number of layers; routed experts are read one expert at a time and never whole (at most an expert's gate and up
    at once, for fc1's interleave), through the MoE lowering and the per-expert quantisation (QMoE). The in-memory
    compile holds every weight at once."""
    alive: dict[int, int] = {}
    experts_alive: dict[int, int] = {}
    peak, expert_peak = [0], [0]
    names: set[str] = set()
    read, read_expert = LazyWeights.read, LazyWeights.read_expert

    def track(array: np.ndarray, pool: dict[int, int], high: list[int]) -> None:
        pool[id(array)] = array.nbytes
        high[0] = max(high[0], sum(pool.values()))
        weakref.finalize(array, pool.pop, id(array), None)

    def tracked(self: LazyWeights, name: str) -> np.ndarray:
        array = read(self, name)
        names.add(name)
        track(array, alive, peak)
        return array

    def tracked_expert(self: LazyWeights, name: str, e: int) -> np.ndarray:
        array = read_expert(self, name, e)
        names.add(f"{name}[{e}]")
        track(array, alive, peak)
        track(array, experts_alive, expert_peak)
        return array

    monkeypatch.setattr(LazyWeights, "read", tracked)
    monkeypatch.setattr(LazyWeights, "read_expert", tracked_expert)
    folder = checkpoints["deepseek-v3-fp8"]
    _compile(folder, tmp_path / "stream", stream=True, **flags)
    _, weights = open_lazy_model(str(folder))
    sizes = {name: int(np.prod(weights.shape(name))) * 4 for name in weights.checkpoint.keys()}
    layers = [sum(b for n, b in sizes.items() if n.startswith(f"model.layers.{i}.")) for i in range(DS3.layers)]
    one_layer = max(max(layers), *(b for n, b in sizes.items() if not n.startswith("model.layers.")))
    assert 0 < peak[0] <= one_layer < sum(sizes.values()), (peak[0], one_layer, sum(sizes.values()))
    stacks = [n for n in weights.checkpoint.keys() if weights.is_expert_stack(n)]
    assert stacks and not names & set(stacks)  # never read whole ...
    one_expert = max(sizes[n] // weights.shape(n)[0] for n in stacks)
    assert 0 < expert_peak[0] <= 2 * one_expert  # ... but expert by expert
    every = {n for n in weights.checkpoint.keys() if n not in stacks} | {
        f"{n}[{e}]" for n in stacks for e in range(weights.shape(n)[0])}
    assert names >= every  # every checkpoint tensor (every expert) went into the artifact


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
    ("tiny-llama", {}, "preset model"),
])
def test_what_needs_the_whole_model_is_refused_up_front(checkpoints: dict[str, Path], tmp_path: Path, model: str,
                                                        flags: dict[str, Any], match: str) -> None:
    source = checkpoints.get(model, model)
    with pytest.raises(MoeforgeError, match=match):
        _compile(Path(source), tmp_path / "out", stream=True, **flags)
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------ parity of a model larger than memory
@pytest.mark.parametrize("case", ["deepseek-v3-fp8", "llama-tied"])
def test_the_layered_reference_equals_the_model_loaded_whole(checkpoints: dict[str, Path], case: str) -> None:
    """One pass with one layer resident gives the whole model's logits and layer outputs; over the prompt and the
    greedy tokens it gives what incremental decoding with a cache gave at each step (teacher forcing)."""
    folder = str(checkpoints[case])
    loaded = load_model(folder)
    _, weights = open_lazy_model(folder)
    prompt = default_prompt(loaded.config.vocab_size, 9, seed=4)
    reference = torch_reference(loaded.model, prompt, 6)
    layered = layered_forward(weights, [*prompt, *reference.tokens[:6]])
    np.testing.assert_allclose(layered.logits[:9], reference.logits[0], rtol=1e-5, atol=1e-5)
    for step in range(6):
        np.testing.assert_allclose(layered.logits[9 + step], reference.logits[1 + step][0], rtol=1e-4, atol=1e-4)
    whole = torch_hidden_states(loaded.model, prompt)
    assert len(layered.hidden) == len(whole) == loaded.config.num_hidden_layers
    for ours, theirs in zip(layered.hidden, whole, strict=True):
        np.testing.assert_allclose(ours[:9], theirs, rtol=1e-5, atol=1e-5)


def test_the_layered_reference_holds_one_layer_at_a_time(checkpoints: dict[str, Path],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The modules filled from the checkpoint never hold more than one layer's weights at once."""
    from moeforge.verify import layered_reference

    alive: dict[int, int] = {}
    peak = [0]
    original = layered_reference.materialise

    def tracked(meta: torch.nn.Module, prefix: str, weights: LazyWeights) -> torch.nn.Module:
        module = original(meta, prefix, weights)
        alive[id(module)] = sum(t.nbytes for t in [*module.parameters(), *module.buffers()])
        peak[0] = max(peak[0], sum(alive.values()))
        weakref.finalize(module, alive.pop, id(module), None)
        return module

    monkeypatch.setattr(layered_reference, "materialise", tracked)
    _, weights = open_lazy_model(str(checkpoints["deepseek-v3-fp8"]))
    layered_forward(weights, [1, 2, 3, 4])
    sizes = {name: int(np.prod(weights.shape(name))) * 4 for name in weights.checkpoint.keys()}
    largest_layer = max(sum(b for n, b in sizes.items() if n.startswith(f"model.layers.{i}."))
                        for i in range(DS3.layers))
    assert 0 < peak[0] <= largest_layer < sum(sizes.values()) / 2


@pytest.mark.parametrize("flags", [{}, {"quant": "int8"}, {"kv_cache": "paged"}], ids=["fp32", "int8", "paged"])
def test_stream_check_runs_pytorch_layer_by_layer_and_passes(checkpoints: dict[str, Path], tmp_path: Path,
                                                             flags: dict[str, Any]) -> None:
    options = CompileOptions.from_flags(model=str(checkpoints["deepseek-v3-fp8"]), output_dir=tmp_path / "out",
                                        progress=False, force=True, stream=True, check=True, **flags)
    result = compile_model(options)
    assert result.parity is not None and result.parity.passed, result.parity
    assert result.parity.decode_steps == options.check_steps
    assert result.parity.greedy_match or "quant" in flags  # int8 may pick another token once logits tie closely


def test_parity_stream_finds_a_wrong_layer(checkpoints: dict[str, Path], tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """``moeforge parity --stream --per-layer`` passes on the streamed artifact; against a checkpoint whose layer 1
    differs it fails and names layer 1."""
    from moeforge.cli import main

    artifact = _compile(checkpoints["deepseek-v3-fp8"], tmp_path / "stream", stream=True)
    argv = ["parity", str(artifact), "--stream", "--per-layer", "--steps", "4", "--json"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["passed"] and result["stream"] and result["first_diverging_layer"] is None
    original = LazyWeights.read

    def wrong_layer_1(self: LazyWeights, name: str) -> np.ndarray:
        array = original(self, name)
        return array * 1.5 if name == "model.layers.1.self_attn.o_proj.weight" else array

    monkeypatch.setattr(LazyWeights, "read", wrong_layer_1)
    assert main(argv) == 1
    result = json.loads(capsys.readouterr().out)
    assert not result["passed"] and result["first_diverging_layer"] == 1


@pytest.mark.parametrize(("extra", "match"), [(["--reference", "transformers"], "--stream runs moeforge"),
                                              (["--model", "tiny-llama"], "preset model")])
def test_parity_stream_refuses_what_loads_whole(checkpoints: dict[str, Path], tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str], extra: list[str],
                                                match: str) -> None:
    from moeforge.cli import main

    artifact = _compile(checkpoints["llama-tied"], tmp_path / "stream", stream=True)
    assert main(["parity", str(artifact), "--stream", *extra]) != 0
    assert match in capsys.readouterr().err


# ------------------------------------------------------------------------------------ per-rank streamed compile
def _tensor_digests(artifact: Path) -> list[tuple[tuple[int, ...], str]]:
    """Every initializer as (shape, sha1 of its bytes), sorted: the tensors whatever their names and order."""
    from onnx import numpy_helper

    graph = onnx.load(str(artifact / "model.onnx")).graph
    return sorted((tuple(t.dims), hashlib.sha1(numpy_helper.to_array(t).tobytes()).hexdigest())
                  for t in graph.initializer)


@pytest.mark.parametrize(("tp", "ep", "quant"), [(2, 2, None), (2, 1, None), (2, 2, "int4-asym")])
def test_each_streamed_rank_reads_its_slices_and_holds_the_in_memory_ranks_tensors(
        checkpoints: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tp: int, ep: int,
        quant: str | None) -> None:
    """``--stream --tp/--ep``: every rank's tensors equal the in-memory sharded compile's (the same bytes; the
    generated constants' names and order aside), and each rank reads only its slices of the checkpoint: about
    1/tp of the sharded weights plus the replicated ones, never the whole."""
    folder = checkpoints["deepseek-v3-fp8"]
    eager = _compile(folder, tmp_path / "eager", stream=False, tp=tp, ep=ep, quant=quant)
    read_by: dict[int, dict[str, int]] = {}  # per rank's weights: the bytes of each tensor it read (once each)
    original, original_expert = LazyWeights.read, LazyWeights.read_expert

    def counted(self: LazyWeights, name: str) -> np.ndarray:
        array = original(self, name)
        if self.stored(name) is not None:
            read_by.setdefault(id(self), {})[name] = array.nbytes
        return array

    def counted_expert(self: LazyWeights, name: str, e: int) -> np.ndarray:  # routed experts: one at a time
        array = original_expert(self, name, e)
        read_by.setdefault(id(self), {})[f"{name}[{e}]"] = array.nbytes
        return array

    monkeypatch.setattr(LazyWeights, "read", counted)
    monkeypatch.setattr(LazyWeights, "read_expert", counted_expert)
    streamed = _compile(folder, tmp_path / "stream", stream=True, tp=tp, ep=ep, quant=quant)
    for rank in range(tp):
        assert _tensor_digests(eager / f"rank{rank}") == _tensor_digests(streamed / f"rank{rank}")
        assert _ops(eager / f"rank{rank}") == _ops(streamed / f"rank{rank}")
    _, weights = open_lazy_model(str(folder))
    total = weights.total_bytes()
    assert len(read_by) == tp
    assert all(0.3 * total < sum(n.values()) < 0.75 * total for n in read_by.values()), (read_by, total)


def test_read_slice_reads_the_slice_of_fp8_blocks_and_stacked_experts(checkpoints: dict[str, Path]) -> None:
    """``HFCheckpoint.read_slice`` equals the slice of the whole tensor: FP8 rows and columns that start and end
    inside a 128-block, whole experts of a stacked tensor, a slice of every expert."""
    _, weights = open_lazy_model(str(checkpoints["deepseek-v3-fp8"]))
    checkpoint = weights.checkpoint
    cases = [("model.layers.0.mlp.gate_proj.weight", 0, 37, 161),  # [512, 256]
             ("model.layers.0.mlp.down_proj.weight", 1, 100, 300),  # [256, 512]
             ("model.layers.1.mlp.shared_experts.down_proj.weight", 1, 48, 96),  # [256, 96]: a partial last block
             ("model.layers.1.mlp.experts.up_proj", 0, 2, 6),
             ("model.layers.1.mlp.experts.down_proj", 2, 5, 70),
             ("model.embed_tokens.weight", 0, 300, 600)]
    for name, dim, start, stop in cases:
        whole = checkpoint.read(name)
        assert torch.equal(checkpoint.read_slice(name, dim, start, stop), whole.narrow(dim, start, stop - start)), name


# ------------------------------------------------------------------------ a killed sharded compile continues
def test_a_killed_sharded_compile_continues_from_the_ranks_written(checkpoints: dict[str, Path], tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Interrupted while writing rank 1, the compile keeps rank 0 in its partial directory; the same command again
    builds only rank 1 and gives the same ranks as an uninterrupted compile. Other options start over; an error
    (not an interruption) leaves nothing."""
    from moeforge.compile import sharded_compile
    from moeforge.compile.partial_compile import partial_dir

    folder, out = checkpoints["deepseek-v3-fp8"], tmp_path / "out"
    built: list[int] = []
    interrupt = [True]
    original = sharded_compile.build_rank

    def build(options: CompileOptions, loaded: Any, weights: Any, rank: int, root: Path, bar: Any) -> None:
        if rank == 1 and interrupt[0]:  # the first attempt dies in rank 1 (rank 0 is written)
            interrupt[0] = False
            raise KeyboardInterrupt
        built.append(rank)
        original(options, loaded, weights, rank, root, bar)

    monkeypatch.setattr(sharded_compile, "build_rank", build)
    with pytest.raises(KeyboardInterrupt):
        _compile(folder, out, stream=True, tp=2, ep=2)
    partial = partial_dir(out.absolute())
    assert not out.exists() and sorted(p.name for p in partial.iterdir()) == [".moeforge-owned", "rank0", "resume.json"]
    built.clear()
    _compile(folder, out, stream=True, tp=2, ep=2)
    assert built == [1] and not partial.exists()  # rank 0 was kept, not rebuilt
    fresh = _compile(folder, tmp_path / "fresh", stream=True, tp=2, ep=2)
    for rank in range(2):
        assert _tensor_digests(out / f"rank{rank}") == _tensor_digests(fresh / f"rank{rank}")
    # A partial directory of other options is cleared: every rank is built again.
    create_owned_dir(partial)  # as a compile makes it: only a folder moeforge owns is resumed or cleared
    (partial / "rank0").mkdir()
    (partial / "resume.json").write_text('{"fingerprint": "another compile", "tp": 2}')
    built.clear()
    _compile(folder, out, stream=True, tp=2, ep=2, force=True)
    assert built == [0, 1]

    def fail(*_args: Any) -> None:
        raise CheckpointError("a corrupt weight")

    monkeypatch.setattr(sharded_compile, "build_rank", fail)
    with pytest.raises(CheckpointError):
        _compile(folder, tmp_path / "failed", stream=True, tp=2, ep=2)
    assert not (tmp_path / "failed").exists() and not partial_dir(tmp_path / "failed").exists()


def test_workers_build_the_ranks_in_parallel_processes(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    folder = checkpoints["deepseek-v3-fp8"]
    sequential = _compile(folder, tmp_path / "one", stream=True, tp=2, ep=2)
    parallel = _compile(folder, tmp_path / "two", stream=True, tp=2, ep=2, workers=2)
    for rank in range(2):
        assert _tensor_digests(sequential / f"rank{rank}") == _tensor_digests(parallel / f"rank{rank}")


@pytest.mark.parametrize(("flags", "match"), [({"workers": 2}, "needs --tp"),
                                              ({"workers": 2, "tp": 2, "stream": False}, "needs --tp .* and --stream"),
                                              ({"workers": 2, "tp": 2, "max_memory": 768 * MIB},
                                               "x 2 workers.*use --workers 1")])
def test_workers_are_refused_where_they_do_not_fit(checkpoints: dict[str, Path], tmp_path: Path,
                                                   flags: dict[str, Any], match: str) -> None:
    flags = {"stream": True, **flags}
    with pytest.raises(MoeforgeError, match=match):
        _compile(checkpoints["deepseek-v3-fp8"], tmp_path / "out", **flags)
    assert not (tmp_path / "out").exists()


_KILLED_IN_RANK_1 = """
import os, signal, sys
from pathlib import Path
from moeforge.compile import sharded_compile
from moeforge.compile.driver import CompileOptions, compile_model
original = sharded_compile.build_rank
def build(options, loaded, weights, rank, root, bar):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer would: no handler, no cleanup
    original(options, loaded, weights, rank, root, bar)
sharded_compile.build_rank = build
compile_model(CompileOptions.from_flags(model=sys.argv[1], output_dir=Path(sys.argv[2]), max_seq_len=64,
                                        progress=False, stream=True, tp=2, ep=2))
"""


def test_a_sigkilled_sharded_compile_continues_from_its_partial_directory(
        checkpoints: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A process killed with SIGKILL while writing rank 1 leaves rank 0 in the partial directory; the same compile
    run again builds rank 1 only."""
    import signal
    import subprocess

    from moeforge.compile import sharded_compile
    from moeforge.compile.partial_compile import partial_dir

    folder, out = checkpoints["deepseek-v3-fp8"], tmp_path / "out"
    killed = subprocess.run([sys.executable, "-c", _KILLED_IN_RANK_1, str(folder), str(out)], capture_output=True,
                            text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    partial = partial_dir(out.absolute())
    assert not out.exists() and (partial / "rank0" / "manifest.json").is_file()
    built: list[int] = []
    original = sharded_compile.build_rank

    def build(options: CompileOptions, loaded: Any, weights: Any, rank: int, root: Path, bar: Any) -> None:
        built.append(rank)
        original(options, loaded, weights, rank, root, bar)

    monkeypatch.setattr(sharded_compile, "build_rank", build)
    _compile(folder, out, stream=True, tp=2, ep=2)
    assert built == [1] and not partial.exists() and (out / "sharded.json").is_file()
