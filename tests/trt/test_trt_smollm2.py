"""SmolLM2-135M (fp16) -> TensorRT-RTX plan for SM89 on CPU (heavy: minutes on 2 cores; the build time at
the default optimisation level is in benchmarks/results/trt_build.json)."""

import numpy as np
import pytest
import torch

from moeforge.compile.driver import CompileOptions, compile_model
from moeforge.core.artifact import load_artifact
from moeforge.model.loader import load_model
from moeforge.verify.golden import load_golden

from .conftest import needs_trt_rtx

pytestmark = [needs_trt_rtx, pytest.mark.heavy, pytest.mark.smollm2]


def test_smollm2_fp16_plan(tmp_path):
    loaded = load_model("smollm2-135m")  # any failure to load is a failure, not a skip
    result = compile_model(CompileOptions.from_flags(model="smollm2-135m", output_dir=tmp_path / "smollm2",
                                                     target="trt",
                                                     max_seq_len=256, trt_impl="tensorrt-rtx", sm=89, progress=False,
                                                     trt_optimization_level=0))  # level 0: a valid plan, built sooner
    artifact = load_artifact(result.output_dir)
    engine = artifact.manifest.engine
    assert engine["compute_capability"] == "SM89" and artifact.manifest.precision == "fp16"
    assert (artifact.root / "model.plan").stat().st_size == engine["plan_bytes"] > 2 * 134e6  # fp16 weights
    types = engine["layer_types"]
    layers = loaded.config.num_hidden_layers
    assert types["ROTARY_EMBEDDING"] == types["KV_CACHE_UPDATE"] == 2 * layers
    assert types["ATTENTION_INPUT"] == types["ATTENTION_OUTPUT"] == layers
    assert not {"PLUGIN", "PLUGIN_V2", "PLUGIN_V3"} & set(types)
    feeds, golden = load_golden(artifact.root)
    with torch.no_grad():
        ref = loaded.model(torch.tensor(feeds["input_ids"]), torch.tensor(feeds["position_ids"]), None).logits.numpy()
    assert np.abs(golden - ref).max() < 2e-2 * np.abs(ref).max()
    assert (golden.argmax(-1) == ref.argmax(-1)).mean() >= 0.9
