"""benchmarks/router_share.py: which nodes are the router, and its profiled share of a decode step."""

from __future__ import annotations

import sys
from pathlib import Path

import onnx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import router_share as rs

from moeforge.compile.driver import CompileOptions, compile_model
from moeforge.model.loader import load_model

PRESET = "tiny-deepseek-v3"


def test_decode_times_skip_the_prefill_and_nested_nodes():
    """Only runs after the first count, and only top-level nodes (an If's event already holds its branch)."""
    trace = [{"name": "model_run", "ts": 0, "dur": 100}, {"name": "model_run", "ts": 200, "dur": 100},
             {"name": "model_run", "ts": 400, "dur": 100},
             {"cat": "Node", "name": "gate_kernel_time", "ts": 10, "dur": 50},  # the prefill: not counted
             {"cat": "Node", "name": "gate_kernel_time", "ts": 210, "dur": 5},
             {"cat": "Node", "name": "gate_kernel_time", "ts": 410, "dur": 7},
             {"cat": "Node", "name": "if_kernel_time", "ts": 220, "dur": 30},
             {"cat": "Node", "name": "inner_kernel_time", "ts": 225, "dur": 20},  # inside the If
             {"cat": "Node", "name": "gate_fence", "ts": 230, "dur": 9}]  # not a kernel time
    times, runs = rs.decode_node_times(trace, {"gate", "if"})
    assert runs == 2 and times == {"gate": 12.0, "if": 30.0}


@pytest.mark.heavy
def test_the_router_of_every_moe_layer_is_found_and_its_share_measured(tmp_path):
    out = tmp_path / "int8"
    compile_model(CompileOptions.from_flags(model=PRESET, output_dir=out, max_seq_len=64, quant="int8",
                                            progress=False))
    config = load_model(PRESET).config
    moe_layers = config.num_hidden_layers - config.moe.first_k_dense_replace  # type: ignore[union-attr]
    graph = onnx.load(str(out / "model.onnx"), load_external_data=False).graph
    routers = rs.router_nodes(graph)
    by_op = {op: sum(1 for n in graph.node if n.name in routers and n.op_type == op) for op in ("TopK", "Gemm",
                                                                                                  "MatMul", "Split")}
    assert by_op["TopK"] >= moe_layers and by_op["Gemm"] + by_op["MatMul"] == moe_layers  # one projection each
    assert by_op["Split"] == moe_layers  # sparse_experts' conditions
    assert not any(n.op_type in ("If", "MatMulNBits") for n in graph.node if n.name in routers)
    share = rs.router_share(out, batch=1, new_tokens=6, threads=1)
    assert share["decode_runs"] == 5 and share["router_nodes"] == len(routers)
    assert 0 < share["router_us_per_step"] < share["profiled_step_node_us"]
    assert 0 < share["router_share"] < 1
