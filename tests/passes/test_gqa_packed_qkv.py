"""GroupQueryAttention reads the packed q/k/v: the ORT pipeline leaves no Split in front of it for GQA models and
leaves MLA's attention alone. Numerics: the compiled-artifact parity tests (test_kv_cache, test_compile) run this
pipeline against PyTorch."""

import pytest

from moeforge.passes.base import MS_DOMAIN, PassContext
from moeforge.passes.pipeline import ort_pipeline, run_passes


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-deepseek-v3"])
def test_gqa_reads_the_packed_projection(fresh_model, name):
    loaded, model = fresh_model(name)
    reports = run_passes(model, PassContext(loaded.config, max_seq_len=64), ort_pipeline())
    matches = {r.name: r.matches for r in reports}["gqa_packed_qkv"]
    attention = [n for n in model.graph if n.domain == MS_DOMAIN and n.op_type == "GroupQueryAttention"]
    assert len(attention) == loaded.config.num_hidden_layers
    if name == "tiny-llama":
        assert matches == len(attention)
        for node in attention:
            assert node.inputs[1] is None and node.inputs[2] is None
            assert node.inputs[0].producer().op_type == "MatMul"  # the packed q/k/v projection itself
    else:  # MLA: the latent attention has no q/k/v Split to drop
        assert matches == 0
