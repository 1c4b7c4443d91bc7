"""``benchmarks/genai_builder.py ARTIFACT``: onnxruntime-genai's builder makes its own model of the
artifact's source checkpoint (a tiny Hugging Face Llama with a byte-level tokenizer here), both are timed in
alternating rounds, and the report's ratios are the medians' ratios. Both run fp32 weights of one checkpoint, so
their greedy tokens must agree: the comparison times the same model."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from moeforge.compile.driver import CompileOptions, compile_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from genai_builder import main
from peers import usable_cores

NEW_TOKENS = 6


def _tiny_checkpoint(folder: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2,
                                 max_position_embeddings=256)).save_pretrained(folder)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # 256 byte symbols: the vocabulary
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=alphabet[0]).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("genai-builder")
    checkpoint = _tiny_checkpoint(root / "checkpoint")
    return compile_model(CompileOptions(model=str(checkpoint), output_dir=root / "artifact", max_seq_len=128,
                                        progress=False)).output_dir


def test_compare_genai_builder_times_the_same_model(capsys, artifact, tmp_path):
    peers = tmp_path / "peers"
    code = main([str(artifact), "--rounds", "2", "--prompt-len", "4",
                 "--new-tokens", str(NEW_TOKENS), "--prefill-len", "16", "--peer-dir", str(peers), "--json"])
    out = capsys.readouterr().out
    assert code == 0
    result = json.loads(out)
    assert set(result["systems"]) == {"moeforge fp32", "genai-builder fp32"}  # fp32 artifact: the fp32 build
    assert result["threads"] == usable_cores()  # every system gets the same threads, not its runtime's default
    assert (peers / "genai_fp32" / "genai_config.json").is_file()
    assert not list(peers.glob(".genai_fp32.*"))  # built in a scratch folder, then renamed
    medians = result["medians"]
    ours, theirs = medians["moeforge fp32"]["b1"], medians["genai-builder fp32"]["b1"]
    assert ours["runs"] == theirs["runs"] == 2
    ratio = result["ratios"]["decode b1: moeforge fp32 / genai-builder fp32"]
    assert ratio == pytest.approx(ours["decode_tokens_per_s"] / theirs["decode_tokens_per_s"], rel=1e-2)
    assert result["greedy_prefix_agreement"]["genai-builder fp32 b1"] == NEW_TOKENS
    assert "| genai-builder fp32 |" in result["markdown"]


def test_compare_genai_builder_needs_a_checkpoint(capsys, tmp_path):
    """A built-in tiny preset has no checkpoint for the builder to read: a clear error, nothing built."""
    out = compile_model(CompileOptions(model="tiny-llama", output_dir=tmp_path / "tiny", max_seq_len=64,
                                       progress=False)).output_dir
    code = main([str(out), "--peer-dir", str(tmp_path / "peers")])
    assert code == 2
    assert "checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "peers").exists()
