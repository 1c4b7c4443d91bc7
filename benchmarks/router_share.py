"""The MoE router's share of a decode step, from ONNX Runtime's profile of the artifact's own engine.

The router is every top-level node that turns a MoE layer's input into its routing weights:

* the router projection (the Gemm or MatMul feeding the first routing node);
* the routing the exporter wrote (``moe_experts/...``: scores, the selection bias, TopK, the scatter into per-expert
  weights, their log);
* sparse_experts' routing prep (``sparse_experts/<layer>/`` softmax, NaN guard, column max, hit test, the Split into
  the experts' If conditions).

The experts themselves (the Ifs and what runs inside them, x's block sums) are not the router. The profile's node
times are summed over the decode runs only (every model run after the first: the first is the prefill), top-level
nodes only (an If's time already holds its branch's nodes). ONNX Runtime's profiler adds several microseconds to
every node, and the router is many small nodes, so its share here is an upper bound on its share of an unprofiled
step.

    python benchmarks/router_share.py ARTIFACT [--batch 1] [--new-tokens 24] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from moeforge.core.artifact import MODEL_FILE
from moeforge.passes.sparse_experts import IF_PREFIX
from moeforge.runtime.engine import BackendOptions, EngineConfig, LLMEngine, SchedulingOptions
from moeforge.runtime.sampler import SamplingParams

ROUTING = re.compile(r"moe_experts(_\d+)?/")  # the exporter's routing nodes of MoE layer 0, 1, ...
_PREP = ("softmax", "isnan", "weights", "column_max", "hit", "conds")  # sparse_experts' routing nodes, per layer
_MOE_OPS = {"MoE", "QMoE", "MoEExperts"}


def router_nodes(graph: onnx.GraphProto) -> set[str]:
    """Names of the top-level nodes that compute the routing (see the module docstring)."""
    routing = {n.name for n in graph.node if ROUTING.search(n.name) and n.op_type not in _MOE_OPS}
    routing |= {n.name for n in graph.node if n.name.startswith(IF_PREFIX)
                and n.name.rsplit("/", 1)[-1] in _PREP and n.op_type != "If"}
    routing_inputs = {i for n in graph.node if n.name in routing for i in n.input}
    projections = {n.name for n in graph.node if n.op_type in ("Gemm", "MatMul")
                   and any(o in routing_inputs for o in n.output)}
    return routing | projections


def decode_node_times(trace: list[dict[str, Any]], top_level: set[str]) -> tuple[dict[str, float], int]:
    """Microseconds per top-level node summed over the decode runs of a profile trace (every run but the first),
    and how many decode runs there were."""
    runs = sorted((e["ts"], e["ts"] + e["dur"]) for e in trace if e.get("name") == "model_run")
    decode = runs[1:]
    times: dict[str, float] = {}
    starts = np.array([start for start, _ in decode])
    for event in trace:
        name = event.get("name", "")
        if event.get("cat") != "Node" or not name.endswith("_kernel_time"):
            continue
        node = name[: -len("_kernel_time")]
        if node not in top_level or not len(starts):
            continue
        run = int(np.searchsorted(starts, event["ts"], side="right")) - 1
        if run >= 0 and event["ts"] <= decode[run][1]:
            times[node] = times.get(node, 0.0) + float(event["dur"])
    return times, len(decode)


def router_share(artifact: str | Path, batch: int = 1, new_tokens: int = 24, threads: int | None = None,
                 prompt_len: int = 8) -> dict[str, Any]:
    """The router's profiled time per decode step and its share of the step's top-level node time."""
    graph = onnx.load(str(Path(artifact) / MODEL_FILE), load_external_data=False).graph
    routers = router_nodes(graph)
    engine = LLMEngine.from_artifact(artifact, EngineConfig(
        scheduling=SchedulingOptions(max_num_seqs=batch, max_num_batched_tokens=batch * prompt_len),
        backend=BackendOptions(threads=threads, profile=True)))
    end_profile = getattr(engine.backend, "end_profile", None)
    if end_profile is None:
        raise SystemExit(f"{artifact}: its backend keeps no ONNX Runtime profile (an ONNX Runtime artifact has one)")
    rng = np.random.default_rng(5)
    prompts = [rng.integers(10, engine.backend.vocab_size, prompt_len).tolist() for _ in range(batch)]
    engine.generate(prompts, SamplingParams(max_tokens=new_tokens, ignore_eos=True))  # one prefill run, then decodes
    trace = json.loads(Path(end_profile()).read_text())
    times, steps = decode_node_times(trace, {n.name for n in graph.node})
    step_us = sum(times.values()) / max(steps, 1)
    router_us = sum(t for node, t in times.items() if node in routers) / max(steps, 1)
    return {"batch": batch, "decode_runs": steps, "router_nodes": len(routers),
            "router_us_per_step": round(router_us, 1), "profiled_step_node_us": round(step_us, 1),
            "router_share": round(router_us / step_us, 4) if step_us else None,
            "note": "profiled: the profiler slows small nodes most, so the share is an upper bound"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    print(json.dumps(router_share(args.artifact, args.batch, args.new_tokens, args.threads), indent=2))


if __name__ == "__main__":
    main()
