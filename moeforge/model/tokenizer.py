"""Tokenizer: a ``tokenizers.Tokenizer`` plus the special-token ids and chat template generation needs.

Built from an HF ``tokenizer.json`` (+ ``tokenizer_config.json``), from GGUF metadata (byte-level or SentencePiece BPE,
rebuilt the way transformers' GGUF converter does it) or as a merge-free byte-level tokenizer for the
tiny preset models. ``save`` writes files both this class and transformers' ``AutoTokenizer`` read.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from moeforge.core.errors import TokenizerError
from moeforge.model.chat_template import render_chat_template
from moeforge.model.gguf_tokenizer import backend_from_gguf, bytes_to_unicode

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # where transformers v5 saves the template

def gguf_end_of_generation_ids(metadata: dict[str, Any]) -> tuple[int, ...]:
    """EOS plus llama.cpp's other end-of-generation ids (EOT, EOM) present in GGUF tokenizer metadata."""
    ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        value = metadata.get(key)
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    return tuple(ids)


class Tokenizer:
    """Text <-> ids, special-token ids and the chat template of one model."""

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int] = (),
        chat_template: str | None = None,
        add_bos: bool = False,
    ) -> None:
        self._backend = backend
        size = backend.get_vocab_size(with_added_tokens=True)
        for what, token_id in (("bos", bos_token_id), *(("eos", e) for e in eos_token_ids)):
            if token_id is not None and not 0 <= token_id < size:
                raise TokenizerError(f"{what} token id {token_id} is outside the vocabulary (size {size})")
        if add_bos and bos_token_id is None:
            raise TokenizerError("add_bos=True needs a bos token id")
        self.bos_token_id = bos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(int(e) for e in eos_token_ids)
        self.chat_template = chat_template
        self.add_bos = add_bos

    # ------------------------------------------------------------------ basic API
    @property
    def backend(self) -> BackendTokenizer:
        """The wrapped ``tokenizers.Tokenizer``."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Number of ids, added/special tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self._backend.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return self._backend.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else None

    @cached_property
    def max_token_chars(self) -> int:
        """The longest vocabulary entry, in characters: no token covers more of a text (byte-level entries have
        one character per byte, so this bounds the characters of decoded text too)."""
        return max(1, max((len(entry) for entry in self._backend.get_vocab(with_added_tokens=True)), default=1))

    def encode(self, text: str, add_bos: bool | None = None, max_tokens: int | None = None) -> list[int]:
        """Token ids of ``text``; special-token text (``<|im_start|>``) maps to its id.

        ``add_bos`` None uses the tokenizer's default (GGUF ``add_bos_token`` / tokenizer_config).
        The backend's post-processor is bypassed so BOS is added exactly once, here. ``max_tokens``: a text
        whose first (max_tokens + 1) * ``max_token_chars`` characters already make more than max_tokens + 1
        tokens (one more: the cut may split a token) is refused after tokenising only those (a server's context
        limit: megabytes of text are not tokenised just to be refused). Text that is not valid Unicode (a lone
        surrogate, as JSON's "\ud800" escape can carry) raises ``TokenizerError``.
        """
        if not isinstance(text, str):
            raise TokenizerError(f"encode takes a str, got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise TokenizerError(f"the text is not valid Unicode: {exc.reason} (U+{ord(text[exc.start]):04X}) at "
                                 f"character {exc.start}; send UTF-8 text (a surrogate pair, not half of one)"
                                 ) from None
        if max_tokens is not None and len(text) > (head := (max_tokens + 1) * self.max_token_chars):
            found = len(self._backend.encode(text[:head], add_special_tokens=False).ids)
            if found > max_tokens + 1:  # + 1: the cut may split the last token in two
                raise TokenizerError(f"the text makes more than {max_tokens} tokens ({found} in its first {head} of "
                                     f"{len(text)} characters); shorten it (nothing is truncated)")
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if self.add_bos if add_bos is None else add_bos:
            if self.bos_token_id is None:
                raise TokenizerError("add_bos=True but this tokenizer has no bos token")
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; special tokens are kept unless ``skip_special_tokens``."""
        ids = [int(i) for i in ids]
        vocab_size = self.vocab_size  # a call into the backend: once, not per id
        bad = [i for i in ids if not 0 <= i < vocab_size]
        if bad:
            raise TokenizerError(f"token ids {bad[:5]} are outside the vocabulary (size {vocab_size})")
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    # ------------------------------------------------------------------ chat template
    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render ``messages`` with the model's Jinja chat template, as transformers'
        ``apply_chat_template(..., tokenize=False)`` does (sandboxed, trim_blocks, lstrip_blocks)."""
        if not self.chat_template:
            raise TokenizerError("this tokenizer has no chat template")
        variables = {"bos_token": self.bos_token, "eos_token": self.eos_token, **kwargs}
        return render_chat_template(self.chat_template, messages, add_generation_prompt, variables)

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    max_tokens: int | None = None) -> list[int]:
        """Token ids of ``messages`` rendered with the chat template. No BOS is added: the template writes its own
        (``{{ bos_token }}``), as transformers' ``apply_chat_template(..., tokenize=True)`` and vLLM's chat API.
        ``max_tokens``: as ``encode``'s."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt),
                           add_bos=False, max_tokens=max_tokens)

    # ------------------------------------------------------------------ persistence
    def save(self, directory: str | Path) -> Path:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``directory``; returns it."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self._backend.save(str(directory / TOKENIZER_FILE))
        config = {
            # transformers reads this folder as a plain fast tokenizer (TokenizersBackend in v5).
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "eos_token_ids": list(self.eos_token_ids),  # ours: the token strings alone cannot list several
            "add_bos_token": self.add_bos,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "chat_template": self.chat_template,
        }
        (directory / TOKENIZER_CONFIG_FILE).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
        return directory

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_file(
        cls,
        path: str | Path,
        *,
        bos_token_id: int | None = None,
        eos_token_ids: Sequence[int] | None = None,
    ) -> Tokenizer:
        """Load ``tokenizer.json`` (a file, or a folder holding it) and the ``tokenizer_config.json``
        beside it if any. Explicit ids override the ones named in the config."""
        path = Path(path)
        file = path / TOKENIZER_FILE if path.is_dir() else path
        if not file.is_file():
            raise TokenizerError(f"no tokenizer file at {file}")
        try:
            backend = BackendTokenizer.from_file(str(file))
        except Exception as exc:  # tokenizers raises a bare Exception on bad JSON
            raise TokenizerError(f"{file} is not a valid tokenizers file: {exc}") from exc

        config: dict[str, Any] = {}
        config_file = file.parent / TOKENIZER_CONFIG_FILE
        if config_file.is_file():
            try:
                config = json.loads(config_file.read_text())
            except json.JSONDecodeError as exc:
                raise TokenizerError(f"{config_file} is not valid JSON: {exc}") from exc

        def token_id(key: str) -> int | None:
            value = config.get(key)
            if isinstance(value, dict):  # older files write {"content": "<s>", ...}
                value = value.get("content")
            if value is None:
                return None
            found = backend.token_to_id(value)
            if found is None:
                raise TokenizerError(f"{config_file}: {key} {value!r} is not in the vocabulary")
            return found

        # What the post-processor puts around empty text: [bos] for tokenizers that add BOS themselves.
        prefix = backend.encode("").ids[:1]
        if bos_token_id is None:
            bos_token_id = token_id("bos_token")
            if bos_token_id is None and "bos_token" not in config and prefix:
                bos_token_id = prefix[0]
        if eos_token_ids is None:
            if config.get("eos_token_ids"):
                eos_token_ids = [int(e) for e in config["eos_token_ids"]]
            else:
                eos = token_id("eos_token")
                eos_token_ids = () if eos is None else (eos,)
        add_bos = config.get("add_bos_token")
        if add_bos is None:
            # No flag (e.g. Llama 3): the tokenizer adds BOS iff its post-processor does.
            add_bos = bos_token_id is not None and prefix == [bos_token_id]
        template = config.get("chat_template")
        template_file = file.parent / CHAT_TEMPLATE_FILE
        if template is None and template_file.is_file():
            template = template_file.read_text()
        if isinstance(template, list):  # several named templates: use the default one
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        return cls(backend, bos_token_id=bos_token_id, eos_token_ids=eos_token_ids, chat_template=template,
                   add_bos=bool(add_bos))

    @classmethod
    def from_gguf_metadata(cls, metadata: dict[str, Any]) -> Tokenizer:
        """Rebuild the tokenizer GGUF metadata describes (the ``tokenizer.*`` keys, arrays as lists): byte-level
        BPE (``tokenizer.ggml.model`` "gpt2") or SentencePiece BPE ("llama"), as transformers' GGUF converter
        does (``moeforge/model/gguf_tokenizer.py``)."""
        backend, add_bos = backend_from_gguf(metadata)
        bos = metadata.get("tokenizer.ggml.bos_token_id")
        bos = None if bos is None else int(bos)
        if add_bos and bos is not None:
            _add_bos_post_processor(backend, bos)
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_ids=gguf_end_of_generation_ids(metadata),
            chat_template=metadata.get("tokenizer.chat_template"),
            add_bos=add_bos,
        )

    @classmethod
    def byte_level(cls, vocab_size: int, bos_id: int, eos_id: int, *, add_bos: bool = True) -> Tokenizer:
        """Merge-free byte-level tokenizer for tiny preset models: id b (0..255) is byte b, plus special
        ``<bos>``/``<eos>`` at the given ids; other ids up to ``vocab_size`` are reserved special tokens."""
        if vocab_size < 258:
            raise TokenizerError(f"a byte-level tokenizer needs vocab_size >= 258 (256 bytes + bos + eos), "
                                 f"got {vocab_size}")
        for what, token_id in (("bos_id", bos_id), ("eos_id", eos_id)):
            if not 256 <= token_id < vocab_size:
                raise TokenizerError(f"{what} {token_id} must be in 256..{vocab_size - 1} (ids 0..255 are bytes)")
        if bos_id == eos_id:
            raise TokenizerError(f"bos_id and eos_id must differ, both are {bos_id}")
        spelling = bytes_to_unicode()
        vocab = {spelling[b]: b for b in range(256)}
        # Every id gets a token, so the tokenizer's vocab_size equals the model's.
        specials = {i: f"<|reserved_{i}|>" for i in range(256, vocab_size)} | {bos_id: "<bos>", eos_id: "<eos>"}
        vocab |= {token: i for i, token in specials.items()}
        backend = BackendTokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        backend.decoder = decoders.ByteLevel()
        backend.add_special_tokens([AddedToken(specials[i], normalized=False, special=True)
                                    for i in range(256, vocab_size)])
        if add_bos:
            _add_bos_post_processor(backend, bos_id)
        return cls(backend, bos_token_id=bos_id, eos_token_ids=(eos_id,), add_bos=add_bos)

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token_id}, eos={self.eos_token_ids}, "
                f"add_bos={self.add_bos}, chat_template={'yes' if self.chat_template else 'no'})")


def _add_bos_post_processor(backend: BackendTokenizer, bos_id: int) -> None:
    # ``encode`` adds BOS itself; this makes the saved tokenizer.json add it too for other readers
    # (transformers, onnxruntime-genai) that encode with special tokens.
    token = backend.id_to_token(bos_id)
    backend.post_processor = processors.TemplateProcessing(
        single=f"{token} $A", pair=f"{token} $A $B:1", special_tokens=[(token, bos_id)]
    )
