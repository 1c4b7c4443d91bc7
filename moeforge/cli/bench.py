"""Benchmark helpers: a description of the machine, and writing results as JSON."""

from __future__ import annotations

import gc
import importlib.util
import os
import platform
import resource
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moeforge.cli.json_output import to_json
from moeforge.compile.genai_config import genai_greedy
from moeforge.core.artifact import MODEL_FILE, KVCacheSpec, load_artifact
from moeforge.core.errors import MoeforgeError
from moeforge.core.host_memory import available_memory, host_bytes
from moeforge.core.manifest import tool_versions
from moeforge.core.progress import StageLog
from moeforge.core.run_bandwidth import RunBandwidth
from moeforge.core.sizes import format_bytes
from moeforge.model.loader import load_model, resolve_source
from moeforge.model.model import CausalLM
from moeforge.runtime.backends.base import Backend
from moeforge.runtime.backends.registry import backend_for
from moeforge.runtime.engine import (
    BackendOptions,
    EngineConfig,
    LLMEngine,
    SchedulingOptions,
    SpeculativeOptions,
)
from moeforge.runtime.expert_stats import run_record, write_expert_load
from moeforge.runtime.roofline import decode_roofline, ranks_roofline, weight_traffic
from moeforge.runtime.sampler import SamplingParams
from moeforge.verify.transformers_reference import quiet_transformers


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on: CPU model, cores, memory, OS, Python and library versions."""
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory_gib = None
    try:
        pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        memory_gib = round(pages * page_size / 2**30, 1)
    except (ValueError, OSError):
        pass
    return {
        "cpu": cpu,
        "logical_cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_gib": memory_gib,
        "os": f"{platform.system()} {platform.release()}",
        "machine": platform.machine(),
        "gpu": None,
        "versions": tool_versions(),
    }


def peak_rss_mib(children: bool = False) -> float:
    """Peak resident set size of this process (or of its finished children), MiB."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN if children else resource.RUSAGE_SELF)
    return usage.ru_maxrss / 1024  # Linux reports KiB


def write_result(path: str | Path, name: str, results: dict[str, Any]) -> Path:
    """Write ``{"benchmark", "date_utc", "machine", "command", "results"}`` as indented JSON."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": name,
        "date_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "results": results,
    }
    path.write_text(to_json(payload, indent=2) + "\n")
    print(f"saved {path.resolve()}", file=sys.stderr)  # --save is relative to the current folder: say where it went
    return path


# ----------------------------------------------------------------------------- moeforge bench
def _prompts(vocab: int, batch: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, length).tolist() for _ in range(batch)]


def bench_engine(artifact_dir: str | Path, batch: int, prompt_len: int, new_tokens: int,
                 threads: int | None = None, speculative_tokens: int = 0, backend: Backend | None = None,
                 expert_load_out: Path | None = None, stats_artifact: str | Path | None = None,
                 model_name: str = "", roofline: RunBandwidth | None = None,
                 rank_dirs: Sequence[Path] = (), expert_load_force: bool = False) -> dict[str, Any]:
    """Our engine: prefill tokens/s (to the last first token), decode tokens/s, TTFT (and with
    ``speculative_tokens`` the draft tokens fed and accepted). ``backend``: opened already (a sharded artifact's
    ``ShardedBackend``; ``artifact_dir`` is its rank 0). MoE artifacts also report the measured expert-load
    imbalance of the timed run (``expert_load``), written to ``expert_load_out`` as ``moeforge eplb`` reads it
    (an existing file replaced only with ``expert_load_force``), named by ``stats_artifact`` (the sharded artifact's
    top directory; default ``artifact_dir``). With ``roofline`` (the run's read bandwidth: probed before the engine
    loads and right after the timed steps, unless it holds the cached number) the decode phase is measured against the
    memory roofline (``roofline`` in the result: bytes a step reads, by kind, every probe, and the achieved fraction,
    or none with the reason; moeforge/runtime/roofline.py); for a sharded artifact ``rank_dirs`` names every rank's
    artifact, in rank order, and the step's bytes are the ranks' sum (``ranks_roofline``)."""
    if roofline is not None:  # the bandwidth next to the steps it judges: before them (and before the engine takes
        # its memory, so the probe's buffer, freed at once, does not add to the peak RSS reported), and just after
        roofline.sample("before")
    engine = LLMEngine.from_artifact(artifact_dir, EngineConfig(
        scheduling=SchedulingOptions(max_num_seqs=batch, max_num_batched_tokens=batch * prompt_len),
        backend=BackendOptions(threads=threads, track_expert_load=True),
        speculative=SpeculativeOptions(tokens=speculative_tokens)), backend=backend)
    vocab = engine.backend.vocab_size
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    engine.generate(_prompts(vocab, batch, prompt_len, seed=99), SamplingParams(max_tokens=2, ignore_eos=True))
    warm_load, warm_ranks = engine.expert_load(), engine.rank_expert_load()
    start = time.perf_counter()
    for prompt in _prompts(vocab, batch, prompt_len):
        engine.add_request(prompt, params)
    first_tokens_at = None
    decode_activity = None  # the experts computed so far, when the decode phase starts
    decode_ranks = None  # the same per rank (a sharded artifact's, with --roofline)
    started: set[int] = set()  # requests that produced their first token
    outputs = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.token_ids:
                started.add(out.request_id)
            if out.finished:
                outputs.append(out)
        if first_tokens_at is None and len(started) == batch:
            first_tokens_at = time.perf_counter()
            decode_activity = engine.expert_activity()
            decode_ranks = engine.rank_expert_activity() if roofline is not None else None
    end = time.perf_counter()
    rss = peak_rss_mib()  # before the probe below and the profiled engine are loaded
    end_activity = engine.expert_activity()
    end_ranks = engine.rank_expert_activity() if roofline is not None else None
    if roofline is not None:
        roofline.sample("after")
    assert first_tokens_at is not None
    ttfts = [o.metrics.ttft for o in outputs if o.metrics is not None and o.metrics.ttft is not None]
    drafts = {"speculative_tokens": speculative_tokens, "draft_tokens": engine.metrics.draft_tokens,
              "accepted_draft_tokens": engine.metrics.accepted_draft_tokens} if speculative_tokens else {}
    experts = _expert_load(engine, warm_load, warm_ranks, expert_load_out, stats_artifact or artifact_dir, model_name,
                           expert_load_force)
    decode_rate = batch * (new_tokens - 1) / (end - first_tokens_at)
    report = None
    if roofline is not None and rank_dirs:  # a sharded artifact's ranks, each reading its own graph
        if decode_ranks is None or end_ranks is None:
            raise MoeforgeError("--roofline on a sharded artifact needs every rank's expert activity: its backend "
                                "does not gather it (a pipeline artifact's stages)")
        report = ranks_roofline(
            [weight_traffic(Path(d) / MODEL_FILE) for d in rank_dirs], batch=batch,
            mean_context=prompt_len + new_tokens / 2,
            kv_bytes_per_token=[load_artifact(d, verify=False).manifest.kv_cache.bytes_per_token for d in rank_dirs],
            active_experts=[e.since(d).per_run() for e, d in zip(end_ranks, decode_ranks, strict=True)],
            bandwidth=roofline, decode_tokens_per_s=decode_rate).to_dict()
    elif roofline is not None:
        active = (end_activity.since(decode_activity).per_run()
                  if end_activity is not None and decode_activity is not None else None)
        report = decode_roofline(
            weight_traffic(Path(artifact_dir) / MODEL_FILE), batch=batch, mean_context=prompt_len + new_tokens / 2,
            kv_bytes_per_token=load_artifact(artifact_dir, verify=False).manifest.kv_cache.bytes_per_token,
            active_experts=active, bandwidth=roofline, decode_tokens_per_s=decode_rate).to_dict()
    del engine  # free its caches first: one engine's memory at a time (what check_bench_memory assumes)
    gc.collect()
    shares = None
    if backend is None:  # kernel time by op type, from a separate profiled run (it perturbs the timings)
        profiled = LLMEngine.from_artifact(artifact_dir, EngineConfig(
            scheduling=SchedulingOptions(max_num_seqs=batch, max_num_batched_tokens=batch * prompt_len),
            backend=BackendOptions(threads=threads, profile=True)))
        profiled.generate(_prompts(vocab, batch, prompt_len), params)
        shares = profiled.backend.op_time_shares()
    share = sum(v for op, v in shares.items() if "Attention" in op) if shares else None
    if report is not None and shares:  # where a step's time goes, next to where its bytes are
        report["kernel_time_shares"] = {op: round(v, 4) for op, v in list(shares.items())[:12]}
    return {
        **({"expert_load": experts} if experts else {}),
        "attention_time_share": round(share or 0.0, 3),
        "prefill_tokens_per_s": batch * prompt_len / (first_tokens_at - start),
        "decode_tokens_per_s": decode_rate,
        **({"roofline": report} if report is not None else {}),
        "ttft_ms_median": 1e3 * sorted(ttfts)[len(ttfts) // 2],
        "peak_rss_mib": round(rss, 1),
        **drafts,
    }


def _expert_load(engine: LLMEngine, warm_load: np.ndarray | None, warm_ranks: np.ndarray | None,
                 out: Path | None, artifact: str | Path, model_name: str, force: bool = False) -> dict[str, Any] | None:
    """The timed run's expert load (the warm-up's subtracted): per-layer imbalance over the experts and, sharded,
    over the ranks; written to ``out`` (the statistics ``moeforge eplb`` reads; replacing a file only with ``force``)
    when given."""
    load, ranks = engine.expert_load(), engine.rank_expert_load()
    if load is None:
        if out is not None:
            raise MoeforgeError(f"--expert-load-out {out}: the artifact routes no experts (not a MoE model)")
        return None
    load = load - warm_load if warm_load is not None else load
    ranks = ranks - warm_ranks if ranks is not None and warm_ranks is not None else ranks
    record = run_record(load, ranks, artifact, model_name)
    if out is not None:
        write_expert_load(out, record, force=force)
    summary: dict[str, Any] = {"expert_imbalance": record["imbalance"],
                               "expert_imbalance_mean": round(float(np.mean(record["imbalance"])), 4)}
    if ranks is not None:
        summary.update(rank_imbalance=record["rank_imbalance"],
                       rank_imbalance_mean=round(float(np.mean(record["rank_imbalance"])), 4))
    return summary


def bench_torch(model: CausalLM, batch: int, prompt_len: int, new_tokens: int, vocab: int) -> dict[str, Any]:
    """Our PyTorch model (eager, fp32, its own KV cache), same work."""
    ids = torch.tensor(_prompts(vocab, batch, prompt_len))
    with torch.inference_mode():
        model(ids[:, :4], torch.arange(4).expand(batch, -1))  # warm-up
        start = time.perf_counter()
        out = model(ids, torch.arange(prompt_len).expand(batch, -1))
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        first = time.perf_counter()
        past = out.past_key_values
        for step in range(new_tokens - 1):
            pos = torch.full((batch, 1), prompt_len + step)
            out = model(token, pos, past)
            past, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        end = time.perf_counter()
    return {"prefill_tokens_per_s": batch * prompt_len / (first - start),
            "decode_tokens_per_s": batch * (new_tokens - 1) / (end - first)}


def transformers_skipped(source: str) -> str | None:
    """Why ``bench`` does not run transformers on ``source`` (None: it does)."""
    if importlib.util.find_spec("transformers") is None:
        return "transformers is not installed"
    resolved = resolve_source(source)  # a built-in model's name -> its file
    if resolved.kind == "preset":
        return f"{source} is a preset: no checkpoint for transformers to load"
    path = Path(resolved.location)
    if path.suffix != ".gguf" and not (path / "config.json").is_file():
        return f"{path} is neither a .gguf file nor a Hugging Face folder"
    return None


def bench_transformers(source: str, batch: int, prompt_len: int, new_tokens: int, vocab: int) -> dict[str, Any] | None:
    """transformers eager on the same weights (HF folder or GGUF); None where ``transformers_skipped`` says why."""
    if transformers_skipped(source) is not None:
        return None
    # transformers is an optional (dev) dependency and slow to import: only this comparison needs it.
    from transformers import AutoModelForCausalLM

    path = Path(resolve_source(source).location)
    with quiet_transformers():  # its bars (minutes of GGUF conversion): the bench's stage line names the wait
        if path.suffix == ".gguf":
            model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        else:
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model.eval()
    ids = torch.tensor(_prompts(vocab, batch, prompt_len))
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        model.generate(ids[:, :4], attention_mask=mask[:, :4], max_new_tokens=2, do_sample=False)
        start = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=1, min_new_tokens=1, do_sample=False)
        first = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=False)
        end = time.perf_counter()
    prefill = first - start
    return {"prefill_tokens_per_s": batch * prompt_len / prefill,
            "decode_tokens_per_s": batch * (new_tokens - 1) / max(end - first - prefill, 1e-9)}


def genai_skipped(artifact_dir: str | Path) -> str | None:
    """Why ``bench`` does not run onnxruntime-genai on the artifact (None: it does)."""
    if importlib.util.find_spec("onnxruntime_genai") is None:
        return "onnxruntime-genai is not installed"
    if not (Path(artifact_dir) / "genai_config.json").is_file():
        return "the artifact has no genai_config.json (a cache onnxruntime-genai cannot drive: paged, int8, MLA)"
    return None


def bench_genai(artifact_dir: str | Path, batch: int, prompt_len: int, new_tokens: int,
                vocab: int) -> dict[str, Any] | None:
    """onnxruntime-genai running the same artifact from its genai_config.json; None where ``genai_skipped`` says
    why."""
    if genai_skipped(artifact_dir) is not None:
        return None
    import onnxruntime_genai as og  # optional (dev) dependency: only this comparison needs it
    model = og.Model(str(artifact_dir))
    prompts = _prompts(vocab, batch, prompt_len)

    def run(n: int) -> float:
        start = time.perf_counter()
        genai_greedy(model, prompts, n, min_new_tokens=n)
        return time.perf_counter() - start

    run(2)
    prefill = run(1)
    total = run(new_tokens)
    return {"prefill_tokens_per_s": batch * prompt_len / prefill,
            "decode_tokens_per_s": batch * (new_tokens - 1) / max(total - prefill, 1e-9)}


def bench_memory(kv: KVCacheSpec, vocab: int, batch: int, prompt_len: int) -> int:
    """Bytes each engine of ``bench_engine`` allocates at least (``core/host_memory.host_bytes``, as the engine counts
    them): the KV cache of ``batch`` sequences of ``max_seq_len`` tokens (whole blocks when paged) and the float32
    logits of one full step of ``batch * prompt_len`` tokens. Weights and activations come on top."""
    blocks = batch * -(-kv.max_seq_len // kv.block_size) if kv.paged and kv.block_size else None
    return host_bytes(kv, vocab, num_seqs=batch, step_tokens=batch * min(prompt_len, kv.max_seq_len),
                      num_blocks=blocks).total


def check_bench_memory(kv: KVCacheSpec, vocab: int, batch: int, prompt_len: int,
                       available: int | None = None) -> None:
    """Refuse (``MoeforgeError``, naming both numbers and the largest batch that fits) a benchmark whose
    ``bench_memory`` exceeds ``available`` (default: ``available_memory()``; unknown: no check). The engine
    would refuse it too, but in its own terms (max_num_seqs); this names the bench's flag."""
    available = available_memory() if available is None else available
    need = bench_memory(kv, vocab, batch, prompt_len)
    if available is None or need <= available:
        return
    fits = available // bench_memory(kv, vocab, 1, prompt_len)
    hint = f"lower --batch to at most {fits}" if fits >= 1 else "this artifact does not fit even at --batch 1"
    raise MoeforgeError(
        f"--batch {batch} needs {format_bytes(need)} ({need} bytes) for the KV cache ({kv.bytes_per_token} B per "
        f"token x max_seq_len {kv.max_seq_len} x {batch} sequences) and the logits of one step, more than the "
        f"{format_bytes(available)} of memory available; {hint}"
    )


def run_bench(artifact_dir: str | Path, batch: int, prompt_len: int, new_tokens: int,
              threads: int | None = None, compare: bool = True, speculative_tokens: int = 0,
              expert_load_out: Path | None = None, roofline: RunBandwidth | None = None,
              expert_load_force: bool = False, stages: StageLog | None = None) -> dict[str, Any]:
    """All measurements of ``moeforge bench`` in one run, with ratios to our engine, each named on ``stages`` (stage
    lines on stderr) as it runs. A batch whose cache and logits do not fit in the available memory is refused before
    anything is allocated."""
    stages = stages or StageLog(enabled=False)
    with stages.stage(f"verifying {artifact_dir}"):  # every file's sha256
        artifact = load_artifact(artifact_dir)
    vocab = int(artifact.manifest.model_config["vocab_size"])
    if backend_for(artifact.manifest).host_kv:  # a TensorRT engine's cache is GPU memory, sized by its profiles
        check_bench_memory(artifact.manifest.kv_cache, vocab, batch, prompt_len)
    model_name = artifact.manifest.model_config.get("name")
    work = f"batch {batch}, prompt {prompt_len}, {new_tokens} new tokens"
    if roofline is not None and roofline.cached is None:
        work += "; the read bandwidth probed before and after"
    with stages.stage(f"measuring moeforge ({work}; then a profiled run)"):
        measured = bench_engine(artifact_dir, batch, prompt_len, new_tokens, threads, speculative_tokens,
                                expert_load_out=expert_load_out, expert_load_force=expert_load_force,
                                model_name=str(model_name), roofline=roofline)
    result: dict[str, Any] = {"artifact": str(artifact_dir), "model": model_name,
                              "batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens,
                              "moeforge_onnxruntime": measured}
    if compare:
        source = artifact.manifest.source
        with stages.stage(f"measuring PyTorch eager on {source}"):
            result["pytorch_eager"] = bench_torch(load_model(source).model, batch, prompt_len, new_tokens, vocab)
        with stages.stage(f"measuring transformers eager on {source}") as line:
            result["transformers_eager"] = bench_transformers(source, batch, prompt_len, new_tokens, vocab)
            line.outcome = f"skipped: {transformers_skipped(source)}" if result["transformers_eager"] is None else ""
        with stages.stage("measuring onnxruntime-genai") as line:
            result["onnxruntime_genai"] = bench_genai(artifact_dir, batch, prompt_len, new_tokens, vocab)
            line.outcome = f"skipped: {genai_skipped(artifact_dir)}" if result["onnxruntime_genai"] is None else ""
        ours = result["moeforge_onnxruntime"]["decode_tokens_per_s"]
        result["decode_speedup_vs"] = {name: round(ours / r["decode_tokens_per_s"], 2)
                                       for name in ("pytorch_eager", "transformers_eager", "onnxruntime_genai")
                                       if (r := result[name]) is not None}
    return result
