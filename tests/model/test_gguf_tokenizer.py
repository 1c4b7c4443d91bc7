"""SentencePiece GGUF tokenizers (tokenizer.ggml.model "llama": Llama-2, Mistral, TinyLlama) against transformers'
GGUF tokenizer reading the same file: ids with BOS, decoded text, and the artifact's saved tokenizer.json."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGUFReader

from moeforge.model.gguf_tokenizer import merges_from_scores
from moeforge.model.tokenizer import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the GGUF factory
from gguf_factory import Vocab, write_gguf_file

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

SPACE = "\u2581"
# Pieces with descending scores (SentencePiece log-probabilities): merges are recovered best-first from them.
PIECES = [SPACE, "e", "t", "h", "a", "n", "d", "o", "l", "w", "r", "i", "s", SPACE + "t", "he", SPACE + "the",
          SPACE + "a", "nd", SPACE + "and", "ll", SPACE + "he", "llo", SPACE + "hello", "lo", "or", "ld", SPACE + "w",
          SPACE + "wor", SPACE + "world", SPACE * 2, SPACE * 3, "is", SPACE + "is", "th"]
TEXTS = ["the hello world", "  leading spaces", "and\nnew line\n", "ünï ☃ 日本 🙂", "<s>the</s> is<|user|>hi", "",
         "trailing ", "hello  world", " the", "\t tab", "<unk> and", "theis", "hello" * 20]


def _write(path: Path, *, with_merges: bool = False, add_space_prefix: bool | None = None,
           add_bos: bool | None = None) -> None:
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *PIECES, "<|user|>"]
    types = [2, 3, 3, *[6] * 256, *[1] * len(PIECES), 4]  # unknown, control, byte, normal, user-defined
    scores = [0.0] * 259 + [-float(i) for i in range(len(PIECES))] + [0.0]
    merges: list[str] = []
    if with_merges:  # merges in another order than the scores imply: the file's merges win (as in transformers)
        vocab = {t: i for i, t in enumerate(tokens)}
        merges = [f"{a} {b}" for a, b in merges_from_scores(vocab, dict(zip(tokens, scores, strict=True)))][::-1]
    write_gguf_file(
        path, "llama",
        metadata={gguf.Keys.LLM.BLOCK_COUNT: 1, gguf.Keys.Tokenizer.ADD_PREFIX: add_space_prefix,
                  gguf.Keys.Tokenizer.ADD_BOS: add_bos},  # None: left out
        tensors={"token_embd.weight": np.zeros((len(tokens), 8), np.float32)},
        vocab=Vocab(tokens, model="llama", merges=merges, scores=scores, token_types=types, bos=1, eos=2, unk=0))


def _metadata(path: Path) -> dict:
    reader = GGUFReader(path)
    return {key: field.contents() for key, field in reader.fields.items() if key.startswith("tokenizer.")}


VARIANTS = {"scores": {}, "merges": {"with_merges": True}, "no-prefix-space": {"add_space_prefix": False},
            "no-bos": {"add_bos": False}}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_sentencepiece_gguf_tokenises_as_transformers(variant: str, tmp_path: Path) -> None:
    path = tmp_path / "spm.gguf"
    _write(path, **VARIANTS[variant])
    ours = Tokenizer.from_gguf_metadata(_metadata(path))
    assert ours.add_bos is (variant != "no-bos")
    # The reference reads the same file, except for add_space_prefix=false, which transformers ignores: it is
    # checked against llama.cpp's meaning (no space prepended) with a file that leaves the flag out.
    reference_path = path if variant != "no-prefix-space" else tmp_path / "plain" / "spm.gguf"
    if reference_path != path:
        reference_path.parent.mkdir()
        _write(reference_path)
    reference = transformers.AutoTokenizer.from_pretrained(reference_path.parent, gguf_file=reference_path.name)
    saved = Tokenizer.from_file(ours.save(tmp_path / "artifact"))  # what an artifact ships
    pieces_used = set()
    for text in TEXTS:
        expected = reference(text, add_special_tokens=variant != "no-bos").input_ids
        if variant == "no-prefix-space":
            if not text or text.startswith(("<", " ")):
                continue  # no text to prefix, a special token first, or a space Metaspace does not double
            text = " " + text  # the space transformers' Metaspace would have prepended
        assert ours.encode(text) == expected, text
        assert saved.encode(text) == expected, text
        assert ours.decode(expected, skip_special_tokens=True) == reference.decode(
            expected, skip_special_tokens=True) or variant == "no-prefix-space", text
        if variant != "no-prefix-space":
            assert ours.decode(expected) == reference.decode(expected), text
        pieces_used |= set(expected)
    assert any(3 <= i < 259 for i in pieces_used)  # byte fallback exercised
    if variant != "no-prefix-space":  # its texts skip those starting with special tokens
        assert {0, 1, 2, 259 + len(PIECES)} <= pieces_used  # <unk>, <s>, </s>, <|user|> in the text stay whole


def test_merges_from_scores_order() -> None:
    vocab = {"a": 0, "b": 1, "c": 2, "ab": 3, "bc": 4, "abc": 5}
    scores = {"a": 0.0, "b": 0.0, "c": 0.0, "ab": -1.0, "bc": -0.5, "abc": -2.0}
    # best-scoring merged token first; abc splits two ways, ordered by the pieces' ids
    assert merges_from_scores(vocab, scores) == [("b", "c"), ("a", "b"), ("ab", "c"), ("a", "bc")]


def test_a_vocabulary_of_huge_tokens_is_refused_not_ground_through() -> None:
    from moeforge.core.errors import TokenizerError

    tokens = ["x" * 20_000] * 2 + ["a", "b"]  # 2 x 4e8 slicing steps if tried
    with pytest.raises(TokenizerError, match="too long to recover merges"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
                                      "tokenizer.ggml.scores": [0.0] * len(tokens)})


def test_a_bos_id_outside_the_vocabulary_is_named(tmp_path: Path) -> None:
    from moeforge.core.errors import TokenizerError

    path = tmp_path / "spm.gguf"
    _write(path)
    metadata = _metadata(path) | {"tokenizer.ggml.bos_token_id": 10_000}
    with pytest.raises(TokenizerError, match=r"bos_token_id 10000 is not a token of the 294-token vocabulary"):
        Tokenizer.from_gguf_metadata(metadata)


def test_chat_prompts_carry_the_templates_bos_only(tmp_path: Path) -> None:
    """A SentencePiece GGUF adds BOS by default and Llama-2-style templates write {{ bos_token }}: one BOS, as
    transformers' apply_chat_template(tokenize=True) gives."""
    import argparse

    from moeforge.cli.commands import _prompt_ids

    path = tmp_path / "spm.gguf"
    _write(path)
    metadata = _metadata(path) | {
        "tokenizer.chat_template": "{{ bos_token }}{% for m in messages %}[INST] {{ m.content }} [/INST]{% endfor %}"}
    tokenizer = Tokenizer.from_gguf_metadata(metadata)
    assert tokenizer.add_bos
    chat = _prompt_ids(argparse.Namespace(prompt="the world", prompt_ids=None, chat=True), tokenizer, "m")
    plain = _prompt_ids(argparse.Namespace(prompt="the world", prompt_ids=None, chat=False), tokenizer, "m")
    assert chat.count(1) == 1 and chat[0] == 1 and plain[0] == 1
