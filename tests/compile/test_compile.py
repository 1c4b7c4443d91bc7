"""`moeforge compile` end to end on the tiny presets: parity, artifact contract, bad input."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest

from moeforge.cli import main
from moeforge.cli.inspect import op_counts
from moeforge.compile.driver import CompileOptions, compile_model
from moeforge.core.artifact import ArtifactError, load_artifact
from moeforge.model.loader import load_model
from moeforge.verify.parity import default_prompt, run_parity

PRESETS = ("tiny-llama", "tiny-deepseek-v3", "tiny-deepseek-v2")


@pytest.fixture(scope="session")
def artifacts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("artifacts")
    out = {}
    for name in PRESETS:
        result = compile_model(CompileOptions(model=name, output_dir=root / name, max_seq_len=256, progress=False))
        out[name] = result.output_dir
    return out


@pytest.mark.parametrize("name", PRESETS)
def test_artifact_matches_pytorch(artifacts, name):
    artifact = load_artifact(artifacts[name])
    loaded = load_model(name)
    report = run_parity(artifact.model_path, artifact.manifest.kv_cache, loaded.model,
                        default_prompt(loaded.config.vocab_size, 16), decode_steps=16)
    assert report.max_abs_err <= 1e-4, report.table()
    assert report.greedy_match and report.top1_agreement == 1.0
    assert len(report.steps) == 17  # prefill + 16 decode steps


@pytest.mark.parametrize("name", PRESETS)
def test_manifest_records_the_contract(artifacts, name):
    artifact = load_artifact(artifacts[name])
    manifest = artifact.manifest
    config = load_model(name).config
    assert manifest.format_version == 1 and manifest.target == "ort" and manifest.precision == "fp32"
    assert [p["name"] for p in manifest.passes][:2] == ["cleanup", "rms_norm"]
    kv_pass = next(p for p in manifest.passes if p["name"] == "kv_cache")
    assert kv_pass["matches"] == config.num_hidden_layers
    assert manifest.kv_cache.max_seq_len == 256
    per_token = config.kv_cache_values_per_token("absorb") * 4 * config.num_hidden_layers
    assert manifest.kv_cache.bytes_per_token == per_token
    assert {"model.onnx", "model.onnx.data", "tokenizer.json"} <= set(manifest.files)
    assert all(len(entry["sha256"]) == 64 for entry in manifest.files.values())
    names = {spec.name for spec in manifest.inputs}
    assert {"input_ids", "position_ids", "attention_mask"} <= names
    assert manifest.model_config["model_type"] == config.model_type
    assert manifest.tool_versions["onnxruntime"]


def test_mla_artifact_caches_only_the_latent(artifacts):
    config = load_model("tiny-deepseek-v3").config
    graph = onnx.load(str(artifacts["tiny-deepseek-v3"] / "model.onnx"), load_external_data=False).graph
    caches = [v for v in graph.input if v.name.startswith("past_key_values.")]
    assert len(caches) == config.num_hidden_layers
    for value in caches:
        dims = value.type.tensor_type.shape.dim
        assert dims[1].dim_value == 1
        assert dims[3].dim_value == config.mla.kv_lora_rank + config.mla.qk_rope_head_dim


@pytest.mark.parametrize("name", PRESETS)
def test_loads_in_a_fresh_onnxruntime_without_custom_ops(artifacts, name):
    counts = op_counts(artifacts[name] / "model.onnx")
    domains = {op.rsplit(".", 1)[0] for op in counts if "." in op}
    assert domains <= {"com.microsoft"}  # standard ops and ORT's own contrib ops only
    code = ("import onnxruntime as ort, sys; s = ort.InferenceSession(sys.argv[1], providers=['CPUExecutionProvider']);"
            "print(len(s.get_inputs()))")
    proc = subprocess.run([sys.executable, "-c", code, str(artifacts[name] / "model.onnx")], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_fused_graph_of_deepseek(artifacts):
    config = load_model("tiny-deepseek-v3").config
    counts = op_counts(artifacts["tiny-deepseek-v3"] / "model.onnx")
    moe_layers = config.num_hidden_layers - config.moe.first_k_dense_replace
    assert counts.get("com.microsoft.MoE") == moe_layers
    assert counts.get("com.microsoft.GroupQueryAttention") == config.num_hidden_layers
    assert "RMSNormalization" not in counts and "Attention" not in counts
    assert not any(op.startswith("moeforge.") for op in counts)


def test_deepseek_router_op_is_lowered_for_onnxruntime(artifacts):
    """moeforge.MoERouter nodes become standard-op routing feeding com.microsoft.MoE (plugins/moe_router)."""
    model = onnx.load(str(artifacts["tiny-deepseek-v3"] / "model.onnx"), load_external_data=False)
    moe_nodes = [n for n in model.graph.node if (n.domain, n.op_type) == ("com.microsoft", "MoE")]
    assert moe_nodes and not model.functions
    producers = {out: n for n in model.graph.node for out in n.output}
    for node in moe_nodes:
        router_probs = producers[node.input[1]]  # Where(chosen, Log(scores), -inf) from ort_lowering
        assert router_probs.op_type == "Where" and producers[router_probs.input[1]].op_type == "Log"


# ----------------------------------------------------------------------------- CLI and bad input


def _cli(capsys, *args):
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_compile_check_inspect_parity(capsys, tmp_path):
    out = tmp_path / "llama"
    code, stdout, stderr = _cli(capsys, "compile", "tiny-llama", "-o", str(out), "--max-seq-len", "128", "--check",
                                "--quiet")
    assert code == 0, stderr
    assert "PASS" in stdout and (out / "manifest.json").is_file()
    code, stdout, _ = _cli(capsys, "inspect", str(out))
    assert code == 0 and "GroupQueryAttention" in stdout
    code, stdout, _ = _cli(capsys, "parity", str(out), "--steps", "4", "--json")
    report = json.loads(stdout)
    assert code == 0 and report["passed"] and len(report["steps"]) == 5
    for key in ("max_abs_err", "mean_abs_err", "cosine_min", "top1_agreement", "greedy_match"):
        assert (key in report and key in report["steps"][0]) or key == "greedy_match"


def test_existing_output_without_force_is_refused(capsys, artifacts, tmp_path):
    target = tmp_path / "existing"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    code, _, stderr = _cli(capsys, "compile", "tiny-llama", "-o", str(target), "--quiet")
    assert code == 2 and "--force" in stderr
    assert (target / "keep.txt").read_text() == "mine"


def test_unwritable_output_dir(capsys, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    code, _, stderr = _cli(capsys, "compile", "tiny-llama", "-o", str(blocker / "out"), "--quiet")
    assert code == 2 and str(blocker) in stderr


def test_flipped_byte_in_external_data_is_refused(capsys, artifacts, tmp_path):
    import shutil

    copy = tmp_path / "tampered"
    shutil.copytree(artifacts["tiny-llama"], copy)
    data = copy / "model.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    with pytest.raises(ArtifactError, match=r"model\.onnx\.data"):
        load_artifact(copy)
    code, _, stderr = _cli(capsys, "inspect", str(copy))
    assert code == 2 and "model.onnx.data" in stderr


def test_sigint_during_compile_leaves_nothing(tmp_path):
    out = tmp_path / "interrupted"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "moeforge.cli", "compile", "tiny-deepseek-v3", "-o", str(out),
                             "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=tmp_path)
    time.sleep(6)  # inside the export stage
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == []  # no temp directory either


def test_bad_max_seq_len(capsys, tmp_path):
    code, _, stderr = _cli(capsys, "compile", "tiny-llama", "-o", str(tmp_path / "x"), "--max-seq-len", "99999",
                           "--quiet")
    assert code == 2 and "max_position_embeddings" in stderr
    assert not (tmp_path / "x").exists()


def _engine_greedy_until_eos(path: Path, prompt: list[int], new_tokens: int) -> list[int]:
    """Our engine's greedy tokens, with a stopping EOS left out as onnxruntime-genai leaves it out."""
    from moeforge.runtime.engine import LLMEngine
    from moeforge.runtime.sampler import SamplingParams

    engine = LLMEngine.from_artifact(path)
    tokens = engine.generate([prompt], SamplingParams(max_tokens=new_tokens))[0].token_ids
    return tokens[:-1] if tokens and tokens[-1] in engine.eos_token_ids else tokens


def test_genai_runs_a_gqa_artifact(artifacts):
    pytest.importorskip("onnxruntime_genai")
    from moeforge.compile.genai_config import genai_greedy

    path = artifacts["tiny-llama"]
    prompt = default_prompt(512, 12, seed=3)
    ours = _engine_greedy_until_eos(path, prompt, 16)
    assert len(ours) > 0
    assert genai_greedy(path, [prompt], 16)[0] == ours



@pytest.mark.parametrize("name", ["tiny-llama", "tiny-deepseek-v3"])
def test_per_layer_parity_names_the_first_diverging_layer(artifacts, name):
    import torch

    from moeforge.verify.parity import run_layer_parity, torch_hidden_states

    artifact = load_artifact(artifacts[name])
    config = load_model(name).config
    assert len(artifact.manifest.layer_outputs) == config.num_hidden_layers
    prompt = default_prompt(config.vocab_size, 12)
    kv, layers = artifact.manifest.kv_cache, artifact.manifest.layer_outputs
    rows, first = run_layer_parity(artifact.model_path, kv, layers,
                                   torch_hidden_states(load_model(name).model, prompt), prompt)
    assert first is None and all(row.relative_err < 1e-5 for row in rows)
    # A reference whose layer 1 differs: layer 0 still agrees, layer 1 is named.
    perturbed = load_model(name).model
    with torch.no_grad():
        perturbed.model.layers[1].self_attn.o_proj.weight.mul_(1.5)
    rows, first = run_layer_parity(artifact.model_path, kv, layers, torch_hidden_states(perturbed, prompt), prompt)
    assert first == 1
    assert not rows[0].diverged and rows[1].diverged


def test_cli_per_layer(capsys, artifacts):
    code, stdout, _ = _cli(capsys, "parity", str(artifacts["tiny-deepseek-v2"]), "--steps", "2", "--per-layer")
    assert code == 0
    assert "no layer diverges" in stdout
    assert stdout.count("\n") > 3 + 3  # steps table + one row per layer


def test_golden_outputs_are_saved_in_polygraphy_format(artifacts):
    from polygraphy.json import load_json

    from moeforge.runtime.backends.onnxruntime import OrtSession
    from moeforge.verify.golden import compare_with_golden, load_golden

    root = artifacts["tiny-deepseek-v3"]
    assert {"golden/inputs.json", "golden/outputs.json"} <= set(load_artifact(root).manifest.files)
    assert load_json(str(root / "golden" / "outputs.json"))[0][0] == "onnxrt-cpu"
    feeds, golden = load_golden(root)
    # A fresh run on the saved inputs reproduces the golden logits; a perturbed one does not.
    session = OrtSession(root / "model.onnx", kv_cache=load_artifact(root).manifest.kv_cache)
    (logits,) = session.session.run(["logits"], feeds)
    assert compare_with_golden(root, logits).max_abs_err < 1e-5
    assert compare_with_golden(root, logits + 0.01).max_abs_err > 5e-3
    # And it agrees with PyTorch on the same prompt.
    import torch

    ids = feeds["input_ids"]
    reference = load_model("tiny-deepseek-v3").model(torch.tensor(ids), torch.tensor(feeds["position_ids"])).logits
    np.testing.assert_allclose(golden, reference.detach().numpy(), atol=1e-4)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-deepseek-v2"])
def test_run_artifact_equals_torch_reference(capsys, artifacts, name):
    args = ["--prompt-ids", "5,6,7,8,9", "--max-new-tokens", "12", "--ignore-eos", "--json"]
    code, stdout, stderr = _cli(capsys, "run", str(artifacts[name]), *args)
    assert code == 0, stderr
    code_ref, stdout_ref, _ = _cli(capsys, "run", name, "--backend", "torch", *args)
    assert code_ref == 0
    assert json.loads(stdout)["token_ids"] == json.loads(stdout_ref)["token_ids"]
    code, _, stderr = _cli(capsys, "run", name, "--backend", "onnxruntime", "--prompt-ids", "1")
    assert code == 2 and "not an artifact" in stderr


def test_bench_reports_speeds_and_ratios(capsys, artifacts):
    code, stdout, stderr = _cli(capsys, "bench", str(artifacts["tiny-llama"]), "--batch", "2", "--prompt-len", "8",
                                "--new-tokens", "4", "--json")
    assert code == 0, stderr
    result = json.loads(stdout)
    ours = result["moeforge_onnxruntime"]
    assert ours["prefill_tokens_per_s"] > 0 and ours["decode_tokens_per_s"] > 0 and ours["peak_rss_mib"] > 0
    assert 0 < ours["attention_time_share"] < 1
    assert result["pytorch_eager"]["decode_tokens_per_s"] > 0
    assert "pytorch_eager" in result["decode_speedup_vs"]
    assert result["transformers_eager"] is None  # a preset has no transformers checkpoint to compare with


def test_bench_roofline_reports_the_active_experts_bytes(capsys, artifacts, tmp_path, monkeypatch):
    monkeypatch.setenv("MOEFORGE_CACHE_DIR", str(tmp_path))
    artifact = artifacts["tiny-deepseek-v3"]
    code, stdout, stderr = _cli(capsys, "bench", str(artifact), "--batch", "1", "--prompt-len", "8",
                                "--new-tokens", "6", "--no-compare", "--roofline", "--json")
    assert code == 0, stderr
    roof = json.loads(stdout)["moeforge_onnxruntime"]["roofline"]
    moe = load_artifact(artifact).config().moe
    # batch 1: each decode step computes exactly top_k experts in every MoE layer
    assert roof["active_experts_per_layer"] == [moe.num_experts_per_tok] * len(roof["experts_per_layer"])
    assert roof["experts_per_layer"] == [moe.n_routed_experts] * len(roof["experts_per_layer"])
    assert 0 < roof["active_expert_bytes"] < roof["weight_bytes"] <= roof["step_bytes"]
    assert roof["kv_bytes"] > 0 and 0 < roof["fraction"] <= 1 and roof["bandwidth_gb_s"] > 0
    # the bandwidth probed in this run, before and after its timed steps; the cache is only a fallback
    assert roof["bandwidth_source"] == "probed in this run"
    assert [p["when"] for p in roof["bandwidth_probes"]] == ["before", "after"]
    assert not (tmp_path / "bandwidth.json").exists()
    code, stdout, _ = _cli(capsys, "bench", str(artifact), "--batch", "2", "--prompt-len", "8", "--new-tokens", "6",
                           "--no-compare", "--roofline")
    assert code == 0 and "of the roofline" in stdout and "experts computed per MoE layer" in stdout
    code, _, stderr = _cli(capsys, "bench", str(artifact), "--no-compare", "--remeasure-bandwidth")
    assert code == 2 and "--roofline" in stderr
