"""Human-readable summary of an artifact (``moeforge inspect``) and graph op counts."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import onnx

from moeforge.compile.sharded_compile import ShardedManifest
from moeforge.compile.trt.inspect_engine import engine_lines
from moeforge.core.artifact import MODEL_FILE, Artifact
from moeforge.core.config import ModelConfig
from moeforge.core.errors import ArtifactError
from moeforge.core.kv_layout import KVCacheSpec
from moeforge.core.manifest import Manifest
from moeforge.core.sizes import format_bytes
from moeforge.runtime.backends.registry import backend_for


def _iter_nodes(graph: onnx.GraphProto) -> Iterable[onnx.NodeProto]:
    for node in graph.node:
        yield node
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _iter_nodes(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for sub in attr.graphs:
                    yield from _iter_nodes(sub)


def op_counts(model_path: str | Path) -> dict[str, int]:
    """Node count per op type (subgraphs included), most frequent first. Ops outside the default
    domain are qualified: ``com.microsoft.GroupQueryAttention``. Weights are not loaded."""
    model = onnx.load(str(model_path), load_external_data=False)
    counts = Counter(
        f"{node.domain}.{node.op_type}" if node.domain not in ("", "ai.onnx") else node.op_type
        for node in _iter_nodes(model.graph)
    )
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def _shape_str(shape: list[int | str]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def v4_cache_lines(kv: KVCacheSpec) -> list[str]:
    """DeepSeek-V4's cache (layout v4_hybrid): what grows with the context (the compressed entries) and what a
    sequence holds whatever its length (the rings), per layer kind, and the bytes at a few context lengths."""
    assert kv.layer_buffers is not None
    kinds: dict[str, int] = {}
    for layer in kv.layer_buffers:
        described = ", ".join(f"{b.kind} {'ring ' + str(b.ring) if b.ring else 'every ' + str(b.tokens_per_row)}"
                              for b in layer)
        kinds[described] = kinds.get(described, 0) + 1
    where = f"pools of {kv.block_size}-token blocks ({format_bytes(kv.bytes_per_block)} each)" if kv.paged else \
        "per-sequence buffers"
    lines = [f"KV cache   {kv.layout}: {kv.num_layers} layers, {kv.dtype}, {where}"]
    lines += [f"           {count} x [{described}]" for described, count in kinds.items()]
    if kv.paged:
        lines.append(f"           grows {format_bytes(kv.bytes_per_token)} per token (a block's entries and rings / "
                     f"{kv.block_size} tokens, all layers)")
    else:
        lines.append(f"           grows {format_bytes(kv.bytes_per_token)} per token (the compressed entries, all "
                     f"layers); rings {format_bytes(kv.bytes_per_sequence)} per sequence whatever its length")
    contexts = sorted({4096, 32768, 1 << 20, kv.max_seq_len})
    lines.append("           per sequence: " + ", ".join(f"{format_bytes(kv.bytes_for(n))} at {n:,} tokens"
                                                         for n in contexts))
    return lines


def _table(rows: list[list[str]], indent: str = "  ") -> list[str]:
    if not rows:
        return []
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def _model_line(cfg: dict[str, Any]) -> str:
    name = cfg.get("name") or cfg.get("model_type", "?")
    parts = [str(cfg.get("model_type", "?")), f"{cfg.get('num_hidden_layers', '?')} layers",
             f"hidden {cfg.get('hidden_size', '?')}", f"vocab {cfg.get('vocab_size', '?')}"]
    if cfg.get("mla"):
        parts.append(f"MLA {cfg.get('num_attention_heads', '?')} heads, kv_lora_rank {cfg['mla'].get('kv_lora_rank')}")
    else:
        parts.append(f"GQA {cfg.get('num_attention_heads', '?')}/{cfg.get('num_key_value_heads', '?')} heads "
                     f"x {cfg.get('head_dim', '?')}")
    if cfg.get("moe"):
        m = cfg["moe"]
        parts.append(f"MoE {m.get('n_routed_experts')} experts top-{m.get('num_experts_per_tok')}")
    try:
        params = ModelConfig.from_dict(cfg).num_parameters()
        parts.append(f"{params / 1e9:.3f} B params" if params >= 1e8 else f"{params / 1e6:.2f} M params")
    except Exception:  # a summary must not fail on an odd config
        pass
    return f"{name} ({', '.join(parts)})"


def _runs_on(m: Manifest) -> str:
    """Which backend runs the artifact, and whether it can (the registry's answer)."""
    try:
        spec = backend_for(m)
    except ArtifactError as exc:
        return str(exc)
    why = spec.refusal(paged=m.kv_cache.paged, sharded=m.sharding is not None, layout=m.kv_cache.layout)
    return f"runs on {spec.name}" + (f"{' (CUDA GPU)' if spec.needs_gpu else ''}" if not why else f": not yet ({why})")


def summarize(artifact: Artifact) -> str:
    """Human-readable description for ``moeforge inspect DIR``."""
    m = artifact.manifest
    lines = [f"artifact   {artifact.root}  (format {m.format_version})",
             f"model      {_model_line(m.model_config)}",
             f"target     {m.target}, precision {m.precision}; {_runs_on(m)}"]
    if m.source:
        lines.append(f"source     {m.source}")
    versions = ", ".join(f"{k} {v}" for k, v in m.tool_versions.items() if v)
    lines.append(f"created    {m.created_utc or '?'}" + (f" with {versions}" if versions else ""))

    lines.append("")
    lines.append("inputs")
    lines += _table([[t.name, t.dtype, _shape_str(t.shape)] for t in m.inputs])
    lines.append("outputs")
    lines += _table([[t.name, t.dtype, _shape_str(t.shape)] for t in m.outputs])

    kv = m.kv_cache
    lines.append("")
    if kv.layer_buffers is not None:
        lines += v4_cache_lines(kv)
    else:
        buffers = {"gqa": "key + value", "mla_dsa": "latent + indexer keys"}.get(kv.layout, "latent")
        lines.append(f"KV cache   {kv.layout}: {kv.num_layers} layers x {buffers}, {kv.dtype} "
                     f"{_shape_str(kv.shape)} per buffer"
                     + (f" (last dims {' / '.join(map(str, kv.buffer_widths))})" if kv.buffer_widths else ""))
        lines.append(f"           {kv.values_per_token_per_layer} values/token/layer, "
                     f"{format_bytes(kv.bytes_per_token)} per token (all layers), "
                     f"{format_bytes(kv.bytes_for(kv.max_seq_len))} per sequence at max_seq_len {kv.max_seq_len}")
    if kv.num_layers:
        lines.append(f"           names {', '.join(kv.past_input_names[0])} -> {', '.join(kv.present_output_names[0])}"
                     + (" (layer 0)" if kv.num_layers > 1 else ""))

    lines.append("")
    if m.passes:
        lines.append("passes")
        rows = [[str(p.get("name", "?")), f"{p.get('matches', '?')} matches",
                 f"{float(p['seconds']):.2f} s" if isinstance(p.get("seconds"), int | float) else "? s"]
                for p in m.passes]
        lines += _table(rows)
    else:
        lines.append("passes     none")

    lines.append("")
    try:
        counts = op_counts(artifact.model_path)
        lines.append(f"ops        {sum(counts.values())} nodes, {len(counts)} op types")
        lines += _table([[op, str(n)] for op, n in counts.items()])
    except Exception as exc:  # inspect should still show the rest
        lines.append(f"ops        cannot read {MODEL_FILE}: {exc}")

    lines += engine_lines(artifact)  # none for an artifact without an engine plan

    lines.append("")
    total = sum(int(e["bytes"]) for e in m.files.values())
    lines.append(f"files      {len(m.files)} files, {format_bytes(total)}")
    lines += _table([[rel, format_bytes(int(e["bytes"])), str(e["sha256"])[:12]] for rel, e in sorted(m.files.items())])
    if artifact.extra_files:
        lines.append(f"           not in the manifest (ignored): {', '.join(artifact.extra_files)}")
    return "\n".join(lines) + "\n"


def _span(value: Any) -> str:
    return f"{value[0]}..{value[1] - 1}" if isinstance(value, list) and len(value) == 2 else "-"


def summarize_sharded(root: Path, sharded: ShardedManifest) -> str:
    """Human-readable description of a sharded artifact (``sharded.json``) for ``moeforge inspect DIR``: the split,
    each rank's share, the expert placement and its replicas; each ``DIR/rank{i}`` is inspected on its own."""
    lines = [f"sharded    {root}  (format {sharded.format_version}, compile {sharded.compile_id[:12]})",
             f"model      {_model_line(sharded.model_config)}",
             f"split      tp {sharded.tp}, ep {sharded.ep}" + (f", pp {sharded.pp}" if sharded.pp > 1 else "")
             + f": {sharded.world_size} ranks, one process each"]
    if sharded.source:
        lines.append(f"source     {sharded.source}")
    lines.append(f"created    {sharded.created_utc or '?'}")
    lines.append("")
    rows = [["rank", "heads", "kv heads", "vocab rows", "experts" if sharded.placement is None else "slots",
             "weights", "KV / token", "manifest"]]
    rows += [[str(r.get("rank")), _span(r.get("heads")), _span(r.get("kv_heads")), _span(r.get("vocab")),
              _span(r.get("experts")), format_bytes(float(r.get("weight_bytes", 0))),
              format_bytes(float(r.get("kv_bytes_per_token", 0))), str(r.get("manifest_sha256", ""))[:12]]
             for r in sharded.ranks]
    lines += _table(rows)
    if sharded.pp > 1:
        lines.append("")
        stage_rows = [["stage", "layers", "holds", "ranks", "weights", "KV / token"]]
        stage_rows += [[str(s["stage"]), _span(s.get("layers")),
                        "+".join(part for part, held in (("embedding", s.get("embedding")), ("head", s.get("head")))
                                 if held) or "-",
                        ",".join(str(r) for r in s.get("ranks", [])), format_bytes(float(s.get("weight_bytes", 0))),
                        format_bytes(float(s.get("kv_bytes_per_token", 0)))] for s in sharded.stages]
        lines += _table(stage_rows)
    slots = sharded.expert_slots()
    lines.append("")
    if slots is None:
        lines.append("placement  " + ("contiguous: rank r holds experts r * E / N .. (r + 1) * E / N - 1"
                                      if sharded.ep > 1 else "none (every rank holds a slice of every expert)"))
    else:
        lines.append(f"placement  --placement: {slots.slots_per_rank} slots per rank; replicated experts per MoE layer "
                     "(expert: ranks of its replicas)")
        experts = int(sharded.model_config["moe"]["n_routed_experts"])
        for layer in range(slots.layers):
            expert_slots, replicas = slots.slot_table(layer, experts)
            replicated = [f"{e}: {','.join(str(slot // slots.slots_per_rank) for slot in expert_slots[e][:n])}"
                          for e, n in enumerate(replicas) if n > 1]
            empty = sum(1 for e in slots.physical_to_logical[layer] if e < 0)
            lines.append(f"  MoE layer {layer}: " + ("; ".join(replicated) or "no replicas")
                         + (f" ({empty} empty slots)" if empty else ""))
    lines.append("")
    lines.append("collectives")
    lines += [f"  {c}" for c in sharded.collectives]
    if sharded.kv_cache_note:
        lines.append(f"KV cache   {sharded.kv_cache_note}")
    lines.append(f"ranks      moeforge inspect {root / 'rank0'} (and rank1 ...) describes each rank's artifact")
    return "\n".join(lines) + "\n"
