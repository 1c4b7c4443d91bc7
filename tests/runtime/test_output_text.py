"""The output text is made once, incrementally (runtime/output_text.py): it equals a whole-output decode, a stop string
ends it at the token that completed it with the text cut before the stop string, and the streamed deltas add up to
the final text without ever sending what a later token could take back."""

from __future__ import annotations

import numpy as np
import pytest

from moeforge.model.loader import load_model
from moeforge.runtime.output_text import OutputText


@pytest.fixture(scope="module")
def byte_tokenizer():
    """tiny-llama's merge-free byte-level tokenizer: a multi-byte character spans several tokens."""
    tokenizer = load_model("tiny-llama").tokenizer
    assert tokenizer is not None
    return tokenizer


def _stream(text: OutputText, ids: list[int], chunk_sizes: list[int]) -> tuple[list[str], int | None]:
    deltas, end, i = [], None, 0
    for size in chunk_sizes:
        if i >= len(ids):
            break
        end = text.feed(ids[i:i + size])
        i += size
        deltas.append(text.delta(finished=end is not None or i >= len(ids)))
        if end is not None:
            break
    return deltas, end


@pytest.mark.parametrize("seed", range(20))
def test_incremental_text_equals_a_whole_decode(byte_tokenizer, seed):
    rng = np.random.default_rng(seed)
    sample = "Grüße, 世界! naïve café 😀 — done"
    ids = byte_tokenizer.encode(sample[: int(rng.integers(1, len(sample)))], add_bos=False)
    text = OutputText(byte_tokenizer)
    deltas, end = _stream(text, ids, rng.integers(1, 4, size=len(ids)).tolist())
    text.finish(ids)
    assert end is None and text.text == byte_tokenizer.decode(ids, skip_special_tokens=True)
    assert "".join(deltas) == text.text  # the deltas add up to the text
    assert all("\ufffd" not in d for d in deltas)  # never half a character


def test_random_token_ids_decode_as_the_tokenizer_decodes_them(byte_tokenizer):
    rng = np.random.default_rng(1)
    for _ in range(50):
        ids = rng.integers(0, 256, int(rng.integers(1, 30))).tolist()  # arbitrary bytes, invalid UTF-8 included
        text = OutputText(byte_tokenizer)
        for token in ids:
            text.feed([token])
        text.finish(ids)
        assert text.text == byte_tokenizer.decode(ids, skip_special_tokens=True)


def test_a_stop_string_ends_the_output_at_the_token_that_completed_it(byte_tokenizer):
    ids = byte_tokenizer.encode("hello world, bye", add_bos=False)
    text = OutputText(byte_tokenizer, stop_strings=("o w", "zzz"))
    end = text.feed(ids)  # all at once, as a run of accepted draft tokens would come
    assert end == len(byte_tokenizer.encode("hello w", add_bos=False))  # "w" completed "o w"
    assert text.text == "hell" and text.delta(finished=True) == "hell"
    assert text.feed(ids) == end  # nothing is fed after the stop


def test_a_stop_string_across_token_boundaries_is_found_once(byte_tokenizer):
    ids = byte_tokenizer.encode("abcSTOPdef", add_bos=False)
    text = OutputText(byte_tokenizer, stop_strings=("STOP",))
    fed = [text.feed([t]) for t in ids]
    assert fed[:6] == [None] * 6 and fed[6:] == [7] * 4  # the "P" ended it; later feeds are refused with that end
    assert text.text == "abc"


def test_deltas_hold_back_what_may_still_become_a_stop_string(byte_tokenizer):
    text = OutputText(byte_tokenizer, stop_strings=("END",))
    sent = []
    for piece in ("abc", "E", "N", "x"):  # "EN" may become "END", then "ENx" cannot
        text.feed(byte_tokenizer.encode(piece, add_bos=False))
        sent.append(text.delta(finished=False))
    assert sent == ["abc", "", "", "ENx"]
    text.feed(byte_tokenizer.encode("yE", add_bos=False))
    assert text.delta(finished=False) == "y" and text.delta(finished=True) == "E"  # the end releases the rest


@pytest.mark.smollm2
def test_smollm2_random_tokens_decode_as_a_whole(smollm2_gguf):
    tokenizer = load_model("smollm2-135m").tokenizer
    assert tokenizer is not None
    rng = np.random.default_rng(0)
    for _ in range(100):
        ids = rng.integers(0, tokenizer.vocab_size, int(rng.integers(1, 40))).tolist()
        text = OutputText(tokenizer)
        text.feed(ids)
        text.finish(ids)
        assert text.text == tokenizer.decode(ids, skip_special_tokens=True)
