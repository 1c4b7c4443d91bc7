"""benchmarks/synthetic_gguf.py: the benchmark model's GGUF and HF folder are one model. moeforge's own deepseek2 GGUF
reader (checked against transformers in tests/model/test_gguf_deepseek.py) and its HF reader give the same logits, the
GGUF holds each weight in the format's type, and the HF folder holds the GGUF's dequantised values."""

import json
import math
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import synthetic_deepseek as sd
import synthetic_gguf as sg

from moeforge.model.loader import load_model

SHAPE = sg.benchmark_shape(sd.deepseek_v3_shape(3, 256, 8, 2, vocab=512))


@pytest.fixture(scope="module", params=sg.FORMATS)
def written(request, tmp_path_factory) -> tuple[str, dict]:
    folder = tmp_path_factory.mktemp("moe_speed_model")
    return request.param, sg.write_model(folder, SHAPE, request.param, seed=4)


def test_gguf_and_hf_folder_are_one_model(written):
    _, info = written
    from_gguf, from_hf = load_model(info["gguf"]), load_model(info["hf"])
    assert from_gguf.config.moe.n_routed_experts == SHAPE.experts and from_gguf.config.num_hidden_layers == 3
    ids = torch.randint(0, SHAPE.vocab, (2, 17), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(17).expand(2, -1)
    with torch.inference_mode():
        a = from_gguf.model(ids, positions).logits
        b = from_hf.model(ids, positions).logits
    assert a.std() > 0.1  # spread logits: not a degenerate model
    torch.testing.assert_close(a, b, atol=2e-5, rtol=0)


def test_each_weight_is_stored_in_its_formats_type(written):
    fmt, info = written
    reader = gguf.GGUFReader(info["gguf"])
    types = {t.name: t.tensor_type for t in reader.tensors}
    expert = gguf.GGMLQuantizationType.Q8_0 if fmt == "q8_0" else gguf.GGMLQuantizationType.Q4_1
    assert types["blk.1.ffn_gate_exps.weight"] == expert and types["blk.2.attn_q_b.weight"] == expert
    assert types["output.weight"] == types["token_embd.weight"] == gguf.GGMLQuantizationType.Q8_0
    assert types["blk.1.ffn_gate_inp.weight"] == types["output_norm.weight"] == gguf.GGMLQuantizationType.F32
    assert "blk.1.attn_k_b.weight" in types and "blk.1.attn_kv_b.weight" not in types  # llama.cpp's MLA layout
    # The HF folder holds the dequantised codes: a Q4_1 block of 32 takes at most 16 values, Q8_0 at most 255.
    index = json.loads((Path(info["hf"]) / sd.INDEX_FILE).read_text())["weight_map"]
    name = "model.layers.1.mlp.experts.0.gate_proj.weight"
    gate = load_file(Path(info["hf"]) / index[name])[name].reshape(-1, 32)
    distinct = max(len(np.unique(block)) for block in gate[:64])
    assert distinct <= (16 if fmt == "q4_1" else 255)
    assert info["parameters"] == sd.parameter_count(SHAPE)


def test_moe_speed_goals_read_the_same_runs_ratios():
    import moe_speed

    summary = {"ratios": {"decode b1: moeforge int8 / llama.cpp Q8_0": 1.3, "decode b8 / b1: moeforge int8": 2.5}}
    accuracy = {"q8_0": {"moeforge int8": {"top1_agreement": 0.98}, "llama.cpp Q8_0": {"top1_agreement": 0.97}}}
    roof = {"moeforge int8 b1": {"fraction": 0.6},  # above 1 twice: no fraction, and why (the roofline's rule)
            "moeforge int4-asym b1": {"fraction": None, "fraction_reason": "no fraction: likely the byte count"}}
    goals = moe_speed.goals(summary, accuracy, roof, [1, 8])
    assert goals["decode b1: moeforge int8 / llama.cpp Q8_0 >= 1.2"]["met"] is True
    assert goals["top-1: moeforge int8 - llama.cpp Q8_0 >= 0"]["value"] == pytest.approx(0.01)
    assert goals["roofline fraction b1: moeforge int8 >= 0.85"]["met"] is False
    assert goals["decode b8 / b1: moeforge int8 >= 3"]["met"] is False
    assert goals["decode b1: moeforge int4-asym / llama.cpp Q4_1 >= 1.2"]["met"] is None  # not measured
    assert goals["roofline fraction b1: moeforge int4-asym >= 0.85"] == {
        "value": None, "bar": 0.85, "met": None, "reason": "no fraction: likely the byte count"}


def _votes(target: np.ndarray, right: np.ndarray) -> np.ndarray:
    """Logits [n, 3] whose argmax is ``target`` where ``right``, else the next class."""
    logits = np.zeros((len(target), 3))
    logits[np.arange(len(target)), np.where(right, target, (target + 1) % 3)] = 1.0
    return logits


def test_paired_top1_counts_the_discordant_positions_and_tests_them_exactly():
    """Ours alone right at 3 positions, theirs alone at 10, both at 80, neither at 7: the gap is -0.07 and McNemar's
    exact two-sided p is 2 * P(Binomial(13, 1/2) <= 3) = 0.0923; moe_speed's top-1 goal carries both."""
    import moe_speed
    from heldout_accuracy import paired_top1

    target = np.random.default_rng(0).integers(0, 3, 100)
    reference = _votes(target, np.ones(100, bool))
    ours_right = np.r_[np.ones(3, bool), np.zeros(10, bool), np.ones(80, bool), np.zeros(7, bool)]
    theirs_right = np.r_[np.zeros(3, bool), np.ones(10, bool), np.ones(80, bool), np.zeros(7, bool)]
    paired = paired_top1(reference, _votes(target, ours_right), _votes(target, theirs_right))
    assert (paired["both"], paired["only_ours"], paired["only_theirs"]) == (80, 3, 10)
    assert paired["difference"] == pytest.approx(-0.07)
    exact = 2 * sum(math.comb(13, i) for i in range(4)) / 2 ** 13
    assert paired["mcnemar_p"] == pytest.approx(exact, abs=1e-4)
    low, high = paired["difference_ci95"]
    assert low < -0.07 < high < 0.0  # this gap is significant at 5% on the interval too
    same = paired_top1(reference, _votes(target, ours_right), _votes(target, ours_right))
    assert (same["mcnemar_p"], same["difference"]) == (1.0, 0.0)

    accuracy = {"q8_0": {"moeforge int8": {"top1_agreement": 0.83}, "llama.cpp Q8_0": {"top1_agreement": 0.90},
                         "paired": {"moeforge int8 vs llama.cpp Q8_0": paired}}}
    goal = moe_speed.goals({"ratios": {}}, accuracy, {}, [1])["top-1: moeforge int8 - llama.cpp Q8_0 >= 0"]
    assert goal["met"] is False and goal["mcnemar_p"] == paired["mcnemar_p"]
    assert goal["ci95"] == paired["difference_ci95"]


@pytest.mark.heavy
def test_q4_1_experts_compile_exactly_and_the_kernel_ceiling_reads_their_shapes(tmp_path):
    """The Q4_1 model's HF folder (GGUF Q4_1 experts and projections, dequantised) compiled --quant int4-asym with
    fp32 activations (--accuracy-level 0) computes what PyTorch computes on those values: min-max blocks of 32
    reproduce Q4_1's, experts included (sparse_experts' MatMulNBits + block offsets). benchmarks/kernel_ceiling.py
    then finds the step's kernels by kind on the artifact."""
    import kernel_ceiling

    from moeforge.compile.driver import CompileOptions, compile_model
    from moeforge.core.artifact import load_artifact
    from moeforge.runtime.backends.onnxruntime import OrtSession

    shape = sg.benchmark_shape(sd.deepseek_v3_shape(2, 256, 8, 2, vocab=512))
    info = sg.write_model(tmp_path / "model", shape, "q4_1", seed=5)
    out = tmp_path / "art"
    compile_model(CompileOptions.from_flags(model=info["hf"], output_dir=out, max_seq_len=64, progress=False,
                                            quant="int4-asym", accuracy_level=0))
    ids = np.random.default_rng(0).integers(0, shape.vocab, 24)
    artifact = load_artifact(out)
    session = OrtSession(artifact.model_path, kv_cache=artifact.manifest.kv_cache)
    session.allocate(batch=1, max_len=32)
    ours = session.forward(ids[None], np.arange(24)[None], np.ones((1, 24), np.int64))[0]
    loaded = load_model(info["hf"])
    with torch.inference_mode():
        reference = loaded.model(torch.tensor(ids[None]), torch.arange(24)[None]).logits[0].float().numpy()
    scale = float(np.abs(reference).max())
    np.testing.assert_allclose(ours, reference, atol=1e-3 * scale, rtol=0)

    kinds = kernel_ceiling.kernel_shapes(out)
    expert = {(a["K"], a["N"], a["bits"]) for a in kinds["routed expert"]}
    inter = shape.moe_intermediate
    assert expert == {(256, 2 * inter, 4), (inter, 256, 4)}
    assert [a["N"] for a in kinds["lm head"]] == [512] and kinds["lm head"][0]["bits"] == 8  # the Q8_0 head
    assert kinds["other MatMulNBits"] and all(a["bits"] == 4 for a in kinds["other MatMulNBits"])  # Q4_1 layers
    timed = kernel_ceiling.time_kernels(kinds["routed expert"], rows=1, threads=1, repeats=2)
    assert timed["kernels"] == 2 and timed["gb_s"] > 0
