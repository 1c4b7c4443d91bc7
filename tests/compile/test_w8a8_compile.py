"""`moeforge compile --quant w8a8 / w8a8-fp8 --calib F`: --check passes on tiny presets, the manifest records the
activation scales the graph really uses, ONNX Runtime fuses the int8 form, and bad options are refused."""

from __future__ import annotations

import re
from pathlib import Path

import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from moeforge.cli import main
from moeforge.core.artifact import load_artifact

CALIB = Path(__file__).resolve().parents[1] / "data" / "quant_calib_en.txt"


@pytest.mark.parametrize(("model", "quant", "extra"), [
    ("tiny-llama", "w8a8", []),
    pytest.param("tiny-deepseek-v3", "w8a8-fp8", ["--calib-method", "percentile", "--percentile", "99.99"],
                 marks=pytest.mark.heavy),  # ~16-21 s on 2 busy cores
])
def test_compile_check_passes_and_manifest_records_scales(tmp_path, capsys, model, quant, extra):
    out = tmp_path / "a"
    code = main(["compile", model, "-o", str(out), "--quiet", "--max-seq-len", "128", "--check",
                 "--quant", quant, "--calib", str(CALIB), *extra])
    assert code == 0, capsys.readouterr().err
    assert f"({quant}) -> PASS" in capsys.readouterr().out
    manifest = load_artifact(out).manifest
    assert manifest.precision == quant
    act = manifest.quantization["activations"]
    assert act["dtype"] == ("int8" if quant == "w8a8" else "fp8")
    assert act["method"] == ("minmax" if not extra else "percentile")
    assert act["percentile"] == (None if not extra else 99.99)
    assert act["smoothquant_alpha"] == (0.5 if not extra else None)
    assert act["fp32_activations"]["patterns"] == (["down_proj"] if not extra else [])
    graph = onnx.load(str(out / "model.onnx"), load_external_data=False).graph
    inits = {i.name: i for i in graph.initializer}
    quantize = [n for n in graph.node if n.op_type == "QuantizeLinear"]
    assert act["tensors"] == len(quantize) == len(act["scales"]) > 0
    for node in quantize:  # the manifest's scale is the one in the graph
        scale = numpy_helper.to_array(inits[node.input[1]], base_dir=str(out))
        assert float(scale) == pytest.approx(act["scales"][node.input[0]], rel=1e-6)
    layers = manifest.quantization["layers"]
    assert layers[-1]["precision"] == ("int8" if quant == "w8a8" else "fp8")  # LM head: weights only
    kept = [layer for layer in layers if "down_proj" in layer["label"]]
    assert kept and all(layer["precision"] == ("int8" if not extra else quant) for layer in kept)
    if model == "tiny-deepseek-v3":  # MoE experts stay weight-only
        experts = [layer for layer in layers if "experts" in layer["name"]]
        assert experts and all(layer["precision"] == "fp8" for layer in experts)
    if quant == "w8a8":  # ORT fuses every static int8 pair (uint8 x uint8 MatMulIntegerToFloat)
        options = ort.SessionOptions()
        options.optimized_model_filepath = str(tmp_path / "opt.onnx")
        options.log_severity_level = 3
        ort.InferenceSession(str(out / "model.onnx"), options, providers=["CPUExecutionProvider"])
        ops = [n.op_type for n in onnx.load(str(tmp_path / "opt.onnx"), load_external_data=False).graph.node]
        assert ops.count("MatMulIntegerToFloat") == act["tensors"] and "MatMul" not in ops


@pytest.mark.parametrize(("args", "match"), [
    (["--quant", "w8a8"], "w8a8 needs calibration prompts: pass --calib FILE"),
    (["--quant", "w8a8-fp8"], "needs calibration prompts"),
    (["--quant", "int8", "--calib-method", "percentile"], "only --quant w8a8"),
    (["--calib-method", "minmax"], r"--calib-method needs --quant \(w8a8 or w8a8-fp8\)"),
    (["--quant", "w8a8", "--calib", str(CALIB), "--calib-method", "percentile", "--percentile", "50"], r"\(50, 100\]"),
    (["--quant", "w8a8", "--calib", str(CALIB), "--calib-method", "percentile", "--percentile", "100.5"], "100"),
    (["--quant", "w8a8", "--calib", str(CALIB), "--percentile", "99"], "needs --calib-method percentile"),
    (["--quant", "w8a8", "--calib", str(CALIB), "--block-size", "32"], "per output channel"),
    (["--quant", "w8a8", "--calib", str(CALIB), "--smooth-alpha", "1.5"], r"must be in \[0, 1\]"),
    (["--quant", "int4", "--act-keep-fp32", "o_proj"], "only --quant w8a8"),
])
def test_bad_w8a8_options_exit_2_and_write_nothing(tmp_path, capsys, args, match):
    out = tmp_path / "never"
    assert main(["compile", "tiny-llama", "-o", str(out), "--quiet", *args]) == 2
    err = capsys.readouterr().err
    assert re.search(match, err), err
    assert not out.exists() and not list(tmp_path.iterdir())

