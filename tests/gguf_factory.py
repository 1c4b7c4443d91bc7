"""The tests' one GGUF writer: a file from a description (architecture, metadata, tensors, tokenizer vocabulary).

Test modules import it as the others import shared helpers under ``--import-mode=importlib``::

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the GGUF factory
    from gguf_factory import Vocab, write_gguf_file

``write_gguf_file`` goes through the gguf package's own ``GGUFWriter`` (what llama.cpp's converter uses), so the
files are real GGUFs; what a test checks about its model stays in the test.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias

import gguf
import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType

# A tensor: an array stored in its own dtype (float32 -> F32, float16 -> F16, int32 -> I32, ...), or (array, type):
# a float array quantised to ``type`` by the gguf package (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q8_0, ...), or a
# uint8 array that already holds ``type``'s stored blocks along its last axis (K-quants and i-quants, which only
# llama.cpp quantises).
TensorSpec: TypeAlias = np.ndarray | tuple[np.ndarray, GGMLQuantizationType]


@dataclass(frozen=True)
class Vocab:
    """The ``tokenizer.ggml.*`` keys. ``model``: "gpt2" (byte-level BPE, ``merges`` as "a b") or "llama"
    (SentencePiece, ``scores``, ``token_types``); empty sequences and None ids are left out of the file."""

    tokens: Sequence[str]
    model: str = "gpt2"
    pre: str | None = None
    merges: Sequence[str] = ()
    scores: Sequence[float] = ()
    token_types: Sequence[int] = ()
    bos: int | None = None
    eos: int | None = None
    unk: int | None = None


def write_gguf_file(path: Path | str, arch: str, *, metadata: Mapping[str, Any] | None = None,
                    tensors: Mapping[str, TensorSpec] | None = None, vocab: Vocab | None = None) -> Path:
    """Write a GGUF of ``arch`` (``general.architecture``) to ``path`` and return the path.

    ``metadata``: key -> value; a key may hold ``{arch}``, as the ``gguf.Keys`` constants do
    (``gguf.Keys.LLM.BLOCK_COUNT``). The value's Python type picks the GGUF type, as the converter writes each key:
    bool BOOL, int UINT32, float FLOAT32, str STRING, list or tuple ARRAY (of INT32, FLOAT32 or STRING); None leaves
    the key out. ``vocab``'s keys come first; a ``metadata`` key of the same name replaces one. ``tensors``: name ->
    ``TensorSpec``, in file order.
    """
    writer = gguf.GGUFWriter(str(path), arch)
    kv = {**(_vocab_metadata(vocab) if vocab is not None else {}), **(metadata or {})}
    for key, value in kv.items():
        if value is not None:
            writer.add_key_value(key.format(arch=arch), value, _value_type(key, value))
    for name, spec in (tensors or {}).items():
        if isinstance(spec, np.ndarray):
            writer.add_tensor(name, spec)
            continue
        data, qtype = spec
        stored = data if data.dtype == np.uint8 else gguf.quants.quantize(data, qtype)
        writer.add_tensor(name, stored, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def _vocab_metadata(vocab: Vocab) -> dict[str, Any]:
    keys = gguf.Keys.Tokenizer
    return {keys.MODEL: vocab.model, keys.PRE: vocab.pre, keys.LIST: list(vocab.tokens),
            keys.MERGES: list(vocab.merges) or None, keys.SCORES: list(vocab.scores) or None,
            keys.TOKEN_TYPE: list(vocab.token_types) or None, keys.BOS_ID: vocab.bos, keys.EOS_ID: vocab.eos,
            keys.UNK_ID: vocab.unk}


def _value_type(key: str, value: Any) -> GGUFValueType:
    if isinstance(value, bool | np.bool_):  # before int: a bool is an int
        return GGUFValueType.BOOL
    if isinstance(value, int | np.integer):
        return GGUFValueType.UINT32
    if isinstance(value, float | np.floating):
        return GGUFValueType.FLOAT32
    if isinstance(value, str):
        return GGUFValueType.STRING
    if isinstance(value, list | tuple):
        return GGUFValueType.ARRAY
    raise TypeError(f"metadata {key!r}: no GGUF type for {type(value).__name__}")


def converter_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute, verbatim semantics: Q/K rows from HF's rotate_half halves
    to llama.cpp's interleaved pairs (Q with ``n_head``, K with ``n_head_kv``)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))
