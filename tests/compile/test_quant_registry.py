"""The quantisation registry is the one place a scheme is declared: the CLI, validation, the passes, the manifest's
precision and parity's thresholds all follow it (a new entry needs nothing else)."""

from __future__ import annotations

from pathlib import Path

import pytest

from moeforge.cli.parser import build_parser
from moeforge.compile.driver import CompileOptions, compile_model
from moeforge.compile.targets import TARGETS
from moeforge.core.artifact import load_artifact
from moeforge.quant import schemes
from moeforge.quant.plan import AwqScales, PlannedWeightQuantization, quant_passes
from moeforge.quant.schemes import KV_CHOICES, LM_HEAD_KINDS, SCHEMES, Scheme, precision_name, thresholds_for
from moeforge.quant.spec import QuantError, QuantSpec, validate

CALIB = Path(__file__).resolve().parents[1] / "data" / "quant_calib_en.txt"


def _choices(flag: str) -> list[object]:
    compile_parser = build_parser()._subparsers._group_actions[0].choices["compile"]
    return list(next(a for a in compile_parser._actions if flag in a.option_strings).choices)


def test_cli_choices_come_from_the_registries():
    assert _choices("--quant") == list(SCHEMES)
    assert _choices("--kv-quant") == list(KV_CHOICES)
    assert _choices("--lm-head") == list(LM_HEAD_KINDS)
    assert _choices("--target") == list(TARGETS)


@pytest.mark.parametrize("name", list(SCHEMES))
def test_every_scheme_has_its_limits_and_is_refused_where_it_is_not_built(name):
    scheme = SCHEMES[name]
    assert thresholds_for(precision_name(name, None)) == scheme.thresholds
    assert thresholds_for(precision_name(name, "int8")) == scheme.thresholds  # quantised weights keep theirs
    calib = CALIB if scheme.calibrated else None
    for target in TARGETS:
        spec = QuantSpec(weights=name, calib=calib)
        if target in scheme.targets:
            validate(spec, target=target, kv_cache="contiguous")
        else:
            with pytest.raises(QuantError, match=f"--quant {name} is built for"):
                validate(spec, target=target, kv_cache="contiguous")


def test_the_pass_list_follows_the_scheme_flags():
    names = [p.name for p in quant_passes(QuantSpec("int4-awq", calib=CALIB, keep_fp=0.1, kv_cache="int8"), [])[0]]
    assert names == ["quant_sensitivity", "quant_awq", "quant_weights", "quant_lowering", "sparse_experts",
                     "shared_embedding", "kv_quant"]
    names = [p.name for p in quant_passes(QuantSpec("w8a8", calib=CALIB), [])[0]]
    assert names == ["quant_act_calibration", "quant_weights", "quant_activations", "quant_act_lowering",
                     "quant_lowering", "sparse_experts", "shared_embedding"]
    passes, plan, kv = quant_passes(QuantSpec(kv_cache="int8", calib=CALIB), [])
    assert [p.name for p in passes] == ["kv_quant"] and plan is None and kv is not None
    assert quant_passes(QuantSpec(), [])[0] == []


def test_a_new_scheme_is_one_registry_entry(tmp_path, monkeypatch):
    """int8 symmetric blocks of 32 (not a built-in scheme), declared only in the registry, compiles, lowers to
    MatMulNBits, is recorded in the manifest and judged by its own limits."""
    entry = Scheme("int8-b32", "int8", 32, schemes._judged_by_agreement(0.85, 0.01), "int8 blocks of 32")
    monkeypatch.setitem(SCHEMES, entry.name, entry)
    monkeypatch.setitem(schemes.THRESHOLDS, entry.name, entry.thresholds)
    assert "int8-b32" in _choices("--quant")
    passes = quant_passes(QuantSpec("int8-b32"), [])[0]
    assert any(isinstance(p, PlannedWeightQuantization) for p in passes)
    assert not any(isinstance(p, AwqScales) for p in passes)
    result = compile_model(CompileOptions.from_flags(model="tiny-llama", output_dir=tmp_path / "a", max_seq_len=64,
                                                     progress=False, check=True, quant="int8-b32"))
    assert result.parity is not None and result.parity.passed and result.parity.precision == "int8-b32"
    quantization = load_artifact(result.output_dir).manifest.quantization
    assert quantization["scheme"] == "int8-b32" and quantization["block_size"] == 32
    assert quantization["weights"] == "int8" and quantization["lm_head"] == "int8"
