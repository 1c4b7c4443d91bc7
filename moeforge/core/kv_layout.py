"""The KV-cache layout, owned in one place: graph I/O names, buffer shapes and the manifest's ``KVCacheSpec``.

Every stage reads names from here: the passes that create the cache inputs (``moeforge/passes/kv_cache_io.py``,
``paged_kv.py``, ``trt_kv_cache.py``), calibration, the manifest and the backends (which bind buffers from
``manifest.kv_cache``, never by parsing names). A leaf module: it imports nothing from moeforge but errors and
the model config.

Dimension letters: B batch, L buffer length (max sequence length), Hkv key/value heads, D head size,
R kv_lora_rank, Dr rope dims, N pool blocks, Bs block size.

| layout        | contiguous buffer (per layer)              | paged pool (per layer)            |
|---------------|--------------------------------------------|-----------------------------------|
| ``gqa``       | key, value [B, Hkv, L, D]                  | key, value [N, Bs, Hkv, D]        |
| ``mla_latent``| latent [B, 1, L, R+Dr] (absorbed MLA)      | latent [N, Bs, 1, R+Dr]           |
| ``mla_dsa``   | latent [B, 1, L, R+Dr], index [B, 1, L, Di] | latent [N, Bs, 1, R+Dr], index [N, Bs, 1, Di] |

``mla_dsa`` is DeepSeek-V3.2's sparse attention: the latent plus the lightning indexer's keys (Di =
index_head_dim). Buffers of one layer may differ in width: ``KVCacheSpec.buffer_widths`` gives each one's last
dim (``shape`` is the first buffer's).

Names (onnxruntime-genai's for contiguous caches, so it can run GQA artifacts):
``past_key_values.{i}.key|value|latent`` -> ``present.{i}.key|value|latent`` (ONNX Runtime's GroupQueryAttention
also writes ``present.{i}.latent_v``, identical, bound to the same buffer); paged: ``kv_pool.{i}.*`` ->
``kv_pool_out.{i}.*``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

from moeforge.core.config import ModelConfig
from moeforge.core.errors import ArtifactError
from moeforge.core.kv_layout_v4 import V4Buffer, layer_buffers

KVLayout = Literal["gqa", "mla_latent", "mla_dsa", "v4_hybrid"]
KV_LAYOUTS: tuple[str, ...] = ("gqa", "mla_latent", "mla_dsa", "v4_hybrid")
KV_CACHE_KINDS = ("contiguous", "paged")  # --kv-cache
DEFAULT_BLOCK_SIZE = 16  # --kv-block-size
DEFAULT_DTYPE = "float32"  # the cache in the graph's activation type (a quantised cache has its own)

PAST_PREFIX, PRESENT_PREFIX = "past_key_values.", "present."
POOL_PREFIX, POOL_OUT_PREFIX = "kv_pool.", "kv_pool_out."
# An optional int64 [1] input (default 0 = all positions): logits of only the last k positions (moeforge/passes/
# last_token_logits.py); fed by the backends when a prefill needs only its last token's logits.
LOGITS_TO_KEEP = "logits_to_keep"
# An optional bool [] input (default false) and a bool [B, S', 1] output (moeforge/passes/argmax_head.py): fed true on
# steps that take only each row's argmax; where ``logits_certified`` is false that step must run again without it.
ARGMAX_ONLY, LOGITS_CERTIFIED = "argmax_only", "logits_certified"
# MoE artifacts (ONNX Runtime): bool [L_moe, T, E], which experts each token was routed to in each MoE layer
# (moeforge/passes/expert_load.py); backends that track expert load bind it and count the real tokens' rows.
EXPERT_HITS = "expert_hits"
# Named dynamic axes of the buffers.
BATCH_AXIS, MAX_SEQ_AXIS, POOL_AXIS = "batch_size", "max_sequence_length", "num_blocks"

DTYPE_BYTES: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1, "bool": 1,
}


def dtype_size(dtype: str) -> int:
    """Bytes per element of a dtype name ("float32", "bfloat16", ...)."""
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ArtifactError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}") from None


@dataclass(frozen=True)
class CacheNames:
    """Graph input/output names of one layer's cache, in the order (key, value) or (latent,)."""

    past: tuple[str, ...]
    present: tuple[str, ...]


def cache_names(layer: int, mla: bool, indexed: bool = False) -> CacheNames:
    """Contiguous cache names of ``layer``; absorbed MLA has GroupQueryAttention's second output ``latent_v``;
    ``indexed`` (DSA): the latent and the indexer's keys, one output each (moeforge.SparseMLACache)."""
    if indexed:
        kinds = ("latent", "index")
        return CacheNames(tuple(f"{PAST_PREFIX}{layer}.{k}" for k in kinds),
                          tuple(f"{PRESENT_PREFIX}{layer}.{k}" for k in kinds))
    if mla:
        latent = f"{PRESENT_PREFIX}{layer}.latent"
        return CacheNames((f"{PAST_PREFIX}{layer}.latent",), (latent, latent + "_v"))
    return CacheNames((f"{PAST_PREFIX}{layer}.key", f"{PAST_PREFIX}{layer}.value"),
                      (f"{PRESENT_PREFIX}{layer}.key", f"{PRESENT_PREFIX}{layer}.value"))


def pool_names(layer: int, mla: bool, indexed: bool = False) -> CacheNames:
    """Paged pool names of ``layer``: ``kv_pool.{i}.*`` in, ``kv_pool_out.{i}.*`` out (DSA: latent and index)."""
    kinds = ("latent", "index") if indexed else ("latent",) if mla else ("key", "value")
    return CacheNames(tuple(f"{POOL_PREFIX}{layer}.{k}" for k in kinds),
                      tuple(f"{POOL_OUT_PREFIX}{layer}.{k}" for k in kinds))


@dataclass
class KVCacheSpec:
    """The KV cache the graph reads and writes, per layer (the manifest's ``kv_cache``).

    ``past_input_names[i]`` / ``present_output_names[i]`` name layer i's graph inputs/outputs, in the order
    (key, value) or (latent,). An MLA layer may have more than one present output (GroupQueryAttention's
    present_key and present_value, which are identical): a backend binds all of them to the layer's single
    latent buffer, the one bound to its past input. ``values_per_token_per_layer`` counts the scalars one
    token adds to one layer (all buffers together); ``bytes_per_token`` covers all layers. ``max_seq_len``
    is the longest sequence the artifact supports (positions, rotary tables).
    ``block_size`` set: a paged artifact (``--kv-cache paged``); ``shape`` is then a block pool
    ``[num_blocks, block_size, Hkv, D]``.
    """

    layout: KVLayout
    num_layers: int
    past_input_names: list[list[str]]
    present_output_names: list[list[str]]
    shape: list[int | str]
    dtype: str
    values_per_token_per_layer: int
    bytes_per_token: int
    max_seq_len: int
    block_size: int | None = None  # paged artifacts only
    # Last dim of each of a layer's buffers, in past-input order, when they differ (mla_dsa: [R+Dr, Di]);
    # None: every buffer is ``shape``.
    buffer_widths: list[int] | None = None
    # v4_hybrid (DeepSeek-V4, core/kv_layout_v4.py): each layer's buffers, rings and entries, in past-input order.
    layer_buffers: list[list[V4Buffer]] | None = None

    def __post_init__(self) -> None:
        self.validate()

    @property
    def paged(self) -> bool:
        return self.block_size is not None

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one pool block over all layers (paged artifacts)."""
        if self.layer_buffers is not None:  # V4: rings hold min(R, Bs) rows of a block, entries Bs / m
            size = self.block_size or 0
            rows = sum(b.rows_per_block(size) * b.width for layer in self.layer_buffers for b in layer)
            return rows * dtype_size(self.dtype)
        return self.bytes_per_token * (self.block_size or 0)

    @property
    def bytes_per_sequence(self) -> int:
        """Bytes a contiguous sequence holds whatever its length (V4's rings; 0 for the other layouts)."""
        if self.layer_buffers is None or self.block_size is not None:  # paged: each block holds its own rings
            return 0
        return sum(b.ring * b.width for layer in self.layer_buffers for b in layer) * dtype_size(self.dtype)

    @property
    def buffers_per_layer(self) -> int:
        return 1 if self.layout == "mla_latent" else 2

    def buffer_shape(self, index: int, layer: int = 0) -> list[int | str]:
        """The shape of a layer's ``index``-th buffer (``shape`` with that buffer's width; V4: its own rows too)."""
        if self.layer_buffers is not None:
            buffer = self.layer_buffers[layer][index]
            if self.block_size is not None:
                return [POOL_AXIS, buffer.rows_per_block(self.block_size), buffer.width]
            return [BATCH_AXIS, buffer.rows_per_sequence(self.max_seq_len), buffer.width]
        if self.buffer_widths is None:
            return list(self.shape)
        return [*self.shape[:-1], self.buffer_widths[index]]

    def bytes_for(self, seq_len: int, batch_size: int = 1) -> int:
        """Bytes of cache for ``batch_size`` sequences of ``seq_len`` tokens (all layers; V4's paged pools: whole
        blocks, rings included)."""
        if self.layer_buffers is not None and self.block_size is not None:
            return -(-seq_len // self.block_size) * self.bytes_per_block * batch_size
        return (self.bytes_per_token * seq_len + self.bytes_per_sequence) * batch_size

    def validate(self) -> None:
        if self.layout not in KV_LAYOUTS:
            raise ArtifactError(f"kv_cache.layout {self.layout!r} is not one of {', '.join(KV_LAYOUTS)}")
        dtype_size(self.dtype)
        for what, names in (("past_input_names", self.past_input_names),
                            ("present_output_names", self.present_output_names)):
            if len(names) != self.num_layers:
                raise ArtifactError(f"kv_cache.{what} has {len(names)} layers, num_layers is {self.num_layers}")
            if self.layout == "v4_hybrid":
                self._validate_v4(what, names)
                continue
            for i, per_layer in enumerate(names):
                n = len(per_layer)
                # MLA: exactly one past input; present outputs all alias that one buffer. GQA / DSA: two and two.
                ok = n == 2 if self.layout != "mla_latent" else (n == 1 or (what == "present_output_names" and n >= 1))
                if not ok:
                    raise ArtifactError(
                        f"kv_cache.{what}[{i}] has {n} names; layout {self.layout} has "
                        f"{self.buffers_per_layer} buffer(s) per layer"
                    )
        if self.buffer_widths is not None and (
                len(self.buffer_widths) != self.buffers_per_layer
                or not all(isinstance(w, int) and w > 0 for w in self.buffer_widths)):
            raise ArtifactError(f"kv_cache.buffer_widths {self.buffer_widths} must give {self.buffers_per_layer} "
                                "positive widths, one per buffer of a layer")

    def _validate_v4(self, what: str, names: list[list[str]]) -> None:
        if self.layer_buffers is None or len(self.layer_buffers) != self.num_layers:
            raise ArtifactError("kv_cache.layout v4_hybrid needs layer_buffers, one list per layer")
        for i, (per_layer, buffers) in enumerate(zip(names, self.layer_buffers, strict=True)):
            if len(per_layer) != len(buffers):
                raise ArtifactError(f"kv_cache.{what}[{i}] has {len(per_layer)} names for {len(buffers)} buffers")
        if self.block_size is not None:
            bad = {b.tokens_per_row for layer in self.layer_buffers for b in layer
                   if b.tokens_per_row and self.block_size % b.tokens_per_row}
            if bad:
                raise ArtifactError(f"kv_cache.block_size {self.block_size} is not a multiple of the compress rates "
                                    f"{sorted(bad)}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | ({"bytes_per_block": self.bytes_per_block} if self.paged else {})

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVCacheSpec:
        return cls(
            layout=data["layout"],
            num_layers=int(data["num_layers"]),
            past_input_names=[list(n) for n in data["past_input_names"]],
            present_output_names=[list(n) for n in data["present_output_names"]],
            shape=list(data["shape"]),
            dtype=str(data["dtype"]),
            values_per_token_per_layer=int(data["values_per_token_per_layer"]),
            bytes_per_token=int(data["bytes_per_token"]),
            max_seq_len=int(data["max_seq_len"]),
            block_size=None if data.get("block_size") is None else int(data["block_size"]),
            buffer_widths=None if data.get("buffer_widths") is None else [int(w) for w in data["buffer_widths"]],
            layer_buffers=None if data.get("layer_buffers") is None else [
                [V4Buffer.from_dict(b) for b in layer] for layer in data["layer_buffers"]],
        )


def _spec(config: ModelConfig, names: list[CacheNames], shape: list[int | str], *, max_seq_len: int, dtype: str,
          block_size: int | None = None) -> KVCacheSpec:
    heads, width = _head_shape(config)
    per_layer = width if config.mla is not None else 2 * heads * width  # the MLA latent is key and value at once
    layers = config.num_hidden_layers
    widths = None
    layout: KVLayout = "mla_latent" if config.mla is not None else "gqa"
    if config.dsa is not None:  # DSA: + the indexer's keys per token
        widths, layout = [width, config.dsa.index_head_dim], "mla_dsa"
        per_layer += config.dsa.index_head_dim
    return KVCacheSpec(
        layout=layout, num_layers=layers, buffer_widths=widths,
        past_input_names=[list(n.past) for n in names], present_output_names=[list(n.present) for n in names],
        shape=shape, dtype=dtype,
        values_per_token_per_layer=per_layer, bytes_per_token=per_layer * layers * dtype_size(dtype),
        max_seq_len=max_seq_len, block_size=block_size)


def _head_shape(config: ModelConfig) -> tuple[int, int]:
    """(heads, values per head) of one cache buffer: the MLA latent is one head of R + Dr."""
    return (1, config.mla.latent_dim) if config.mla is not None else (config.num_key_value_heads, config.head_dim)


def contiguous_spec(config: ModelConfig, *, max_seq_len: int, dtype: str = DEFAULT_DTYPE) -> KVCacheSpec:
    """Per-sequence buffers ``[batch_size, H, max_sequence_length, D]`` (ONNX Runtime GroupQueryAttention);
    DeepSeek-V4: ``v4_spec``."""
    if config.compressed_attention is not None:
        return v4_spec(config, max_seq_len=max_seq_len, dtype=dtype)
    mla = config.mla is not None
    heads, width = _head_shape(config)
    names = [cache_names(i, mla, config.dsa is not None) for i in range(config.num_hidden_layers)]
    return _spec(config, names, [BATCH_AXIS, heads, MAX_SEQ_AXIS, width], max_seq_len=max_seq_len, dtype=dtype)


def static_spec(config: ModelConfig, *, max_seq_len: int, dtype: str) -> KVCacheSpec:
    """TensorRT's contiguous cache: the buffer length is ``max_seq_len`` (its KV-cache update needs a static
    length) and an MLA layer has one present output (no GroupQueryAttention duplicate)."""
    spec = contiguous_spec(config, max_seq_len=max_seq_len, dtype=dtype)
    spec.shape = [max_seq_len if d == MAX_SEQ_AXIS else d for d in spec.shape]
    if spec.layout == "mla_latent":
        spec.present_output_names = [names[:1] for names in spec.present_output_names]
    return spec


def paged_spec(config: ModelConfig, *, max_seq_len: int, block_size: int, dtype: str = DEFAULT_DTYPE) -> KVCacheSpec:
    """Block pools ``[num_blocks, block_size, H, D]`` read and written by ``moeforge::PagedAttention`` (DSA:
    ``moeforge::SparseMLAPaged``); DeepSeek-V4: ``v4_spec``."""
    if config.compressed_attention is not None:
        return v4_spec(config, max_seq_len=max_seq_len, block_size=block_size, dtype=dtype)
    mla = config.mla is not None
    heads, width = _head_shape(config)
    names = [pool_names(i, mla, config.dsa is not None) for i in range(config.num_hidden_layers)]
    return _spec(config, names, [POOL_AXIS, block_size, heads, width], max_seq_len=max_seq_len, dtype=dtype,
                 block_size=block_size)


def v4_spec(config: ModelConfig, *, max_seq_len: int, block_size: int | None = None,
            dtype: str = DEFAULT_DTYPE) -> KVCacheSpec:
    """DeepSeek-V4's cache (layout ``v4_hybrid``, ``kv_layout_v4.py``): per layer its window ring, and on compressed
    layers the compressor's pending ring and entries (CSA: the indexer's too); contiguous buffers [B, rows, w], or
    pools [num_blocks, rows per block, w] with ``block_size``. ``bytes_per_token`` counts what grows with the context,
    rounded up: contiguous, the entries (the rings are ``bytes_per_sequence``); paged, a block's bytes / block size
    (its rings included)."""
    layers = [layer_buffers(config, i) for i in range(config.num_hidden_layers)]
    past, present = (POOL_PREFIX, POOL_OUT_PREFIX) if block_size is not None else (PAST_PREFIX, PRESENT_PREFIX)
    per_token = sum(b.values_per_token for layer in layers for b in layer)
    if block_size is not None:  # a block's rings count too: a pool grows by whole blocks
        per_token = sum(b.rows_per_block(block_size) * b.width for layer in layers for b in layer) / block_size
    first = layers[0][0]
    shape: list[int | str] = ([POOL_AXIS, first.rows_per_block(block_size), first.width] if block_size is not None
                              else [BATCH_AXIS, first.rows_per_sequence(max_seq_len), first.width])
    return KVCacheSpec(
        layout="v4_hybrid", num_layers=len(layers),
        past_input_names=[[f"{past}{i}.{b.kind}" for b in layer] for i, layer in enumerate(layers)],
        present_output_names=[[f"{present}{i}.{b.kind}" for b in layer] for i, layer in enumerate(layers)],
        shape=shape, dtype=dtype, values_per_token_per_layer=math.ceil(per_token / len(layers)),
        bytes_per_token=math.ceil(per_token * dtype_size(dtype)), max_seq_len=max_seq_len, block_size=block_size,
        layer_buffers=layers)
