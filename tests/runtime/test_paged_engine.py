"""Paged artifacts (``--kv-cache paged``) on the engine: token-identical to contiguous artifacts and to
PyTorch with 8 concurrent requests of mixed lengths, pools written in place, loadable by a bare ONNX
Runtime session (no custom-op library), and prefix sharing of real pool blocks."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest

from moeforge.compile.driver import CompileOptions, compile_model
from moeforge.model.loader import load_model
from moeforge.runtime.backends.base import RowInput, StepInput
from moeforge.runtime.backends.onnxruntime_paged import PagedOrtBackend
from moeforge.runtime.engine import CacheOptions, EngineConfig, LLMEngine, SchedulingOptions
from moeforge.runtime.sampler import SamplingParams
from moeforge.verify.generate import generate

GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)
BLOCK = 16


def _compile(name: str, root: Path, kv_cache: str, max_seq_len: int = 128) -> Path:
    out = root / f"{name}-{kv_cache}"
    options = CompileOptions.from_flags(model=name, output_dir=out, max_seq_len=max_seq_len, progress=False,
                                        kv_cache=kv_cache, kv_block_size=BLOCK)
    return compile_model(options).output_dir


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("paged-deepseek")
    return {kind: _compile("tiny-deepseek-v3", root, kind) for kind in ("contiguous", "paged")}


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    """PyTorch greedy tokens of ``_prompts(8)`` (shared by the tests below)."""
    model = load_model("tiny-deepseek-v3").model
    return [generate(model, p, SamplingParams(max_tokens=10)).token_ids for p in _prompts(8)]


def _prompts(n: int, seed: int = 0, vocab: int = 256) -> list[list[int]]:
    """Mixed lengths 2..60: some within one block, some crossing one or more block boundaries."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, int(length)).tolist() for length in rng.integers(2, 60, n)]


def test_paged_artifact_graph_and_manifest(deepseek):
    from moeforge.core.artifact import load_artifact

    kv = load_artifact(deepseek["paged"]).manifest.kv_cache
    assert kv.paged and kv.block_size == BLOCK and kv.layout == "mla_latent"
    assert kv.shape == ["num_blocks", BLOCK, 1, 40] and kv.bytes_per_block == 40 * 3 * 4 * BLOCK
    graph = onnx.load(str(deepseek["paged"] / "model.onnx"), load_external_data=False)
    nodes = [n for n in graph.graph.node if n.domain == "moeforge" and n.op_type == "PagedAttention"]
    assert len(nodes) == 3 and all(not n.input[2] and not n.input[4] and len(n.output) == 2 for n in nodes)
    assert [f.name for f in graph.functions] == ["PagedAttention"]  # the standard-op body travels with it
    assert [i.name for i in graph.graph.input][:5] == ["input_ids", "position_ids", "block_tables", "seq_lens",
                                                       "query_start_loc"]


def test_paged_equals_contiguous_and_pytorch_8_concurrent(deepseek, expected):
    prompts = _prompts(8)
    outputs = {}
    for kind, path in deepseek.items():
        engine = LLMEngine.from_artifact(path, EngineConfig(
            scheduling=SchedulingOptions(max_num_seqs=8, max_num_batched_tokens=64)))
        outputs[kind] = [o.token_ids for o in engine.generate(prompts, GREEDY)]
        assert engine.kv.stats().blocks_in_use == 0
    assert outputs["paged"] == outputs["contiguous"] == expected


def test_preemption_with_a_third_of_the_pool(deepseek, expected):
    """Preempted sequences lose their blocks (reused by others: stale pool contents must stay masked) and
    come back through the prefix cache; outputs still equal PyTorch's."""
    prompts = _prompts(8)
    need = sum(-(-(len(p) + 10) // BLOCK) for p in prompts)
    engine = LLMEngine.from_artifact(
        deepseek["paged"], EngineConfig(
            scheduling=SchedulingOptions(max_num_seqs=8, max_num_batched_tokens=64),
            cache=CacheOptions(kv_blocks=max(need // 3, 5))))
    assert engine.backend.num_blocks == engine.kv.config.num_blocks == max(need // 3, 5)
    outputs = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == expected
    assert engine.metrics.preemptions > 0 and engine.kv.stats().blocks_in_use == 0
    assert not engine.requests and not engine.scheduler.requests


def test_pools_are_updated_in_place(deepseek):
    engine = LLMEngine.from_artifact(deepseek["paged"], EngineConfig(scheduling=SchedulingOptions(max_num_seqs=4)))
    backend = engine.backend
    assert isinstance(backend, PagedOrtBackend)
    pointers = backend.pool_pointers()
    assert pointers == {name: pool.ctypes.data for name, pool in backend.pools.items()}
    engine.generate(_prompts(3, seed=4), GREEDY)
    assert backend.pool_pointers() == pointers
    # The numpy arrays behind the bound OrtValues hold the new tokens: ORT wrote into them, not a copy.
    assert all(np.abs(pool).sum() > 0 for pool in backend.pools.values())


def test_a_bare_onnxruntime_session_loads_the_paged_artifact(deepseek):
    """A fresh interpreter that never imports moeforge (no schema, no custom-op library) runs one mixed
    step of the artifact as shipped (its PagedAttention local function) and gets the engine's logits."""
    path = deepseek["paged"]
    rows = (RowInput(0, (5, 6, 7, 8, 9), 0, (2,)), RowInput(1, (11, 12), 0, (0,)))
    backend = PagedOrtBackend(path / "model.onnx", kv_cache=_kv(path), num_blocks=4, num_slots=2, vocab_size=512)
    expected = backend.execute(StepInput(rows))
    script = textwrap.dedent(f"""
        import json, sys, numpy as np, onnxruntime as ort
        assert not any(m.startswith("moeforge") for m in sys.modules)
        s = ort.InferenceSession({str(path / "model.onnx")!r}, providers=["CPUExecutionProvider"])
        feeds = {{"input_ids": np.array([5, 6, 7, 8, 9, 11, 12]), "position_ids": np.array([0, 1, 2, 3, 4, 0, 1]),
                 "block_tables": np.array([[2], [0]], np.int32), "seq_lens": np.array([5, 2], np.int32),
                 "query_start_loc": np.array([0, 5, 7], np.int32), "logits_indices": np.array([4, 6])}}
        for i in s.get_inputs():
            if i.name.startswith("kv_pool."):
                feeds[i.name] = np.zeros([4, *i.shape[1:]], np.float32)
        logits = s.run(["logits"], feeds)[0]
        assert not any(m.startswith("moeforge") for m in sys.modules)
        print(json.dumps(logits.tolist()))
    """)
    done = subprocess.run([sys.executable, "-I", "-c", script], capture_output=True, text=True, cwd=path,
                          check=False, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    logits = np.array(json.loads(done.stdout.strip().splitlines()[-1]), np.float32)
    np.testing.assert_allclose(logits, expected, atol=1e-5, rtol=0)


def _kv(path: Path):
    from moeforge.core.artifact import load_artifact

    return load_artifact(path).manifest.kv_cache


def test_two_requests_sharing_a_64_token_prefix_share_its_blocks(deepseek):
    rng = np.random.default_rng(7)
    prefix = rng.integers(0, 256, 64).tolist()
    prompts = [prefix + rng.integers(0, 256, 5).tolist(), prefix + rng.integers(0, 256, 9).tolist()]
    one_seq = EngineConfig(scheduling=SchedulingOptions(max_num_seqs=1))
    solo = [LLMEngine.from_artifact(deepseek["paged"], one_seq).generate([p], GREEDY)[0]
            .token_ids for p in prompts]
    two_seqs = EngineConfig(scheduling=SchedulingOptions(max_num_seqs=2))
    contiguous = LLMEngine.from_artifact(deepseek["contiguous"], two_seqs).generate(prompts, GREEDY)
    assert [o.token_ids for o in contiguous] == solo

    # Together, admitted in the same step: the second finds the first's 4 prefix blocks keyed already.
    engine = LLMEngine.from_artifact(
        deepseek["paged"], EngineConfig(scheduling=SchedulingOptions(max_num_seqs=2, max_num_batched_tokens=256)))
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    engine.step()
    tables = [engine.kv.block_table(i) for i in ids]
    assert tables[0][:4] == tables[1][:4]  # the same physical pool blocks
    assert set(tables[0][4:]).isdisjoint(tables[1][4:])
    assert engine.kv.stats().hits == 4
    assert engine.kv.stats().blocks_in_use == len(tables[0]) + len(tables[1]) - 4
    results = {}
    while engine.has_unfinished():
        results.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    assert [results[i] for i in ids] == solo

    # One after the other: the second revives the first's freed, still-keyed prefix blocks.
    engine = LLMEngine.from_artifact(deepseek["paged"], EngineConfig(scheduling=SchedulingOptions(max_num_seqs=2)))
    first = engine.generate([prompts[0]], GREEDY)[0].token_ids
    hits_before = engine.kv.stats().hits
    second = engine.generate([prompts[1]], GREEDY)[0].token_ids
    assert engine.kv.stats().hits - hits_before == 4
    assert [first, second] == solo


@pytest.mark.heavy
@pytest.mark.smollm2
def test_smollm2_paged_equals_contiguous_8_concurrent(tmp_path_factory, smollm2_artifact):
    root = tmp_path_factory.mktemp("paged-smollm2")
    paths = {"contiguous": smollm2_artifact, "paged": _compile("smollm2-135m", root, "paged")}
    prompts = _prompts(8, seed=3, vocab=49152)
    outputs = {}
    for kind, path in paths.items():
        engine = LLMEngine.from_artifact(path, EngineConfig(
            scheduling=SchedulingOptions(max_num_seqs=8, max_num_batched_tokens=128)))
        outputs[kind] = [o.token_ids for o in engine.generate(prompts, GREEDY)]
    assert outputs["paged"] == outputs["contiguous"]


def test_a_failed_step_on_a_paged_artifact(deepseek, expected, monkeypatch):
    """The backend raises once, on the step that prefills two requests: they finish with the error, the
    waiting one and the same prompts sent again give PyTorch's tokens, with no hit on the failed step's
    (never written) blocks and no block left in use."""
    prompts = [p for p in _prompts(8) if len(p) > BLOCK][:3]  # 51, 38 and 31 tokens: full blocks to key
    want = [expected[_prompts(8).index(p)] for p in prompts]
    engine = LLMEngine.from_artifact(
        deepseek["paged"], EngineConfig(scheduling=SchedulingOptions(max_num_seqs=2, max_num_batched_tokens=256)))
    real_execute, calls = engine.backend.execute, []

    def execute_failing_once(step: StepInput) -> np.ndarray:
        calls.append(len(step.rows))
        if len(calls) == 1:
            raise RuntimeError("simulated backend failure")
        return real_execute(step)

    monkeypatch.setattr(engine.backend, "execute", execute_failing_once)
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    failed = engine.step()
    assert calls == [2] and [o.request_id for o in failed] == ids[:2]
    assert all(o.finish_reason == "error" and "simulated backend failure" in o.error for o in failed)
    assert engine.kv.stats().cached_blocks == 0
    results = {}
    while engine.has_unfinished():
        results.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    assert results[ids[2]] == want[2]
    hits = engine.kv.stats().hits
    assert [o.token_ids for o in engine.generate(prompts[:2], GREEDY)] == want[:2]
    assert engine.kv.stats().hits == hits and engine.kv.stats().blocks_in_use == 0


def test_a_request_too_big_for_a_small_pool_fails_alone(deepseek, expected):
    """4 blocks (64 tokens): a 70-token prompt can never fit, one of 50 + 20 tokens outgrows the pool while
    decoding; both end with an error naming CacheOptions(kv_blocks=...), the others give PyTorch's tokens."""
    small = [(p, e) for p, e in zip(_prompts(8), expected, strict=True) if len(p) + 10 <= 2 * BLOCK][:2]
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, 256, 70).tolist(), small[0][0], rng.integers(0, 256, 50).tolist(), small[1][0]]
    params = [GREEDY, GREEDY, SamplingParams(max_tokens=20, ignore_eos=True), GREEDY]
    engine = LLMEngine.from_artifact(deepseek["paged"], EngineConfig(
        scheduling=SchedulingOptions(max_num_seqs=4),
        cache=CacheOptions(kv_blocks=4)))
    outputs = engine.generate(prompts, params)
    for out in (outputs[0], outputs[2]):
        assert out.finish_reason == "error" and "CacheOptions(kv_blocks=...)" in out.error
    assert [outputs[1].token_ids, outputs[3].token_ids] == [small[0][1], small[1][1]]
    assert engine.kv.stats().blocks_in_use == 0


def test_stale_non_finite_pool_contents_are_never_read(deepseek):
    """Freed blocks may hold NaN (an earlier request's): the backend zeroes a block before its first write,
    and pads short block tables with the row's own block, so NaN in unowned blocks changes nothing."""
    path = deepseek["paged"]
    rows = (RowInput(0, tuple(range(5, 25)), 0, (2, 3)), RowInput(1, (11, 12), 0, (1,)))
    clean = PagedOrtBackend(path / "model.onnx", kv_cache=_kv(path), num_blocks=4, num_slots=2, vocab_size=512)
    want = clean.execute(StepInput(rows))
    dirty = PagedOrtBackend(path / "model.onnx", kv_cache=_kv(path), num_blocks=4, num_slots=2, vocab_size=512)
    for pool in dirty.pools.values():
        pool[:] = np.nan
    got = dirty.execute(StepInput(rows))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    assert np.isnan(next(iter(dirty.pools.values()))[0]).all()  # block 0: nobody's, left as it was


def test_engine_config_block_size_must_match_the_paged_artifact(deepseek):
    from moeforge.runtime.engine import EngineConfigError

    with pytest.raises(EngineConfigError, match="--kv-block-size"):
        LLMEngine.from_artifact(deepseek["paged"], EngineConfig(cache=CacheOptions(block_size=BLOCK * 2)))
    engine = LLMEngine.from_artifact(deepseek["paged"], EngineConfig(
        scheduling=SchedulingOptions(max_num_seqs=2),
        cache=CacheOptions(block_size=BLOCK)))
    assert engine.kv.config.num_blocks == 2 * -(-128 // BLOCK)  # default: every slot can reach max_seq_len
