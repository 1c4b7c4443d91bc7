"""The measured part of docs/performance.md, regenerated from the committed benchmark results (never typed by hand).

`python benchmarks/speed_table.py` reads benchmarks/results/genai_compare.json (moeforge vs onnxruntime-genai's
builder models and llama.cpp, one alternating run; ``genai_compare_*.json``: the same script on other machines),
moe_speed.json (a DeepSeek-shaped MoE model against llama.cpp, with the memory roofline),
heldout_accuracy.json (top-1 / KL on a text the project did not write), step_overhead.json (host time per decode
step), decode_breakdown*.json (the step's parts inside ONNX Runtime, per batch), matmul_scaling.json (matmul
kernels against rows) and compile_time.json, and rewrites the part of
docs/performance.md between ``<!-- speed:start -->`` and ``<!-- speed:end -->``. ``--print`` only prints it.
The README's short Speed section quotes a few of these numbers and links there.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "performance.md"
START, END = "<!-- speed:start -->", "<!-- speed:end -->"


def _load(name: str) -> dict[str, Any] | None:
    path = RESULTS / name
    return json.loads(path.read_text()) if path.is_file() else None


def _machine(payload: dict[str, Any]) -> str:
    m = payload["machine"]
    return f"{m['cpu']}, {m['usable_cores']} cores, {payload['date_utc'][:10]}"


def _compare_section(compare: dict[str, Any], intro: str) -> list[str]:
    """The decode / prefill table and the same-run ratios of one ``genai_compare`` result."""
    r = compare["results"]
    batches = r["batches"]
    lines = [f"{intro}SmolLM2-135M, {r['rounds']} alternating rounds in one run, medians "
             f"({_machine(compare)}; `benchmarks/genai_compare.py`): greedy decode of {r['new_tokens']} tokens "
             f"from {r['prompt_len']}-token prompts, prefill of one {r['prefill_len']}-token prompt. "
             "onnxruntime-genai runs models made by its own builder from the same weights; llama.cpp runs the "
             "GGUF itself (Q4_1, batch 1 only).", ""]
    header = ["system", *(f"decode b{b} tok/s" for b in batches), "TTFT b1 ms", f"prefill {r['prefill_len']} tok/s"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for system, by_batch in r["medians"].items():
        cells = [system]
        for b in batches:
            row = by_batch.get(f"b{b}")
            cells.append(f"{row['decode_tokens_per_s']:.1f}" if row else "-")
        first = by_batch.get("b1", {})
        cells += [f"{first['ttft_ms']:.0f}" if first.get("ttft_ms") else "-",
                  f"{first['prefill_tokens_per_s']:.0f}" if first.get("prefill_tokens_per_s") else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| ratio (same run) | value |", "|---|---|"]
    lines += [f"| {name} | {value:.2f} |" for name, value in r["ratios"].items()
              if name.startswith(("decode", "prefill", "batch")) and value is not None]
    lines.append("")
    return lines


def _goal(met: bool | None) -> str:
    return "-" if met is None else ("met" if met else "missed")


def _floor(row: dict[str, Any]) -> str:
    """Kernel floor ms | the kernels' read rates (benchmarks/kernel_ceiling.py), or dashes when not measured."""
    ceiling = row.get("kernel_ceiling") or {}
    if "floor_step_ms" not in ceiling:
        return "- | -"
    rates = " / ".join(str(ceiling.get(k, {}).get("gb_s", "-"))
                       for k in ("routed expert", "lm head", "other MatMulNBits", "float MatMul"))
    return f"{ceiling['floor_step_ms']:.1f} | {rates}"


def _fraction(row: dict[str, Any]) -> str:
    """The roofline fraction, or a dash where the run gave none (the reason follows the table)."""
    return "-" if row.get("fraction") is None else f"{row['fraction']:.2f}"


def _bandwidth(row: dict[str, Any]) -> str:
    """The row's bandwidth (the highest best of its run's probes) and the probes' spread, lowest median to highest
    best; the bandwidth alone for results whose rows did not record their probes."""
    probes = row.get("bandwidth_probes") or []
    if not probes:
        return f"{row['bandwidth_gb_s']:.1f}"
    low, high = min(p["median_gb_s"] for p in probes), max(p["best_gb_s"] for p in probes)
    return f"{row['bandwidth_gb_s']:.1f} ({low:.1f}-{high:.1f})"


def _router(row: dict[str, Any]) -> str:
    """The router's share of the profiled step and its microseconds (benchmarks/router_share.py), or a dash."""
    router = row.get("router") or {}
    if router.get("router_share") is None:
        return "-"
    return f"{100 * router['router_share']:.1f}% ({router['router_us_per_step'] / 1e3:.2f} ms)"


def _moe_section(moe: dict[str, Any]) -> list[str]:
    """benchmarks/moe_speed.py: the DeepSeek-shaped MoE model against llama.cpp, its accuracy, the roofline, ep."""
    r = moe["results"]
    shape = r["shape"]
    lines = [f"DeepSeek-V3-shaped MoE, {r['parameters'] / 1e9:.2f} B parameters ({shape['layers']} layers, hidden "
             f"{shape['hidden']}, {shape['experts']} routed experts top-{shape['top_k']} + {shape['shared_experts']} "
             f"shared, MLA, vocabulary {shape['vocab']}; `benchmarks/moe_speed.py`, {_machine(moe)}, {r['rounds']} "
             f"alternating rounds, medians): greedy decode of {r['new_tokens']} tokens from {r['prompt_len']}-token "
             f"prompts, prefill of {r['prefill_len']} tokens. The same weights as GGUF (llama.cpp) and as an HF "
             "folder of their dequantised values (moeforge's streamed compile): int8 from the Q8_0 file, int4-asym "
             "from the Q4_1 file (Q4_1 projections and experts, Q8_0 embedding and head)."
             + "".join(f" {note}" for note in r.get("notes", [])), "", r["markdown"], ""]
    accuracy = r.get("accuracy") or {}
    if accuracy:
        lines += ["Teacher-forced accuracy against moeforge's PyTorch model of the dequantised weights "
                  f"({next(iter(accuracy.values()))['tokens']} random tokens):", "",
                  "| format | system | top-1 agreement | mean KL |", "|---|---|---|---|"]
        for fmt, by_system in accuracy.items():
            for system, row in by_system.items():
                if isinstance(row, dict) and "top1_agreement" in row:
                    lines.append(f"| {fmt} | {system} | {row['top1_agreement']:.3f} | {row['mean_kl']:.2g} |")
        lines.append("")
        paired = [(pair, row) for by_system in accuracy.values() for pair, row in by_system.get("paired", {}).items()]
        if paired:
            lines += ["The same positions, system against system (`heldout_accuracy.paired_top1`): where only one of "
                      "the two has the reference's top-1, the gap with its 95% interval, and McNemar's exact p (how "
                      "likely a gap this large is by chance alone):", "",
                      "| pair | both right | only the first | only the second | gap (95% interval) | McNemar p |",
                      "|---|---|---|---|---|---|"]
            for pair, row in paired:
                low, high = row["difference_ci95"]
                lines.append(f"| {pair} | {row['both']} | {row['only_ours']} | {row['only_theirs']} | "
                             f"{row['difference']:+.3f} ({low:+.3f} .. {high:+.3f}) | {row['mcnemar_p']:.2f} |")
            lines.append("")
    roof = r.get("roofline") or {}
    band = roof.get("bandwidth")
    if band:
        if "source" in band:  # each row's bandwidth probed in its own run
            where = (f"read bandwidth probed in each row's run, before and after its timed steps: "
                     f"{band['lowest_gb_s']} to {band['highest_gb_s']} GB/s best, {band['threads']} threads")
        else:  # results of a run that took one bandwidth for every row
            where = (f"read bandwidth {band['best_gb_s']} GB/s best, {band['median_gb_s']} median, {band['threads']} "
                     "threads" + (", the cached number: measured before this run, not in it" if band.get("cached")
                                  else ""))
        lines += [f"Decode against the memory roofline (`moeforge bench --roofline`; {where}): the bytes a step reads "
                  "(weights no routing skips + the union of the routed experts + the KV cache) over that bandwidth, "
                  "against the measured step; kernel time from a profiled run. Each row's bandwidth is the highest "
                  "best of its run's probes, with their spread (lowest median to highest best).", "",
                  "The kernel floor (`benchmarks/kernel_ceiling.py`) is the same step made of ONNX Runtime's kernels "
                  "alone, on the artifact's shapes with fresh weights: the routed experts' bytes at their MatMulNBits "
                  "rate plus the LM head, the other MatMulNBits and the float MatMuls, each timed by itself. Kernel "
                  "rates are GB/s.", "",
                  "| artifact | step MiB | routed experts MiB | LM head MiB | experts / layer | measured ms | "
                  "bandwidth GB/s (spread) | roofline ms | fraction | kernel floor ms | "
                  "kernel GB/s: experts / head / other / float | kernel time | router (profiled) |", "|---" * 13 + "|"]
        mib = 2**20
        for key, row in roof.items():
            if key == "bandwidth":
                continue
            active = row["active_experts_per_layer"]
            shares = ", ".join(f"{op} {100 * v:.0f}%" for op, v in list(row.get("kernel_time_shares", {}).items())[:4])
            lines.append(f"| {key} | {row['step_bytes'] / mib:.0f} | {row['active_expert_bytes'] / mib:.0f} | "
                         f"{row['head_bytes'] / mib:.0f} | {sum(active) / max(len(active), 1):.1f} of "
                         f"{max(row['experts_per_layer'] or [0])} | {row['measured_step_ms']:.1f} | "
                         f"{_bandwidth(row)} | "
                         f"{row['roofline_step_ms']:.1f} | {_fraction(row)} | {_floor(row)} | {shares} | "
                         f"{_router(row)} |")
        lines.append("")
        unjudged = [(key, row) for key, row in roof.items() if key != "bandwidth" and row.get("fraction") is None]
        if unjudged:  # a fraction above 1, twice: not a result (moeforge/runtime/roofline_fraction.py)
            lines += [f"- {key}: {row['fraction_reason']}" for key, row in unjudged] + [""]
    ep = r.get("expert_parallel")
    if ep and "ep2_step_over_ep1" in ep:
        lines += [f"Expert parallelism at batch 1 (`--tp 2 --ep 2`, two rank processes of one thread, against "
                  f"unsharded with two threads): {ep['ep1']['step_ms']:.1f} ms vs {ep['ep2']['step_ms']:.1f} ms per "
                  f"step ({ep['ep2_step_over_ep1']:.2f}x).", ""]
    goals = r.get("goals")
    if goals:
        lines += ["| issue 38 goal | measured | |", "|---|---|---|"]
        lines += [f"| {name} | {g['value'] if g['value'] is not None else '-'}"
                  + (f" (95% interval {g['ci95'][0]:+.3f} .. {g['ci95'][1]:+.3f}, McNemar p {g['mcnemar_p']:.2f})"
                     if "ci95" in g else "") + f" | {_goal(g['met'])} |" for name, g in goals.items()]
        lines.append("")
    return lines


def speed_section() -> str:
    """The markdown of the section."""
    lines: list[str] = []
    compare = _load("genai_compare.json")
    if compare is not None:
        lines += _compare_section(compare, "")
    moe = _load("moe_speed.json")
    if moe is not None:
        lines += _moe_section(moe)
    for path in sorted(RESULTS.glob("genai_compare_*.json")):  # the same script on other machines
        other = json.loads(path.read_text())
        lines += _compare_section(other, f"The same script on another machine (`{path.name}`"
                                  + (f"; {other['results']['note']}" if other['results'].get("note") else "") + "): ")
    speculative = _load("speculative_decoding.json")
    if speculative is not None:
        sp = speculative["results"]
        lines += [f"Prompt-lookup speculative decoding against plain decoding (`--speculative-tokens`; "
                  f"`benchmarks/speculative_decoding.py`, {_machine(speculative)}; batch 1, "
                  f"{sp['prompts_per_set']} prompts per set, {sp['new_tokens']} greedy tokens, medians; kKnN = K "
                  "draft tokens at most, tails of N+ tokens matched):", "",
                  "| artifact | prompts | setting | decode tok/s | vs plain | drafts accepted | outputs = plain's |",
                  "|---|---|---|---|---|---|---|"]
        for artifact, by_set in sp["results"].items():
            for prompts, by_setting in by_set.items():
                for setting, row in by_setting.items():
                    accepted = "-" if row["accepted_share"] is None else f"{row['accepted_share']:.0%}"
                    lines.append(f"| {artifact} | {prompts} | {setting} | {row['decode_tokens_per_s']:.1f} | "
                                 f"{row['vs_plain']:.2f}x | {accepted} | "
                                 f"{row['outputs_equal_to_plain']}/{sp['prompts_per_set']} |")
        lines.append("")
    accuracy = _load("heldout_accuracy.json")
    if accuracy is not None:
        a = accuracy["results"]
        lines += [f"Accuracy on held-out text ({a['tokens']} tokens of `{a['text']}`, teacher-forced, vs "
                  f"{a['reference']}; `benchmarks/heldout_accuracy.py`):", "",
                  "| model | top-1 agreement | mean KL |", "|---|---|---|"]
        for name, row in a["results"].items():
            if "top1_agreement" in row:
                lines.append(f"| {name} | {row['top1_agreement']:.3f} | {row['mean_kl']:.2g} |")
        lines.append("")
    overhead = _load("step_overhead.json")
    if overhead is not None:
        lines += [f"Host time per decode step outside ONNX Runtime (`benchmarks/step_overhead.py`, "
                  f"{_machine(overhead)}; in situ = step minus `run_with_iobinding`, host code = the same steps "
                  "with the kernels made no-ops):", "",
                  "| artifact | batch | step ms | ONNX Runtime ms | host in situ ms | host code ms |",
                  "|---|---|---|---|---|---|"]
        for row in overhead["results"]["runs"]:
            lines.append(f"| {Path(row['artifact']).name} | {row['batch']} | {row['step_ms']:.2f} | "
                         f"{row['ort_run_ms']:.2f} | {row['host_overhead_ms']:.3f} | "
                         f"{row.get('host_only_ms', 0):.3f} |")
        lines.append("")
    for path in sorted(RESULTS.glob("decode_breakdown*.json")):  # batch 1, then other batches (_b8 ...)
        breakdown = json.loads(path.read_text())
        b = breakdown["results"]
        lines += [f"Inside ONNX Runtime's run, by part (`benchmarks/decode_breakdown.py`, `{path.name}`, "
                  f"{_machine(breakdown)}; batch {b['batch']}, {b['past']} cached tokens, medians of {b['rounds']} "
                  "alternating rounds; a part = the step minus a copy of the graph without it; int4-asym's offsets = "
                  f"its step minus the symmetric int4 artifact's; 1.25x {b['baseline']}'s speed needs a "
                  f"{b['bar_1_25x_ms']:.2f} ms step):", "", b["markdown"], ""]
    scaling = _load("matmul_scaling.json")
    if scaling is not None:
        m = scaling["results"]
        shapes = ", ".join(f"{k}x{n}" for k, n in m["shapes"])
        lines += [f"ONNX Runtime's CPU matmul kernels against the rows they multiply (`benchmarks/matmul_scaling.py`, "
                  f"{_machine(scaling)}; us per layer of SmolLM2 projections ({shapes}), {m['copies']} distinct "
                  "copies so the weights stream from memory, each output checked against NumPy first; batch 8 can "
                  "decode at most 8 / (M=8 / M=1) times batch 1's tokens on a kernel):", "", m["markdown"], ""]
    compile_time = _load("compile_time.json")
    if compile_time is not None:
        for row in compile_time["results"]["rows"]:
            if row["model"] == "smollm2-135m":
                check = " --check" if row["check"] else ""
                lines += [f"`moeforge compile smollm2-135m{check}`: {row['seconds']:.0f} s "
                          f"wall, peak RSS {row['peak_rss_mib']:.0f} MiB = {row['peak_rss_over_fp32_weights']:.2f}x "
                          f"the fp32 weights (`benchmarks/compile_time.py`, {_machine(compile_time)}).", ""]
    return "\n".join(lines).rstrip() + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--print", action="store_true",
                        help="print the section instead of rewriting docs/performance.md")
    args = parser.parse_args()
    section = speed_section()
    if args.print:
        print(section)
        return
    text = DOC.read_text()
    if START not in text or END not in text:
        raise SystemExit(f"docs/performance.md has no {START} ... {END} markers")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    DOC.write_text(f"{head}{START}\n{section}{END}{tail}")


if __name__ == "__main__":
    main()
