"""The parity reference from Hugging Face transformers: an implementation of the checkpoint nobody here wrote.

``moeforge parity DIR --reference transformers`` compares the artifact with transformers running the artifact's
source checkpoint, rather than with moeforge's own PyTorch model. Both references are fed the same way (greedy
prefill + decode with the reference's own cache, ``TorchReference``), so the report reads the same. The torch
reference proves the graph equals our model; this one also proves our model reads the checkpoint and its config
as transformers does (a config field read wrong passes the first check and fails this one).

Loading is transformers' own, in float32, from safetensors only (``use_safetensors=True``: never a pickle) or a
GGUF file; no code from the checkpoint is run (``trust_remote_code`` stays off), so a model type transformers does
not ship is refused with its reason.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from moeforge.core.errors import MoeforgeError
from moeforge.model.gguf_loader import read_gguf
from moeforge.model.loader import resolve_source
from moeforge.verify.parity import TorchReference


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' own progress bars off while loading (its "Loading weights" bar, its GGUF "Converting and
    de-quantizing" bar: minutes of them for a large GGUF); the caller names the stage instead. Restored after."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils  # optional: only these comparisons need it
    from transformers.utils import logging as hf_logging  # optional, as above

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # the bars made through transformers.utils.logging.tqdm
    gguf_tqdm = gguf_utils.tqdm  # the GGUF reader imports tqdm.auto.tqdm itself: the switch above misses it
    gguf_utils.tqdm = functools.partial(gguf_tqdm, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = gguf_tqdm
        if was_enabled:
            hf_logging.enable_progress_bar()


def check_transformers_loadable(spec: str) -> None:
    """Refuse (``MoeforgeError``) a ``spec`` transformers has no checkpoint of: a preset with random weights."""
    if resolve_source(spec).kind == "preset":
        raise MoeforgeError(f"{spec} is a preset with random weights, not a checkpoint transformers can load: give "
                            "the checkpoint with --model, or compare with --reference torch")


def load_transformers_model(spec: str) -> Any:
    """transformers' ``AutoModelForCausalLM`` of ``spec`` (an HF folder, a .gguf file or a built-in GGUF name), float32,
    eval mode. MoeforgeError naming the problem when ``spec`` is a preset (no checkpoint) or transformers refuses."""
    check_transformers_loadable(spec)
    source = resolve_source(spec)
    from transformers import AutoModelForCausalLM  # lazy: seconds of import, needed only here

    path = Path(source.location)
    if source.kind == "gguf":
        gguf_config = read_gguf(path).config
        if gguf_config.model_type == "mixtral":
            raise MoeforgeError(f"{spec} is a llama GGUF with experts (Mixtral), which transformers' GGUF reader "
                                "loads as a dense Llama with random MLP weights: compare with --reference torch, or "
                                "compile the HF safetensors checkpoint and compare that with transformers")
        if gguf_config.rope.frequency_factors is not None:
            raise MoeforgeError(f"{spec} carries Llama-3.x rope scaling as rope_freqs.weight, which transformers' GGUF "
                                "reader ignores (it would run unscaled RoPE and disagree for its own reason): compare "
                                "with --reference torch, or compile the HF safetensors checkpoint and compare that "
                                "with transformers")
    try:
        with quiet_transformers(), warnings.catch_warnings():  # its notices are transformers' to act on, not ours
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            if source.kind == "gguf":
                model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
            else:
                model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, use_safetensors=True)
    except (ValueError, KeyError, OSError, RuntimeError) as error:  # RuntimeError: its weights do not fit its config
        raise MoeforgeError(f"transformers cannot load {spec} as a causal LM ({type(error).__name__}: "
                            f"{str(error).splitlines()[0] if str(error) else ''}); compare with --reference torch "
                            "instead") from None
    return model.eval()


@torch.inference_mode()
def transformers_reference(model: Any, prompt_ids: list[int], decode_steps: int = 16) -> TorchReference:
    """Prefill ``prompt_ids`` and decode ``decode_steps`` greedy tokens with a transformers model (its own cache):
    the logits of every step (prefill [P, V], then one [1, V] per step) and the token each step chose."""
    out = model(input_ids=torch.tensor([prompt_ids], dtype=torch.int64), use_cache=True)
    logits = [out.logits[0].float().numpy()]  # [P, V]
    past = out.past_key_values
    tokens = [int(out.logits[0, -1].argmax())]
    for _ in range(decode_steps):
        out = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits.append(out.logits[0].float().numpy())
        tokens.append(int(out.logits[0, -1].argmax()))
    return TorchReference(list(prompt_ids), logits, tokens)
