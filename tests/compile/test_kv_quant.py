"""`moeforge compile --kv-quant int8`: per-head scales calibrated from PyTorch's own cache, an int8 cache that
decodes like PyTorch with a fake-quantised cache, the engine on int8 buffers, and refusals."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from moeforge.cli import main
from moeforge.compile.driver import CompileOptions, compile_model
from moeforge.core.artifact import load_artifact
from moeforge.core.errors import MoeforgeError
from moeforge.model.loader import load_model
from moeforge.quant.calibration import CalibrationError, read_prompts, tokenize_prompts
from moeforge.quant.schemes import THRESHOLDS, thresholds_for
from moeforge.quant.spec import KVQuantError
from moeforge.runtime.backends.onnxruntime import OrtSession
from moeforge.runtime.engine import EngineConfig, LLMEngine, SchedulingOptions
from moeforge.runtime.sampler import SamplingParams
from moeforge.verify.parity import default_prompt

DATA = Path(__file__).resolve().parents[1] / "data"
CALIB = DATA / "quant_calib_en.txt"
MAX_LEN = 128


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-deepseek-v3"])
def kv_artifact(request, tmp_path_factory) -> tuple[str, Path]:
    out = tmp_path_factory.mktemp(request.param) / "kv-int8"
    result = compile_model(CompileOptions.from_flags(model=request.param, output_dir=out, max_seq_len=MAX_LEN,
                                                     progress=False, check=True, kv_quant="int8", calib=CALIB))
    assert result.parity is not None and result.parity.passed, result.parity.table()
    return request.param, out


def _scales(path: Path) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Layer -> (k_scale, v_scale) [1, H, 1, D] as stored in the graph."""
    graph = onnx.load(str(path / "model.onnx")).graph
    inits = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    layers = sorted({int(n.split(".")[1]) for n in inits if n.startswith("kv_quant.")})
    return {i: (inits[f"kv_quant.{i}.k_scale"], inits.get(f"kv_quant.{i}.v_scale", inits[f"kv_quant.{i}.k_scale"]))
            for i in layers}


def _torch_cache_layout(cache: torch.Tensor) -> np.ndarray:
    """PyTorch cache -> [H, S, D]: GQA [1, H, S, D]; absorbed MLA latent [1, S, R+Dr] (one head)."""
    array = cache.detach().numpy()
    return array[0] if array.ndim == 4 else array[0][None]


def test_manifest_and_graph_describe_an_int8_cache(kv_artifact):
    name, path = kv_artifact
    manifest = load_artifact(path).manifest
    fp32_bytes = load_model(name).config.kv_cache_values_per_token() * manifest.kv_cache.num_layers * 4
    assert manifest.precision == "fp32+kv-int8"
    assert manifest.kv_cache.dtype == "int8" and manifest.kv_cache.bytes_per_token * 4 == fp32_bytes
    summary = manifest.quantization["kv_cache"]
    assert summary["dtype"] == "int8" and summary["granularity"] == "head" and summary["calibration_prompts"] == 10
    graph = onnx.load(str(path / "model.onnx"), load_external_data=False).graph
    caches = [v for v in graph.input if v.name.startswith("past_key_values.")]
    assert caches and all(v.type.tensor_type.elem_type == onnx.TensorProto.INT8 for v in caches)
    gqa = [n for n in graph.node if n.op_type == "GroupQueryAttention"]
    attrs = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute} for n in gqa]
    assert all(a["k_quant_type"] == b"PER_CHANNEL" and a["kv_cache_bit_width"] == 8 for a in attrs)
    assert not (path / "genai_config.json").exists()  # onnxruntime-genai cannot allocate an int8 cache


def _rotation_bound(cache: np.ndarray, config, is_key: bool) -> np.ndarray:
    """max over positions of |x| per head [H], with each rotary key pair counted by its norm (its largest value
    at any position). cache [H, S, D]; the rotary channels are the head (GQA) or the latent's last Dr."""
    x = cache.astype(np.float64)
    if is_key:
        rope = x[..., -config.rope_dim:]
        pairs = (rope[..., 0::2], rope[..., 1::2]) if config.rope.interleaved else np.split(rope, 2, axis=-1)
        norm = np.sqrt(pairs[0] ** 2 + pairs[1] ** 2)
        return np.maximum(np.abs(x[..., : x.shape[-1] - config.rope_dim]).max(axis=(1, 2), initial=0.0),
                          norm.max(axis=(1, 2)))
    return np.abs(x).max(axis=(1, 2))


def test_scales_are_pytorch_cache_max_per_head_over_127(kv_artifact):
    """Independent calibration: PyTorch's own cache (keys after rotary) over the same prompts; rotary pairs
    count by their norm, so a later position cannot push a key past its scale."""
    name, path = kv_artifact
    loaded = load_model(name, mla_impl="absorb")
    amax: dict[int, list[np.ndarray]] = {}
    for ids in tokenize_prompts(read_prompts(CALIB), loaded.tokenizer, MAX_LEN):
        with torch.no_grad():
            past = loaded.model(torch.tensor([ids]), torch.arange(len(ids))[None]).past_key_values
        for layer, tensors in enumerate(past):
            per_head = [_rotation_bound(_torch_cache_layout(t), loaded.config, is_key=j == 0)
                        for j, t in enumerate(tensors)]  # [H] each
            old = amax.get(layer, per_head)
            amax[layer] = [np.maximum(a, b) for a, b in zip(old, per_head, strict=True)]
    scales = _scales(path)
    assert sorted(scales) == sorted(amax)
    for layer, (k_scale, v_scale) in scales.items():
        expected_k = amax[layer][0] / 127
        expected_v = amax[layer][-1] / 127  # MLA: one latent, one scale
        np.testing.assert_allclose(k_scale[0, :, 0, :], np.repeat(expected_k[:, None], k_scale.shape[3], 1),
                                   rtol=2e-4)
        np.testing.assert_allclose(v_scale[0, :, 0, :], np.repeat(expected_v[:, None], v_scale.shape[3], 1),
                                   rtol=2e-4)


def _fake_quant(x: torch.Tensor, scale: np.ndarray) -> torch.Tensor:
    """Round x [B, H, L, D] to the int8 grid of ``scale`` [1, H, 1, >=D] and back."""
    s = torch.tensor(scale[..., : x.shape[-1]])
    return torch.clamp(torch.round(x / s), -128, 127) * s


class _QuantisedReads:
    """Stands in for ``torch.nn.functional`` in the PyTorch attention modules: every attention call
    reads its keys/values through the int8 grid of that layer's scales, as the kernel reads its cache."""

    def __init__(self, scales: dict[int, tuple[np.ndarray, np.ndarray]]) -> None:
        self.scales, self.calls = scales, 0

    def __getattr__(self, name: str):
        return getattr(torch.nn.functional, name)

    def scaled_dot_product_attention(self, q, k, v, **kw):
        k_scale, v_scale = self.scales[self.calls % len(self.scales)]  # layers run in order
        self.calls += 1
        return torch.nn.functional.scaled_dot_product_attention(q, _fake_quant(k, k_scale), _fake_quant(v, v_scale),
                                                                **kw)


def test_prefill_and_decode_equal_pytorch_reading_an_int8_cache(kv_artifact, monkeypatch):
    """Independent reference: PyTorch whose attention reads keys/values rounded to the artifact's int8 grid
    (prefill included: the kernel writes the new tokens first, then attends over the quantised cache). The
    artifact is far closer to it than to plain fp32 PyTorch and picks the same greedy tokens."""
    import moeforge.model.attention as gqa_module
    import moeforge.model.mla as mla_module

    name, path = kv_artifact
    model = load_model(name, mla_impl="absorb").model
    prompt = default_prompt(model.config.vocab_size, 12, seed=7)
    steps = 8

    def reference() -> tuple[list[np.ndarray], list[int]]:
        with torch.no_grad():
            out = model(torch.tensor([prompt]), torch.arange(len(prompt))[None])
            logits, tokens = [out.logits[0].numpy()], [int(out.logits[0, -1].argmax())]
            for step in range(steps):
                out = model(torch.tensor([[tokens[-1]]]), torch.tensor([[len(prompt) + step]]), out.past_key_values)
                logits.append(out.logits[0].numpy())
                tokens.append(int(out.logits[0, -1].argmax()))
        return logits, tokens

    fp32_logits, _ = reference()
    for module in (gqa_module, mla_module):
        monkeypatch.setattr(module, "F", _QuantisedReads(_scales(path)))
    int8_logits, tokens = reference()

    session = OrtSession(path / "model.onnx", kv_cache=load_artifact(path).manifest.kv_cache)
    session.allocate(batch=1, max_len=len(prompt) + steps + 1)
    assert all(buffer.dtype == np.int8 for buffer in session.buffers)
    ours = [session.forward(np.array([prompt]), np.arange(len(prompt))[None], np.ones((1, len(prompt)), np.int64))[0]]
    for step in range(steps):
        pos = len(prompt) + step
        ours.append(session.forward(np.array([[tokens[step]]]), np.array([[pos]]), np.ones((1, pos + 1), np.int64))[0])
    err_int8 = max(float(np.abs(a - b).max()) for a, b in zip(ours, int8_logits, strict=True))
    err_fp32 = max(float(np.abs(a - b).max()) for a, b in zip(ours, fp32_logits, strict=True))
    assert err_int8 < 0.01 * err_fp32, (err_int8, err_fp32)  # measured: 2e-6 vs 3e-2
    assert [int(o[-1].argmax()) for o in ours] == tokens


def test_engine_batches_int8_caches_like_solo_runs(kv_artifact):
    _, path = kv_artifact
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, int(n)).tolist() for n in (5, 17, 33, 9)]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    one_seq = EngineConfig(scheduling=SchedulingOptions(max_num_seqs=1))
    solo = [LLMEngine.from_artifact(path, one_seq).generate([p], params)[0].token_ids
            for p in prompts]
    engine = LLMEngine.from_artifact(path, EngineConfig(scheduling=SchedulingOptions(max_num_seqs=4)))
    assert [o.token_ids for o in engine.generate(prompts, params)] == solo


def test_int4_weights_with_an_int8_cache(tmp_path):
    result = compile_model(CompileOptions.from_flags(model="tiny-llama", output_dir=tmp_path / "a", max_seq_len=MAX_LEN,
                                          progress=False, check=True, quant="int4", kv_quant="int8", calib=CALIB))
    assert result.parity is not None and result.parity.passed and result.parity.precision == "int4+kv-int8"
    manifest = load_artifact(result.output_dir).manifest
    assert manifest.precision == "int4+kv-int8" and manifest.kv_cache.dtype == "int8"
    assert manifest.quantization["scheme"] == "int4" and manifest.quantization["kv_cache"]["dtype"] == "int8"
    ops = {n.op_type for n in onnx.load(str(result.output_dir / "model.onnx"), load_external_data=False).graph.node}
    assert {"MatMulNBits", "GroupQueryAttention"} <= ops


def test_parity_limits_for_an_int8_cache():
    assert thresholds_for("fp32+kv-int8") == THRESHOLDS["int8"]  # fp32 weights: judged like int8
    assert thresholds_for("int4+kv-int8") == THRESHOLDS["int4"]  # quantised weights keep their own limits
    assert thresholds_for("fp32") == THRESHOLDS["fp32"]
    with pytest.raises(ValueError, match="no parity thresholds"):
        thresholds_for("int3+kv-int8")


# ------------------------------------------------------------------------------------------ bad input
def _compile(tmp_path: Path, **kw) -> None:
    compile_model(CompileOptions.from_flags(model="tiny-llama", output_dir=tmp_path / "out", max_seq_len=64,
                                            progress=False, **kw))


@pytest.mark.parametrize(("kw", "error", "match"), [
    ({"kv_quant": "int8"}, KVQuantError, "needs calibration prompts.*--calib FILE"),
    ({"kv_quant": "fp8", "calib": CALIB}, KVQuantError, "no float8e4m3fn cache kernel.*--kv-quant int8"),
    ({"kv_quant": "int8", "calib": CALIB, "kv_cache": "paged"}, KVQuantError, "--kv-cache contiguous"),
    ({"kv_quant": "int8", "calib": CALIB, "target": "trt"}, KVQuantError, "--target ort"),
    ({"kv_quant": "int8", "calib": Path("/nonexistent/calib.txt")}, CalibrationError, "does not exist"),
    ({"calib": CALIB}, MoeforgeError, "--calib needs --quant"),
])
def test_bad_kv_quant_options_write_nothing(tmp_path, kw, error, match):
    with pytest.raises(error, match=match):
        _compile(tmp_path, **kw)
    assert not any(tmp_path.iterdir())


def test_cli_does_not_offer_kv_quant_fp8(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:  # argparse: not a choice here (the API still says why)
        main(["compile", "tiny-llama", "-o", str(tmp_path / "x"), "--kv-quant", "fp8", "--calib", str(CALIB)])
    assert exit_info.value.code == 2 and "invalid choice: 'fp8'" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
