"""Tokenizers from GGUF metadata: what a GGUF stores instead of a ``tokenizer.json``.

llama.cpp writes the vocabulary (``tokenizer.ggml.tokens``), per-token scores and types, the merges (byte-level
BPE) and the special-token ids as metadata. The tokenizer is rebuilt the way transformers' GGUF converter
(integrations/gguf/gguf_tokenizer_mapping.py) rebuilds it, on the ``tokenizers`` library:

- ``gpt2``: byte-level BPE (Llama-3, Qwen2/3, SmolLM2), with the pre-tokenizer split ``tokenizer.ggml.pre`` names;
- ``llama``: SentencePiece BPE with byte fallback (Llama-2, Mistral, TinyLlama); the file's merges, or, in files
  without them (the usual case), merges recovered from the per-token scores, best-scoring first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cache
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from moeforge.core.errors import TokenizerError

SUPPORTED_GGUF_TOKENIZERS = ("gpt2", "llama")
MAX_MERGE_RECOVERY_WORK = 200_000_000  # sum of squared token lengths (see merges_from_scores)
_SPIECE_SPACE = "\u2581"  # SentencePiece's visible space

# GGUF token types (llama.cpp's llama_token_type).
_CONTROL, _USER_DEFINED = 3, 4

# Pre-tokenizer splits by ``tokenizer.ggml.pre``, as transformers' GGUF converter
# (integrations/gguf/gguf_tokenizer_mapping.py, GGUF_PRE_TOKENIZER_SPLITS) assigns them. Any other
# value, including SmolLM2's "smollm", gets GPT-2's byte-level regex: that is what transformers does.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GGUF_PRE_TOKENIZER_SPLITS: dict[str, str] = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
         "jina-v5-nano", "dbrx", "smaug-bpe"),
        _LLAMA3_SPLIT,
    ),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}


@cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level BPE vocabularies are spelled in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:  # control bytes, space, etc. move to code points 256+ so every byte is visible
            table[b] = chr(256 + extra)
            extra += 1
    return table


def backend_from_gguf(metadata: dict[str, Any]) -> tuple[BackendTokenizer, bool]:
    """(``tokenizers.Tokenizer``, whether encoding adds BOS by default) for GGUF tokenizer metadata.
    TokenizerError naming the problem for an unsupported tokenizer model or inconsistent metadata."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind not in SUPPORTED_GGUF_TOKENIZERS:
        raise TokenizerError(f"GGUF tokenizer model {kind!r} is not supported; supported: 'gpt2' (byte-level BPE), "
                             "'llama' (SentencePiece BPE)")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not tokens or not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise TokenizerError("GGUF tokenizer metadata has no 'tokenizer.ggml.tokens' (a list of strings)")
    token_types: list[int] = list(metadata.get("tokenizer.ggml.token_type") or ())
    for key in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):
        token_id = metadata.get(key)
        if token_id is not None and (isinstance(token_id, bool) or not isinstance(token_id, int)
                                     or not 0 <= token_id < len(tokens)):
            raise TokenizerError(f"GGUF {key} {token_id!r} is not a token of the {len(tokens)}-token vocabulary")
    if kind == "gpt2":
        backend = _byte_level(metadata, tokens, token_types)
        # transformers defaults this to False for byte-level BPE.
        return backend, bool(metadata.get("tokenizer.ggml.add_bos_token", False))
    backend = _sentencepiece(metadata, tokens, token_types)
    # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise (and transformers follows).
    default_bos = metadata.get("tokenizer.ggml.bos_token_id") is not None
    return backend, bool(metadata.get("tokenizer.ggml.add_bos_token", default_bos))


def _file_merges(metadata: dict[str, Any]) -> list[tuple[str, str]]:
    merges = []
    for merge in metadata["tokenizer.ggml.merges"]:
        pair = merge.split(" ") if isinstance(merge, str) else []
        if len(pair) != 2:
            raise TokenizerError(f"GGUF merge {merge!r} is not two tokens separated by one space")
        merges.append((pair[0], pair[1]))
    return merges


def _bpe(vocab: dict[str, int], merges: list[tuple[str, str]], **options: Any) -> BackendTokenizer:
    try:
        return BackendTokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, **options))
    except Exception as exc:
        raise TokenizerError(f"cannot build a BPE tokenizer from the GGUF vocabulary: {exc}") from exc


def _byte_level(metadata: dict[str, Any], tokens: list[str], token_types: list[int]) -> BackendTokenizer:
    if not metadata.get("tokenizer.ggml.merges"):
        raise TokenizerError("GGUF tokenizer metadata has no 'tokenizer.ggml.merges'")
    # Tokens are stored in the byte alphabet already; any that is not (a raw-text token) is respelled.
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())

    def spell(token: str) -> str:
        return token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8"))

    vocab = {spell(token): index for index, token in enumerate(tokens)}
    backend = _bpe(vocab, _file_merges(metadata), continuing_subword_prefix="", end_of_word_suffix="",
                   fuse_unk=False)
    split = GGUF_PRE_TOKENIZER_SPLITS.get(metadata.get("tokenizer.ggml.pre", ""))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # GPT-2's regex
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated"),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    backend.decoder = decoders.ByteLevel()
    # A "control" token spelled outside the byte alphabet is a llama.cpp mislabel that transformers skips.
    _add_marked_tokens(backend, tokens, token_types, vocab, control_ok=lambda t: set(t) <= alphabet)
    return backend


def _sentencepiece(metadata: dict[str, Any], tokens: list[str], token_types: list[int]) -> BackendTokenizer:
    vocab = {token: index for index, token in enumerate(tokens)}
    scores = metadata.get("tokenizer.ggml.scores")
    if metadata.get("tokenizer.ggml.merges"):
        # The file's merges when it has them, as transformers' converter does (converters that write them for a
        # Llama-family tokenizer.json give placeholder scores, which would rank the merges arbitrarily).
        merges = _file_merges(metadata)
    elif isinstance(scores, list) and len(scores) == len(tokens):
        merges = merges_from_scores(vocab, dict(zip(tokens, scores, strict=True)))
    else:
        raise TokenizerError("a SentencePiece GGUF needs 'tokenizer.ggml.scores', one per token (or merges), to "
                             "know the order in which pieces merge")
    backend = _bpe(vocab, merges, fuse_unk=True, byte_fallback=True)
    prefix_space = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=_SPIECE_SPACE, prepend_scheme="first" if prefix_space else "never", split=False)
    steps = [decoders.Replace(_SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix_space:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    unknown = metadata.get("tokenizer.ggml.unknown_token_id")
    if isinstance(unknown, int) and 0 <= unknown < len(tokens):  # transformers keeps <unk> whole, as a special
        backend.add_special_tokens([AddedToken(tokens[unknown], normalized=False, special=True)])
    _add_marked_tokens(backend, tokens, token_types, vocab, control_ok=lambda t: True)
    return backend


def merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges a SentencePiece vocabulary implies: every split of a token into two tokens of the vocabulary,
    ordered by the merged token's score (best first), then by the pieces' lengths; within one token, by the
    pieces' ids (transformers' ``generate_merges``, so both tokenise alike)."""
    # Each token of length L is tried at L - 1 split points, each slicing O(L): bound the work a crafted vocabulary
    # can ask for (real ones: Llama-2 ~2e6, Gemma's 256k tokens ~2e7).
    work = sum(len(token) ** 2 for token in scores)
    if work > MAX_MERGE_RECOVERY_WORK:
        raise TokenizerError(f"this SentencePiece vocabulary's tokens are too long to recover merges from (sum of "
                             f"squared token lengths {work:.2e} > {MAX_MERGE_RECOVERY_WORK:.0e}): the GGUF is corrupt "
                             "or not a tokenizer vocabulary")
    found: list[tuple[str, str, float]] = []
    for token, score in scores.items():
        local = [(token[:i], token[i:], score) for i in range(1, len(token))
                 if token[:i] in vocab and token[i:] in vocab]
        found.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


def _add_marked_tokens(backend: BackendTokenizer, tokens: Sequence[str], token_types: Sequence[int],
                       vocab: dict[str, int], control_ok: Callable[[str], bool]) -> None:
    # Control tokens (<|im_end|>, <s>) stay whole and are special; user-defined ones (<think>) stay whole too.
    control = [AddedToken(t, normalized=False, special=True)
               for t, kind in zip(tokens, token_types, strict=False) if kind == _CONTROL and control_ok(t)]
    user = [AddedToken(t, normalized=False, special=False)
            for t, kind in zip(tokens, token_types, strict=False) if kind == _USER_DEFINED and t in vocab]
    if control:
        backend.add_special_tokens(control)
    if user:
        backend.add_tokens(user)
