"""`moeforge compile --kv-cache paged` for a GQA preset through the CLI: manifest, inspect, engine == PyTorch
(block size 4: most sequences cross several block boundaries), and bad options refused before any work."""

from pathlib import Path

import numpy as np
import onnx
import pytest

from moeforge.cli import main
from moeforge.compile.driver import CompileOptions, compile_model
from moeforge.core.artifact import load_artifact
from moeforge.core.errors import MoeforgeError
from moeforge.model.loader import load_model
from moeforge.runtime.backends.onnxruntime_paged import PagedSequenceSession
from moeforge.runtime.engine import EngineConfig, LLMEngine, SchedulingOptions
from moeforge.runtime.sampler import SamplingParams
from moeforge.verify.generate import generate
from moeforge.verify.golden import load_golden


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_paged_gqa_compile_inspect_and_engine(capsys, tmp_path):
    out = tmp_path / "llama-paged"
    code, stdout, stderr = _cli(capsys, "compile", "tiny-llama", "-o", str(out), "--max-seq-len", "128",
                                "--kv-cache", "paged", "--kv-block-size", "4", "--check", "--quiet")
    assert code == 0, stderr
    assert "PASS" in stdout  # teacher-forced parity vs PyTorch, prefill + decodes, over the block pools
    kv = load_artifact(out).manifest.kv_cache
    assert kv.paged and kv.block_size == 4 and kv.layout == "gqa" and kv.shape == ["num_blocks", 4, 2, 16]
    assert kv.past_input_names[0] == ["kv_pool.0.key", "kv_pool.0.value"]
    assert kv.bytes_per_block == kv.bytes_per_token * 4
    assert not (out / "genai_config.json").exists()  # onnxruntime-genai cannot drive block pools
    feeds, golden = load_golden(out)  # packed-token golden feeds; logits [P, V] of every prompt token
    assert golden.shape == (16, 512) and feeds["kv_pool.0.key"].shape == (4, 4, 2, 16)
    lowered = PagedSequenceSession(out / "model.onnx", 16, kv_cache=kv).forward(feeds["input_ids"][None],
                                                                                feeds["position_ids"][None], None)
    np.testing.assert_allclose(lowered[0], golden, atol=1e-5, rtol=0)  # ORT lowering == the shipped function
    code, stdout, _ = _cli(capsys, "inspect", str(out))
    assert code == 0 and "PagedAttention" in stdout
    graph = onnx.load(str(out / "model.onnx"), load_external_data=False).graph
    assert not [n for n in graph.node if n.op_type in ("GroupQueryAttention", "Attention")]
    assert sum(n.op_type == "RotaryEmbedding" for n in graph.node) == 4  # RoPE before the op, q and k per layer

    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 256, int(n)).tolist() for n in rng.integers(1, 30, 8)]
    model = load_model("tiny-llama").model
    expected = [generate(model, p, SamplingParams(max_tokens=8)).token_ids for p in prompts]
    engine = LLMEngine.from_artifact(out, EngineConfig(
        scheduling=SchedulingOptions(max_num_seqs=8, max_num_batched_tokens=40)))
    outputs = engine.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    assert [o.token_ids for o in outputs] == expected
    assert engine.kv.config.block_size == 4 and engine.kv.config.enable_prefix_caching


def test_bad_paged_options_are_refused(capsys, tmp_path):
    target = tmp_path / "x"
    code, _, stderr = _cli(capsys, "compile", "tiny-llama", "-o", str(target), "--kv-cache", "paged",
                           "--kv-block-size", "0", "--quiet")
    assert code == 2 and "--kv-block-size" in stderr
    with pytest.raises(MoeforgeError, match="--kv-cache 'pagd'"):
        compile_model(CompileOptions.from_flags(model="tiny-llama", output_dir=target, kv_cache="pagd", progress=False))
    assert not Path(target).exists()
