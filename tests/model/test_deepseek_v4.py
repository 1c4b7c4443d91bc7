"""DeepSeek-V4 against transformers' DeepseekV4ForCausalLM (eager, fp32): config reading, the torch model, the cache,
checkpoint names (transformers' and the published ones, FP8 with ue8m0 scales, the MTP module), the preset and the CLI.

Seeded tiny HF models saved with save_pretrained and read by ``load_model(folder)``:
- ``every_layer``: sliding, CSA, HCA, CSA, HCA layers; an 6-token window, entries of 4 (CSA) and 8 (HCA) tokens, the
  indexer keeping 3 of up to 14 entries; two hash-routed MoE layers then top-k ones (sqrtsoftplus); 4 mHC streams; YaRN
  on the compressed layers. A 40-token prompt and 16 decode steps cross many window and compression boundaries.
- ``dense_topk``: CSA (entries of 2), HCA (of 4) and sliding layers, the indexer keeping every entry, sigmoid scores,
  2 mHC streams, plain RoPE on both settings, tied embeddings.
"""

from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from moeforge.cli import main
from moeforge.core.config import ModelConfig
from moeforge.core.errors import CheckpointError, ConfigError
from moeforge.model.deepseek_v4 import DeepseekV4ForCausalLM
from moeforge.model.lightning_indexer import LightningIndexer, closed_entries
from moeforge.model.loader import load_model
from moeforge.model.presets import get_preset
from moeforge.model.rope import apply_rotary_tail
from moeforge.runtime.sampler import SamplingParams
from moeforge.verify.generate import generate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the seeded transformers V4 models
from v4_hf_models import fp8_ue8m0, hf_config, hf_greedy, published_name, randomise, write_published

VOCAB, PROMPT_LEN, STEPS = 96, 40, 16
CSA, HCA, SLIDING = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"
# A selection whose K-th and (K+1)-th scores are closer than this could be a tie broken alike by chance.
MIN_MARGIN = 1e-5

CASES: dict[str, dict[str, Any]] = {
    "every_layer": dict(
        num_hidden_layers=5, layer_types=[SLIDING, CSA, HCA, CSA, HCA], compress_rates={CSA: 4, HCA: 8},
        mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe", "moe"], sliding_window=6, index_topk=3,
        index_n_heads=8, hc_mult=4, hc_sinkhorn_iters=20, scoring_func="sqrtsoftplus",
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}),
    "dense_topk": dict(
        num_hidden_layers=3, layer_types=[CSA, HCA, SLIDING], compress_rates={CSA: 2, HCA: 4},
        mlp_layer_types=["moe", "hash_moe", "moe"], sliding_window=12, index_topk=64, index_n_heads=4, hc_mult=2,
        hc_sinkhorn_iters=3, scoring_func="sigmoid", tie_word_embeddings=True, compress_rope_theta=50000.0),
}


# randomise()'s seed per case: greedy tokens that do not settle into one repeated token within the 16 steps.
SEEDS = {"every_layer": 1, "dense_topk": 5}


def hf_model(case: str) -> Any:
    torch.manual_seed(0)
    model = transformers.DeepseekV4ForCausalLM(hf_config(**CASES[case]))
    randomise(model, SEEDS[case])
    return model.eval()


@pytest.fixture(scope="module", params=sorted(CASES))
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any, Path]:
    folder = tmp_path_factory.mktemp(request.param)
    model = hf_model(request.param)
    model.save_pretrained(folder)
    return request.param, model, folder


def _prompt(length: int = PROMPT_LEN) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(7))


def _close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    # fp32: ~1e-5 of the logits' range
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5 * float(theirs.abs().max()))


def cached_logits(model: Any, ids: torch.Tensor, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill logits [P, V] for ``ids`` [1, P], then one cached decode step per token of ``tokens`` [len, V]."""
    prompt_len = ids.shape[1]
    out = model(ids, torch.arange(prompt_len)[None])
    past, decode = out.past_key_values, []
    for step, token in enumerate(tokens):
        step_out = model(torch.tensor([[token]]), torch.tensor([[prompt_len + step]]), past)
        past = step_out.past_key_values
        decode.append(step_out.logits[0, 0])
    return out.logits[0], torch.stack(decode)


# ---------------------------------------------------------------------------------------- the model
def _record_selections(monkeypatch: pytest.MonkeyPatch) -> list[tuple[LightningIndexer, tuple[Any, ...], Any]]:
    """Every LightningIndexer.select call: (indexer, args, mask)."""
    calls: list[tuple[LightningIndexer, tuple[Any, ...], Any]] = []
    select = LightningIndexer.select

    def recording(self: LightningIndexer, *args: Any) -> Any:
        mask = select(self, *args)
        calls.append((self, args, mask))
        return mask

    monkeypatch.setattr(LightningIndexer, "select", recording)
    return calls


def _margin(indexer: LightningIndexer, args: tuple[Any, ...]) -> tuple[float, int]:
    """(the smallest gap between the K-th and (K+1)-th readable index score over the call's queries, the most entries
    a query could read)."""
    x, q_resid, cos, sin, keys, first_token = args
    b, s, _ = x.shape
    q = apply_rotary_tail(indexer.q_b_proj(q_resid).view(b, s, indexer.n_heads, indexer.width), cos, sin)
    index = indexer.scorer(q, keys, x, indexer.scale)[0]  # [S, T]
    closed = closed_entries(first_token, s, keys.shape[1], indexer.rate, x.device)
    margin, most = float("inf"), 0
    for scores, readable in zip(index, closed, strict=True):
        allowed = scores[readable]
        most = max(most, allowed.numel())
        if allowed.numel() > indexer.topk:
            top = allowed.topk(indexer.topk + 1).values
            margin = min(margin, float(top[-2] - top[-1]))
    return margin, most


@torch.no_grad()
def test_prefill_and_cached_decode_match_transformers(saved: tuple[str, Any, Path],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    case, model_hf, folder = saved
    ids = _prompt()
    hf_indexers = [m for m in model_hf.modules() if type(m).__name__ == "DeepseekV4Indexer"]
    hf_picks: list[torch.Tensor] = []
    handles = [m.register_forward_hook(lambda _m, _a, out: hf_picks.append(out)) for m in hf_indexers]
    hf = model_hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=STEPS, do_sample=False,
                           eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    for h in handles:
        h.remove()
    hf_tokens = hf.sequences[0, PROMPT_LEN:].tolist()
    hf_prefill = model_hf(ids).logits[0]  # [P, V]
    hf_decode = torch.cat(hf.logits[1:])  # [STEPS - 1, V]: after feeding generated tokens 0..14

    loaded = load_model(str(folder))
    assert loaded.config.model_type == "deepseek_v4" and isinstance(loaded.model, DeepseekV4ForCausalLM)
    calls = _record_selections(monkeypatch)
    prefill, decode = cached_logits(loaded.model, ids, hf_tokens[:-1])
    monkeypatch.undo()

    assert hf_prefill.abs().max() > 0.5  # logits with a real spread
    _close(prefill, hf_prefill)
    _close(decode, hf_decode)
    assert generate(loaded.model, ids[0].tolist(), SamplingParams(max_tokens=STEPS)).token_ids == hf_tokens
    assert len(set(hf_tokens)) > 2  # not a degenerate repeat that would hide a wrong step

    # The indexer reads the same entries for every query of every CSA layer, prefill and decode, by a real margin.
    assert len(calls) == len(hf_picks) == len(hf_indexers) * STEPS
    margin, most = float("inf"), 0
    for (indexer, args, mask), picks in zip(calls, hf_picks, strict=True):
        ours = [set(torch.nonzero(row).flatten().tolist()) for row in mask[0]]
        assert ours == [{t for t in row.tolist() if t >= 0} for row in picks[0]]
        call_margin, call_most = _margin(indexer, args)
        margin, most = min(margin, call_margin), max(most, call_most)
    topk = CASES[case]["index_topk"]
    if most > topk:
        assert margin > MIN_MARGIN, f"near-tie at the top-k boundary ({margin:.2e}): pick another seed"
    assert (most > topk) == (case == "every_layer")  # every_layer really selects (3 of up to 13 entries)


@torch.no_grad()
def test_cache_holds_what_transformers_caches(saved: tuple[str, Any, Path]) -> None:
    # After a prefill and 5 decode steps (P ends off a window boundary): the window, the entries, the pending tokens
    # and the overlap state of every layer equal transformers' DynamicCache's, tensor for tensor.
    case, model_hf, folder = saved
    ids = _prompt(PROMPT_LEN + 5)
    out = model_hf(ids[:, :PROMPT_LEN], use_cache=True)
    cache = out.cache
    for t in range(PROMPT_LEN, PROMPT_LEN + 5):
        cache = model_hf(ids[:, t: t + 1], cache=cache, use_cache=True).cache
    model = load_model(str(folder)).model
    past = model(ids[:, :PROMPT_LEN], torch.arange(PROMPT_LEN)[None]).past_key_values
    for t in range(PROMPT_LEN, PROMPT_LEN + 5):
        past = model(ids[:, t: t + 1], torch.tensor([[t]]), past).past_key_values
    window = CASES[case]["sliding_window"]
    for kind, ours, theirs in zip(CASES[case]["layer_types"], past, cache.layers, strict=True):
        assert ours[0].shape[1] == window - 1
        torch.testing.assert_close(ours[0], theirs.keys[:, 0], rtol=1e-5, atol=1e-5)
        if kind == SLIDING:
            assert len(ours) == 1
            continue
        rate = CASES[case]["compress_rates"][kind]
        names = ("compressor", "indexer") if kind == CSA else ("compressor",)
        for j, name in enumerate(names):
            entries, pending = ours[1 + 3 * j], ours[2 + 3 * j]
            assert entries.shape[1] == (PROMPT_LEN + 5) // rate and pending.shape[1] == (PROMPT_LEN + 5) % rate
            torch.testing.assert_close(entries, theirs.compressed_kv[name], rtol=1e-5, atol=1e-5)
            buffered = torch.cat((theirs.buffer_kv[name], theirs.buffer_gate[name]), dim=-1)
            torch.testing.assert_close(pending, buffered, rtol=1e-5, atol=1e-5)
            if kind == CSA:
                overlap = torch.cat((theirs.overlap_kv[name], theirs.overlap_gate[name]), dim=-1)
                torch.testing.assert_close(ours[3 + 3 * j], overlap, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_chunked_prefill_equals_one_prefill(saved: tuple[str, Any, Path]) -> None:
    # Chunks of 7, 9, 13 and 11 tokens: windows close inside and across chunks, pending tokens carry over.
    _, model_hf, folder = saved
    ids = _prompt()
    model = load_model(str(folder)).model
    past, logits, start = None, [], 0
    for size in (7, 9, 13, 11):
        out = model(ids[:, start: start + size], torch.arange(start, start + size)[None], past)
        past, start = out.past_key_values, start + size
        logits.append(out.logits[0])
    _close(torch.cat(logits), model_hf(ids).logits[0])


@torch.no_grad()
def test_a_batch_prefills_and_decodes_as_transformers(saved: tuple[str, Any, Path]) -> None:
    # Two different sequences side by side: a 24-token prefill, then 8 single-token steps (teacher-forced), against
    # transformers' forward over the whole 32 tokens.
    _, model_hf, folder = saved
    ids = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(11))
    model = load_model(str(folder)).model
    out = model(ids[:, :24], torch.arange(24).expand(2, -1))
    past, logits = out.past_key_values, [out.logits]
    for t in range(24, 32):
        out = model(ids[:, t: t + 1], torch.tensor([[t], [t]]), past)
        past = out.past_key_values
        logits.append(out.logits)
    _close(torch.cat(logits, dim=1), model_hf(ids).logits)


def test_parameter_count_is_transformers(saved: tuple[str, Any, Path]) -> None:
    _, model_hf, folder = saved
    config = ModelConfig.from_hf_json(folder / "config.json")
    # transformers keeps the correction biases as buffers; moeforge counts them as it does V3's
    biases = sum(b.numel() for n, b in model_hf.named_buffers() if n.endswith("e_score_correction_bias"))
    assert config.num_parameters() == sum(p.numel() for p in model_hf.parameters()) + biases
    assert config.kv_cache_values_per_token() > 0


# ---------------------------------------------------------------------------------------- checkpoints
@torch.no_grad()
def test_published_fp8_checkpoint_loads_with_its_mtp_module(tmp_path: Path) -> None:
    # The release's layout: published names, FP8 projections with ue8m0 `.scale` blocks (compressor and indexer
    # projections stay unquantised, as in V4-Flash), an MTP module. transformers' model holds the dequantised weights.
    folder, out = tmp_path / "hf", tmp_path / "published"
    model_hf = hf_model("every_layer")
    model_hf.save_pretrained(folder)
    tensors = load_file(str(folder / "model.safetensors"))
    published: dict[str, torch.Tensor] = {}
    quantised = (".wq_a.", ".wq_b.", ".wkv.", ".wo_a.", ".wo_b.", ".w1.", ".w2.", ".w3.")
    for key, value in tensors.items():
        name = published_name(key)
        if name.endswith(".weight") and any(q in name for q in quantised) and ".compressor." not in name:
            q, scale = fp8_ue8m0(value, 8)
            published[name], published[name.removesuffix("weight") + "scale"] = q, scale
            tensors[key] = (q.to(torch.float32).reshape(value.shape[0] // 8, 8, -1, 8)
                            * scale.to(torch.float32)[:, None, :, None]).reshape(value.shape)
        else:
            published[name] = value
    mtp = {"mtp.0.attn.wq_a.weight": published["layers.1.attn.wq_a.weight"].clone(),
           "mtp.0.attn.wq_a.scale": published["layers.1.attn.wq_a.scale"].clone(),
           "mtp.0.enorm.weight": torch.ones(32), "mtp.0.e_proj.weight": torch.randn(32, 32)}
    out.mkdir()
    save_file({**published, **mtp}, str(out / "model.safetensors"))
    hf_json = json.loads((folder / "config.json").read_text())
    hf_json["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [8, 8], "scale_fmt": "ue8m0"}
    (out / "config.json").write_text(json.dumps(hf_json))
    # transformers' model with the same (dequantised) weights, from its own save_pretrained names.
    model_hf.load_state_dict(_hf_state(model_hf, tensors))

    loaded = load_model(str(out))
    assert isinstance(loaded.model, DeepseekV4ForCausalLM)
    kept = loaded.model.mtp.tensors
    assert set(kept) == {"mtp.0.attn.wq_a.weight", "mtp.0.enorm.weight", "mtp.0.e_proj.weight"}
    torch.testing.assert_close(kept["mtp.0.attn.wq_a.weight"], tensors["model.layers.1.attn.wq_a.weight"])
    ids = _prompt(24)
    _close(loaded.model(ids, torch.arange(24)[None]).logits[0], model_hf(ids).logits[0])


def _hf_state(model_hf: Any, saved: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' state dict with each tensor replaced by the saved file's (same order: names map one to one)."""
    from moeforge.model.deepseek_v4_names import v4_name

    ours = {v4_name(k, set(saved)): v for k, v in saved.items()}
    state = {}
    for name, value in model_hf.state_dict().items():
        if name.endswith("experts.gate_up_proj"):
            prefix = name.removesuffix("gate_up_proj")
            state[name] = torch.stack([torch.cat((ours[f"{prefix}{e}.gate_proj.weight"],
                                                  ours[f"{prefix}{e}.up_proj.weight"])) for e in range(len(value))])
        elif name.endswith("experts.down_proj"):
            prefix = name.removesuffix("down_proj")
            state[name] = torch.stack([ours[f"{prefix}{e}.down_proj.weight"] for e in range(len(value))])
        else:
            state[name] = ours.get(name, value)
    return state


@pytest.mark.parametrize("k", [64, 16])
@pytest.mark.parametrize("stored", ["int8", "uint8", "float4_e2m1fn_x2"])
@pytest.mark.parametrize("scale_dtype", ["float8_e8m0fnu", "float32"])
def test_fp4_dequantises_as_transformers(k: int, stored: str, scale_dtype: str) -> None:
    # Every code in every nibble, K of 2 groups or one partial group: transformers' own dequantisation as reference.
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    from moeforge.model.fp4 import dequantize_fp4

    gen = torch.Generator().manual_seed(k)
    packed = torch.randint(0, 256, (2, 5, k // 2), generator=gen, dtype=torch.uint8)
    packed[0].view(-1)[:16] = torch.arange(16, dtype=torch.uint8) * 17  # codes 0..15 in both nibbles
    scale = torch.exp2(torch.randint(-6, 4, (2, 5, -(-k // 32)), generator=gen).float()).to(getattr(torch, scale_dtype))
    theirs = torch.stack([Fp8Dequantize(None)._dequantize_one(packed[e].view(torch.int8), scale[e], torch.float32)
                          for e in range(2)])
    ours = dequantize_fp4(packed.view(getattr(torch, stored)), scale)
    assert ours.shape == (2, 5, k) and ours.dtype == torch.float32
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


@torch.no_grad()
def test_published_fp4_experts_load_as_transformers_reads_them(tmp_path: Path) -> None:
    # DeepSeek-V4-Flash's layout: routed experts FP4 (e2m1 pairs in int8, a ue8m0 scale per 32 values), the rest FP8.
    # transformers reads the same folder (dequantising on CPU); logits and greedy tokens must be its own.
    torch.manual_seed(0)
    model_hf = transformers.DeepseekV4ForCausalLM(hf_config(**{**CASES["dense_topk"], "moe_intermediate_size": 64}))
    randomise(model_hf, SEEDS["dense_topk"])
    write_published(model_hf.eval(), tmp_path, experts="fp4")
    reference = transformers.DeepseekV4ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    loaded = load_model(str(tmp_path))
    ids = _prompt()
    theirs = reference(ids).logits[0]
    _close(loaded.model(ids, torch.arange(PROMPT_LEN)[None]).logits[0], theirs)
    assert (theirs - model_hf(ids).logits[0]).abs().max() > 0.05  # the FP4 rounding is really in the weights
    tokens = hf_greedy(reference, ids[0].tolist(), STEPS)
    assert generate(loaded.model, ids[0].tolist(), SamplingParams(max_tokens=STEPS)).token_ids == tokens
    assert len(set(tokens)) > 2


@pytest.mark.parametrize("packed", [torch.int8, torch.float4_e2m1fn_x2])
def test_fp4_experts_read_in_parts_as_whole(packed: torch.dtype, tmp_path: Path) -> None:
    # The streamed compile reads one expert, or a tp rank's rows / groups of 32 along K: each part is that of the whole.
    from moeforge.model.safetensors_loader import read_hf_checkpoint

    torch.manual_seed(0)
    model_hf = transformers.DeepseekV4ForCausalLM(hf_config(**{**CASES["dense_topk"], "moe_intermediate_size": 64}))
    randomise(model_hf, 2)
    write_published(model_hf.eval(), tmp_path, experts="fp4", packed=packed)
    checkpoint = read_hf_checkpoint(tmp_path, ModelConfig.from_hf_json(tmp_path / "config.json"))
    for proj in ("gate_proj", "down_proj"):
        name = f"model.layers.1.mlp.experts.{proj}"
        whole = checkpoint.read(name)
        assert whole.shape == checkpoint.shape(name) and whole.dtype == torch.float32
        for dim, start, stop in ((0, 2, 3), (1, 16, 32), (2, 32, 64), (2, 8, 40)):
            if stop <= whole.shape[dim]:
                torch.testing.assert_close(checkpoint.read_slice(name, dim, start, stop),
                                           whole.narrow(dim, start, stop - start), rtol=0, atol=0)


def test_fp4_experts_need_the_config_to_say_so(tmp_path: Path) -> None:
    # Packed int8 experts without expert_dtype fp4 are refused by name (read as floats they would be garbage).
    torch.manual_seed(0)
    model_hf = transformers.DeepseekV4ForCausalLM(hf_config(**{**CASES["dense_topk"], "moe_intermediate_size": 64}))
    write_published(model_hf.eval(), tmp_path, experts="fp4")
    hf_json = json.loads((tmp_path / "config.json").read_text())
    del hf_json["quantization_config"]["expert_dtype"]
    (tmp_path / "config.json").write_text(json.dumps(hf_json))
    with pytest.raises(CheckpointError, match="expert_dtype"):
        load_model(str(tmp_path))


def test_a_hash_table_naming_missing_experts_is_refused(saved: tuple[str, Any, Path], tmp_path: Path) -> None:
    _, _, folder = saved
    tensors = load_file(str(folder / "model.safetensors"))
    key = next(k for k in tensors if k.endswith("tid2eid"))
    tensors[key][3, 0] = 6  # experts are 0..5
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(CheckpointError, match="names experts"):
        load_model(str(tmp_path))


# ---------------------------------------------------------------------------------------- config
def _raw(**fields: Any) -> dict[str, Any]:
    return {"model_type": "deepseek_v4", "vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 4,
            "num_attention_heads": 4, "head_dim": 16, "q_lora_rank": 16, "o_groups": 2, "o_lora_rank": 8,
            "index_head_dim": 16, "n_routed_experts": 8, "moe_intermediate_size": 16, "bos_token_id": 0,
            "eos_token_id": 1, **fields}


@pytest.mark.parametrize("fields", [
    {},  # transformers' defaults: 2 HCA then CSA/HCA alternating, 3 hash layers, rope dim 64/512, flat rope_scaling
    {"compress_ratios": [0, 4, 128, 4], "compress_rate_csa": 8, "num_hash_layers": 1, "qk_rope_head_dim": 8,
     "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 64}},  # legacy keys
    {"layer_types": [SLIDING, CSA, HCA, SLIDING, CSA], "mlp_layer_types": ["moe"] * 5, "partial_rotary_factor": 0.5,
     "rope_parameters": {"rope_type": "yarn", "factor": 2.0, "beta_fast": 16}},  # lists cut to the layers
])
def test_config_is_read_as_transformers_reads_it(fields: dict[str, Any]) -> None:
    raw = _raw(**fields)
    resolved = transformers.DeepseekV4Config(**{k: v for k, v in raw.items() if k != "model_type"}).to_dict()
    ours = ModelConfig.from_hf_dict(raw)
    assert ours == ModelConfig.from_hf_dict(resolved)
    attn, moe = ours.compressed_attention, ours.moe
    assert attn is not None and moe is not None
    assert list(attn.layer_types) == resolved["layer_types"]
    assert [i for i, t in enumerate(resolved["mlp_layer_types"]) if t == "hash_moe"] == list(moe.hash_layers)
    assert attn.qk_rope_head_dim == resolved["qk_rope_head_dim"]
    assert (attn.csa_rate, attn.hca_rate) == (resolved["compress_rates"][CSA], resolved["compress_rates"][HCA])
    compress = resolved["rope_parameters"]["compress"]
    assert attn.compress_rope.theta == compress["rope_theta"] and attn.compress_rope.scaling == compress["rope_type"]
    assert ours.rope.theta == resolved["rope_parameters"]["main"]["rope_theta"] and ours.rope.scaling == "default"


def test_rope_frequencies_are_transformers(saved: tuple[str, Any, Path]) -> None:
    case, model_hf, folder = saved
    model = load_model(str(folder)).model
    rotary = model_hf.model.rotary_emb
    for ours, label in ((model.model.rotary, "main"), (model.model.compress_rotary, "compress")):
        torch.testing.assert_close(ours.inv_freq, getattr(rotary, f"{label}_inv_freq"), rtol=1e-6, atol=0)
        assert ours.amplitude == getattr(rotary, f"{label}_attention_scaling")
    assert (model.model.compress_rotary.rope.scaling == "yarn") == (case == "every_layer")


def test_v4_flash_sizes() -> None:
    # transformers' class defaults are DeepSeek-V4-Flash's shapes: 284B parameters; per token a CSA layer caches
    # (512 + 128) / 4 values and an HCA layer 512 / 128, on average over the default 43 layers' types.
    config = ModelConfig.from_hf_dict({"model_type": "deepseek_v4", "vocab_size": 129280, "hidden_size": 4096,
                                       "num_hidden_layers": 43, "num_attention_heads": 64})
    assert 283e9 < config.num_parameters() < 285e9
    attn = config.compressed_attention
    assert attn is not None
    csa, hca = attn.layer_types.count(CSA), attn.layer_types.count(HCA)
    assert config.kv_cache_values_per_token() == math.ceil((csa * 160 + hca * 4) / 43)


@pytest.mark.parametrize(("change", "field"), [
    ({"layer_types": [SLIDING, CSA]}, "layer_types"),
    ({"layer_types": [SLIDING, CSA, "full_attention", HCA]}, "layer_types"),
    ({"compress_ratios": [0, 4, 3, 4]}, "compress_ratios"),
    ({"mlp_layer_types": ["moe", "dense", "moe", "moe"]}, "mlp_layer_types"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"o_groups": 3}, "o_groups"),
    ({"partial_rotary_factor": 1.5}, "partial_rotary_factor"),
    ({"index_head_dim": 1, "partial_rotary_factor": 0.25}, "partial_rotary_factor"),
    ({"hc_mult": 0}, "hc_mult"),
    ({"hc_sinkhorn_iters": "20"}, "hc_sinkhorn_iters"),
    ({"compress_rates": {HCA: 128}, "layer_types": [CSA, HCA, CSA, HCA]}, "compress_rates"),
    ({"compress_rates": {CSA: 0, HCA: 128}}, f"compress_rates.{CSA}"),
    ({"swiglu_limit": -1.0}, "swiglu_limit"),
    ({"rope_scaling": {"type": "llama3", "factor": 8.0}}, "rope_scaling.rope_type"),
    ({"sliding_window": 0}, "sliding_window"),
])
def test_bad_v4_config_names_the_field(change: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_hf_dict(_raw(**change))
    assert info.value.field == field


def test_settings_transformers_ignores_are_ignored_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        config = ModelConfig.from_hf_dict(_raw(n_shared_experts=2, norm_topk_prob=False, num_key_value_heads=4))
    assert config.moe is not None and config.moe.n_shared_experts == 1 and config.moe.norm_topk_prob
    assert config.num_key_value_heads == 1
    assert all(key in caplog.text for key in ("n_shared_experts", "norm_topk_prob", "num_key_value_heads"))


def test_v4_fields_belong_to_deepseek_v4() -> None:
    v4 = get_preset("tiny-deepseek-v4").config
    with pytest.raises(ConfigError, match="belongs to deepseek_v4"):
        get_preset("tiny-deepseek-v3").config.replace(hyper_connections=v4.hyper_connections)


# ---------------------------------------------------------------------------------------- preset, run, compile
@torch.no_grad()
def test_tiny_preset_runs_every_part() -> None:
    loaded = load_model("tiny-deepseek-v4")
    config = loaded.config
    attn, moe = config.compressed_attention, config.moe
    assert attn is not None and moe is not None and config.hyper_connections is not None
    assert set(attn.layer_types) == {SLIDING, CSA, HCA} and moe.hash_layers and len(moe.hash_layers) < 4
    table = loaded.model.model.layers[0].mlp.gate.tid2eid
    assert table.shape == (512, 2) and bool((table[:, 0] != table[:, 1]).all())
    ids = list(range(1, 41))  # past the window (8) and many entries of 4 and of 16
    out = generate(loaded.model, ids, SamplingParams(max_tokens=6))
    assert len(out.token_ids) == 6


def test_run_with_the_torch_backend_gives_transformers_tokens(saved: tuple[str, Any, Path],
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    _, model_hf, folder = saved
    ids = _prompt(20)
    expected = model_hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)[0, 20:].tolist()
    prompt = ",".join(str(t) for t in ids[0].tolist())
    assert main(["run", str(folder), "--backend", "torch", "--prompt-ids", prompt, "--max-new-tokens", "8",
                 "--ignore-eos", "--json", "--quiet"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["token_ids"] == expected


def test_what_v4_compiles_do_not_take_is_refused_in_one_line(saved: tuple[str, Any, Path], tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    # The compiles themselves: tests/compile/test_compile_deepseek_v4.py.
    _, _, folder = saved
    out = tmp_path / "artifact"
    for flags, why in ((["--kv-cache", "paged", "--kv-block-size", "3"], "a block must hold whole windows"),):
        assert main(["compile", str(folder), "-o", str(out), "--quiet", *flags]) == 2
        assert why in capsys.readouterr().err and not out.exists()


