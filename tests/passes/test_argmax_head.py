"""The certified argmax head: with ``argmax_only`` fed, a float32 head's argmax comes from int8 draft logits plus
exact float logits of the k best candidates, and ``logits_certified`` says where that argmax is proven. Not fed,
the graph is the float head every other caller knows. The engine feeds it on plain greedy steps only and reruns a
step whose rows are not all certified."""

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from moeforge.compile.driver import CompileOptions, compile_model
from moeforge.core.artifact import load_artifact
from moeforge.core.kv_layout import ARGMAX_ONLY, LOGITS_CERTIFIED
from moeforge.passes.argmax_head import BLOCK, SAFETY, quantize_head
from moeforge.runtime.backends.base import ArgmaxHeadStats
from moeforge.runtime.backends.onnxruntime import OrtSession
from moeforge.runtime.engine import EngineConfig, LLMEngine, SchedulingOptions
from moeforge.runtime.sampler import SamplingParams

from .conftest import artifact_feeds


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> dict[str, Path]:
    """tiny-llama (untied head, V 512) with and without the argmax head, and int4 (a quantised head: left alone)."""
    root = tmp_path_factory.mktemp("argmax")
    made = {}
    for name, flags in (("argmax", {}), ("plain", {"argmax_head": False}), ("int4", {"quant": "int4"})):
        made[name] = root / name
        compile_model(CompileOptions.from_flags(model="tiny-llama", output_dir=made[name], max_seq_len=64,
                                                progress=False, **flags))
    return made


def _graph(path: Path) -> onnx.GraphProto:
    return onnx.load(str(path / "model.onnx"), load_external_data=False).graph


def test_pass_adds_an_optional_flag_and_the_certified_output(artifacts):
    graph = _graph(artifacts["argmax"])
    assert ARGMAX_ONLY in {i.name for i in graph.input} and ARGMAX_ONLY in {i.name for i in graph.initializer}
    assert LOGITS_CERTIFIED in {o.name for o in graph.output}
    assert [n.op_type for n in graph.node].count("If") == 1
    session = ort.InferenceSession(str(artifacts["argmax"] / "model.onnx"))
    assert ARGMAX_ONLY not in {i.name for i in session.get_inputs()}  # optional: nobody has to feed it
    for name in ("plain", "int4"):  # --no-argmax-head, and a head the quantisation already made MatMulNBits
        other = _graph(artifacts[name])
        assert "If" not in {n.op_type for n in other.node}
        assert ARGMAX_ONLY not in {i.name for i in other.input}
    manifest = load_artifact(artifacts["argmax"]).manifest
    assert "argmax_head" in [p["name"] if isinstance(p, dict) else p for p in manifest.passes]


def test_default_is_the_float_head_and_argmax_only_keeps_the_argmax(artifacts):
    with_head = ort.InferenceSession(str(artifacts["argmax"] / "model.onnx"))
    plain = ort.InferenceSession(str(artifacts["plain"] / "model.onnx"))
    rng = np.random.default_rng(0)
    certified_rows = 0
    for _ in range(4):
        ids = rng.integers(0, 512, (3, 12)).astype(np.int64)
        reference = plain.run(["logits"], artifact_feeds(plain, ids))[0]  # [B, S, V]: every position (logits_to_keep 0)
        default, always = with_head.run(["logits", LOGITS_CERTIFIED], artifact_feeds(with_head, ids))
        np.testing.assert_allclose(default, reference, rtol=1e-5, atol=1e-5)
        assert always.all()
        fast, certified = with_head.run(["logits", LOGITS_CERTIFIED],
                                        {**artifact_feeds(with_head, ids), ARGMAX_ONLY: np.array(True)})
        assert certified.shape == (*reference.shape[:2], 1)
        ok = certified[..., 0]
        np.testing.assert_array_equal(fast.argmax(-1)[ok], reference.argmax(-1)[ok])
        # The winner's logit is the float one, not the draft's.
        best = np.take_along_axis(fast, fast.argmax(-1)[..., None], -1)[..., 0]
        np.testing.assert_allclose(best[ok], reference.max(-1)[ok], rtol=1e-5, atol=1e-5)
        assert not np.allclose(fast, reference, atol=1e-4)  # the rest is the int8 draft: approximate
        certified_rows += int(ok.sum())
    assert certified_rows > 0.8 * 4 * 3 * 12


def _decode_tokens(session: OrtSession, first: int, steps: int, argmax_only: bool) -> list[int]:
    session.allocate(1, 64)
    tokens = [first]
    for position in range(steps):
        logits = session.decode(0, 1, [tokens[-1]], [position], [position + 1], argmax_only=argmax_only)
        tokens.append(int(logits[0, -1].argmax()))
    return tokens


def test_uncertified_runs_repeat_on_the_float_head(artifacts):
    """A bound so loose that nothing is certified: every argmax run reruns, and the tokens are the float head's."""
    path = artifacts["argmax"] / "model.onnx"
    model = onnx.load(str(path), load_external_data=False)
    bound = next(i for i in model.graph.initializer if i.name == "argmax_head.bound")
    bound.CopyFrom(numpy_helper.from_array(np.full(tuple(bound.dims), 1e30, np.float32), "argmax_head.bound"))
    kv = load_artifact(artifacts["argmax"]).manifest.kv_cache
    never = OrtSession(path, kv_cache=kv, graph=model)
    normal = OrtSession(path, kv_cache=kv)
    expected = _decode_tokens(normal, 5, 20, argmax_only=False)
    assert _decode_tokens(normal, 5, 20, argmax_only=True) == expected
    assert normal.argmax_runs == 20
    assert _decode_tokens(never, 5, 20, argmax_only=True) == expected
    assert never.argmax_runs == never.argmax_reruns == 20


def test_engine_feeds_argmax_only_on_plain_greedy_steps(artifacts):
    engine = LLMEngine.from_artifact(artifacts["argmax"], EngineConfig(scheduling=SchedulingOptions(max_num_seqs=4)))
    session = engine.backend._session  # type: ignore[attr-defined]
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7]]
    greedy = engine.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    assert session.argmax_runs >= 10
    plain = LLMEngine.from_artifact(artifacts["plain"], EngineConfig(scheduling=SchedulingOptions(max_num_seqs=4)))
    assert [o.token_ids for o in plain.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))] == [
        o.token_ids for o in greedy]
    before = session.argmax_runs
    for params in (SamplingParams(max_tokens=6, logprobs=0), SamplingParams(max_tokens=6, repetition_penalty=1.3),
                   SamplingParams(max_tokens=6, temperature=0.8, seed=1)):
        engine.generate(prompts, params)
        assert session.argmax_runs == before, params  # these read more than the argmax: the float head


def test_paged_graphs_get_it_too(tmp_path):
    """Paged graphs (logits [T', V] of the logits_indices rows): the flag is squeezed like the logits, and the
    paged runner feeds it on plain greedy steps with the same tokens as the float head."""
    made = {}
    for name, flags in (("argmax", {}), ("plain", {"argmax_head": False})):
        made[name] = tmp_path / name
        compile_model(CompileOptions.from_flags(model="tiny-llama", output_dir=made[name], max_seq_len=64,
                                                kv_cache="paged", progress=False, **flags))
    certified = next(o for o in _graph(made["argmax"]).output if o.name == LOGITS_CERTIFIED)
    assert len(certified.type.tensor_type.shape.dim) == 2  # [T', 1], like logits [T', V]
    prompts = [[(31 * b + 7 * i) % 512 for i in range(8 + b)] for b in range(4)]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    config = EngineConfig(scheduling=SchedulingOptions(max_num_seqs=4))
    engines = {name: LLMEngine.from_artifact(path, config) for name, path in made.items()}
    tokens = {name: [o.token_ids for o in engine.generate(prompts, params)] for name, engine in engines.items()}
    assert tokens["argmax"] == tokens["plain"]
    runner = engines["argmax"].backend._runner  # type: ignore[attr-defined]
    assert runner.argmax_head and runner.argmax_runs >= 15
    assert engines["argmax"].argmax_head_stats() == ArgmaxHeadStats(runner.argmax_runs, runner.argmax_reruns)
    assert engines["plain"].argmax_head_stats() is None


def test_the_bound_covers_onnx_runtimes_int8_kernel():
    """|MatMulNBits(h) - h.W| <= the bound, without the safety margin, for activations whose 32-blocks differ by
    up to 1e6 in scale: ONNX Runtime's accuracy_level-4 kernel quantises activations per block (a per-row scale
    would break the bound on the small blocks)."""
    rng = np.random.default_rng(0)
    vocab, width = 2048, 256
    table = (rng.standard_normal((vocab, width)) * rng.uniform(0.01, 0.2, (vocab, 1))).astype(np.float32)
    table[:, :BLOCK] *= 5
    packed, scales, bound = quantize_head(table)
    node = onnx.helper.make_node("MatMulNBits", ["h", "B", "S"], ["q"], domain="com.microsoft", K=width, N=vocab,
                                 bits=8, block_size=BLOCK, accuracy_level=4)
    graph = onnx.helper.make_graph(
        [node], "draft", [onnx.helper.make_tensor_value_info("h", onnx.TensorProto.FLOAT, [None, width])],
        [onnx.helper.make_tensor_value_info("q", onnx.TensorProto.FLOAT, [None, vocab])],
        [numpy_helper.from_array(packed, "B"), numpy_helper.from_array(scales, "S")])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 21),
                                                         onnx.helper.make_opsetid("com.microsoft", 1)])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    blocks = width // BLOCK
    worst = 0.0
    for trial in range(12):
        scale = np.ones(blocks)
        scale[trial % blocks] = 10 ** rng.uniform(1, 3)
        scale[(trial + 3) % blocks] = 1e-3
        h = (rng.standard_normal((4, width)) * np.repeat(scale, BLOCK)).astype(np.float32)
        error = np.abs(session.run(None, {"h": h})[0] - h @ table.T)  # [4, V]
        features = np.stack([np.abs(h).sum(-1), np.abs(h).reshape(4, blocks, BLOCK).max(-1).sum(-1)], -1)
        worst = max(worst, float((error / (features @ (bound / SAFETY))).max()))
    assert 0.01 < worst <= 1.0
