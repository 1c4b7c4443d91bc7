"""Read a Hugging Face safetensors checkpoint into moeforge's parameter naming, one tensor at a time.

``read_hf_checkpoint(folder, config)`` checks the whole checkpoint up front from the safetensors
headers (missing / unexpected tensors, missing shards, truncated files, incomplete expert sets, FP8
scales, non-float dtypes, more layers or experts in the config than in the files) and raises
``CheckpointError`` before any weight is read. Iterating it then yields
``(name, tensor)`` in ``expected_keys(config)`` order, reading memory-mapped with ``safe_open``
(never pickle), so a caller can assign each tensor into a meta-initialised model and drop it.

Layouts accepted for routed experts of MoE layer i (E experts, intermediate I, hidden H):
- per expert (DeepSeek originals; what transformers v5 ``save_pretrained`` writes by default):
  ``model.layers.i.mlp.experts.{e}.{gate_proj,up_proj,down_proj}.weight`` ([I, H], [I, H], [H, I]);
- fused (transformers v5 in-memory layout, ``save_pretrained(save_original_format=False)``):
  ``model.layers.i.mlp.experts.gate_up_proj`` [E, 2I, H] (gate rows first, then up rows: HF computes
  ``gate, up = linear(x, gate_up_proj[e]).chunk(2, dim=-1)``) and ``mlp.experts.down_proj`` [E, H, I].
Both become our stacked ``mlp.experts.gate_proj`` [E, I, H], ``up_proj`` [E, I, H], ``down_proj``
[E, H, I].

Family names read as ours (``_canonical_names``): Mixtral's original layout, which transformers v5
``save_pretrained`` writes back, ``model.layers.i.block_sparse_moe.{gate, experts.{e}.w1|w3|w2}`` is our
``mlp.{gate, experts.{e}.gate_proj|up_proj|down_proj}`` (w1 = gate, w3 = up, w2 = down). q/k norms
(Qwen3-MoE, GLM-4.5 with use_qk_norm, OLMoE) are ``self_attn.q_norm.weight`` / ``self_attn.k_norm.weight``.
DeepSeek-V3.2's indexer: ``self_attn.indexer.{wq_b,wk,weights_proj}.weight``, ``self_attn.indexer.k_norm.{weight,
bias}``.

FP8 (DeepSeek-V3): a float8_e4m3fn tensor ``X`` with a float32 sibling ``X_scale_inv`` is dequantised
block-wise (``moeforge.model.fp8``); ``_scale_inv`` tensors never appear in our naming. DeepSeek-V4's ue8m0 scales
(float8_e8m0fnu, powers of two) are read as float32.

DeepSeek-V4 (``moeforge.model.deepseek_v4_names``): transformers' names, or the published checkpoint's (``layers.N.attn.
wq_a.weight`` + ``.scale``), read as ours; a hash layer's ``mlp.gate.tid2eid`` is an integer table; the MTP module's
``mtp.*`` tensors are read under their own names and kept. Routed experts in FP4 (``quantization_config.expert_dtype``
"fp4": e2m1 pairs per byte, I8 / U8 / F4, a ue8m0 or float32 scale per 32 values along K) are dequantised exactly to
float32 (``moeforge.model.fp4``), one expert at a time.

Ignored on purpose: the DeepSeek-V3 multi-token-prediction layer(s) ``model.layers.{k}.*`` with
k >= num_hidden_layers, rotary ``inv_freq`` buffers, and ``lm_head.weight`` when embeddings are tied.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from moeforge.core.config import ModelConfig
from moeforge.core.errors import CheckpointError
from moeforge.model.deepseek_v4_names import INTEGER_SUFFIX, MTP_PREFIX, v4_expected_keys, v4_name
from moeforge.model.fp4 import as_bytes, dequantize_fp4, fp4_scale_shape
from moeforge.model.fp8 import dequantize_fp8_blockwise, fp8_scale_shape

log = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SCALE_SUFFIX = "_scale_inv"
EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")
_FP8_DTYPES = ("F8_E4M3",)  # safetensors' dtype string for torch.float8_e4m3fn
# Weights and FP8 scales are floating point; an integer header dtype (I32 over F32 bytes) is a corrupt file.
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
_SCALE_DTYPES = (*_FLOAT_DTYPES, "F8_E8M0")  # F8_E8M0: DeepSeek-V4's ue8m0 block scales
_INT_DTYPES = ("I64", "I32")  # DeepSeek-V4's tid2eid tables only
# DeepSeek-V4's FP4 experts: two e2m1 values per byte (F4: torch.float4_e2m1fn_x2, whose header shape counts values).
_FP4_DTYPES = ("I8", "U8", "F4")
# At most 9 digits: int() of a crafted 5000-digit layer index would raise; such a name is just unexpected.
_LAYER_RE = re.compile(r"^model\.layers\.(\d{1,9})\.")
_EXPERT_RE = re.compile(r"^model\.layers\.\d{1,9}\.mlp\.experts\.(\d{1,9})\.")
_ROUTED_EXPERTS_RE = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_proj|up_proj|down_proj)$")
# Mixtral checkpoint names -> ours: (pattern, replacement), applied in order to every stored name.
_MIXTRAL_NAMES = (
    (re.compile(r"^(model\.layers\.\d{1,9})\.block_sparse_moe\."), r"\1.mlp."),
    (re.compile(r"^(model\.layers\.\d{1,9}\.mlp\.experts\.\d{1,9})\.w1\."), r"\1.gate_proj."),
    (re.compile(r"^(model\.layers\.\d{1,9}\.mlp\.experts\.\d{1,9})\.w3\."), r"\1.up_proj."),
    (re.compile(r"^(model\.layers\.\d{1,9}\.mlp\.experts\.\d{1,9})\.w2\."), r"\1.down_proj."),
)
_MAX_LISTED = 8  # names listed in one error message


# ---------------------------------------------------------------------------------------- naming
def expected_keys(config: ModelConfig) -> list[str]:
    """Every tensor name the model for ``config`` needs, in the order ``read_hf_checkpoint`` yields."""
    if config.compressed_attention is not None:
        return v4_expected_keys(config)
    keys = ["model.embed_tokens.weight"]
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        keys += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        keys += [p + "self_attn." + k for k in _attention_keys(config)]
        keys += [p + "mlp." + k for k in _mlp_keys(config, i)]
    keys.append("model.norm.weight")
    if not config.tie_word_embeddings:
        keys.append("lm_head.weight")
    return keys


def _attention_keys(config: ModelConfig) -> list[str]:
    qkv_bias, o_bias = config.qkv_bias, config.o_proj_bias
    if config.mla is None:
        keys = [f"{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        if qkv_bias:
            keys += ["q_proj.bias", "k_proj.bias", "v_proj.bias"]
        if config.qk_norm != "none":
            keys += ["q_norm.weight", "k_norm.weight"]
    else:
        # MLA: HF puts attention_bias on q_a_proj and kv_a_proj_with_mqa only (q_proj/q_b/kv_b never).
        if config.mla.q_lora_rank is None:
            keys = ["q_proj.weight"]
        else:
            keys = ["q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight"]
            if qkv_bias:
                keys.append("q_a_proj.bias")
        keys += ["kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight", "kv_b_proj.weight", "o_proj.weight"]
        if qkv_bias:
            keys.append("kv_a_proj_with_mqa.bias")
        if config.dsa is not None:  # DeepSeek-V3.2's lightning indexer (wq_b / wk FP8 in the release, as V3's)
            keys += [f"indexer.{k}" for k in ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias",
                                              "weights_proj.weight")]
    if o_bias:
        keys.append("o_proj.bias")
    return keys


def _mlp_keys(config: ModelConfig, layer: int) -> list[str]:
    if not config.is_moe_layer(layer):
        return [f"{n}.weight" for n in EXPERT_PROJS]
    moe = config.moe
    assert moe is not None
    keys = ["gate.weight"]
    if moe.has_correction_bias:
        keys.append("gate.e_score_correction_bias")
    keys += [f"experts.{n}" for n in EXPERT_PROJS]  # stacked [E, ...]: no ".weight" suffix
    if moe.n_shared_experts > 0:
        keys += [f"shared_experts.{n}.weight" for n in EXPERT_PROJS]
    return keys


# ---------------------------------------------------------------------------------------- plan
@dataclass(frozen=True)
class _Info:
    """One tensor in a file, from the safetensors header (no data read)."""

    file: Path
    dtype: str  # safetensors dtype string, e.g. "F32", "BF16", "F8_E4M3"
    shape: tuple[int, ...]
    key: str  # its name in the file (what is read), which may differ from ours (_canonical_names)


@dataclass(frozen=True)
class _Source:
    """A stored tensor to read, with its FP8 (or, ``fp4``, FP4) scale when it has one."""

    key: str
    info: _Info
    scale_key: str | None = None
    scale_info: _Info | None = None
    fp4: bool = False  # packed e2m1 pairs [..., K/2] (``moeforge.model.fp4``)

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the values (an FP4 tensor's K unpacked)."""
        if self.fp4 and self.info.dtype != "F4":  # I8 / U8 bytes hold two values each; F4's header counts values
            return (*self.info.shape[:-1], 2 * self.info.shape[-1])
        return self.info.shape


@dataclass(frozen=True)
class _Direct:
    src: _Source


@dataclass(frozen=True)
class _Stacked:
    """Per-expert tensors stacked along a new dim 0 (expert e at index e)."""

    srcs: tuple[_Source, ...]


@dataclass(frozen=True)
class _FusedHalf:
    """Half of a fused ``gate_up_proj`` [E, 2I, H] along dim 1: 0 = gate rows, 1 = up rows."""

    src: _Source
    half: int


_Plan = _Direct | _Stacked | _FusedHalf


class HFCheckpoint:
    """A validated HF safetensors checkpoint: ``keys()``, ``shape(name)``, iteration yields tensors.

    ``dtype``: cast floating tensors to it; None keeps the stored dtype, except that FP8 weights are
    dequantised to float32. Construction raises ``CheckpointError`` for anything unreadable.
    """

    def __init__(self, folder: str | Path, config: ModelConfig, dtype: torch.dtype | None = None) -> None:
        self.folder = Path(folder)
        self.config = config
        self.dtype = dtype
        self.fp8_block = _fp8_block_size(self.folder)
        self.fp4_experts = config.compressed_attention is not None and _expert_dtype(self.folder) == "fp4"
        infos = _canonical_names(_scan(self.folder), config)
        self.files: tuple[Path, ...] = tuple(sorted({i.file for i in infos.values()}))
        _check_counts_present(self.folder, infos, config)
        self._plan = _make_plan(infos, config, self.fp8_block, self.fp4_experts)
        self._shapes = {name: _planned_shape(p) for name, p in self._plan.items()}
        _check_experts_consistent(config, self._shapes, self._plan)

    def keys(self) -> list[str]:
        """Our tensor names, in iteration order (equal to ``expected_keys(config)``)."""
        return list(self._plan)

    def __len__(self) -> int:
        return len(self._plan)

    def __contains__(self, name: object) -> bool:
        return name in self._plan

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape ``name`` will have, from the headers (lets a caller check shapes before reading)."""
        return self._shapes[name]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        with _Reader(self.dtype, self.fp8_block) as reader:
            for name, plan in self._plan.items():
                yield name, reader.materialise(plan)

    def read(self, name: str) -> torch.Tensor:
        """Read one tensor by our name."""
        if name not in self._plan:
            raise KeyError(name)
        with _Reader(self.dtype, self.fp8_block) as reader:
            return reader.materialise(self._plan[name])

    def read_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """``name``[start:stop] along ``dim``, reading only that part (whole experts along dim 0 of a stacked expert
        tensor: only theirs; FP8: the blocks that cover the slice)."""
        if name not in self._plan:
            raise KeyError(name)
        with _Reader(self.dtype, self.fp8_block) as reader:
            return reader.materialise(self._plan[name], (dim, start, stop))

    def __repr__(self) -> str:
        return f"HFCheckpoint({str(self.folder)!r}, {len(self)} tensors, {len(self.files)} file(s))"


def read_hf_checkpoint(
    folder: str | Path, config: ModelConfig, dtype: torch.dtype | None = None
) -> HFCheckpoint:
    """Open and validate the safetensors checkpoint in ``folder`` for ``config``.

    Iterate the result for ``(name, tensor)`` pairs in our naming; see ``HFCheckpoint``.
    """
    return HFCheckpoint(folder, config, dtype)


# ---------------------------------------------------------------------------------------- scanning
def _fp8_block_size(folder: Path) -> tuple[int, int]:
    """Block size of FP8 scales: config.json quantization_config.weight_block_size, else 128 x 128."""
    try:
        hf = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError, RecursionError):
        return (128, 128)  # config problems are reported by ModelConfig.from_hf_json
    quant = hf.get("quantization_config") if isinstance(hf, dict) else None
    if quant is not None and not isinstance(quant, dict):
        raise CheckpointError(f"{folder / 'config.json'}: quantization_config must be a JSON object, got {quant!r:.60}")
    block = (quant or {}).get("weight_block_size") or [128, 128]
    # bool is an int subclass: [true, true] is not a block size.
    if not (isinstance(block, list) and len(block) == 2
            and all(type(b) is int and 0 < b <= 2**16 for b in block)):
        raise CheckpointError(
            f"{folder / 'config.json'}: quantization_config.weight_block_size must be two positive "
            f"integers, got {block!r}"
        )
    return (block[0], block[1])


def _open_error(path: Path, exc: Exception) -> CheckpointError:
    return CheckpointError(
        f"{path} is truncated or not a valid safetensors file ({exc}); re-download or re-save it"
    )


def _read_header(path: Path) -> dict[str, _Info]:
    try:
        with safe_open(str(path), framework="pt") as f:
            out = {}
            for key in f.keys():
                sl = f.get_slice(key)
                out[key] = _Info(path, sl.get_dtype(), tuple(sl.get_shape()), key)
            return out
    except SafetensorError as exc:
        raise _open_error(path, exc) from None
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from None


def _scan(folder: Path) -> dict[str, _Info]:
    """Map every tensor name to the file holding it (single file or sharded via the index)."""
    if not folder.exists():
        raise CheckpointError(
            f"checkpoint folder {folder} does not exist; pass the folder that holds config.json"
        )
    if not folder.is_dir():
        raise CheckpointError(
            f"{folder} is not a folder; pass the folder that holds config.json and the weights"
        )
    single, index = folder / SINGLE_FILE, folder / INDEX_FILE
    if single.is_file():  # transformers also prefers the single file when both exist
        return _read_header(single)
    if not index.is_file():
        weight_suffixes = (".safetensors", ".bin", ".pt", ".pth")
        others = sorted(p.name for p in folder.iterdir() if p.suffix in weight_suffixes)
        hint = (
            f" (found {', '.join(others[:_MAX_LISTED])}; pickled .bin/.pt weights are never loaded: "
            "re-save with save_pretrained(..., safe_serialization=True))"
            if others
            else ""
        )
        raise CheckpointError(f"{folder} has no {SINGLE_FILE} and no {INDEX_FILE}{hint}")
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{index} is not a valid safetensors index ({exc}); re-download it") from None
    shards = sorted(set(weight_map.values()))
    missing = [s for s in shards if not (folder / s).is_file()]
    if missing:
        raise CheckpointError(
            f"{index} names shard {missing[0]} which does not exist in {folder}"
            + (f" ({len(missing)} shards missing)" if len(missing) > 1 else "")
            + "; re-download the missing shard(s)"
        )
    headers = {s: _read_header(folder / s) for s in shards}
    infos: dict[str, _Info] = {}
    for key, shard in weight_map.items():
        if key not in headers[shard]:
            raise CheckpointError(
                f"{index} maps tensor {key!r} to {shard}, but that shard does not contain it; "
                "the index and shards are out of sync: re-download the checkpoint"
            )
        infos[key] = headers[shard][key]
    return infos


def _expert_dtype(folder: Path) -> str | None:
    """DeepSeek-V4's routed-expert format, config.json's quantization_config.expert_dtype ("fp8" or "fp4"; None when
    unquantised), as transformers' FineGrainedFP8Config reads it."""
    try:
        hf = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError, RecursionError):
        return None  # config problems are reported by ModelConfig.from_hf_json
    quant = hf.get("quantization_config") if isinstance(hf, dict) else None
    dtype = (quant.get("expert_dtype") if isinstance(quant, dict) else None) or \
        (hf.get("expert_dtype") if isinstance(hf, dict) else None)
    if dtype not in (None, "fp8", "fp4"):
        raise CheckpointError(f"{folder / 'config.json'}: quantization_config.expert_dtype must be \"fp8\" or "
                              f"\"fp4\", got {dtype!r:.40}")
    return dtype


def _canonical_names(infos: dict[str, _Info], config: ModelConfig) -> dict[str, _Info]:
    """``infos`` keyed by our names (each _Info keeps the stored one); two stored names for one of ours is an error."""
    if config.model_type not in ("mixtral", "deepseek_v4"):
        return infos
    stored = set(infos)
    out: dict[str, _Info] = {}
    for key, info in infos.items():
        name = key
        if config.model_type == "deepseek_v4":
            name = v4_name(key, stored)
        for pattern, replacement in _MIXTRAL_NAMES if config.model_type == "mixtral" else ():
            name = pattern.sub(replacement, name)
        if name in out:
            raise CheckpointError(
                f"{info.file.name}: {key} and {out[name].key} are the same tensor ({name}) in two naming schemes; "
                "a checkpoint must use one (Mixtral's block_sparse_moe.experts.E.w1/w2/w3 or mlp.experts...; "
                "DeepSeek-V4's published layers.N.attn... or transformers' model.layers.N.self_attn...)"
            )
        out[name] = info
    return out


def _check_counts_present(folder: Path, infos: dict[str, _Info], config: ModelConfig) -> None:
    """The config's layer and expert counts must not exceed what the files hold.

    Checked from the header names before planning, which loops over layers and experts: a config.json
    claiming 1000 layers for a 2-layer checkpoint fails here, in one line, not after 1000 layers of names.
    """
    layers = config.num_hidden_layers
    present = {int(m.group(1)) for key in infos if (m := _LAYER_RE.match(key))}
    have = sum(1 for i in present if i < layers)
    if have < layers:
        missing = min(set(range(have + 1)) - present)  # among 0..have, at least one layer is absent
        raise CheckpointError(
            f"config.json says num_hidden_layers={layers} but the checkpoint in {folder} has tensors for {have} "
            f"layer(s) (none for model.layers.{missing}.*): fix num_hidden_layers, or re-download an incomplete "
            "checkpoint"
        )
    moe = config.moe
    if moe is None or not any(config.is_moe_layer(i) for i in range(layers)):
        return
    if any(key.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")) for key in infos):
        return  # fused layout: _expert_plan checks dim 0 against n_routed_experts
    experts = {int(m.group(1)) for key in infos if (m := _EXPERT_RE.match(key))}
    if experts and len(experts) < moe.n_routed_experts:
        raise CheckpointError(
            f"config.json says n_routed_experts={moe.n_routed_experts} but the checkpoint in {folder} has "
            f"per-expert tensors for {len(experts)} expert(s): fix n_routed_experts, or re-download an "
            "incomplete checkpoint"
        )


# ---------------------------------------------------------------------------------------- planning
def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_LISTED])
    return shown + (f" ... ({len(names)} in all)" if len(names) > _MAX_LISTED else "")


def _make_plan(infos: dict[str, _Info], config: ModelConfig, block: tuple[int, int],
               fp4_experts: bool = False) -> dict[str, _Plan]:
    consumed: set[str] = set()
    skipped_mtp: list[str] = []
    ignored: set[str] = set()
    for key in infos:
        m = _LAYER_RE.match(key)
        if m and int(m.group(1)) >= config.num_hidden_layers:
            skipped_mtp.append(key)  # DeepSeek-V3 multi-token-prediction module(s): not used for decoding
        elif key.endswith("inv_freq"):
            ignored.add(key)  # rotary buffers in older checkpoints; we recompute them from the config
        elif key == "lm_head.weight" and config.tie_word_embeddings:
            ignored.add(key)  # tied: the output projection is embed_tokens
    if skipped_mtp:
        log.debug("skipping %d tensors of layers >= num_hidden_layers (MTP): %s", len(skipped_mtp),
                  _listed(skipped_mtp))
    ignored.update(skipped_mtp)
    ignored.update([k + SCALE_SUFFIX for k in ignored])  # a skipped FP8 tensor takes its scale along

    def source(key: str) -> _Source:
        info = infos[key]
        consumed.add(key)
        scale_key = key + SCALE_SUFFIX
        scale_info = infos.get(scale_key)
        if key.endswith(INTEGER_SUFFIX) and config.compressed_attention is not None:
            if info.dtype not in _INT_DTYPES:
                raise CheckpointError(f"{info.file.name}: {key} (token -> experts table) is stored as {info.dtype}, "
                                      f"not an integer type ({', '.join(_INT_DTYPES)}): re-download or re-save it")
            return _Source(key, info)
        if info.dtype in _FP4_DTYPES and ".experts." in key and config.compressed_attention is not None:
            return fp4_source(key, info, scale_key, infos.get(scale_key))
        if info.dtype not in (*_FLOAT_DTYPES, *_FP8_DTYPES):
            raise CheckpointError(
                f"{info.file.name}: tensor {key} is stored as {info.dtype}, but the model needs floating-point "
                f"weights ({', '.join(_FLOAT_DTYPES)}, or {', '.join(_FP8_DTYPES)} with a {SCALE_SUFFIX}); "
                "the file is corrupt or not this model's checkpoint: re-download or re-save it"
            )
        if scale_info is not None and scale_info.dtype not in _SCALE_DTYPES:
            raise CheckpointError(
                f"{scale_info.file.name}: FP8 scale {scale_key} is stored as {scale_info.dtype}, but scales must be "
                f"{', '.join(_SCALE_DTYPES)}; re-download the checkpoint"
            )
        if info.dtype in _FP8_DTYPES:
            if scale_info is None:
                raise CheckpointError(
                    f"{info.file.name}: {key} is stored as FP8 ({info.dtype}) but has no {scale_key}; "
                    "the block scales are needed to dequantise it: re-download the checkpoint"
                )
            want = fp8_scale_shape(info.shape, block)
            if scale_info.shape != want:
                raise CheckpointError(
                    f"{scale_info.file.name}: {scale_key} has shape {list(scale_info.shape)} but {key} "
                    f"{list(info.shape)} with {block[0]}x{block[1]} blocks needs {list(want)}"
                )
        elif scale_info is not None:
            raise CheckpointError(
                f"{scale_info.file.name}: {scale_key} is present but {key} is {info.dtype}, not FP8; "
                "the checkpoint mixes quantised and unquantised formats"
            )
        if scale_info is not None:
            consumed.add(scale_key)
            return _Source(key, info, scale_key, scale_info)
        return _Source(key, info)

    def fp4_source(key: str, info: _Info, scale_key: str, scale_info: _Info | None) -> _Source:
        """A routed expert's packed e2m1 weight [..., out, K/2] with its scale [..., out, ceil(K/32)]."""
        if not fp4_experts:
            raise CheckpointError(
                f"{info.file.name}: {key} is stored as {info.dtype} (packed FP4 experts?) but config.json's "
                "quantization_config does not say expert_dtype \"fp4\": add it, or re-download the checkpoint")
        if scale_info is None:
            raise CheckpointError(f"{info.file.name}: FP4 expert weight {key} has no {scale_key} (.scale): the scale "
                                  "per 32 values is needed to dequantise it; re-download the checkpoint")
        if scale_info.dtype not in _SCALE_DTYPES:
            raise CheckpointError(f"{scale_info.file.name}: FP4 scale {scale_key} is stored as {scale_info.dtype}, "
                                  f"but scales must be {', '.join(_SCALE_DTYPES)}; re-download the checkpoint")
        src = _Source(key, info, scale_key, scale_info, fp4=True)
        try:
            want = fp4_scale_shape(src.shape)
        except ValueError as exc:
            raise CheckpointError(f"{info.file.name}: FP4 expert weight {key}: {exc}") from None
        if scale_info.shape != want:
            raise CheckpointError(f"{scale_info.file.name}: {scale_key} has shape {list(scale_info.shape)} but FP4 "
                                  f"{key} of {list(src.shape)} values (a scale per 32 along K) needs {list(want)}")
        consumed.update((key, scale_key))
        return src

    plan: dict[str, _Plan] = {}
    missing: list[str] = []
    for name in expected_keys(config):
        m = _ROUTED_EXPERTS_RE.match(name)
        if m:
            entry = _expert_plan(m.group(1), m.group(2), infos, config, source)
            if entry is None:
                missing.append(name)
            else:
                plan[name] = entry
        elif name in infos:
            plan[name] = _Direct(source(name))
        else:
            missing.append(name)
    if config.compressed_attention is not None:  # DeepSeek-V4's MTP module: read under its own names, kept
        for key in sorted(k for k in infos if k.startswith(MTP_PREFIX) and not k.endswith(SCALE_SUFFIX)):
            plan[key] = _Direct(source(key))
    if missing:
        layouts = (
            " (routed experts are read from fused mlp.experts.gate_up_proj + mlp.experts.down_proj or "
            "from per-expert mlp.experts.{e}.{gate,up,down}_proj.weight)"
            if any(_ROUTED_EXPERTS_RE.match(n) for n in missing)
            else ""
        )
        raise CheckpointError(
            f"checkpoint in {_where(infos)} is missing tensor(s) the config needs: {_listed(missing)}"
            f"{layouts}; check that config.json matches the weights, or re-download an incomplete checkpoint"
        )
    # A tensor with no elements holds no weights: transformers saves zero-width shared experts for
    # n_shared_experts = 0, and moeforge builds none.
    unexpected = sorted(k for k in infos if k not in consumed and k not in ignored and 0 not in infos[k].shape)
    if unexpected:
        raise CheckpointError(
            f"checkpoint in {_where(infos)} has tensor(s) this config does not use: {_listed(unexpected)}; "
            "config.json probably does not describe these weights (model_type, layer count, biases, "
            "MoE settings)"
        )
    return plan


def _where(infos: dict[str, _Info]) -> str:
    files = {i.file for i in infos.values()}
    if not files:
        return "(empty checkpoint)"
    return str(next(iter(files)).parent)


def _expert_plan(
    prefix: str, proj: str, infos: dict[str, _Info], config: ModelConfig, source: Any
) -> _Plan | None:
    """Plan our stacked ``{prefix}.{proj}`` from fused or per-expert tensors; None when neither exists."""
    assert config.moe is not None
    n_exp = config.moe.n_routed_experts
    fused_key = f"{prefix}.gate_up_proj" if proj in ("gate_proj", "up_proj") else f"{prefix}.down_proj"
    per_expert = [f"{prefix}.{e}.{proj}.weight" for e in range(n_exp)]
    present = [k for k in per_expert if k in infos]
    if fused_key in infos:
        if present:
            raise CheckpointError(
                f"{infos[fused_key].file.name}: both fused {fused_key} and per-expert {present[0]} are "
                "present; a checkpoint must use one expert layout"
            )
        info = infos[fused_key]
        if len(info.shape) != 3 or info.shape[0] != n_exp:
            raise CheckpointError(
                f"{info.file.name}: fused {fused_key} has shape {list(info.shape)}; expected "
                f"[{n_exp}, ...] with 3 dims (n_routed_experts={n_exp})"
            )
        if proj == "down_proj":
            return _Direct(source(fused_key))
        if info.shape[1] % 2:
            raise CheckpointError(
                f"{info.file.name}: fused {fused_key} has odd dim 1 ({info.shape[1]}); it must hold "
                "gate rows then up rows [E, 2*I, H]"
            )
        return _FusedHalf(source(fused_key), 0 if proj == "gate_proj" else 1)
    if not present:
        return None
    if len(present) < n_exp:
        gone = [k for k in per_expert if k not in infos]
        experts = [k.rsplit(".", 3)[1] for k in gone]
        raise CheckpointError(
            f"{prefix}: expert(s) {', '.join(experts[:_MAX_LISTED])} of {n_exp} missing ({gone[0]} not "
            "found); the checkpoint is incomplete or n_routed_experts is wrong"
        )
    srcs = tuple(source(k) for k in per_expert)
    shapes = {(s.shape, s.fp4) for s in srcs}
    if len(shapes) != 1 or len(srcs[0].shape) != 2:
        odd = next(s for s in srcs if (s.shape, s.fp4) != (srcs[0].shape, srcs[0].fp4) or len(s.shape) != 2)
        raise CheckpointError(
            f"{prefix}: per-expert {proj} weights differ in shape or format or are not 2-D ({srcs[0].key} "
            f"{list(srcs[0].shape)} {srcs[0].info.dtype} vs {odd.key} {list(odd.shape)} {odd.info.dtype})"
        )
    return _Stacked(srcs)


def _planned_shape(plan: _Plan) -> tuple[int, ...]:
    if isinstance(plan, _Direct):
        return plan.src.shape
    if isinstance(plan, _Stacked):
        return (len(plan.srcs), *plan.srcs[0].shape)
    e, two_i, h = plan.src.shape
    return (e, two_i // 2, h)


def _check_experts_consistent(
    config: ModelConfig, shapes: dict[str, tuple[int, ...]], plan: dict[str, _Plan]
) -> None:
    """gate/up [E, I, H] and down [E, H, I] of each MoE layer must agree (also across layouts)."""
    for i in range(config.num_hidden_layers):
        if not config.is_moe_layer(i):
            continue
        p = f"model.layers.{i}.mlp.experts."
        gate, up, down = (shapes[p + n] for n in EXPERT_PROJS)
        if gate != up or down != (gate[0], gate[2], gate[1]):
            src = plan[p + "down_proj"]
            file = (src.src if isinstance(src, _Direct | _FusedHalf) else src.srcs[0]).info.file.name
            raise CheckpointError(
                f"{file}: routed experts of layer {i} are inconsistent: gate {list(gate)}, up {list(up)}, "
                f"down {list(down)} (expected gate = up = [E, I, H] and down = [E, H, I])"
            )


# ---------------------------------------------------------------------------------------- reading
class _Reader(contextlib.AbstractContextManager["_Reader"]):
    """Keeps each file memory-mapped once while tensors are read; closes them on exit."""

    def __init__(self, dtype: torch.dtype | None, block: tuple[int, int]) -> None:
        self.dtype = dtype
        self.block = block
        self._stack = contextlib.ExitStack()
        self._handles: dict[Path, Any] = {}

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def _handle(self, path: Path) -> Any:
        if path not in self._handles:
            try:
                self._handles[path] = self._stack.enter_context(safe_open(str(path), framework="pt"))
            except SafetensorError as exc:
                raise _open_error(path, exc) from None
        return self._handles[path]

    def _get(self, info: _Info, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        try:
            f = self._handle(info.file)
            tensor: torch.Tensor = f.get_tensor(info.key) if index is None else f.get_slice(info.key)[index]
            return tensor
        except SafetensorError as exc:
            raise CheckpointError(
                f"{info.file}: cannot read tensor {info.key} ({exc}); re-download the file"
            ) from None

    def _cast(self, t: torch.Tensor) -> torch.Tensor:
        if self.dtype is not None and t.is_floating_point() and t.dtype != self.dtype:
            return t.to(self.dtype)
        return t

    def read(self, src: _Source) -> torch.Tensor:
        """The whole stored tensor, dequantised when FP8 or FP4, in the requested dtype."""
        t = self._get(src.info)
        if src.scale_key is None:
            return self._cast(t)
        assert src.scale_info is not None
        scale = self._get(src.scale_info)
        if src.fp4:
            return dequantize_fp4(t, scale, dtype=self.dtype or torch.float32)
        return dequantize_fp8_blockwise(t, scale, self.block, dtype=self.dtype or torch.float32)

    def _read_fp4_part(self, src: _Source, dim: int, start: int, stop: int) -> torch.Tensor:
        """FP4 ``src``[start:stop] along ``dim``: whole rows (dim < last) with their scales, or the groups of 32 along
        K that cover the slice, dequantised, then trimmed."""
        assert src.scale_info is not None
        last = len(src.shape) - 1
        lo, hi = (start, stop) if dim < last else (start // 32 * 32, min(-(-stop // 32) * 32, src.shape[last]))
        packed = (slice(lo, hi) if dim < last else slice(lo // 2, hi // 2))
        groups = (slice(lo, hi) if dim < last else slice(lo // 32, -(-hi // 32)))
        if src.info.dtype == "F4":  # safetensors slices F4 by values but returns bytes: read it whole
            part = as_bytes(self._get(src.info))[(*(slice(None),) * dim, packed)]
        else:
            part = self._get(src.info, _along(dim, packed.start, packed.stop))
        scale = self._get(src.scale_info, _along(dim, groups.start, groups.stop))
        whole = dequantize_fp4(part, scale, dtype=self.dtype or torch.float32)
        return whole.narrow(dim, start - lo, stop - start).contiguous()

    def read_part(self, src: _Source, dim: int, start: int, stop: int) -> torch.Tensor:
        """``src``[start:stop] along ``dim``, reading only that part of the mapped file (FP8: the scale blocks that
        cover it, dequantised, then trimmed)."""
        if src.scale_key is None:
            return self._cast(self._get(src.info, _along(dim, start, stop)).contiguous())
        if src.fp4:
            return self._read_fp4_part(src, dim, start, stop)
        assert src.scale_info is not None and dim < 2, "FP8 weights are 2-D, in blocks over both dims"
        block = self.block[dim]
        lo, hi = start // block * block, min(-(-stop // block) * block, src.info.shape[dim])
        part = self._get(src.info, _along(dim, lo, hi))
        scale = self._get(src.scale_info, _along(dim, lo // block, -(-hi // block)))
        whole = dequantize_fp8_blockwise(part, scale, self.block, dtype=self.dtype or torch.float32)
        return whole.narrow(dim, start - lo, stop - start).contiguous()

    def materialise(self, plan: _Plan, part: tuple[int, int, int] | None = None) -> torch.Tensor:
        """The planned tensor, or with ``part`` = (dim, start, stop) only that slice of it (read alone)."""
        if isinstance(plan, _Direct):
            return self.read(plan.src) if part is None else self.read_part(plan.src, *part)
        if isinstance(plan, _FusedHalf):
            two_i = plan.src.shape[1]
            rows = slice(0, two_i // 2) if plan.half == 0 else slice(two_i // 2, two_i)
            if plan.src.scale_key is None:
                # Read only the needed half ([E, I, H]) straight from the mapped file.
                whole = self._cast(self._get(plan.src.info, (slice(None), rows)).contiguous())
            else:  # FP8 blocks may straddle the gate/up boundary: dequantise all [E, 2I, H], then slice.
                whole = self.read(plan.src)[:, rows].contiguous()
            return whole if part is None else whole.narrow(part[0], part[1], part[2] - part[1]).contiguous()
        # Per-expert: fill one [E, ...] buffer so only one expert is transient besides the result.
        if part is None:
            return _stack([functools.partial(self.read, src) for src in plan.srcs])
        dim, start, stop = part
        if dim == 0:  # whole experts start..stop-1: the others are not read
            return _stack([functools.partial(self.read, src) for src in plan.srcs[start:stop]])
        return _stack([functools.partial(self.read_part, src, dim - 1, start, stop) for src in plan.srcs])


def _along(dim: int, start: int, stop: int) -> tuple[slice, ...]:
    """The index of [start:stop] along ``dim`` (all of the dims before it)."""
    return (*(slice(None),) * dim, slice(start, stop))


def _stack(reads: list[Callable[[], torch.Tensor]]) -> torch.Tensor:
    """The tensors ``reads`` return, stacked along a new dim 0 in one buffer, read one at a time."""
    first = reads[0]()
    out = torch.empty((len(reads), *first.shape), dtype=first.dtype)
    out[0] = first
    del first
    for e, read in enumerate(reads[1:], start=1):
        out[e] = read()
    return out
