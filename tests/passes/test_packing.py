"""Projection packing: one GEMM per group of sibling projections, numerically unchanged."""

import collections

import numpy as np
import pytest

from moeforge.passes.base import PassContext
from moeforge.passes.packing import ProjectionPacking

from .conftest import random_feeds, run_ort


def _expected_groups(config) -> int:
    # Per layer: q/k/v (GQA) or q_a + kv_a (MLA with q_lora); then gate/up of the dense MLP or of the
    # shared experts. MLA without q_lora has q_proj beside kv_a: also a group.
    groups = 0
    for layer in range(config.num_hidden_layers):
        groups += 1  # attention input projections
        moe = config.is_moe_layer(layer)
        if not moe or config.moe.n_shared_experts > 0:
            groups += 1
    return groups


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-deepseek-v3", "tiny-deepseek-v2"])
def test_packing_counts_and_parity(fresh_model, name):
    loaded, model = fresh_model(name)
    feeds = random_feeds(loaded.config.vocab_size)
    before = run_ort(model, feeds)[0]
    matmuls_before = collections.Counter(n.op_type for n in model.graph)["MatMul"]
    packed = ProjectionPacking().apply(model, PassContext(loaded.config, 256))
    assert packed == _expected_groups(loaded.config)
    after = run_ort(model, feeds)[0]
    np.testing.assert_allclose(after, before, atol=1e-5, rtol=0)
    matmuls_after = collections.Counter(n.op_type for n in model.graph)["MatMul"]
    assert matmuls_after < matmuls_before
    # The old weights are gone: the artifact does not carry both copies.
    total = sum(v.const_value.size for v in model.graph.initializers.values() if v.const_value is not None)
    params = sum(p.numel() for p in loaded.model.parameters())
    assert total < 1.05 * params + 10_000


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-deepseek-v3"])
def test_cleanup_keeps_numerics(fresh_model, name):
    from moeforge.passes.cleanup import Cleanup

    loaded, model = fresh_model(name)
    feeds = random_feeds(loaded.config.vocab_size)
    before = run_ort(model, feeds)[0]
    nodes_before = sum(1 for _ in model.graph)
    removed = Cleanup().apply(model, PassContext(loaded.config, 256))
    assert removed == nodes_before - sum(1 for _ in model.graph)
    np.testing.assert_allclose(run_ort(model, feeds)[0], before, atol=1e-6, rtol=0)
