"""Pipeline-parallel artifacts (issue 35): compile --pp [--tp], run the stages on torch.distributed (gloo, CPU).

Each case compiles one tiny model split into 2 stages (and, for one, each stage over 2 tensor-parallel ranks) and
launches real rank processes: the engine's greedy tokens for 8 concurrent requests, sent through the stages in
micro-batches, must equal the unsharded artifact's and PyTorch's; ``moeforge parity`` on the directory must be within
1e-4 of PyTorch; each stage's bytes must be the planner's; preemption on a small pool must not change a token; a rank
from another compile and a stage dying mid-step must end every rank with an error, never a hang.
"""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import onnx
import pytest

from moeforge.compile.driver import CompileOptions, compile_model
from moeforge.compile.sharded_compile import read_sharded
from moeforge.core.config import ModelConfig
from moeforge.core.errors import MoeforgeError
from moeforge.model.loader import load_model
from moeforge.model.pipeline_stages import stage_costs
from moeforge.parallel.net import free_port
from moeforge.runtime.engine import BackendOptions, EngineConfig, LLMEngine, SchedulingOptions
from moeforge.runtime.sampler import SamplingParams
from moeforge.verify.parity import torch_reference
from tests.compile.test_sharded import DRIVER, LAUNCH_TIMEOUT_S, MAX_TOKENS, _launch
from tests.conftest import wait_healthy

pytestmark = pytest.mark.heavy

# (preset, pp, tp): GQA; MLA + MoE; MLA + DSA indexer + MoE; MLA + MoE with two tp ranks per stage (4 ranks).
CASES = [("tiny-llama", 2, 1), ("tiny-deepseek-v3", 2, 1), ("tiny-deepseek-v3.2", 2, 1), ("tiny-deepseek-v3", 2, 2)]


def _case_id(case: tuple[str, int, int]) -> str:
    return f"{case[0]}-pp{case[1]}-tp{case[2]}"


@pytest.fixture(scope="session")
def pipeline_artifacts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """Per case: (pipeline artifact, the same model compiled unsharded, paged), compiled once per session."""
    root = tmp_path_factory.mktemp("pipeline")
    singles: dict[str, Path] = {}
    out = {}
    for case in CASES:
        preset, pp, tp = case
        name = _case_id(case)
        staged = compile_model(CompileOptions.from_flags(model=preset, output_dir=root / name, pp=pp, tp=tp,
                                                         kv_cache="paged", max_seq_len=128, progress=False))
        if preset not in singles:
            singles[preset] = compile_model(CompileOptions.from_flags(
                model=preset, output_dir=root / f"{preset}-single", kv_cache="paged", max_seq_len=128,
                progress=False)).output_dir
        out[name] = (staged.output_dir, singles[preset])
    return out


def _unsharded_tokens(single: Path, prompts: list[list[int]]) -> list[list[int]]:
    engine = LLMEngine.from_artifact(single, EngineConfig(scheduling=SchedulingOptions(max_num_seqs=8),
                                                          backend=BackendOptions(threads=1)))
    return [list(o.token_ids) for o in engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS,
                                                                               ignore_eos=True))]


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_pipeline_engine_matches_unsharded_and_pytorch(case: tuple[str, int, int],
                                                        pipeline_artifacts: dict[str, tuple[Path, Path]],
                                                        tmp_path: Path) -> None:
    sys.path.insert(0, str(DRIVER.parent))
    from sharded_driver import PROMPTS

    staged, single = pipeline_artifacts[_case_id(case)]
    world = case[1] * case[2]
    results = _launch(staged, tmp_path / "tokens.json", world=world)
    assert [code for code, _ in results] == [0] * world, [err[-2000:] for _, err in results]
    tokens = json.loads((tmp_path / "tokens.json").read_text())
    metrics = json.loads((tmp_path / "tokens.json.metrics.json").read_text())
    model = load_model(case[0], mla_impl="absorb").model
    pytorch = [torch_reference(model, prompt, MAX_TOKENS - 1).tokens for prompt in PROMPTS]
    assert len(tokens) == len(PROMPTS) and all(len(t) == MAX_TOKENS for t in tokens)
    assert tokens == _unsharded_tokens(single, PROMPTS)
    assert tokens == pytorch
    assert metrics["steps"] > 0


@pytest.mark.parametrize(("micro_batches", "step_tokens"), [(1, 512), (4, 512), (3, 16)])
def test_pipeline_tokens_do_not_depend_on_the_micro_batches(micro_batches: int, step_tokens: int,
                                                             pipeline_artifacts: dict[str, tuple[Path, Path]],
                                                             tmp_path: Path) -> None:
    """One micro-batch (no overlap), more micro-batches than stages (prefill rows cut into token ranges, decode steps
    into rows: no minimum piece here), and chunked prefill (16-token steps: prompts span several steps, each cut in 3
    pieces) give the unsharded tokens."""
    sys.path.insert(0, str(DRIVER.parent))
    from sharded_driver import PROMPTS

    staged, single = pipeline_artifacts[_case_id(CASES[1])]
    results = _launch(staged, tmp_path / "tokens.json", "--micro-batches", str(micro_batches),
                      "--max-num-batched-tokens", str(step_tokens), "--min-micro-batch-tokens", "1", world=2)
    assert [code for code, _ in results] == [0, 0], [err[-2000:] for _, err in results]
    assert json.loads((tmp_path / "tokens.json").read_text()) == _unsharded_tokens(single, PROMPTS)


def test_pipeline_with_preemption_gives_the_same_tokens(pipeline_artifacts: dict[str, tuple[Path, Path]],
                                                        tmp_path: Path) -> None:
    """A pool of 6 blocks for 8 requests that need up to 3 each: requests are preempted and recomputed through the
    stages, and every token is still the unsharded artifact's."""
    sys.path.insert(0, str(DRIVER.parent))
    from sharded_driver import PROMPTS

    staged, single = pipeline_artifacts[_case_id(CASES[0])]
    results = _launch(staged, tmp_path / "tokens.json", "--kv-blocks", "6", world=2)
    assert [code for code, _ in results] == [0, 0], [err[-2000:] for _, err in results]
    metrics = json.loads((tmp_path / "tokens.json.metrics.json").read_text())
    assert metrics["preemptions"] > 0
    assert json.loads((tmp_path / "tokens.json").read_text()) == _unsharded_tokens(single, PROMPTS)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_pipeline_parity_cli_within_1e4(case: tuple[str, int, int],
                                        pipeline_artifacts: dict[str, tuple[Path, Path]]) -> None:
    """``moeforge parity DIR`` starts its own ranks; 64-token prompt, 16 cached decode steps."""
    staged, _ = pipeline_artifacts[_case_id(case)]
    proc = subprocess.run([sys.executable, "-P", "-m", "moeforge.cli", "parity", str(staged), "--json",
                           "--prompt-len", "64", "--steps", "16"],
                          capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["pp"] == case[1] and report["tp"] == case[2]
    assert report["max_abs_err"] <= 1e-4
    assert report["greedy_match"] is True
    assert report["decode_steps"] == 16


def _checkpoint_float_bytes(graph: Path) -> int:
    """Bytes of a graph's float32 initializers that come from the checkpoint: all but the tables the passes derive
    (rotary cos/sin caches, the argmax head's int8 copy of the head and its bounds)."""
    model = onnx.load(str(graph), load_external_data=False)
    total = 0
    for tensor in model.graph.initializer:
        if tensor.data_type != onnx.TensorProto.FLOAT or tensor.name.startswith(("cos_cache", "sin_cache",
                                                                                  "argmax_head")):
            continue
        count = 1
        for dim in tensor.dims:
            count *= dim
        total += 4 * count
    return total


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_each_stage_holds_its_planned_bytes(case: tuple[str, int, int],
                                            pipeline_artifacts: dict[str, tuple[Path, Path]]) -> None:
    staged, _ = pipeline_artifacts[_case_id(case)]
    _preset, pp, tp = case
    sharded = read_sharded(staged)
    config = ModelConfig.from_dict(sharded.model_config)
    specs = sharded.stage_specs()
    assert sharded.pp == pp and sharded.world_size == pp * tp and len(specs) == pp
    assert next(s.first_layer for s in specs) == 0 and specs[-1].last_layer == config.num_hidden_layers
    assert all(a.last_layer == b.first_layer for a, b in itertools.pairwise(specs))
    plan = stage_costs(config, specs, 4.0, 4, tp, sharded.ep)
    for spec, cost, entry in zip(specs, plan, sharded.stages, strict=True):
        ranks = entry["ranks"]
        assert ranks == list(range(spec.stage * tp, (spec.stage + 1) * tp))
        # Each stage caches only its own layers: exactly the planner's KV bytes.
        assert entry["kv_bytes_per_token"] == cost.kv_bytes_per_token * tp == entry["planned_kv_bytes_per_token"]
        for rank in ranks:
            stage_info = sharded.ranks[rank]["stage"]
            assert stage_info["layers"] == [spec.first_layer, spec.last_layer]
            rank_config = ModelConfig.from_dict(json.loads((staged / f"rank{rank}" / "manifest.json").read_text())
                                                ["model_config"])
            assert rank_config.num_hidden_layers == spec.num_layers
            # Each rank's weights are exactly its share of the checkpoint (a few scalar constants aside).
            graph_bytes = _checkpoint_float_bytes(staged / f"rank{rank}" / "model.onnx")
            assert abs(graph_bytes - cost.weight_bytes) <= 64, (spec, rank, graph_bytes, cost.weight_bytes)
        assert entry["planned_weight_bytes"] == cost.weight_bytes * tp
    # Stage 0 holds the embedding, the last stage the head: its graph returns logits, the others the hidden state.
    first = json.loads((staged / "rank0" / "manifest.json").read_text())
    last = json.loads((staged / f"rank{sharded.world_size - 1}" / "manifest.json").read_text())
    assert "input_ids" in [t["name"] for t in first["inputs"]]
    assert "hidden_states" in [t["name"] for t in first["outputs"]]
    assert "hidden_states_in" in [t["name"] for t in last["inputs"]]
    assert "logits" in [t["name"] for t in last["outputs"]]


def test_a_stage_from_another_compile_stops_every_rank(pipeline_artifacts: dict[str, tuple[Path, Path]],
                                                        tmp_path: Path) -> None:
    llama = pipeline_artifacts[_case_id(CASES[0])][0]
    other = pipeline_artifacts[_case_id(CASES[1])][0]
    mixed = tmp_path / "mixed"
    shutil.copytree(llama, mixed)
    shutil.rmtree(mixed / "rank1")
    shutil.copytree(other / "rank1", mixed / "rank1")
    start = time.monotonic()
    results = _launch(mixed, tmp_path / "unused.json", world=2)
    assert time.monotonic() - start < LAUNCH_TIMEOUT_S
    for code, err in results:
        assert code != 0
        assert "rank 1" in err and "another compile" in err, err[-2000:]


def test_a_stage_dying_mid_step_stops_rank0_with_an_error(pipeline_artifacts: dict[str, tuple[Path, Path]],
                                                           tmp_path: Path) -> None:
    staged = pipeline_artifacts[_case_id(CASES[1])][0]
    start = time.monotonic()
    (code0, err0), (code1, _) = _launch(staged, tmp_path / "unused.json", "--die-after", "3", world=2)
    elapsed = time.monotonic() - start
    assert code1 == 17  # the driver's crash, inside the last stage's step
    assert code0 != 0 and "pipeline step failed" in err0, err0[-2000:]
    assert elapsed < 60, elapsed  # gloo sees the closed peer at once: no wait for the timeout
    assert not (tmp_path / "unused.json").exists()


def test_a_wrong_world_size_is_refused(pipeline_artifacts: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:
    staged = pipeline_artifacts[_case_id(CASES[3])][0]  # 4 ranks
    results = _launch(staged, tmp_path / "unused.json", world=2)
    for code, err in results:
        assert code != 0
        assert "4 ranks" in err and "pp 2" in err, err[-2000:]


def test_bench_roofline_refuses_a_pipeline_before_starting_its_ranks(
        pipeline_artifacts: dict[str, tuple[Path, Path]], capsys: pytest.CaptureFixture[str]) -> None:
    """The roofline sums what tp / ep ranks read at once; a pipeline's stages run one after another."""
    from moeforge.cli import main

    staged = pipeline_artifacts[_case_id(CASES[0])][0]
    assert main(["bench", str(staged), "--no-compare", "--roofline"]) == 2
    assert "is a pipeline (--pp): --roofline" in capsys.readouterr().err


def test_pipeline_compile_refusals_leave_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with pytest.raises(MoeforgeError, match="paged"):
        compile_model(CompileOptions.from_flags(model="tiny-llama", output_dir=out, pp=2, kv_cache="contiguous",
                                                progress=False))
    with pytest.raises(MoeforgeError, match="decoder layers"):
        compile_model(CompileOptions.from_flags(model="tiny-llama", output_dir=out, pp=3, kv_cache="paged",
                                                progress=False))
    with pytest.raises(MoeforgeError, match="pp-layers"):
        compile_model(CompileOptions.from_flags(model="tiny-llama", output_dir=out, pp=2, pp_layers="0-1,1-1",
                                                kv_cache="paged", progress=False))
    assert not out.exists()
    assert not list(tmp_path.glob(".out*"))


def test_pipeline_serve_answers_like_the_engine_and_stops_cleanly(pipeline_artifacts: dict[str, tuple[Path, Path]]
                                                                  ) -> None:
    """``moeforge serve DIR`` on a pp 2 x tp 2 artifact starts its 4 ranks, answers concurrent requests over HTTP with
    the unsharded engine's tokens, and on SIGTERM drains, stops every rank and exits 0."""
    import signal
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    staged, single = pipeline_artifacts[_case_id(CASES[3])]
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-P", "-m", "moeforge.cli", "serve", str(staged), "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    prompts = [[5, 17, 3, 99, 42], [7, 7, 1], list(range(1, 40))]
    try:
        wait_healthy(proc, url)

        def complete(prompt: list[int]) -> list[int]:
            body = {"model": staged.name, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                    "ignore_eos": True, "return_token_ids": True}
            answer = httpx.post(url + "/v1/completions", json=body, timeout=120).json()
            return list(answer["choices"][0]["token_ids"])

        with ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(complete, prompts))
        assert answers == _unsharded_tokens(single, prompts)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    assert "rank process exited" not in err


def test_quantised_stages_give_the_unsharded_quantised_tokens(tmp_path: Path) -> None:
    """int8 weights (and the int8 head) quantised per stage are the unsharded int8 artifact's: the same greedy tokens
    through 2 stages, and only the last stage carries the head."""
    sys.path.insert(0, str(DRIVER.parent))
    from sharded_driver import PROMPTS

    flags = {"model": "tiny-deepseek-v3", "kv_cache": "paged", "max_seq_len": 128, "quant": "int8", "progress": False}
    staged = compile_model(CompileOptions.from_flags(output_dir=tmp_path / "pp", pp=2, **flags)).output_dir
    single = compile_model(CompileOptions.from_flags(output_dir=tmp_path / "single", **flags)).output_dir
    results = _launch(staged, tmp_path / "tokens.json", world=2)
    assert [code for code, _ in results] == [0, 0], [err[-2000:] for _, err in results]
    assert json.loads((tmp_path / "tokens.json").read_text()) == _unsharded_tokens(single, PROMPTS)
    first = json.loads((staged / "rank0" / "manifest.json").read_text())
    assert first["quantization"] is not None and "logits" not in [t["name"] for t in first["outputs"]]


@pytest.mark.parametrize("stream", [False, True], ids=["in-memory", "streamed"])
def test_tied_embeddings_split_into_stages(stream: bool, tmp_path: Path) -> None:
    """A Hub-style tied Llama: stage 0 holds the table, the last stage a copy as its head, whether the compile holds
    the model (the stages share its modules: releasing stage 0's weights must not take the head's) or streams each
    stage's tensors from the checkpoint; the tokens are the unsharded artifact's."""
    from tests.compile.test_stream_compile import _llama_folder

    sys.path.insert(0, str(DRIVER.parent))
    from sharded_driver import PROMPTS

    folder = _llama_folder(tmp_path / "llama")
    flags = {"model": str(folder), "kv_cache": "paged", "max_seq_len": 64, "stream": stream, "progress": False}
    staged = compile_model(CompileOptions.from_flags(output_dir=tmp_path / "pp", pp=2, **flags)).output_dir
    single = compile_model(CompileOptions.from_flags(output_dir=tmp_path / "single", **flags)).output_dir
    results = _launch(staged, tmp_path / "tokens.json", world=2)
    assert [code for code, _ in results] == [0, 0], [err[-2000:] for _, err in results]
    assert json.loads((tmp_path / "tokens.json").read_text()) == _unsharded_tokens(single, PROMPTS)
