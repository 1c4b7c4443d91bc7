"""A seeded DeepSeek-V3-shaped MoE model written twice with the same weights: a GGUF ``deepseek2`` file (llama.cpp's
layout) and an HF safetensors folder holding that GGUF's dequantised values (float32), for benchmarks/moe_speed.py.

Each weight is drawn by synthetic_deepseek.py's seeded generator (``weight_value``), quantised to its GGUF type with
the gguf package (what llama.cpp's converter uses), and dequantised again for the HF folder: both systems run one
model, bit for bit, and accuracy is measured against the PyTorch model of those dequantised weights.

Formats (``--formats``): ``q8_0`` stores every projection, the embedding and the LM head as Q8_0; ``q4_1`` stores
the attention, dense and expert projections as Q4_1 and the embedding and LM head as Q8_0 (llama.cpp's usual
mix). Norms, the router and its correction bias stay F32.

What is simplified against a released DeepSeek-V3 (so that llama.cpp and moeforge compute one function): plain RoPE
(no YaRN) and ungrouped routing (n_group 1); the rest -- MLA with q/kv LoRA, sigmoid routing with a correction
bias, top-k renormalised and scaled, a shared expert, a dense first layer -- is the release's. MLA is written as
llama.cpp's converter writes it today: MQA over the latent, ``kv_b_proj`` split per head into ``attn_k_b``
(transposed) and ``attn_v_b``, the real head sizes in ``key_length_mla`` / ``value_length_mla``.

    python benchmarks/synthetic_gguf.py build/moe_speed --formats q8_0 q4_1
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as GgmlType
from safetensors.numpy import save_file
from synthetic_deepseek import (
    DEFAULTS,
    INDEX_FILE,
    CheckpointShape,
    WeightSpec,
    add_shape_arguments,
    checkpoint_weights,
    hf_config,
    parameter_count,
    shape_from_args,
    weight_value,
)
from timer import Stopwatch

from moeforge.model.presets import TINY_BOS, TINY_EOS
from moeforge.model.tokenizer import Tokenizer

GENERATOR_VERSION = 2  # bump when the written files change: an older stamp is not reused
STAMP_FILE = "moe_speed_model.json"
SHARD_BYTES = 1 << 30
FORMATS = ("q8_0", "q4_1")
LLM, ATTENTION, ROPE = gguf.Keys.LLM, gguf.Keys.Attention, gguf.Keys.Rope


def benchmark_shape(shape: CheckpointShape) -> CheckpointShape:
    """The shape with ungrouped routing (llama.cpp's and moeforge's routing then agree whatever llama.cpp's version
    does with expert groups)."""
    return dataclasses.replace(shape, n_group=1, topk_group=1)


def gguf_type(fmt: str, hf_name: str, ndim: int) -> GgmlType:
    """The GGUF storage type of a weight in format ``fmt``."""
    if ndim < 2 or hf_name.endswith(("mlp.gate.weight", "e_score_correction_bias")):
        return GgmlType.F32  # norms, the router and its bias: F32 as the converter keeps them
    if fmt == "q8_0" or hf_name in ("model.embed_tokens.weight", "lm_head.weight"):
        return GgmlType.Q8_0
    if fmt == "q4_1":
        return GgmlType.Q4_1
    raise ValueError(f"unknown format {fmt!r}: choose from {FORMATS}")


def _quantize(values: np.ndarray, qtype: GgmlType) -> tuple[np.ndarray, np.ndarray]:
    """(stored GGUF data, its dequantised float32 values)."""
    if qtype == GgmlType.F32:
        return values, values
    stored = gguf.quants.quantize(values, qtype)
    return stored, gguf.quants.dequantize(stored, qtype).reshape(values.shape).astype(np.float32)


def _gguf_name(names: gguf.TensorNameMap, hf_name: str) -> str:
    hf_name = hf_name.replace("e_score_correction_bias", "e_score_correction.bias")  # as the converter renames it
    base, suffix = hf_name.rsplit(".", 1)
    found = names.get_name(base)
    if found is None:
        raise KeyError(f"no GGUF name for {hf_name}")
    return f"{found}.{suffix}"


def gguf_metadata(shape: CheckpointShape, fmt: str) -> dict[str, Any]:
    """llama.cpp's deepseek2 hyper-parameters (convert_hf_to_gguf.py DeepseekV2Model) for ``shape``, and the file
    type of format ``fmt``."""
    s, config = shape, hf_config(shape)
    file_type = gguf.LlamaFileType.MOSTLY_Q8_0 if fmt == "q8_0" else gguf.LlamaFileType.MOSTLY_Q4_1
    return {
        gguf.Keys.General.FILE_TYPE: int(file_type.value),
        LLM.CONTEXT_LENGTH: 4096, LLM.EMBEDDING_LENGTH: s.hidden, LLM.BLOCK_COUNT: s.layers,
        LLM.FEED_FORWARD_LENGTH: s.intermediate, ATTENTION.HEAD_COUNT: s.heads, ATTENTION.HEAD_COUNT_KV: 1,
        ROPE.FREQ_BASE: float(config["rope_theta"]), ATTENTION.LAYERNORM_RMS_EPS: float(config["rms_norm_eps"]),
        LLM.LEADING_DENSE_BLOCK_COUNT: s.first_dense, ATTENTION.Q_LORA_RANK: s.q_lora_rank,
        ATTENTION.KV_LORA_RANK: s.kv_lora_rank, ATTENTION.KEY_LENGTH: s.kv_lora_rank + s.qk_rope_head_dim,
        ATTENTION.VALUE_LENGTH: s.kv_lora_rank, ATTENTION.KEY_LENGTH_MLA: s.qk_nope_head_dim + s.qk_rope_head_dim,
        ATTENTION.VALUE_LENGTH_MLA: s.v_head_dim, LLM.EXPERT_FEED_FORWARD_LENGTH: s.moe_intermediate,
        LLM.EXPERT_COUNT: s.experts, LLM.EXPERT_USED_COUNT: s.top_k, LLM.EXPERT_SHARED_COUNT: s.shared_experts,
        LLM.EXPERT_WEIGHTS_SCALE: float(config["routed_scaling_factor"]), LLM.EXPERT_WEIGHTS_NORM: True,
        LLM.EXPERT_GATING_FUNC: int(gguf.ExpertGatingFuncType.SIGMOID.value),
        ROPE.DIMENSION_COUNT: s.qk_rope_head_dim, gguf.Keys.General.NAME: "moeforge-synthetic-deepseek-v3",
    }


def benchmark_hf_config(shape: CheckpointShape) -> dict[str, Any]:
    """config.json of the float32 HF folder: DeepSeek-V3's, unquantised, plain RoPE."""
    config = hf_config(shape)
    config.pop("quantization_config")
    config.update(torch_dtype="float32", rope_scaling=None, max_position_embeddings=4096)
    return config


def _tokenizer_metadata(vocab: int) -> dict[str, Any]:
    """A byte-level BPE vocabulary of ``vocab`` tokens with one merge: llama.cpp loads it; the benchmarks feed ids."""
    keys = gguf.Keys.Tokenizer
    tokens = ["a", "b", "ab", *(f"<t{i}>" for i in range(3, vocab))]
    return {keys.MODEL: "gpt2", keys.PRE: "default", keys.LIST: tokens, keys.MERGES: ["a b"],
            keys.BOS_ID: TINY_BOS, keys.EOS_ID: TINY_EOS}


class _ShardWriter:
    """float32 HF safetensors shards of about ``SHARD_BYTES``, written as tensors arrive."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.pending, self.size, self.index = folder, {}, 0, 0
        self.weight_map: dict[str, str] = {}
        self.pending_names: list[str] = []

    def add(self, name: str, values: np.ndarray) -> None:
        self.pending[name] = np.ascontiguousarray(values, np.float32)
        self.size += values.size * 4
        if self.size >= SHARD_BYTES:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        name = f"model-{self.index + 1:05d}.safetensors"
        save_file(self.pending, str(self.folder / name), metadata={"format": "pt"})
        self.weight_map.update((tensor, name) for tensor in self.pending)
        self.pending, self.size, self.index = {}, 0, self.index + 1


def _layer_groups(shape: CheckpointShape) -> list[list[WeightSpec]]:
    """The weights moeforge builds, grouped so that a layer's experts are stacked together (MTP layers left out)."""
    mtp = tuple(f"model.layers.{i}." for i in range(shape.layers, shape.layers + shape.mtp_layers))
    keep = [w for w in checkpoint_weights(shape) if not (mtp and w.name.startswith(mtp))]
    groups: list[list[WeightSpec]] = []
    for weight in keep:
        if ".mlp.experts." in weight.name and groups and ".mlp.experts." in groups[-1][0].name \
                and weight.name.split(".mlp.experts.")[0] == groups[-1][0].name.split(".mlp.experts.")[0]:
            groups[-1].append(weight)
        else:
            groups.append([weight])
    return groups


def write_model(folder: str | Path, shape: CheckpointShape, fmt: str, *, seed: int = 0) -> dict[str, Any]:
    """Write ``folder/model-<fmt>.gguf`` and the HF folder ``folder/hf-<fmt>`` (float32, the GGUF's values); return
    the description (also written as the stamp, last)."""
    folder = Path(folder)
    hf_dir = folder / f"hf-{fmt}"
    hf_dir.mkdir(parents=True, exist_ok=True)
    gguf_path = folder / f"model-{fmt}.gguf"
    (folder / f"{fmt}-{STAMP_FILE}").unlink(missing_ok=True)
    for old in hf_dir.glob("model-*.safetensors"):
        old.unlink()
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, shape.layers)
    tensors: dict[str, tuple[np.ndarray, GgmlType]] = {}
    shards = _ShardWriter(hf_dir)
    heads, nope, v_dim = shape.heads, shape.qk_nope_head_dim, shape.v_head_dim
    with Stopwatch() as writing:
        for group in _layer_groups(shape):
            stored_parts: dict[str, list[np.ndarray]] = {}
            for weight in group:
                values = weight_value(weight, seed).numpy()
                qtype = gguf_type(fmt, weight.name, values.ndim)
                if weight.name.endswith("kv_b_proj.weight"):
                    # llama.cpp's layout: per head, k_b [H, kv_lora, nope] (transposed) and v_b [H, v, kv_lora],
                    # each quantised along its own rows; the HF weight is their dequantised values put back.
                    k_b, v_b = np.split(values.reshape(heads, nope + v_dim, -1), [nope], axis=1)
                    k_stored, k_values = _quantize(np.ascontiguousarray(k_b.transpose(0, 2, 1)), qtype)
                    v_stored, v_values = _quantize(np.ascontiguousarray(v_b), qtype)
                    base = weight.name.replace("kv_b_proj", "{}")
                    tensors[_gguf_name(names, base.format("k_b_proj"))] = (k_stored, qtype)
                    tensors[_gguf_name(names, base.format("v_b_proj"))] = (v_stored, qtype)
                    joined = np.concatenate([k_values.transpose(0, 2, 1), v_values], axis=1).reshape(values.shape)
                    shards.add(weight.name, joined)
                    continue
                stored, dequantised = _quantize(values, qtype)
                shards.add(weight.name, dequantised)
                if ".mlp.experts." in weight.name:  # stacked: blk.N.ffn_{gate,up,down}_exps [E, ...]
                    prefix, rest = weight.name.split(".mlp.experts.")
                    stacked = f"{prefix}.mlp.experts.{rest.split('.', 1)[1]}"
                    stored_parts.setdefault(stacked, []).append(stored)
                else:
                    tensors[_gguf_name(names, weight.name)] = (stored, qtype)
            for stacked, parts in stored_parts.items():
                tensors[_gguf_name(names, stacked)] = (np.stack(parts), gguf_type(fmt, stacked, 2))
        shards.flush()
        _write_gguf(gguf_path, gguf_metadata(shape, fmt), tensors, shape.vocab)
    index = {"metadata": {"total_size": parameter_count(shape) * 4},
             "weight_map": dict(sorted(shards.weight_map.items()))}
    (hf_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (hf_dir / "config.json").write_text(json.dumps(benchmark_hf_config(shape), indent=2) + "\n")
    Tokenizer.byte_level(shape.vocab, TINY_BOS, TINY_EOS).save(hf_dir)
    info = {"generator_version": GENERATOR_VERSION, "format": fmt, "seed": seed, "shape": shape.to_dict(),
            "parameters": parameter_count(shape), "gguf": str(gguf_path), "gguf_bytes": gguf_path.stat().st_size,
            "hf": str(hf_dir), "seconds": round(writing.seconds, 1),
            "gguf_types": {str(t.name): sum(1 for _, q in tensors.values() if q == t) for t in
                           {q for _, q in tensors.values()}}}
    (folder / f"{fmt}-{STAMP_FILE}").write_text(json.dumps(info, indent=2) + "\n")
    return info


def _write_gguf(path: Path, metadata: dict[str, Any], tensors: dict[str, tuple[np.ndarray, GgmlType]],
                vocab: int) -> None:
    writer = gguf.GGUFWriter(str(path), "deepseek2")
    for key, value in {**_tokenizer_metadata(vocab), **metadata}.items():
        key = key.format(arch="deepseek2")
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)
    for name, (data, qtype) in tensors.items():
        if qtype == GgmlType.F32:
            writer.add_tensor(name, np.ascontiguousarray(data, np.float32))
        else:
            writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def reuse_or_write(folder: Path, shape: CheckpointShape, fmt: str, *, seed: int) -> dict[str, Any]:
    """The model already in ``folder`` when its stamp says it is this one, else a new one written there."""
    stamp = folder / f"{fmt}-{STAMP_FILE}"
    if stamp.is_file():
        with contextlib.suppress(ValueError, OSError):
            info = json.loads(stamp.read_text())
            if (info.get("generator_version") == GENERATOR_VERSION and info.get("shape") == shape.to_dict()
                    and info.get("seed") == seed and Path(info["gguf"]).is_file()):
                return {**info, "reused": True}
    return write_model(folder, shape, fmt, seed=seed)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--layers", type=int, default=8, help="decoder layers (default: 8: ~1.4 B parameters)")
    parser.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    add_shape_arguments(parser)
    args = parser.parse_args(argv)
    for key, value in DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    shape = benchmark_shape(shape_from_args(args, args.layers))
    print(f"{parameter_count(shape) / 1e9:.2f} B parameters")
    for fmt in args.formats:
        print(json.dumps(reuse_or_write(args.folder, shape, fmt, seed=args.seed), indent=2))


if __name__ == "__main__":
    main()
