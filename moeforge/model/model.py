"""The decoder-only model, one definition: DeepSeek-V2/V3/V3.2 and Kimi-K2 (MLA + MoE), Qwen3-MoE, GLM-4.5 MoE,
Mixtral and OLMoE (GQA + MoE), Llama/Qwen2/Mistral (GQA). DeepSeek-V4 is its subclass ``DeepseekV4ForCausalLM``
(``moeforge/model/deepseek_v4.py``): other layers, the same interface.

forward(input_ids [B, S], position_ids [B, S], past_key_values) -> (logits [B, S, V], present).
Positions and the cache are explicit inputs; nothing is read from globals; the only Python loops
are over static layer/expert counts. Parameter names follow Hugging Face (model.layers.N....),
with routed experts stacked (mlp.experts.gate_proj [E, I, H]).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from moeforge.core.config import V4_FAMILIES, ModelConfig
from moeforge.core.errors import MoeforgeError
from moeforge.model.attention import GQAAttention, LayerCache, causal_mask
from moeforge.model.mla import MLAImpl, MLAttention
from moeforge.model.mlp import SwiGLU
from moeforge.model.moe import MoEBlock
from moeforge.model.norm import RMSNorm
from moeforge.model.rope import RotaryEmbedding

KVCache = tuple[LayerCache, ...]

# What a compile of DeepSeek-V4 says: every compile stage (export, sharding, pipeline stages, streamed weights) builds
# a ``CausalLM``, and DeepSeek-V4 runs in PyTorch only for now (``DeepseekV4ForCausalLM``).
# DeepSeek-V4 is its own class (model/deepseek_v4.py: ``loader.new_model`` builds it), and its graph is exported with
# its cache (compile/v4_export.py), never as the other families' stateless graph.
V4_COMPILE_REFUSAL = ("DeepSeek-V4 is built by moeforge.model.loader.new_model (DeepseekV4ForCausalLM) and exported "
                      "with its cache by moeforge.compile.v4_export, not as a stateless CausalLM graph")


class ModelOutput(NamedTuple):
    """logits [B, S, V] float32; present cache per layer; hidden_states per layer when asked."""

    logits: torch.Tensor
    past_key_values: KVCache
    hidden_states: tuple[torch.Tensor, ...] | None = None


class DecoderLayer(nn.Module):
    """x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig, layer_idx: int, mla_impl: MLAImpl) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MLAttention(config, mla_impl) if config.mla is not None else GQAAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MoEBlock(config) if config.is_moe_layer(layer_idx) else SwiGLU(
            config.hidden_size, config.intermediate_size
        )

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                past: LayerCache | None, positions: torch.Tensor | None = None) -> tuple[torch.Tensor, LayerCache]:
        # positions [B, S]: read by DSA's indexer only (its causal limit per query)
        if isinstance(self.self_attn, MLAttention) and self.self_attn.indexer is not None:
            attn_out, present = self.self_attn(self.input_layernorm(x), cos, sin, mask, past, positions)
        else:
            attn_out, present = self.self_attn(self.input_layernorm(x), cos, sin, mask, past)
        x = x + attn_out
        return x + self.mlp(self.post_attention_layernorm(x)), present


class DecoderModel(nn.Module):
    """Embeddings, decoder layers, final norm (HF's ``model.*``)."""

    def __init__(self, config: ModelConfig, layers: Iterable[nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config)


class CausalLM(nn.Module):
    """Decoder + LM head. ``mla_impl`` picks the MLA cache layout (absorb: latent only)."""

    def __init__(self, config: ModelConfig, mla_impl: MLAImpl = "absorb") -> None:
        super().__init__()
        self.config = config
        self.mla_impl = mla_impl
        self.model = self.build_decoder()
        # Tied embeddings: no lm_head parameter at all, so a state dict never holds the table twice.
        self.lm_head = (
            None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )

    def build_decoder(self) -> DecoderModel:
        """The decoder of ``self.config`` (a subclass builds its own family's)."""
        if self.config.model_type in V4_FAMILIES:
            raise MoeforgeError(V4_COMPILE_REFUSAL)
        layers = (DecoderLayer(self.config, i, self.mla_impl) for i in range(self.config.num_hidden_layers))
        return DecoderModel(self.config, layers)

    @property
    def output_embedding(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        past_key_values: KVCache | None = None,
        output_hidden_states: bool = False,
    ) -> ModelOutput:
        """input_ids, position_ids: [B, S] int64; past_key_values: one tuple per layer (see attention
        modules for layouts) or None. Returns logits [B, S, V] float32 and the grown cache."""
        x, present, hidden = self.run_layers(self.model.embed_tokens(input_ids), position_ids, past_key_values,
                                             output_hidden_states)
        return ModelOutput(self.lm_logits(self.model.norm(x)), present, hidden)

    def run_layers(self, x: torch.Tensor, position_ids: torch.Tensor, past_key_values: KVCache | None,
                   output_hidden_states: bool) -> tuple[torch.Tensor, KVCache, tuple[torch.Tensor, ...] | None]:
        """The decoder layers on x [B, S, H]: the last layer's output, the grown cache, and (with
        ``output_hidden_states``) every layer's output (a pipeline stage runs its own layers through this too)."""
        cos, sin = self.model.rotary(position_ids)
        past_len = 0 if past_key_values is None else cache_length(past_key_values, self.mla_impl, self.config)
        mask = causal_mask(past_len, position_ids.shape[1], self.config.sliding_window, position_ids.device)
        present: list[LayerCache] = []
        hidden: list[torch.Tensor] = []
        for i, layer in enumerate(self.model.layers):
            x, layer_cache = layer(x, cos, sin, mask, None if past_key_values is None else past_key_values[i],
                                   position_ids)
            present.append(layer_cache)
            if output_hidden_states:
                hidden.append(x)
        return x, tuple(present), tuple(hidden) if output_hidden_states else None

    def lm_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The LM head: x [B, S, H] -> logits [B, S, V] float32 (a tensor-parallel rank overrides it)."""
        return F.linear(x, self.output_embedding).to(torch.float32)

    def reset_buffers(self) -> None:
        """Recompute derived buffers (after building on the meta device and loading weights)."""
        self.model.rotary.reset_buffers()


def cache_length(past: KVCache, mla_impl: MLAImpl, config: ModelConfig) -> int:
    """Tokens already in the cache (the sequence axis depends on the layout)."""
    first = past[0][0]
    return first.shape[1] if (config.mla is not None and mla_impl == "absorb") else first.shape[2]


@torch.no_grad()
def init_random_weights(model: CausalLM, seed: int) -> None:
    """Seeded random weights with a healthy spread (tiny presets and tests).

    Linear weights ~ N(0, 1/fan_in), embeddings ~ N(0, 1), norms ~ 1 + N(0, 0.1), biases ~ N(0, 0.05),
    correction bias ~ U(0, 0.1) (positive: see routing's note on masks), a hash layer's tid2eid K distinct random
    experts per token id (DeepSeek-V4). Parameters are visited in name order, so the same seed gives the same model
    whatever the construction order.
    """
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = dict(model.named_parameters())
    tensors.update((n, b) for n, b in model.named_buffers() if n.endswith(("e_score_correction_bias", "tid2eid")))
    for name in sorted(tensors):
        t = tensors[name]
        if name.endswith("tid2eid"):  # DeepSeek-V4 hash routing: K distinct experts per token id
            experts = model.config.moe.n_routed_experts if model.config.moe is not None else 1
            t.copy_(torch.rand(t.shape[0], experts, generator=gen).argsort(dim=-1)[:, : t.shape[1]])
        elif name.endswith("e_score_correction_bias"):
            t.copy_(torch.rand(t.shape, generator=gen) * 0.1)
        elif "norm" in name:
            t.copy_(1.0 + 0.1 * torch.randn(t.shape, generator=gen))
        elif name.endswith("bias"):
            t.copy_(0.05 * torch.randn(t.shape, generator=gen))
        elif "embed_tokens" in name:
            t.copy_(torch.randn(t.shape, generator=gen))
        else:
            t.copy_(torch.randn(t.shape, generator=gen) / t.shape[-1] ** 0.5)
