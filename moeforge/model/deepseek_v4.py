"""DeepSeek-V4: the decoder, beside V3's ``CausalLM`` and with its interface (``forward(input_ids, position_ids,
past_key_values) -> ModelOutput``), so generation, ``moeforge run --backend torch`` and the tests drive it alike.

Dimension letters: B batch, S new tokens, N hyper-connection streams (hc_mult), H hidden, V vocabulary.

    h = embed(input_ids) copied to N streams                                        [B, S, N, H]
    per layer:  x, post, comb = attn_hc(h);   h = expand(h, attn(input_layernorm(x)), post, comb)
                x, post, comb = ffn_hc(h);    h = expand(h, moe(post_attention_layernorm(x), input_ids), post, comb)
    logits = lm_head(norm(hc_head(h)))                                              [B, S, V] float32
Attention: ``compressed_attention.py`` (sliding / CSA / HCA per layer, the cache layout there); mHC:
``hyper_connections.py``; MoE: ``deepseek_v4_moe.py``. Parameter names are transformers' DeepseekV4ForCausalLM's
(``model.layers.N.attn_hc.fn``, ``...self_attn.compressor.indexer.q_b_proj.weight``, ...) with routed experts stacked.
The checkpoint's multi-token-prediction module (``mtp.*``) is loaded and kept in ``mtp`` (not run).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moeforge.core.config import ModelConfig
from moeforge.core.errors import MoeforgeError
from moeforge.model.attention import LayerCache
from moeforge.model.compressed_attention import CompressedAttention
from moeforge.model.deepseek_v4_moe import V4MoE
from moeforge.model.hyper_connections import HyperConnection, HyperHead
from moeforge.model.model import V4_COMPILE_REFUSAL, CausalLM, DecoderModel, KVCache, ModelOutput
from moeforge.model.norm import RMSNorm
from moeforge.model.rope import RotaryEmbedding

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin [B, S, Dr/2]


class DeepseekV4DecoderLayer(nn.Module):
    """Attention then MoE, each read from and written back to the N streams through its hyper-connection."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.attn_hc = HyperConnection(config)
        self.ffn_hc = HyperConnection(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = CompressedAttention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = V4MoE(config, layer_idx)

    def forward(self, h: torch.Tensor, input_ids: torch.Tensor, main: Rope, compress: Rope,
                past: LayerCache | None) -> tuple[torch.Tensor, LayerCache]:
        # h [B, S, N, H]; input_ids [B, S]; main / compress: cos, sin of the two RoPE settings at the tokens' positions
        cos, sin = main if self.self_attn.compressor is None else compress
        x, post, comb = self.attn_hc(h)
        out, present = self.self_attn(self.input_layernorm(x), cos, sin, past)
        h = HyperConnection.expand(h, out, post, comb)
        x, post, comb = self.ffn_hc(h)
        return HyperConnection.expand(h, self.mlp(self.post_attention_layernorm(x), input_ids), post, comb), present


class MTPWeights(nn.Module):
    """The checkpoint's multi-token-prediction tensors (``mtp.*``), kept by name as read; nothing runs them yet."""

    def __init__(self) -> None:
        super().__init__()
        self.tensors: dict[str, torch.Tensor] = {}

    def keep(self, name: str, tensor: torch.Tensor) -> None:
        self.tensors[name] = tensor


class DeepseekV4Model(DecoderModel):
    """Embeddings, V4 layers, the final HyperHead and norm; ``rotary`` is the main RoPE, ``compress_rotary`` the
    compressed layers' (HF's ``model.*``)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, (DeepseekV4DecoderLayer(config, i) for i in range(config.num_hidden_layers)))
        assert config.compressed_attention is not None
        self.compress_rotary = RotaryEmbedding(config, config.compressed_attention.compress_rope)
        self.hc_head = HyperHead(config)


class DeepseekV4ForCausalLM(CausalLM):
    """DeepSeek-V4 with an LM head; the cache is one tuple per layer (``compressed_attention.py``)."""

    model: DeepseekV4Model
    # A pipeline stage's ``StageSpec`` (``pipeline_stages.v4_stage_model``; typed loosely: that module imports this
    # one); None: the whole model.
    pipeline_stage: Any = None

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, "absorb")  # mla_impl: no MLA here, kept for the interface
        self.mtp = MTPWeights()

    def build_decoder(self) -> DeepseekV4Model:
        return DeepseekV4Model(self.config)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        past_key_values: KVCache | None = None,
        output_hidden_states: bool = False,
    ) -> ModelOutput:
        """input_ids, position_ids: [B, S] int64; past_key_values: one tuple per layer or None. Returns logits
        [B, S, V] float32, the new cache and (with ``output_hidden_states``) each layer's streams [B, S, N, H]."""
        if torch.compiler.is_exporting():
            raise MoeforgeError(V4_COMPILE_REFUSAL)
        hc = self.config.hyper_connections
        assert hc is not None
        x = self.model.embed_tokens(input_ids)  # [B, S, H]
        streams = x.unsqueeze(2).expand(-1, -1, hc.hc_mult, -1).contiguous()  # [B, S, N, H]
        streams, present, hidden = self.run_layers(streams, position_ids, past_key_values, output_hidden_states,
                                                   input_ids)
        return ModelOutput(self.lm_logits(self.model.norm(self.model.hc_head(streams))), present, hidden)

    def run_layers(self, x: torch.Tensor, position_ids: torch.Tensor, past_key_values: KVCache | None,
                   output_hidden_states: bool, input_ids: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, KVCache, tuple[torch.Tensor, ...] | None]:
        """The layers on the streams x [B, S, N, H]; ``input_ids`` [B, S] feed the hash-routed layers."""
        if input_ids is None:
            raise MoeforgeError("DeepSeek-V4's hash-routed MoE layers need the token ids: pass input_ids")
        main, compress = self.model.rotary(position_ids), self.model.compress_rotary(position_ids)
        present: list[LayerCache] = []
        hidden: list[torch.Tensor] = []
        for i, layer in enumerate(self.model.layers):
            past = None if past_key_values is None else past_key_values[i]
            x, layer_cache = layer(x, input_ids, main, compress, past)
            present.append(layer_cache)
            if output_hidden_states:
                hidden.append(x)
        return x, tuple(present), tuple(hidden) if output_hidden_states else None

    def reset_buffers(self) -> None:
        """Recompute every RoPE's ``inv_freq`` (the main, the compressed layers', each compressor's)."""
        for module in self.modules():
            if isinstance(module, RotaryEmbedding):
                module.reset_buffers()
