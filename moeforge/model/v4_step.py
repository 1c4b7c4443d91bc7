"""DeepSeek-V4 as one inference step over its KV cache buffers: the module a V4 compile exports (contiguous or paged).

    contiguous: (input_ids [B, S], position_ids [B, S], attention_mask [B, L], *buffers) -> (logits [B, S, V],
                *buffers written); L the longest row's cached + new tokens (entries past it are not read)
    paged:      (input_ids [T], position_ids [T], block_tables [N, M], query_start_loc [N+1], logits_indices [K],
                 *pools) -> (logits [K, V], *pools written)
A pipeline stage (``pipeline_stages.v4_stage_model``, paged): after stage 0 the streams arrive as
``hidden_states_in`` [T, N * H] after position_ids (input_ids stay: hash-routed layers read them); before the last
stage the output is every token's streams ``hidden_states`` [T, N * H] instead of logits.
``buffers`` / ``pools``: every layer's ``kv_layout_v4.layer_buffers`` in layer order (contiguous [B, rows, w], paged
[num_blocks, rows per block, w]). The layers are the model's own modules (``deepseek_v4.py``): mHC, MoE (hash layers
read input_ids) and norms run as in the reference; attention runs ``v4_cache.cached_attention``.
"""

from __future__ import annotations

from typing import Literal, cast

import torch
from torch import nn

from moeforge.core.kv_layout_v4 import layer_buffers
from moeforge.model.deepseek_v4 import DeepseekV4DecoderLayer, DeepseekV4ForCausalLM
from moeforge.model.hyper_connections import HyperConnection
from moeforge.model.pipeline_stages import StageSpec
from moeforge.model.v4_cache import CacheAddress, cached_attention, contiguous_address, paged_address

CacheKind = Literal["contiguous", "paged"]


class V4StepLM(nn.Module):
    """One step of ``model`` over its cache buffers; ``max_seq_len`` bounds positions (contiguous), ``block_size``
    is the pool block size (paged); ``stage``: the pipeline stage ``model`` is (None: the whole model);
    ``mark_layers``: the outputs end with every layer's streams [T, N, H] (``moeforge parity --per-layer``)."""

    def __init__(self, model: DeepseekV4ForCausalLM, kind: CacheKind, *, max_seq_len: int,
                 block_size: int | None = None, stage: StageSpec | None = None, mark_layers: bool = False) -> None:
        super().__init__()
        self.model, self.kind, self.max_seq_len, self.block_size = model, kind, max_seq_len, block_size
        self.mark_layers = mark_layers  # also return each layer's streams [T, N, H] (parity --per-layer)
        if stage is not None and kind != "paged":
            raise ValueError("a DeepSeek-V4 pipeline stage runs over a paged cache")
        self.takes_streams = stage is not None and not stage.has_embedding
        self.returns_streams = stage is not None and not stage.has_head
        config = model.config
        self.buffer_counts = [len(layer_buffers(config, i)) for i in range(config.num_hidden_layers)]

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                *rest: torch.Tensor) -> tuple[torch.Tensor, ...]:
        streams_in = None
        if self.takes_streams:
            streams_in, rest = rest[0], rest[1:]  # [T, N * H]: the previous stage's output
        if self.kind == "paged":
            assert self.block_size is not None
            block_tables, query_start_loc, logits_indices, *buffers = rest
            address = paged_address(position_ids, block_tables, query_start_loc, self.block_size)
            ids, positions = input_ids, position_ids
        else:
            attention_mask, *buffers = rest  # only its width is read: the longest row's cached + new tokens
            address = contiguous_address(position_ids, self.max_seq_len, attention_mask.shape[1])
            ids, positions = input_ids.reshape(-1), position_ids.reshape(-1)
        h = self.streams(ids) if streams_in is None else streams_in.view(1, ids.shape[0], self.hc_mult, -1)
        each: list[torch.Tensor] = []
        h, written = self.layers(ids, positions, address, buffers, h, each if self.mark_layers else None)
        if self.returns_streams:
            return (h.reshape(ids.shape[0], -1), *written)  # [T, N * H] of every token, for the next stage
        decoder = self.model.model
        hidden = decoder.norm(decoder.hc_head(h))[0]  # [T, H]
        if self.kind == "paged":
            hidden = hidden[logits_indices]  # [K, H]
        else:
            hidden = hidden.view(*input_ids.shape, -1)
        return (self.model.lm_logits(hidden), *written, *each)

    @property
    def hc_mult(self) -> int:
        hc = self.model.config.hyper_connections
        assert hc is not None
        return hc.hc_mult

    def streams(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] -> the embedding copied to every stream [1, T, N, H]."""
        embedded: torch.Tensor = self.model.model.embed_tokens(ids)  # [T, H]
        return embedded[None, :, None, :].expand(-1, -1, self.hc_mult, -1).contiguous()

    def layers(self, ids: torch.Tensor, positions: torch.Tensor, address: CacheAddress, buffers: list[torch.Tensor],
               h: torch.Tensor, each: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The streams h [1, T, N, H] through every layer (ids, positions [T]) -> the streams and the buffers;
        ``each`` (when given) gets every layer's streams [T, N, H]."""
        decoder = self.model.model
        main, compress = decoder.rotary(positions[None]), decoder.compress_rotary(positions[None])
        written: list[torch.Tensor] = []
        first = 0
        for module, count in zip(decoder.layers, self.buffer_counts, strict=True):
            layer = cast(DeepseekV4DecoderLayer, module)
            cos, sin = main if layer.self_attn.compressor is None else compress
            x, post, comb = layer.attn_hc(h)
            out, layer_written = cached_attention(layer.self_attn, layer.input_layernorm(x)[0], cos[0], sin[0],
                                                  address, tuple(buffers[first:first + count]))
            first += count
            written.extend(layer_written)
            h = HyperConnection.expand(h, out[None], post, comb)
            x, post, comb = layer.ffn_hc(h)
            h = HyperConnection.expand(h, layer.mlp(layer.post_attention_layernorm(x), ids[None]), post, comb)
            if each is not None:
                each.append(h[0])
        return h, written
