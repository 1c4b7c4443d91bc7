"""The command line: reference generation and bad input (clear message, exit code 2)."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moeforge.cli import main
from moeforge.model.loader import load_model
from moeforge.runtime.sampler import SamplingParams
from moeforge.verify.generate import generate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the GGUF factory
from gguf_factory import write_gguf_file


def _run(capsys, *args):
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("preset", ["tiny-deepseek-v3", "tiny-deepseek-v2", "tiny-llama"])
def test_run_preset_json_equals_in_process_generation(capsys, preset):
    code, out, err = _run(capsys, "run", preset, "--backend", "torch", "--prompt-ids", "1,2,3,4",
                          "--max-new-tokens", "8", "--ignore-eos", "--json")
    assert code == 0, err
    result = json.loads(out)
    expected = generate(load_model(preset).model, [1, 2, 3, 4], SamplingParams(max_tokens=8)).token_ids
    assert result["token_ids"] == expected and len(expected) == 8
    assert isinstance(result["text"], str)


def test_seeded_sampling_is_reproducible_and_differs_from_greedy(capsys):
    args = ["run", "tiny-llama", "--prompt", "hello", "--max-new-tokens", "12", "--ignore-eos", "--json"]
    runs = [json.loads(_run(capsys, *args, "--temperature", "1.5", "--seed", str(s))[1])["token_ids"]
            for s in (1, 1, 2)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_stream_prints_the_same_text(capsys):
    code, plain, _ = _run(capsys, "run", "tiny-llama", "--prompt", "abc", "--max-new-tokens", "6", "--ignore-eos")
    code2, streamed, _ = _run(capsys, "run", "tiny-llama", "--prompt", "abc", "--max-new-tokens", "6",
                              "--ignore-eos", "--stream")
    assert code == code2 == 0
    assert streamed == plain


def test_console_script_is_installed():
    exe = shutil.which("moeforge")
    assert exe is not None
    proc = subprocess.run([exe, "run", "tiny-llama", "--prompt-ids", "5,6", "--max-new-tokens", "3",
                           "--ignore-eos", "--json"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads(proc.stdout)["token_ids"]) == 3


def test_config_command_plans_full_size_models(capsys):
    code, out, _ = _run(capsys, "config", "deepseek-v3", "--json")
    assert code == 0
    summary = json.loads(out)
    assert summary["kv_cache_values_per_token_per_layer"]["absorb"] == 576
    assert summary["parameters"] > 6e11


# ----------------------------------------------------------------------------- bad input


def _save_tiny_llama(folder):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(folder)
    return folder


def _expect_bad_input(capsys, match, *args):
    code, _, err = _run(capsys, *args)
    assert code == 2
    assert match in err, err
    return err


def test_missing_path(capsys, tmp_path):
    _expect_bad_input(capsys, "not found", "run", str(tmp_path / "nope"), "--prompt-ids", "1")


def test_missing_config_field(capsys, tmp_path):
    folder = _save_tiny_llama(tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    del config["hidden_size"]
    (folder / "config.json").write_text(json.dumps(config))
    _expect_bad_input(capsys, "hidden_size", "run", str(folder), "--prompt-ids", "1")


def test_unsupported_model_type(capsys, tmp_path):
    folder = _save_tiny_llama(tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "gpt2"
    (folder / "config.json").write_text(json.dumps(config))
    _expect_bad_input(capsys, "gpt2", "run", str(folder), "--prompt-ids", "1")


def test_tensor_shape_mismatch(capsys, tmp_path):
    folder = _save_tiny_llama(tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] = 48  # weights say 64
    (folder / "config.json").write_text(json.dumps(config))
    err = _expect_bad_input(capsys, "shape", "run", str(folder), "--prompt-ids", "1")
    assert "mlp" in err


def test_missing_shard(capsys, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path / "m"
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(
        folder, max_shard_size="20KB")
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()
    _expect_bad_input(capsys, shards[-1].name, "run", str(folder), "--prompt-ids", "1")


def test_truncated_safetensors(capsys, tmp_path):
    folder = _save_tiny_llama(tmp_path / "m")
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    _expect_bad_input(capsys, "model.safetensors", "run", str(folder), "--prompt-ids", "1")


def test_gguf_of_unsupported_architecture(capsys, tmp_path):
    import numpy as np

    path = write_gguf_file(tmp_path / "falcon.gguf", "falcon", metadata={"{arch}.block_count": 1},
                           tensors={"token_embd.weight": np.zeros((4, 8), dtype=np.float32)})
    _expect_bad_input(capsys, "falcon", "run", str(path), "--prompt-ids", "1")


def test_prompt_errors_are_clear(capsys):
    _expect_bad_input(capsys, "outside the vocabulary", "run", "tiny-llama", "--prompt-ids", "1,99999")
    _expect_bad_input(capsys, "exceeds", "run", "tiny-llama", "--prompt-ids", "1", "--max-new-tokens", "5000")
    _expect_bad_input(capsys, "--top-p must", "run", "tiny-llama", "--prompt-ids", "1", "--top-p", "0")  # the flag
    _expect_bad_input(capsys, "shapes only", "run", "deepseek-v3", "--prompt-ids", "1")


def test_run_with_speculative_tokens_prints_plain_greedy_tokens(capsys, tmp_path):
    out = tmp_path / "artifact"
    assert _run(capsys, "compile", "tiny-llama", "-o", str(out), "--max-seq-len", "64")[0] == 0
    prompt = ",".join(map(str, [5, 6, 7, 8, 9] * 4))
    args = ["run", str(out), "--prompt-ids", prompt, "--max-new-tokens", "24", "--ignore-eos", "--json"]
    plain = json.loads(_run(capsys, *args)[1])["token_ids"]
    code, speculative, err = _run(capsys, *args, "--speculative-tokens", "4")
    assert code == 0, err
    expected = generate(load_model("tiny-llama").model, [5, 6, 7, 8, 9] * 4, SamplingParams(max_tokens=24))
    assert json.loads(speculative)["token_ids"] == plain == expected.token_ids
