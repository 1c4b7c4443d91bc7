"""``genai_config.json`` for onnxruntime-genai 0.18, so that an artifact also runs under ``og.Model(dir)``.

Facts this relies on (checked against onnxruntime-genai 0.18, see the ORT prototype findings):
``model.type`` must be a type GenAI knows (there is no deepseek type; "decoder" and "llama" both
run a plain decoder graph); ``vocab_size``, ``context_length`` and ``decoder.filename`` are required;
``search.past_present_share_buffer`` defaults to false and must be true for an in-place cache graph;
``search.max_length`` sizes the shared cache buffers (``[B, Hkv, max_length, D]``) and may not exceed
``context_length``; with symbolic cache dims GenAI sizes the buffers from ``num_key_value_heads`` and
``head_size``, so they must be right. GenAI feeds ``position_ids`` only if the graph has that input.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from moeforge.core.config import ModelConfig
from moeforge.core.errors import ConfigError
from moeforge.core.kv_layout import KVCacheSpec

GENAI_MODEL_TYPES: tuple[str, ...] = ("decoder", "llama")

DEFAULT_INPUT_NAMES: dict[str, str] = {
    "input_ids": "input_ids",
    "attention_mask": "attention_mask",
    "position_ids": "position_ids",
    "past_key_names": "past_key_values.%d.key",
    "past_value_names": "past_key_values.%d.value",
}
DEFAULT_OUTPUT_NAMES: dict[str, str] = {
    "logits": "logits",
    "present_key_names": "present.%d.key",
    "present_value_names": "present.%d.value",
}


def _merge(defaults: Mapping[str, str], overrides: Mapping[str, str | None] | None) -> dict[str, str]:
    merged: dict[str, str | None] = {**defaults, **(overrides or {})}
    return {k: v for k, v in merged.items() if v is not None}


def genai_config(
    config: ModelConfig,
    kv: KVCacheSpec,
    *,
    context_length: int,
    filename: str = "model.onnx",
    eos_token_id: int | Sequence[int] | None = None,
    bos_token_id: int | None = None,
    pad_token_id: int | None = None,
    input_names: Mapping[str, str | None] | None = None,
    output_names: Mapping[str, str | None] | None = None,
    model_type: str = "decoder",
    session_options: Mapping[str, Any] | None = None,
) -> dict[str, Any] | None:
    """The ``genai_config.json`` dict for a GQA-cache artifact, or ``None`` for an MLA-latent one.

    ``context_length`` becomes both ``model.context_length`` and ``search.max_length`` (the length of
    the shared cache buffers); it must not exceed ``kv.max_seq_len``. Token ids default to the model
    config's (``eos_token_ids``, ``bos_token_id``); ``pad_token_id`` defaults to the first EOS id.
    ``input_names`` / ``output_names`` override GenAI's keys (``input_ids``, ``attention_mask``,
    ``position_ids``, ``past_key_names``, ``past_value_names``; ``logits``, ``present_key_names``,
    ``present_value_names``); a value of ``None`` drops the key. The ``%d`` patterns must produce
    exactly ``kv.past_input_names`` / ``kv.present_output_names``.

    Returns ``None`` for ``kv.layout == "mla_latent"``: GenAI 0.18 allocates a key and a value buffer
    per layer, both ``[batch, num_key_value_heads, max_length, head_size]``, and feeds them under two
    names. An absorbed-MLA graph has a single latent input per layer (``[c_kv | k_rope]``, one buffer
    read as both K and V), which GenAI cannot express; such an artifact runs on moeforge's own runtime.
    """
    if kv.layout in ("mla_latent", "mla_dsa", "v4_hybrid"):  # DSA: the indexer keys too; V4: rings and entries
        return None
    if kv.layout != "gqa":
        raise ValueError(f"unknown KV layout {kv.layout!r}")
    if config.mla is not None:
        raise ValueError(f"{config.name or config.model_type} uses MLA but the KV spec says gqa")
    if model_type not in GENAI_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not one of {', '.join(GENAI_MODEL_TYPES)}")
    if not 0 < context_length <= kv.max_seq_len:
        raise ConfigError(
            f"context_length {context_length} must be in 1..{kv.max_seq_len} (the artifact's max_seq_len)",
            field="context_length",
        )
    if kv.num_layers != config.num_hidden_layers:
        raise ValueError(f"KV spec has {kv.num_layers} layers, the model {config.num_hidden_layers}")
    static_dims = [d for d in kv.shape if isinstance(d, int)]
    if static_dims and static_dims != [config.num_key_value_heads, config.head_dim]:
        raise ValueError(
            f"KV buffer shape {kv.shape} does not match [batch_size, {config.num_key_value_heads}, "
            f"max_sequence_length, {config.head_dim}]"
        )

    inputs = _merge(DEFAULT_INPUT_NAMES, input_names)
    outputs = _merge(DEFAULT_OUTPUT_NAMES, output_names)
    for i in range(kv.num_layers):
        want_past = [inputs["past_key_names"] % i, inputs["past_value_names"] % i]
        want_present = [outputs["present_key_names"] % i, outputs["present_value_names"] % i]
        if kv.past_input_names[i] != want_past or kv.present_output_names[i] != want_present:
            raise ValueError(
                f"layer {i}: KV names {kv.past_input_names[i]} -> {kv.present_output_names[i]} do not follow the "
                f"GenAI patterns {want_past} -> {want_present}"
            )

    if eos_token_id is None:
        eos_ids = list(config.eos_token_ids)
    elif isinstance(eos_token_id, int):
        eos_ids = [eos_token_id]
    else:
        eos_ids = [int(e) for e in eos_token_id]
    if bos_token_id is None:
        bos_token_id = config.bos_token_id
    if pad_token_id is None and eos_ids:
        pad_token_id = eos_ids[0]

    model: dict[str, Any] = {"type": model_type, "vocab_size": config.vocab_size, "context_length": context_length}
    if eos_ids:
        model["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    if bos_token_id is not None:
        model["bos_token_id"] = bos_token_id
    if pad_token_id is not None:
        model["pad_token_id"] = pad_token_id
    decoder: dict[str, Any] = {
        "filename": filename,
        "head_size": config.head_dim,
        "hidden_size": config.hidden_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "num_hidden_layers": config.num_hidden_layers,
        "inputs": inputs,
        "outputs": outputs,
    }
    if session_options:
        decoder["session_options"] = dict(session_options)
    model["decoder"] = decoder
    return {
        "model": model,
        "search": {"max_length": context_length, "past_present_share_buffer": True, "do_sample": False},
    }


def genai_greedy(model: Any, prompts: Sequence[Sequence[int]], new_tokens: int,
                 min_new_tokens: int = 0) -> list[list[int]]:
    """Greedy generation by onnxruntime-genai: the new ids per prompt. ``model`` is an artifact
    directory or an already loaded ``og.Model`` (load once when timing).

    Prompts must have equal lengths (GenAI pads on the right with pad_token_id otherwise). GenAI stops
    at EOS unless ``min_new_tokens`` forces it on, and leaves a stopping EOS out of the sequence.
    """
    import onnxruntime_genai as og  # optional (dev) dependency, a separate C++ runtime: only this check needs it

    lengths = {len(p) for p in prompts}
    if len(lengths) != 1:
        raise ValueError("genai_greedy takes prompts of one length")
    prompt_len = lengths.pop()
    if isinstance(model, (str, Path)):
        model = og.Model(str(model))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=prompt_len + new_tokens, min_length=prompt_len + min_new_tokens,
                              batch_size=len(prompts), do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(np.array(prompts, dtype=np.int32))
    while not generator.is_done():
        generator.generate_next_token()
    return [list(generator.get_sequence(i))[prompt_len:] for i in range(len(prompts))]
