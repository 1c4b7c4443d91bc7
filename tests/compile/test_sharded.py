"""Sharded artifacts (issue 17): compile --tp/--ep, run on torch.distributed (gloo, CPU), parity, failures.

Each case compiles one tiny model split over 2 ranks and launches real rank processes: the engine's greedy tokens
for 8 concurrent requests must equal the unsharded artifact's and PyTorch's; ``moeforge parity`` on the sharded
directory must be within 1e-4 of the unsharded PyTorch model; a rank from another compile and a rank that dies
mid-step must end every rank with an error, never a hang.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import onnx
import onnxruntime as ort
import pytest

from moeforge.compile.driver import CompileOptions, compile_model
from moeforge.compile.sharded_compile import SHARDED_FILE, read_sharded
from moeforge.core.errors import MoeforgeError
from moeforge.model.loader import load_model
from moeforge.model.sharding import plan_sharding
from moeforge.ops.collectives.ort import _library, cpu_graph
from moeforge.parallel.net import free_port
from moeforge.runtime.engine import BackendOptions, EngineConfig, LLMEngine, SchedulingOptions
from moeforge.runtime.sampler import SamplingParams
from moeforge.verify.parity import torch_reference
from tests.conftest import wait_healthy

pytestmark = pytest.mark.heavy

DRIVER = Path(__file__).with_name("sharded_driver.py")
MAX_TOKENS = 12
LAUNCH_TIMEOUT_S = 240
# (preset, tp, ep, kv layout): GQA with kv heads split; MLA + MoE with experts split by rank; MLA + MoE (V2) with
# each expert split, on block pools.
CASES = [("tiny-llama", 2, 1, "contiguous"), ("tiny-deepseek-v3", 2, 2, "contiguous"),
         ("tiny-deepseek-v2", 2, 1, "paged")]


def _case_id(case: tuple[str, int, int, str]) -> str:
    return f"{case[0]}-tp{case[1]}-ep{case[2]}-{case[3]}"


@pytest.fixture(scope="session")
def sharded_artifacts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """Per case: (sharded artifact, the same model compiled unsharded), compiled once per session."""
    root = tmp_path_factory.mktemp("sharded")
    out = {}
    for case in CASES:
        preset, tp, ep, layout = case
        name = _case_id(case)
        sharded = compile_model(CompileOptions.from_flags(model=preset, output_dir=root / name, tp=tp, ep=ep,
                                                          kv_cache=layout, max_seq_len=128, progress=False))
        single = compile_model(CompileOptions.from_flags(model=preset, output_dir=root / f"{name}-single",
                                                         kv_cache=layout, max_seq_len=128, progress=False))
        out[name] = (sharded.output_dir, single.output_dir)
    return out


def _launch(artifact: Path, out: Path, *extra: str, world: int = 2) -> list[tuple[int, str]]:
    """Start the driver as ``world`` ranks with torchrun's environment (what torchrun sets); (status, stderr)."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, str(DRIVER), str(artifact), str(out), *extra], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    results = []
    for proc in procs:
        _, err = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
        results.append((proc.returncode, err))
    return results


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_sharded_engine_matches_unsharded_and_pytorch(case: tuple[str, int, int, str],
                                                       sharded_artifacts: dict[str, tuple[Path, Path]],
                                                       tmp_path: Path) -> None:
    sys.path.insert(0, str(DRIVER.parent))
    from sharded_driver import PROMPTS

    sharded, single = sharded_artifacts[_case_id(case)]
    results = _launch(sharded, tmp_path / "tokens.json")
    assert [code for code, _ in results] == [0, 0], [err[-2000:] for _, err in results]
    tokens = json.loads((tmp_path / "tokens.json").read_text())

    engine = LLMEngine.from_artifact(single, EngineConfig(
        scheduling=SchedulingOptions(max_num_seqs=8),
        backend=BackendOptions(threads=1)))
    unsharded = [list(o.token_ids) for o in engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS,
                                                                                     ignore_eos=True))]
    model = load_model(case[0], mla_impl="absorb").model
    pytorch = [torch_reference(model, prompt, MAX_TOKENS - 1).tokens for prompt in PROMPTS]
    assert len(tokens) == len(PROMPTS) and all(len(t) == MAX_TOKENS for t in tokens)
    assert tokens == unsharded
    assert tokens == pytorch


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_sharded_speculative_decoding_gives_the_plain_tokens(case: tuple[str, int, int, str],
                                                             sharded_artifacts: dict[str, tuple[Path, Path]],
                                                             tmp_path: Path) -> None:
    # Prompt-lookup drafts on a sharded artifact: each row's num_logits travels to every rank and all 8 running rows
    # verify their drafts (speculative_max_batch 8). Repeating prompts make the lookup draft from the first step, and
    # these seeded tiny models repeat themselves within 40 tokens, so some drafts are accepted; the greedy tokens must
    # be the unsharded artifact's plain decoding (fp32: exact).
    sharded, single = sharded_artifacts[_case_id(case)]
    prompts = [[10 + i, 20 + i, 30 + i, 40 + i] * 3 + [10 + i, 20 + i] for i in range(8)]
    out = tmp_path / "tokens.json"
    results = _launch(sharded, out, "--speculative-tokens", "4", "--max-tokens", "40", "--prompts", json.dumps(prompts))
    assert [code for code, _ in results] == [0, 0], [err[-2000:] for _, err in results]
    tokens = json.loads(out.read_text())
    metrics = json.loads(Path(f"{out}.metrics.json").read_text())
    engine = LLMEngine.from_artifact(single, EngineConfig(
        scheduling=SchedulingOptions(max_num_seqs=8),
        backend=BackendOptions(threads=1)))
    plain = [list(o.token_ids) for o in engine.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True))]
    assert tokens == plain
    assert metrics["draft_tokens"] > 0 and metrics["accepted_draft_tokens"] > 0, metrics


def test_sharded_kv_tiers_each_rank_tiers_its_shard(sharded_artifacts: dict[str, tuple[Path, Path]],
                                                     tmp_path: Path) -> None:
    # tp 2 on block pools, a pool too small for the prompts run twice: the second pass promotes blocks every rank
    # demoted to its own host tier; a restart then serves them from every rank's own disk namespace. Tokens equal the
    # unsharded artifact's without tiers.
    sharded, single = sharded_artifacts["tiny-deepseek-v2-tp2-ep1-paged"]
    prompts = [[1 + (11 * i + j) % 250 for j in range(40)] for i in range(6)]
    tiers = ["--max-num-seqs", "2", "--kv-blocks", "8", "--max-tokens", "8", "--prompts", json.dumps(prompts)]
    disk = ["--kv-disk-dir", str(tmp_path / "kv")]
    out = tmp_path / "tokens.json"
    results = _launch(sharded, out, *tiers, *disk, "--kv-host-bytes", str(1 << 20), "--repeat", "2")
    assert [code for code, _ in results] == [0, 0], [err[-2000:] for _, err in results]
    engine = LLMEngine.from_artifact(single, EngineConfig(scheduling=SchedulingOptions(max_num_seqs=2),
                                                          backend=BackendOptions(threads=1)))
    plain = [list(o.token_ids) for o in engine.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))]
    assert json.loads(out.read_text()) == plain
    assert json.loads(Path(f"{out}.tiers.json").read_text())["host_hits"] > 0
    namespaces = sorted(p.name for p in (tmp_path / "kv").iterdir())
    assert len(namespaces) == 2  # one per rank: each rank's own manifest digest
    assert all(list((tmp_path / "kv" / n).rglob("*.kvblock")) for n in namespaces)
    results = _launch(sharded, out, *tiers, *disk)  # a restart: empty pools and host tiers
    assert [code for code, _ in results] == [0, 0], [err[-2000:] for _, err in results]
    assert json.loads(out.read_text()) == plain
    counts = json.loads(Path(f"{out}.tiers.json").read_text())
    # Each 40-token prompt's two full blocks came from disk on every rank: only 8 tokens a prompt were computed.
    assert counts["disk_hits"] > 0 and counts["prefill_tokens"] == 6 * 8, counts


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_sharded_parity_cli_within_1e4(case: tuple[str, int, int, str],
                                       sharded_artifacts: dict[str, tuple[Path, Path]]) -> None:
    """``moeforge parity DIR`` starts its own ranks; 64-token prompt, 16 cached decode steps."""
    sharded, _ = sharded_artifacts[_case_id(case)]
    proc = subprocess.run([sys.executable, "-P", "-m", "moeforge.cli", "parity", str(sharded), "--json",
                           "--prompt-len", "64", "--steps", "16"],
                          capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["tp"] == case[1] and report["ep"] == case[2]
    assert report["max_abs_err"] <= 1e-4
    assert report["greedy_match"] is True
    assert report["decode_steps"] == 16


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_rank_weights_are_one_nth_of_the_sharded_tensors(case: tuple[str, int, int, str],
                                                         sharded_artifacts: dict[str, tuple[Path, Path]]) -> None:
    preset, tp, ep, _ = case
    sharded, _ = sharded_artifacts[_case_id(case)]
    manifest = read_sharded(sharded)
    config = load_model(preset, mla_impl="absorb").config
    plan = plan_sharding(config, tp, ep)
    assert manifest.replicated == plan.replicated() and manifest.replicated  # listed, by name
    replicated_bytes = 4 * sum(t.numel for t in plan.tensors if t.rule == "replicated")
    sharded_bytes = 4 * sum(t.numel for t in plan.tensors if t.rule != "replicated")
    for rank in manifest.ranks:
        # The graph also holds small tables of its own (RoPE cos/sin): they count as replicated.
        own = rank["weight_bytes"] - replicated_bytes
        assert abs(own - sharded_bytes / tp) <= 0.05 * sharded_bytes / tp, (rank["rank"], own, sharded_bytes / tp)
    if config.mla is not None:  # the latent is replicated: every rank caches all of it, and says so
        assert {r["kv_bytes_per_token"] for r in manifest.ranks} == {4 * config.num_hidden_layers
                                                                     * config.mla.latent_dim}
        assert "latent" in manifest.kv_cache_note
    if ep > 1:
        assert config.moe is not None
        count = config.moe.n_routed_experts
        assert [tuple(r["experts"]) for r in manifest.ranks] == [(r * count // ep, (r + 1) * count // ep)
                                                                 for r in range(ep)]


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_rank_graph_loads_with_only_the_collectives_registered(case: tuple[str, int, int, str],
                                                               sharded_artifacts: dict[str, tuple[Path, Path]]) -> None:
    sharded, _ = sharded_artifacts[_case_id(case)]
    for rank in range(case[1]):
        path = sharded / f"rank{rank}" / "model.onnx"
        graph = onnx.load(str(path), load_external_data=False)
        ops = {(n.domain, n.op_type) for n in graph.graph.node}
        assert ("com.microsoft", "AllReduce") in ops and ("com.microsoft", "AllGather") in ops
        with pytest.raises(Exception, match=r"AllReduce|AllGather"):  # plain CPU ONNX Runtime has no kernel
            ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        assert cpu_graph(graph) >= 2
        options = ort.SessionOptions()
        options.register_custom_ops_library(_library())
        options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(path.parent))
        session = ort.InferenceSession(graph.SerializeToString(), options, providers=["CPUExecutionProvider"])
        assert "logits" in [o.name for o in session.get_outputs()]


def test_a_compile_into_a_rank_of_a_sharded_artifact_is_refused(sharded_artifacts: dict[str, tuple[Path, Path]],
                                                                  tmp_path: Path) -> None:
    """-o SHARDED/rank0 --force would replace one rank and leave sharded.json and the others describing another
    model: refused before anything is loaded, and the rank is untouched."""
    sharded = tmp_path / "sharded"
    shutil.copytree(sharded_artifacts[_case_id(CASES[0])][0], sharded)
    before = {p.name: p.stat().st_mtime_ns for p in (sharded / "rank0").iterdir()}
    for target in (sharded / "rank0", sharded / "rank0" / "nested"):
        with pytest.raises(MoeforgeError, match=r"inside the sharded artifact .*sharded\.json"):
            compile_model(CompileOptions(model="tiny-llama", output_dir=target, force=True, progress=False))
    assert {p.name: p.stat().st_mtime_ns for p in (sharded / "rank0").iterdir()} == before


def test_rank_from_another_compile_stops_every_rank(sharded_artifacts: dict[str, tuple[Path, Path]],
                                                     tmp_path: Path) -> None:
    llama = sharded_artifacts[_case_id(CASES[0])][0]
    other = sharded_artifacts[_case_id(CASES[2])][0]
    mixed = tmp_path / "mixed"
    shutil.copytree(llama, mixed)
    shutil.rmtree(mixed / "rank1")
    shutil.copytree(other / "rank1", mixed / "rank1")
    start = time.monotonic()
    results = _launch(mixed, tmp_path / "unused.json")
    assert time.monotonic() - start < LAUNCH_TIMEOUT_S
    for code, err in results:
        assert code != 0
        assert "rank 1" in err and "another compile" in err, err[-2000:]
    assert not (tmp_path / "unused.json").exists()


def test_a_rank_dying_mid_step_stops_rank0_with_an_error(sharded_artifacts: dict[str, tuple[Path, Path]],
                                                          tmp_path: Path) -> None:
    sharded = sharded_artifacts[_case_id(CASES[1])][0]
    start = time.monotonic()
    (code0, err0), (code1, _) = _launch(sharded, tmp_path / "unused.json", "--die-after", "3")
    elapsed = time.monotonic() - start
    assert code1 == 17  # the driver's crash
    assert code0 != 0 and "collective failed" in err0 and "another rank died" in err0, err0[-2000:]
    assert elapsed < 60, elapsed  # gloo sees the closed peer at once: no wait for the timeout
    assert not (tmp_path / "unused.json").exists()


def test_sharded_compile_refuses_bad_splits_and_leaves_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with pytest.raises(MoeforgeError, match="does not divide the 4 attention heads"):
        compile_model(CompileOptions.from_flags(model="tiny-llama", output_dir=out, tp=3, progress=False))
    with pytest.raises(MoeforgeError, match="--ep 3 with --tp 2"):
        compile_model(CompileOptions.from_flags(model="tiny-deepseek-v3", output_dir=out, tp=2, ep=3,
                                                progress=False))
    with pytest.raises(MoeforgeError, match="moeforge parity DIR"):
        compile_model(CompileOptions.from_flags(model="tiny-llama", output_dir=out, tp=2, check=True,
                                                progress=False))
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_sharded_manifest_records_the_mapping(sharded_artifacts: dict[str, tuple[Path, Path]]) -> None:
    sharded = sharded_artifacts[_case_id(CASES[1])][0]
    data = json.loads((sharded / SHARDED_FILE).read_text())
    assert data["world_size"] == 2 and data["tp"] == 2 and data["ep"] == 2
    assert [r["dir"] for r in data["ranks"]] == ["rank0", "rank1"]
    assert [tuple(r["heads"]) for r in data["ranks"]] == [(0, 2), (2, 4)]
    assert [tuple(r["vocab"]) for r in data["ranks"]] == [(0, 256), (256, 512)]
    assert any("AllGather" in point for point in data["collectives"])
    for rank in range(2):
        manifest = json.loads((sharded / f"rank{rank}" / "manifest.json").read_text())
        assert manifest["sharding"]["rank"] == rank and manifest["sharding"]["tp"] == 2


def test_sharded_serve_answers_like_the_engine_and_stops_cleanly(sharded_artifacts: dict[str, tuple[Path, Path]]
                                                                 ) -> None:
    """``moeforge serve DIR`` starts its ranks, answers over HTTP with the unsharded engine's tokens, and on SIGTERM
    drains, stops every rank and exits 0."""
    import signal

    import httpx

    sharded, single = sharded_artifacts[_case_id(CASES[1])]
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-P", "-m", "moeforge.cli", "serve", str(sharded), "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url)
        prompt = [5, 17, 3, 99, 42]
        body = {"model": sharded.name, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}
        answer = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
        engine = LLMEngine.from_artifact(single, EngineConfig(
            scheduling=SchedulingOptions(max_num_seqs=1),
            backend=BackendOptions(threads=1)))
        expected = engine.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))[0].token_ids
        assert answer["choices"][0]["token_ids"] == list(expected)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    assert "rank process exited" not in err


@contextlib.contextmanager
def _sharded_server(sharded: Path) -> Iterator[tuple[subprocess.Popen[str], str, int]]:
    """``moeforge serve`` of a 2-rank artifact, healthy: (its process, its URL, rank 1's pid); killed at the end."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-P", "-m", "moeforge.cli", "serve", str(sharded), "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url)
        (rank1,) = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()  # started by rank 0
        yield proc, url, int(rank1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_dead_rank_makes_serve_unhealthy_at_once_and_exit_non_zero(sharded_artifacts: dict[str, tuple[Path, Path]]
                                                                     ) -> None:
    """SIGKILL of rank 1 of an idle sharded server: within a poll (0.5 s) /health says so (503 naming the rank) and
    the server stops by itself with a non-zero exit code, for a supervisor to restart it."""
    import signal

    import httpx

    with _sharded_server(sharded_artifacts[_case_id(CASES[0])][0]) as (proc, url, rank1):
        os.kill(rank1, signal.SIGKILL)
        deadline, gone = time.monotonic() + 10, False
        while time.monotonic() < deadline and not gone:
            try:
                health = httpx.get(url + "/health", timeout=2)
                if health.status_code == 503:  # caught between noticing and stopping: it names the rank
                    assert "rank 1 exited" in health.json()["reason"]
            except httpx.TransportError:  # it stopped by itself
                gone = True
            time.sleep(0.05)
        assert gone, "the server kept answering after its rank died"
        assert proc.wait(timeout=LAUNCH_TIMEOUT_S) != 0
        assert proc.stderr is not None and "rank 1 exited" in proc.stderr.read()


def test_a_rank_killed_mid_stream_ends_the_stream_with_an_error_and_done(
        sharded_artifacts: dict[str, tuple[Path, Path]]) -> None:
    """Rank 1 killed while rank 0 streams: the stream ends with an OpenAI-shaped error event and ``[DONE]`` (not a
    cut body), and the server stops non-zero."""
    import signal

    import httpx

    sharded = sharded_artifacts[_case_id(CASES[0])][0]
    with _sharded_server(sharded) as (proc, url, rank1):
        body = {"model": sharded.name, "prompt": [1, 2, 3], "max_tokens": 100, "ignore_eos": True, "stream": True}
        events = []
        with httpx.Client(timeout=60) as http, http.stream("POST", url + "/v1/completions", json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 3:
                        os.kill(rank1, signal.SIGKILL)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["type"] == "server_error" and "rank" in error["message"]
        assert proc.wait(timeout=LAUNCH_TIMEOUT_S) != 0


def test_a_deleted_rank_is_reported_once_by_the_cli(sharded_artifacts: dict[str, tuple[Path, Path]],
                                                    tmp_path: Path) -> None:
    """Every rank finds the missing rank together; rank 0 alone prints it (one error line, exit 2)."""
    broken = tmp_path / "broken"
    shutil.copytree(sharded_artifacts[_case_id(CASES[0])][0], broken)
    shutil.rmtree(broken / "rank1")
    result = subprocess.run([sys.executable, "-m", "moeforge.cli", "run", str(broken), "--prompt-ids", "1,2,3",
                             "--max-new-tokens", "2"], capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert result.returncode == 2
    assert result.stderr.count("error:") == 1 and "rank 1: no artifact" in result.stderr, result.stderr[-2000:]
    assert "terminate called" not in result.stderr
