"""`moeforge compile` for the MoE families beyond DeepSeek (tiny seeded presets of Qwen3-MoE, GLM-4.5 MoE, Mixtral,
OLMoE, Kimi-K2), contiguous and paged: the same passes lower every MoE layer to com.microsoft.MoE, and the
artifact agrees with PyTorch teacher-forced over a 64-token prompt and 16 decode steps (max |logits diff| < 1e-4,
greedy identical; tests/model/test_moe_families.py ties each preset's PyTorch model to transformers). Quantised
int8 and int4-asym artifacts of one family pass `moeforge parity` at their scheme's thresholds.

Each compile takes ~10 s on 2 cores: one case per family runs by default, the other layout is marked heavy.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest

from moeforge.cli import main
from moeforge.compile.driver import CompileOptions, compile_model
from moeforge.core.artifact import load_artifact
from moeforge.model.loader import load_model
from moeforge.runtime.engine import EngineConfig, LLMEngine, SchedulingOptions
from moeforge.runtime.sampler import SamplingParams
from moeforge.verify.generate import generate
from moeforge.verify.parity import default_prompt, run_parity

PROMPT_LEN, STEPS = 64, 16
FAMILIES = ("tiny-qwen3-moe", "tiny-glm4-moe", "tiny-mixtral", "tiny-olmoe", "tiny-kimi-k2")
# The layout each family compiles in the default run (both layouts run under the heavy marker).
DEFAULT_LAYOUT = {"tiny-qwen3-moe": "contiguous", "tiny-glm4-moe": "paged", "tiny-mixtral": "paged",
                  "tiny-olmoe": "contiguous", "tiny-kimi-k2": "paged"}
CASES = [pytest.param(model, kv, marks=() if DEFAULT_LAYOUT[model] == kv else pytest.mark.heavy, id=f"{model}-{kv}")
         for model in FAMILIES for kv in ("contiguous", "paged")]


def _compile(tmp_path: Path, model: str, **flags: object) -> Path:
    options = CompileOptions.from_flags(model=model, output_dir=tmp_path / "artifact", max_seq_len=128,
                                        progress=False, **flags)
    return compile_model(options).output_dir


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], Path]:
    """(model, kv layout) -> its artifact, compiled once per module (the engine test reuses one)."""
    cache: dict[tuple[str, str], Path] = {}

    def get(model: str, kv: str) -> Path:
        if (model, kv) not in cache:
            cache[model, kv] = _compile(tmp_path_factory.mktemp(f"{model}-{kv}"), model, kv_cache=kv)
        return cache[model, kv]

    return get


@pytest.mark.parametrize(("model", "kv"), CASES)
def test_compiled_family_matches_pytorch(compiled: Callable[[str, str], Path], model: str, kv: str) -> None:
    out = compiled(model, kv)
    artifact = load_artifact(out)
    manifest = artifact.manifest
    loaded = load_model(model)
    config = loaded.config
    moe_layers = sum(config.is_moe_layer(i) for i in range(config.num_hidden_layers))
    matches = {p["name"]: p["matches"] for p in manifest.passes}
    assert matches["moe_lowering"] == moe_layers > 0
    assert matches["rotary"] == 2 * config.num_hidden_layers  # q and k (partial rotary included)
    assert matches["paged_kv" if kv == "paged" else "kv_cache"] == config.num_hidden_layers
    nodes = onnx.load(str(out / "model.onnx"), load_external_data=False).graph.node
    assert sum(n.op_type == "MoE" and n.domain == "com.microsoft" for n in nodes) == moe_layers
    assert not [n for n in nodes if n.domain == "moeforge" and n.op_type in ("MoERouter", "MoEExperts")]
    if config.rope_dim < config.head_dim:  # partial rotary (GLM): one RotaryEmbedding per q/k over the whole head
        rotary = [n for n in nodes if n.op_type == "RotaryEmbedding"]
        assert len(rotary) == 2 * config.num_hidden_layers
        assert all({a.name: a.i for a in n.attribute}["rotary_embedding_dim"] == config.rope_dim for n in rotary)
        producer = {name: n for n in nodes for name in n.output}
        reshaped = {n.output[0] for n in nodes if n.op_type == "Reshape"
                    and getattr(producer.get(n.input[0]), "op_type", None) == "RotaryEmbedding"}
        # The pass-through dims were folded in: no Concat re-joins a rotated part with the rest of the head.
        assert not [n for n in nodes if n.op_type == "Concat" and reshaped & set(n.input)]

    report = run_parity(artifact.model_path, manifest.kv_cache, loaded.model,
                        default_prompt(config.vocab_size, PROMPT_LEN), decode_steps=STEPS)
    assert report.passed and report.greedy_match, report.table()
    assert report.max_abs_err < 1e-4, report.table()


def test_paged_engine_generates_what_pytorch_does(compiled: Callable[[str, str], Path]) -> None:
    # The engine over block pools (prefix caching on) on the family with every new block: GLM-4.5's partial
    # rotary, q/k norm, q/k/v bias, grouped sigmoid routing and a shared expert.
    out = compiled("tiny-glm4-moe", "paged")
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 256, int(n)).tolist() for n in rng.integers(1, 40, 5)]
    shared = rng.integers(0, 256, 37).tolist()  # two full 16-token blocks: a prefix-cache hit for the second
    prompts += [[*shared, 1, 2], [*shared, 3]]
    model = load_model("tiny-glm4-moe").model
    expected = [generate(model, p, SamplingParams(max_tokens=8)).token_ids for p in prompts]
    engine = LLMEngine.from_artifact(out, EngineConfig(
        scheduling=SchedulingOptions(max_num_seqs=4, max_num_batched_tokens=32)))
    outputs = engine.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    assert [o.token_ids for o in outputs] == expected


@pytest.mark.heavy
@pytest.mark.parametrize("quant", ["int8", "int4-asym"])
def test_quantised_family_passes_moeforge_parity(tmp_path: Path, quant: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = _compile(tmp_path, "tiny-glm4-moe", quant=quant)
    manifest = load_artifact(out).manifest
    assert manifest.precision == quant and "router" in manifest.quantization["always_fp32"]
    nodes = onnx.load(str(out / "model.onnx"), load_external_data=False).graph.node
    # the experts are quantised, one If + MatMulNBits per expert (sparse_experts), no float MoE left
    assert not [n for n in nodes if n.op_type in ("MoE", "QMoE")]
    experts = [n for n in nodes if n.op_type == "If" and n.name.startswith("sparse_experts/")]
    assert len(experts) == load_model("tiny-glm4-moe").config.moe.n_routed_experts * len({n.name.split("/")[1]
                                                                                         for n in experts})
    code = main(["parity", str(out), "--json"])
    assert code == 0, capsys.readouterr().out  # within the scheme's thresholds (top-1 agreement, KL)
