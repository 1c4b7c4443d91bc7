"""A real tokenizer (tokenizers' WordLevel, wrapped in moeforge's ``Tokenizer``) in which token t decodes to one
letter, ``alphabet[t % len(alphabet)]``: enough for stop strings and output text in engine tests with fake backends,
through the same incremental detokenisation the engine uses on real models."""

from __future__ import annotations

from tokenizers import Regex, decoders, models
from tokenizers import Tokenizer as BackendTokenizer

from moeforge.model.tokenizer import Tokenizer


def letter_tokenizer(alphabet: str, vocab_size: int) -> Tokenizer:
    """Token t is the string ``<letter><t // len(alphabet)>`` (unique), decoded with the digits dropped."""
    vocab = {f"{alphabet[t % len(alphabet)]}{t // len(alphabet)}": t for t in range(vocab_size)}
    backend = BackendTokenizer(models.WordLevel(vocab=vocab, unk_token=next(iter(vocab))))
    backend.decoder = decoders.Sequence([decoders.Replace(Regex("[0-9]+"), ""), decoders.Fuse()])
    return Tokenizer(backend, bos_token_id=None)
