"""benchmarks/matmul_scaling.py's graphs compute the products they are timed as, and its check catches one that
does not."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import matmul_scaling as scaling

SHAPES = ((64, 48), (96, 32))


@pytest.mark.parametrize("kernel", list(scaling.KERNELS))
def test_every_kernel_graph_computes_its_reference_product(kernel):
    graph = scaling.build_graph(kernel, SHAPES, copies=2)
    assert len(graph.references) == 4
    session = scaling.make_session(graph.model, threads=1)
    for rows in (1, 3):
        bound = scaling.Bound(graph, session, rows)
        assert bound.worst_error(graph.references) < scaling.TOLERANCE.get(kernel, scaling.DEFAULT_TOLERANCE)
        assert all(np.abs(out).max() > 0 for out in bound.outputs.values())
        assert bound.time(2) > 0


def test_the_check_catches_a_wrong_reference():
    graph = scaling.build_graph("int4 + block offsets", SHAPES, copies=1)
    bound = scaling.Bound(graph, scaling.make_session(graph.model, threads=1), rows=2)
    without_offsets = scaling.build_graph("MatMulNBits int4", SHAPES, copies=1).references  # same seed, same codes
    assert bound.worst_error(graph.references) < scaling.DEFAULT_TOLERANCE
    assert bound.worst_error(without_offsets) > scaling.DEFAULT_TOLERANCE


def test_markdown_and_shapes():
    kernels = {"k": {"us_per_layer": {"1": 10.0, "8": 25.0}, "m8_over_m1": 2.5, "weight_mb": 1.0}}
    table = scaling.markdown(kernels, [1, 8])
    assert "| k | 10.0 | 25.0 | 2.50 | 1.0 |" in table
    assert scaling.parse_shapes("576x960, 1536x576") == ((576, 960), (1536, 576))
    with pytest.raises(SystemExit, match="multiple of 32"):
        scaling.parse_shapes("100x10")
