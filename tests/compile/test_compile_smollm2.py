"""SmolLM2-135M (a real model from a PyPI wheel) compiled end to end: fusion is real, parity holds,
and onnxruntime-genai (a C++ runtime) runs the artifact with identical greedy tokens."""


import onnx
import pytest

from moeforge.cli.inspect import op_counts
from moeforge.core.artifact import load_artifact
from moeforge.model.loader import load_model
from moeforge.verify.parity import run_parity

pytestmark = [
    pytest.mark.heavy,
    pytest.mark.smollm2,  # skipped locally, failed under CI, without the wheel (tests/conftest.py)
]
LAYERS = 30


@pytest.fixture(scope="module")
def reference():
    return load_model("smollm2-135m")


def test_fusion_is_real(smollm2_artifact):
    counts = op_counts(smollm2_artifact / "model.onnx")
    # One fused norm per norm site: 2 per layer + the final norm; all but the first take the residual add.
    assert counts.get("SimplifiedLayerNormalization", 0) + counts.get("com.microsoft.SkipSimplifiedLayerNormalization",
                                                                      0) == 2 * LAYERS + 1
    assert counts.get("com.microsoft.SkipSimplifiedLayerNormalization") == 2 * LAYERS
    assert counts.get("com.microsoft.GroupQueryAttention") == LAYERS  # one attention node per layer
    # RoPE was fused (rotary pass) and then folded into the attention kernel (do_rotary), head size 64.
    assert "com.microsoft.RotaryEmbedding" not in counts
    for leftover in ("RMSNormalization", "Pow", "ReduceMean", "Attention", "Cos", "Sin"):
        assert leftover not in counts, leftover
    # Packed projections: q/k/v and gate/up are one GEMM each; plus o_proj, down_proj and the LM head, which the
    # argmax head puts in an If beside its certified branch (2 more MatMuls: the bound's slack, the candidates' dots).
    assert counts.get("MatMul") == 4 * LAYERS + 1 + 2
    assert counts.get("If") == 1 and counts.get("com.microsoft.MatMulNBits") == 1
    graph = onnx.load(str(smollm2_artifact / "model.onnx"), load_external_data=False).graph
    caches = [v.name for v in graph.input if v.name.startswith("past_key_values.")]
    assert len(caches) == 2 * LAYERS
    users = {name: [n.op_type for n in graph.node if name in n.input] for name in caches}
    assert all(ops == ["GroupQueryAttention"] for ops in users.values())  # no Concat-grown caches
    for node in graph.node:
        if node.op_type == "GroupQueryAttention":
            attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            assert attributes["do_rotary"] == 1 and attributes["rotary_interleaved"] == 0


def test_parity_with_pytorch(smollm2_artifact, reference):
    artifact = load_artifact(smollm2_artifact)
    prompt = reference.tokenizer.encode("The capital of France is")
    report = run_parity(artifact.model_path, artifact.manifest.kv_cache, reference.model, prompt + [504, 2988, 314] * 4,
                        decode_steps=16)
    # A pure 1e-4 atol is below fp32 noise for this 30-layer model (PyTorch fp32 itself is 8e-5 from
    # PyTorch fp64 on these logits, up to ~33); the parity bar adds rtol 1e-5 of each row's scale.
    assert report.passed and report.tolerance_used <= 1.0, report.table()
    assert report.max_abs_err <= 3e-4 and report.cosine_min > 0.999999
    assert report.greedy_match and report.top1_agreement == 1.0


def test_genai_runs_the_artifact_with_identical_greedy_tokens(smollm2_artifact, reference):
    pytest.importorskip("onnxruntime_genai")
    from moeforge.compile.genai_config import genai_greedy
    from moeforge.runtime.engine import LLMEngine
    from moeforge.runtime.sampler import SamplingParams

    prompt = reference.tokenizer.encode("The capital of France is")
    engine = LLMEngine.from_artifact(smollm2_artifact)
    ours = engine.generate([prompt], SamplingParams(max_tokens=24))[0].token_ids
    if ours and ours[-1] in engine.eos_token_ids:
        ours = ours[:-1]  # GenAI stops at EOS too and leaves it out of the sequence
    genai_tokens = genai_greedy(smollm2_artifact, [prompt], 24)[0]
    assert len(ours) >= 5
    assert genai_tokens == ours
    assert "Paris" in reference.tokenizer.decode(genai_tokens)



def test_engine_greedy_equals_pytorch_batch_1_and_8(smollm2_artifact, reference):
    from moeforge.runtime.engine import EngineConfig, LLMEngine, SchedulingOptions
    from moeforge.runtime.sampler import SamplingParams
    from moeforge.verify.generate import generate

    texts = ["The capital of France is", "Water boils at", "def fibonacci(n):", "Once upon a time, in a small village",
             "1, 2, 3, 4,", "The quick brown fox", "Photosynthesis is the process by which plants", "Hello"]
    prompts = [reference.tokenizer.encode(t) for t in texts]
    expected = [generate(reference.model, p, SamplingParams(max_tokens=12)).token_ids for p in prompts]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    one_seq = EngineConfig(scheduling=SchedulingOptions(max_num_seqs=1))
    solo = LLMEngine.from_artifact(smollm2_artifact, one_seq).generate(prompts[:1], params)
    assert solo[0].token_ids == expected[0]
    engine = LLMEngine.from_artifact(
        smollm2_artifact, EngineConfig(scheduling=SchedulingOptions(max_num_seqs=8, max_num_batched_tokens=32)))
    assert [o.token_ids for o in engine.generate(prompts, params)] == expected
    session = engine.backend._session  # type: ignore[attr-defined]
    # Plain greedy decode steps ran on the certified argmax head (a tied head: rows gathered from the embedding).
    assert session.argmax_runs >= 10 and session.argmax_reruns <= session.argmax_runs // 4
