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
from dataclasses import dataclass
from typing import Any, Literal

from moeforge.core.config import ModelConfig
from moeforge.core.errors import ArtifactError

KVLayout = Literal["gqa", "mla_latent", "mla_dsa"]
KV_LAYOUTS: tuple[str, ...] = ("gqa", "mla_latent", "mla_dsa")
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

    def __post_init__(self) -> None:
        self.validate()

    @property
    def paged(self) -> bool:
        return self.block_size is not None

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one pool block over all layers (paged artifacts)."""
        return self.bytes_per_token * (self.block_size or 0)

    @property
    def buffers_per_layer(self) -> int:
        return 1 if self.layout == "mla_latent" else 2

    def buffer_shape(self, index: int) -> list[int | str]:
        """The shape of a layer's ``index``-th buffer (``shape`` with that buffer's width)."""
        if self.buffer_widths is None:
            return list(self.shape)
        return [*self.shape[:-1], self.buffer_widths[index]]

    def bytes_for(self, seq_len: int, batch_size: int = 1) -> int:
        """Bytes of cache for ``batch_size`` sequences of ``seq_len`` tokens (all layers)."""
        return self.bytes_per_token * seq_len * batch_size

    def validate(self) -> None:
        if self.layout not in KV_LAYOUTS:
            raise ArtifactError(f"kv_cache.layout {self.layout!r} is not one of {', '.join(KV_LAYOUTS)}")
        dtype_size(self.dtype)
        for what, names in (("past_input_names", self.past_input_names),
                            ("present_output_names", self.present_output_names)):
            if len(names) != self.num_layers:
                raise ArtifactError(f"kv_cache.{what} has {len(names)} layers, num_layers is {self.num_layers}")
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
    """Per-sequence buffers ``[batch_size, H, max_sequence_length, D]`` (ONNX Runtime GroupQueryAttention)."""
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
    ``moeforge::SparseMLAPaged``)."""
    mla = config.mla is not None
    heads, width = _head_shape(config)
    names = [pool_names(i, mla, config.dsa is not None) for i in range(config.num_hidden_layers)]
    return _spec(config, names, [POOL_AXIS, block_size, heads, width], max_seq_len=max_seq_len, dtype=dtype,
                 block_size=block_size)
