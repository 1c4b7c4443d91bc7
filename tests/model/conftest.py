"""Shared SmolLM2 fixtures: transformers' load of the GGUF is the slowest step of the suite, so once."""

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

from moeforge.model.gguf_loader import GGUFCheckpoint, read_gguf


@pytest.fixture(scope="session")
def smollm2(smollm2_gguf: Path) -> GGUFCheckpoint:
    return read_gguf(smollm2_gguf)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf: Path) -> Any:
    """transformers' own GGUF loading of the same file: dequantised float32 weights + inferred config."""
    import transformers

    path = smollm2_gguf
    if importlib.util.find_spec("accelerate") is None:
        pytest.fail("transformers loads GGUF models only with `accelerate` installed: add it to the dev extra")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(smollm2_gguf: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)
