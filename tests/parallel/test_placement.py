"""Expert placement (issue 37): ``compile --tp 2 --ep 2 --placement PLAN`` with replicas of an expert on both ranks.

Per MoE family (DeepSeek-V3 group-limited sigmoid, Qwen3-MoE softmax top-k, Kimi-K2), real rank processes run 8
concurrent greedy requests: the tokens equal the unsharded artifact's and PyTorch's, ``moeforge parity`` finds the
logits within 1e-4 of PyTorch, the routed load summed over replicas equals PyTorch's router on the tokens the model
ran, and both replicas of a replicated expert take a share of its tokens. Then the user's workflow end to end
(``run --expert-load-out`` -> ``eplb`` -> ``compile --placement`` -> ``run``/``bench``), the streamed compile, and
plans that do not fit being refused before anything is written.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from moeforge.compile.driver import CompileOptions, compile_model
from moeforge.compile.sharded_compile import read_sharded
from moeforge.core.errors import MoeforgeError
from moeforge.model.expert_slots import EMPTY, ExpertSlots, PlacementError, load_plan
from moeforge.model.loader import load_model
from moeforge.model.moe import route_to_replicas
from moeforge.parallel.eplb import Placement, write_plan
from moeforge.runtime.engine import BackendOptions, EngineConfig, LLMEngine, SchedulingOptions
from moeforge.runtime.sampler import SamplingParams
from moeforge.verify.parity import torch_reference
from tests.compile.sharded_driver import PROMPTS
from tests.compile.test_sharded import LAUNCH_TIMEOUT_S, MAX_TOKENS, _launch
from tests.conftest import pytorch_router_counts

pytestmark = pytest.mark.heavy


PRESETS = ["tiny-deepseek-v3", "tiny-qwen3-moe", "tiny-kimi-k2"]
CLI = [sys.executable, "-P", "-m", "moeforge.cli"]


def cross_rank_plan(load: np.ndarray) -> Placement:
    """Two ranks, two redundant slots: each rank holds its half of the experts in reverse order (slot != expert id)
    plus a replica of the other half's heaviest expert, so a replicated expert lives on both ranks."""
    layers, experts = load.shape
    half = experts // 2
    rows = []
    for layer in range(layers):
        heavy0 = int(np.argmax(load[layer, :half]))
        heavy1 = half + int(np.argmax(load[layer, half:]))
        rows.append([*range(half - 1, -1, -1), heavy1, *range(experts - 1, half - 1, -1), heavy0])
    table = np.array(rows)
    count = np.stack([np.bincount(row, minlength=experts) for row in table])
    return Placement("global", 2, 2, 1, 1, load, table, count)


def _engine_run(artifact: Path) -> tuple[list[list[int]], np.ndarray]:
    engine = LLMEngine.from_artifact(artifact, EngineConfig(scheduling=SchedulingOptions(max_num_seqs=8),
                                                            backend=BackendOptions(threads=1, track_expert_load=True)))
    outputs = engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    load = engine.expert_load()
    assert load is not None
    return [list(o.token_ids) for o in outputs], load


@pytest.fixture(scope="session")
def placed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Per preset: the unsharded artifact, its tokens and expert load, the plan, and the placed 2-rank artifact."""
    root = tmp_path_factory.mktemp("placement")
    out: dict[str, dict[str, Any]] = {}
    for preset in PRESETS:
        single = compile_model(CompileOptions.from_flags(model=preset, output_dir=root / f"{preset}-single",
                                                         max_seq_len=128, progress=False)).output_dir
        tokens, load = _engine_run(single)
        plan = cross_rank_plan(load)
        plan_file = root / f"{preset}-plan.json"
        write_plan(plan, plan_file)
        sharded = compile_model(CompileOptions.from_flags(model=preset, output_dir=root / f"{preset}-placed", tp=2,
                                                          ep=2, placement=plan_file, max_seq_len=128,
                                                          progress=False)).output_dir
        out[preset] = {"single": single, "tokens": tokens, "load": load, "plan": plan, "plan_file": plan_file,
                       "sharded": sharded}
    return out


@pytest.mark.parametrize("preset", PRESETS)
def test_placed_ranks_give_the_unsharded_tokens_and_split_replicated_load(preset: str, placed: dict[str, Any],
                                                                         tmp_path: Path) -> None:
    case = placed[preset]
    out, stats = tmp_path / "tokens.json", tmp_path / "load.json"
    results = _launch(case["sharded"], out, "--expert-load", str(stats))
    assert [code for code, _ in results] == [0, 0], [err[-2000:] for _, err in results]
    tokens = json.loads(out.read_text())
    assert tokens == case["tokens"]
    model = load_model(preset, mla_impl="absorb").model
    assert tokens == [torch_reference(model, prompt, MAX_TOKENS - 1).tokens for prompt in PROMPTS]

    measured = json.loads(stats.read_text())
    logical, ranks, slots = (np.array(measured[k]) for k in ("logical", "ranks", "slots"))
    ran = [prompt + generated[:-1] for prompt, generated in zip(PROMPTS, tokens, strict=True)]
    np.testing.assert_array_equal(logical, pytorch_router_counts(preset, ran))  # replicas summed = PyTorch's routing
    np.testing.assert_array_equal(logical, case["load"])
    table = case["plan"].physical_to_logical
    assert slots.shape == table.shape
    np.testing.assert_array_equal(ranks, slots.reshape(len(slots), 2, -1).sum(axis=2))
    for layer, row in enumerate(table):
        half = len(row) // 2
        for expert in {int(row[half - 1]), int(row[-1])}:  # the replicated experts: one slot on each rank
            where = np.flatnonzero(row == expert)
            assert len(where) == 2 and where[0] < half <= where[1]
            shares = slots[layer, where]
            assert shares.sum() == logical[layer, expert]
            assert (shares > 0).all(), (layer, expert, shares)  # the router's choice is split between replicas


@pytest.mark.parametrize("preset", PRESETS)
def test_placed_parity_cli_within_1e4(preset: str, placed: dict[str, Any]) -> None:
    """``moeforge parity`` on the placed artifact: its logits against PyTorch's (64-token prompt, 16 decode steps)."""
    proc = subprocess.run([*CLI, "parity", str(placed[preset]["sharded"]), "--json", "--prompt-len", "64",
                           "--steps", "16"], capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["ep"] == 2 and report["greedy_match"] is True
    assert report["max_abs_err"] <= 1e-4


def test_the_placement_is_recorded_and_each_rank_holds_its_slots(placed: dict[str, Any]) -> None:
    case = placed["tiny-deepseek-v3"]
    manifest = read_sharded(case["sharded"])
    slots = manifest.expert_slots()
    assert slots is not None
    np.testing.assert_array_equal(np.array(slots.physical_to_logical), case["plan"].physical_to_logical)
    # Each rank's stacked expert weights hold slots_per_rank experts: E/2 + 1 with two redundant slots.
    experts = int(manifest.model_config["moe"]["n_routed_experts"])
    for rank in range(2):
        graph = onnx.load(str(case["sharded"] / f"rank{rank}" / "model.onnx"), load_external_data=False).graph
        stacked = {t.dims[0] for t in graph.initializer if ".experts." in t.name}
        assert stacked == {experts // 2 + 1}, stacked


def test_inspect_shows_the_split_and_the_replicas(placed: dict[str, Any], tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """``moeforge inspect`` on the sharded directory: every rank's share and, per MoE layer, which ranks hold each
    replicated expert; ``--json`` is sharded.json; a rank from another compile is refused."""
    import shutil

    from moeforge.cli.commands import main

    case = placed["tiny-deepseek-v3"]
    assert main(["inspect", str(case["sharded"])]) == 0
    text = capsys.readouterr().out
    assert "split      tp 2, ep 2" in text and "slots" in text
    for layer, row in enumerate(case["plan"].physical_to_logical):
        half = len(row) // 2
        expected = sorted({int(row[half - 1]), int(row[-1])})
        assert f"MoE layer {layer}: " + "; ".join(f"{e}: 0,1" for e in expected) in text
    assert main(["inspect", str(case["sharded"]), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads((case["sharded"] / "sharded.json").read_text())

    mixed = tmp_path / "mixed"
    shutil.copytree(case["sharded"], mixed)
    shutil.rmtree(mixed / "rank1")
    shutil.copytree(placed["tiny-qwen3-moe"]["sharded"] / "rank1", mixed / "rank1")
    assert main(["inspect", str(mixed)]) == 2
    assert "rank directory from another compile" in capsys.readouterr().err


def test_the_users_workflow_from_measured_load_to_a_balanced_run(placed: dict[str, Any], tmp_path: Path) -> None:
    """``run --expert-load-out`` -> ``eplb`` (groups from the statistics) -> ``compile --placement`` -> the sharded
    ``run --expert-load-out`` and ``bench`` report the per-rank load; tokens unchanged."""
    single = placed["tiny-deepseek-v3"]["single"]
    prompt = ["--prompt-ids", "5,17,200,3,99,41,7,7,300,12", "--max-new-tokens", "16", "--ignore-eos", "--json"]
    stats = tmp_path / "stats.json"
    first = subprocess.run([*CLI, "run", str(single), *prompt, "--expert-load-out", str(stats)],
                           capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert first.returncode == 0, first.stderr[-2000:]
    record = json.loads(stats.read_text())
    assert record["format"] == "moeforge-expert-load" and record["groups"] == 4
    assert record["artifact_sha256"] == hashlib.sha256((single / "manifest.json").read_bytes()).hexdigest()
    assert np.array(record["layers"]).sum() > 0

    plan = tmp_path / "plan.json"
    subprocess.run([*CLI, "eplb", str(stats), "-o", str(plan), "--ep", "2", "--redundant", "2"], check=True,
                   capture_output=True, timeout=120)
    written = json.loads(plan.read_text())
    assert written["groups"] == 4 and written["artifact_sha256"] == record["artifact_sha256"]
    placed_dir = tmp_path / "placed"
    subprocess.run([*CLI, "compile", "tiny-deepseek-v3", "-o", str(placed_dir), "--tp", "2", "--ep", "2",
                    "--placement", str(plan), "--max-seq-len", "128"], check=True, capture_output=True,
                   timeout=LAUNCH_TIMEOUT_S)
    after = tmp_path / "after.json"
    second = subprocess.run([*CLI, "run", str(placed_dir), *prompt, "--expert-load-out", str(after)],
                            capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert second.returncode == 0, second.stderr[-2000:]
    assert json.loads(second.stdout)["token_ids"] == json.loads(first.stdout)["token_ids"]
    measured = json.loads(after.read_text())
    assert measured["layers"] == record["layers"]  # the same routing, summed over the replicas
    rank_load = np.array(measured["rank_load"])
    assert rank_load.shape == (len(record["layers"]), 2) and (rank_load > 0).all()
    assert measured["rank_imbalance"] == pytest.approx(list(rank_load.max(axis=1) / rank_load.mean(axis=1)),
                                                       abs=1e-5)

    bench = subprocess.run([*CLI, "bench", str(placed_dir), "--no-compare", "--json", "--batch", "2",
                            "--prompt-len", "8", "--new-tokens", "4"], capture_output=True, text=True,
                           timeout=LAUNCH_TIMEOUT_S)
    assert bench.returncode == 0, bench.stderr[-2000:]
    experts = json.loads(bench.stdout)["moeforge_onnxruntime"]["expert_load"]
    assert len(experts["rank_imbalance"]) == len(record["layers"])
    assert all(1.0 <= x <= 2.0 for x in experts["rank_imbalance"])


def test_the_sharded_roofline_sums_each_ranks_bytes_and_reads_only_its_routed_experts(placed: dict[str, Any],
                                                                                       tmp_path: Path) -> None:
    """``bench --roofline`` of the placed tp 2 / ep 2 artifact: each rank's step bytes from its own graph, summed.
    At batch 1 a token's top-k experts are each computed by exactly one rank (one replica), so the ranks together
    compute top-k experts per layer and read the same routed-expert bytes as the unsharded artifact; the experts
    held are every physical slot."""
    case = placed["tiny-deepseek-v3"]
    env = {**os.environ, "MOEFORGE_CACHE_DIR": str(tmp_path)}

    def roofline(artifact: Path) -> dict[str, Any]:
        done = subprocess.run([*CLI, "bench", str(artifact), "--no-compare", "--json", "--batch", "1",
                               "--prompt-len", "8", "--new-tokens", "6", "--roofline"], capture_output=True,
                              text=True, timeout=LAUNCH_TIMEOUT_S, env=env)
        assert done.returncode == 0, done.stderr[-2000:]
        return dict(json.loads(done.stdout)["moeforge_onnxruntime"]["roofline"])

    sharded, single = roofline(case["sharded"]), roofline(case["single"])
    top_k = load_model("tiny-deepseek-v3").config.moe.num_experts_per_tok  # type: ignore[union-attr]
    layers = len(single["experts_per_layer"])
    assert sharded["ranks"] == 2 and len(sharded["rank_step_bytes"]) == 2
    assert sum(sharded["rank_step_bytes"]) == pytest.approx(sharded["step_bytes"], abs=2)
    assert sharded["active_experts_per_layer"] == [top_k] * layers == single["active_experts_per_layer"]
    assert sharded["experts_per_layer"] == [case["plan"].physical_to_logical.shape[1]] * layers
    assert sharded["active_expert_bytes"] == pytest.approx(single["active_expert_bytes"], rel=1e-6)
    assert all(0 < b < single["step_bytes"] for b in sharded["rank_step_bytes"])  # tp halves what ranks split


def test_served_placement_reports_per_rank_load_and_writes_statistics_at_exit(placed: dict[str, Any],
                                                                             tmp_path: Path) -> None:
    """``moeforge serve`` of the placed artifact: /metrics has the per-rank load of every MoE layer (each routing
    choice computed by exactly one rank; the gauge is its max / mean) beside the logical load, which equals PyTorch's
    router on the tokens served; SIGTERM writes ``--expert-load-out`` with the same counts."""
    import signal

    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from moeforge.parallel.net import free_port
    from tests.conftest import wait_healthy

    case = placed["tiny-deepseek-v3"]
    port, out = free_port(), tmp_path / "served.json"
    proc = subprocess.Popen([*CLI, "serve", str(case["sharded"]), "--port", str(port), "--expert-load-out", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    prompt = [5, 17, 200, 3, 99, 41, 7, 7]
    try:
        wait_healthy(proc, url)
        reply = httpx.post(url + "/v1/completions", json={"model": case["sharded"].name, "prompt": prompt,
                                                          "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                                                          "return_token_ids": True}, timeout=60).json()
        generated = reply["choices"][0]["token_ids"]
        text = httpx.get(url + "/metrics", timeout=30).text  # the loop publishes once the engine is idle
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    families = {f.name: f for f in text_string_to_metric_families(text)}
    expected = pytorch_router_counts("tiny-deepseek-v3", [prompt + generated[:-1]])
    logical = np.zeros_like(expected)
    for sample in families["moeforge:expert_routed_tokens"].samples:
        logical[int(sample.labels["layer"]), int(sample.labels["expert"])] = sample.value
    np.testing.assert_array_equal(logical, expected)
    ranks = np.zeros((len(expected), 2))
    for sample in families["moeforge:expert_rank_routed_tokens"].samples:
        ranks[int(sample.labels["layer"]), int(sample.labels["rank"])] = sample.value
    np.testing.assert_array_equal(ranks.sum(axis=1), expected.sum(axis=1))
    assert (ranks > 0).all()
    for sample in families["moeforge:expert_rank_load_imbalance"].samples:
        row = ranks[int(sample.labels["layer"])]
        assert sample.value == pytest.approx(row.max() / row.mean())
    written = json.loads(out.read_text())
    assert written["layers"] == expected.tolist() and written["rank_load"] == ranks.astype(int).tolist()


def _digests(artifact: Path) -> list[tuple[tuple[int, ...], str]]:
    graph = onnx.load(str(artifact / "model.onnx")).graph
    return sorted((tuple(t.dims), hashlib.sha1(numpy_helper.to_array(t).tobytes()).hexdigest())
                  for t in graph.initializer)


def test_the_streamed_placed_compile_holds_the_in_memory_ranks_tensors(tmp_path: Path) -> None:
    """``--stream --placement`` on an FP8 DeepSeek-V3-shaped checkpoint: each rank reads its slots' experts (the
    replicas included) from the file and writes the tensors the in-memory compile does."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import synthetic_deepseek as sd

    folder = tmp_path / "ds3"
    sd.write_checkpoint(folder, sd.deepseek_v3_shape(2, 256, 8, 2, vocab=600, intermediate=512), seed=5,
                        shard_bytes=2**20)
    moe_layers = sum(1 for _ in range(1, 2))  # first_k_dense_replace 1: layer 1 is the MoE layer
    load = np.arange(1, 9, dtype=np.float64)[None].repeat(moe_layers, axis=0) ** 2
    plan = tmp_path / "plan.json"
    write_plan(cross_rank_plan(load), plan)
    flags = dict(tp=2, ep=2, placement=plan, max_seq_len=64, progress=False)
    eager = compile_model(CompileOptions.from_flags(model=str(folder), output_dir=tmp_path / "eager", stream=False,
                                                    **flags)).output_dir
    streamed = compile_model(CompileOptions.from_flags(model=str(folder), output_dir=tmp_path / "stream", stream=True,
                                                       **flags)).output_dir
    for rank in range(2):
        assert _digests(eager / f"rank{rank}") == _digests(streamed / f"rank{rank}")


def _plan_file(tmp_path: Path, table: list[list[int]], ep: int) -> Path:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"format": "moeforge-eplb-plan", "version": 1, "ep": ep,
                                "physical_to_logical": table}))
    return path


@pytest.mark.parametrize(("table", "ep", "flags", "message"), [  # tiny-deepseek-v3: 2 MoE layers of 8 experts
    ([[*range(8), 0, 1]] * 2, 4, {}, "planned for --ep 4"),
    ([[*range(8), 0, 1]] * 3, 2, {}, "has 3 MoE layers"),
    ([[*range(8), 0, 1], [*range(7), 0, 1, 2]], 2, {}, "gives expert 7 no slot"),
    ([[*range(8), 0, 9]] * 2, 2, {}, "holds expert 9"),
    ([[*range(8), 0]] * 2, 2, {}, "not one multiple of --ep 2"),
    ([[*range(8), 0, 1]] * 2, 2, {"tp": 2, "ep": 1}, "it needs --tp N --ep N"),
    ([[*range(8), 0, 1]] * 2, 2, {"model": "tiny-llama"}, "has none: drop --placement"),
], ids=["wrong-ep", "wrong-layers", "missing-expert", "unknown-expert", "uneven-slots", "ep-1", "dense-model"])
def test_a_placement_that_does_not_fit_is_refused_and_leaves_nothing(tmp_path: Path, table: list[list[int]],
                                                                     ep: int, flags: dict[str, Any],
                                                                     message: str) -> None:
    plan = _plan_file(tmp_path, table, ep)
    options = {"model": "tiny-deepseek-v3", "tp": 2, "ep": 2, **flags}
    out = tmp_path / "out"
    with pytest.raises(MoeforgeError, match=message):
        compile_model(CompileOptions.from_flags(output_dir=out, placement=plan, max_seq_len=64, progress=False,
                                                **options))
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]


@pytest.mark.parametrize(("content", "message"), [
    ("not json", "cannot read placement plan"),
    (json.dumps({"format": "something-else"}), "is not an EPLB plan"),
    (json.dumps({"format": "moeforge-eplb-plan", "version": 9}), "version 9 is not supported"),
    (json.dumps({"format": "moeforge-eplb-plan", "version": 1, "ep": 2}), "malformed"),
    (json.dumps({"format": "moeforge-eplb-plan", "version": 1, "ep": 2, "physical_to_logical": [[0.5, 1]]}),
     "2-D integer table"),
])
def test_bad_plan_files_are_refused_with_the_fix(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "plan.json"
    path.write_text(content)
    with pytest.raises(PlacementError, match=message):
        load_plan(path)
    with pytest.raises(PlacementError, match="does not exist"):
        load_plan(tmp_path / "missing.json")


def test_route_to_replicas_keeps_the_expert_and_splits_its_tokens() -> None:
    slots = ExpertSlots(((3, 0, 1, 3, 2, EMPTY),), ep=2)
    logical_to_slot, count = slots.slot_table(0, 4)
    assert count == (1, 1, 1, 2)
    # [T, K]: expert 3 chosen 5 times, 4 of them as the top choice (a position rule t * K + k would send those
    # 4 to one replica).
    ids = torch.tensor([[3, 0], [3, 1], [3, 2], [1, 3], [3, 2]])
    slot = route_to_replicas(ids, torch.tensor(logical_to_slot), torch.tensor(count))
    table = torch.tensor(slots.physical_to_logical[0])
    assert torch.equal(table[slot], ids)  # every choice lands on a slot holding the chosen expert
    hits = torch.bincount(slot.reshape(-1), minlength=6)
    assert sorted([hits[0].item(), hits[3].item()]) == [2, 3]
    np.testing.assert_array_equal(slots.logical_counts(hits.numpy()[None], 4), [[1, 2, 2, 5]])
