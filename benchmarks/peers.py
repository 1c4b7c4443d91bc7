"""moeforge side by side with peer runtimes on the same checkpoint: onnxruntime-genai running models made by its
own builder, and llama.cpp (llama-cpp-python) on a GGUF, timed in alternating rounds in one process.

``benchmarks/genai_builder.py ARTIFACT`` and ``benchmarks/genai_compare.py`` drive it:

* ``checkpoint_folder``: the Hugging Face folder GenAI's builder reads, from the artifact's source checkpoint
  (an HF folder as it is; a GGUF dequantised to fp32 by transformers first: the builder reads only fp16/fp32
  GGUFs); ``ensure_peer_models`` runs the builder once per precision into a cache folder;
* runners (``MoeforgeRunner``, ``GenaiRunner``, ``LlamaCppRunner``): one system at one batch size, loaded once;
  ``run_rounds`` warms them up and times greedy decode (TTFT, tokens/s after the first token) and, at batch 1,
  prefill, the order rotating from round to round; ``summarize`` gives medians, same-run ratios and how many
  leading greedy tokens each system shares with the first moeforge one; ``markdown`` renders both tables.

onnxruntime-genai and llama-cpp-python are optional: imported only by their runners.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import onnx
import torch
from gguf import GGUFReader, LlamaFileType
from timer import Rounds, Stopwatch

from moeforge.cli.bench import _prompts
from moeforge.core.artifact import load_artifact
from moeforge.core.errors import MoeforgeError
from moeforge.runtime.engine import BackendOptions, EngineConfig, LLMEngine, SchedulingOptions, SpeculativeOptions
from moeforge.runtime.sampler import SamplingParams

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


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def convert_gguf_to_hf(gguf: Path, out: Path) -> Path:
    """A Hugging Face folder (fp32 safetensors, config, tokenizer) of ``gguf``'s weights, dequantised by
    transformers; reused when ``out/config.json`` exists. GenAI's builder reads HF folders (and only fp16/fp32
    GGUFs), so this is its input."""
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer  # optional here: only a GGUF source needs it

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # transformers marks a GGUF-loaded model as "quantised" and refuses to save it; the tensors are plain fp32.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    with _staged(out) as staging:
        model.save_pretrained(str(staging))
        AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(staging))
    return out


@contextmanager
def _staged(out: Path) -> Iterator[Path]:
    """A scratch folder beside ``out`` that becomes ``out`` when the block completes (replacing an incomplete
    one) and is removed when it raises: an interrupted build leaves no folder that looks finished."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        yield staging
        shutil.rmtree(out, ignore_errors=True)
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


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
    if importlib.util.find_spec("onnxruntime_genai") is None:
        raise MoeforgeError("onnxruntime-genai is not installed (its builder makes the peer models): "
                            "pip install onnxruntime-genai, or the dev extra")
    log = out.parent / f"{out.name}.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with _staged(out) as staging, log.open("w") as handle:
        done = subprocess.run(builder_command(hf_dir, staging, name, cache_dir), stdout=handle,
                              stderr=subprocess.STDOUT, env=env, check=False)
        if done.returncode != 0:
            raise MoeforgeError(f"the GenAI builder failed ({done.returncode}) for {name}: see {log}")
    return out


def checkpoint_folder(source: Path, converted: Path) -> Path:
    """The Hugging Face folder of checkpoint ``source`` that GenAI's builder reads: an HF folder (``config.json``)
    as it is; a GGUF converted into ``converted`` (``convert_gguf_to_hf``, once)."""
    if source.is_dir() and (source / "config.json").is_file():
        return source
    if source.is_file() and source.suffix == ".gguf":
        return convert_gguf_to_hf(source, converted)
    raise ValueError(f"{source}: GenAI's builder needs the checkpoint the artifact was compiled from, a Hugging Face "
                     "folder or a GGUF file; this is neither (a built-in tiny model has no checkpoint)")


def ensure_peer_models(work_dir: Path, source: Path, names: Sequence[str] = GENAI_PRECISIONS) -> dict[str, Path]:
    """``{name: GenAI model dir}`` for names of ``GENAI_BUILDS``, built into ``work_dir/genai_<name>`` on first
    use from checkpoint ``source`` (a GGUF is converted into ``work_dir/hf`` first; ``checkpoint_folder``)."""
    hf_dir = checkpoint_folder(source, work_dir / "hf")
    return {n: build_genai_model(hf_dir, work_dir / f"genai_{n}", n, work_dir / "cache_dir") for n in names}


def gguf_type_name(gguf: Path) -> str:
    """A GGUF's weight type as llama.cpp names it (``Q4_1``, ``Q8_0``, ``F16``; ``GGUF`` when unrecorded)."""
    field = GGUFReader(str(gguf)).fields.get("general.file_type")  # maps the file; reads only the metadata
    if field is None:
        return "GGUF"
    value = int(field.parts[field.data[0]][0])
    try:
        return LlamaFileType(value).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except ValueError:
        return f"type {value}"


def describe_onnx(path: Path) -> dict[str, Any]:
    """What a graph contains: op counts, the MatMulNBits settings, whether the LM head is quantised and
    whether Q/K/V are one projection."""
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

    @classmethod
    def timed(cls, first_s: float, end_s: float, rows: int, new_tokens: int, row0: list[int]) -> DecodeRun:
        """From the seconds to the first token and to the last (of every row), for ``rows`` rows."""
        return cls(first_s, rows * (new_tokens - 1) / (end_s - first_s), row0)


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
    speculative_tokens: int = 0  # EngineConfig.speculative_tokens
    engine: LLMEngine = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.engine = LLMEngine.from_artifact(self.artifact, EngineConfig(
            scheduling=SchedulingOptions(max_num_seqs=self.batch, max_num_batched_tokens=self.max_batched_tokens),
            backend=BackendOptions(threads=self.threads),
            speculative=SpeculativeOptions(tokens=self.speculative_tokens)))

    def _run(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, float, list[int]]:
        """Seconds until every row has its first token, seconds until the last, row 0's tokens."""
        params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
        watch = Stopwatch()
        ids = [self.engine.add_request(p, params) for p in prompts]
        first_at, started, row0 = None, set(), []
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.token_ids:
                    started.add(out.request_id)
                if out.finished and out.request_id == ids[0]:
                    row0 = list(out.token_ids)
            if first_at is None and len(started) == len(prompts):
                first_at = watch.elapsed()
        end = watch.elapsed()
        assert first_at is not None and len(row0) == new_tokens, (len(row0), new_tokens)
        return first_at, end, row0

    def decode(self, prompts: list[list[int]], new_tokens: int) -> DecodeRun:
        first, end, row0 = self._run(prompts, new_tokens)
        return DecodeRun.timed(first, end, len(prompts), new_tokens, row0)

    def prefill(self, prompt: list[int]) -> float:
        first, _, _ = self._run([prompt], 1)
        return len(prompt) / first


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
        import onnxruntime_genai as og  # optional (dev) dependency

        length = len(prompts[0]) + new_tokens
        params = og.GeneratorParams(self.model)
        params.set_search_options(max_length=length, min_length=length, batch_size=len(prompts), do_sample=False)
        return og.Generator(self.model, params)

    def decode(self, prompts: list[list[int]], new_tokens: int) -> DecodeRun:
        watch = Stopwatch()
        generator = self._generator(prompts, new_tokens)
        generator.append_tokens(np.array(prompts, dtype=np.int32))
        generator.generate_next_token()
        first = watch.elapsed()
        while not generator.is_done():
            generator.generate_next_token()
        end = watch.elapsed()
        row0 = [int(t) for t in generator.get_sequence(0)][len(prompts[0]):]
        assert len(row0) == new_tokens, (len(row0), new_tokens)
        return DecodeRun.timed(first, end, len(prompts), new_tokens, row0)

    def prefill(self, prompt: list[int]) -> float:
        watch = Stopwatch()
        generator = self._generator([prompt], 1)
        generator.append_tokens(np.array([prompt], dtype=np.int32))
        generator.generate_next_token()
        return len(prompt) / watch.elapsed()


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
        watch = Stopwatch()
        token = self._next(prompts[0])
        first = watch.elapsed()
        row0 = [token]
        for _ in range(new_tokens - 1):
            token = self._next([token])
            row0.append(token)
        end = watch.elapsed()
        return DecodeRun.timed(first, end, 1, new_tokens, row0)

    def prefill(self, prompt: list[int]) -> float:
        self.llm.reset()
        watch = Stopwatch()
        self._next(prompt)
        return len(prompt) / watch.elapsed()


def artifact_label(artifact: Path) -> tuple[str, str]:
    """(label, weight kind) of a moeforge artifact: ``moeforge int4-asym`` / ``int4``, ``moeforge fp32`` / ``fp32``;
    ``--asym-offsets digit`` artifacts are ``moeforge int4-asym digit``."""
    quant = load_artifact(artifact, verify=False).manifest.quantization
    if not quant:
        return "moeforge fp32", "fp32"
    offsets = " digit" if quant.get("asym_offsets") == "digit" else ""
    return f"moeforge {quant['scheme']}{offsets}", str(quant.get("weights", quant["scheme"]))


def make_runners(artifacts: Sequence[Path], genai_models: dict[str, Path], gguf: Path | None,
                 batches: Sequence[int], prompt_len: int, prefill_len: int,
                 threads: int | None, llama_threads: int | None = None,
                 speculative_tokens: int = 0) -> tuple[list[Runner], dict[str, Any]]:
    """Load every system once per batch size; returns the runners and ``{system: info}`` (its kind, what it
    runs, why it is missing). ``gguf``: also llama.cpp on that file, labelled by its weight type (``llama.cpp
    Q4_1``); ``llama_threads`` (default ``threads``) is llama.cpp's thread count. ``speculative_tokens``: each
    artifact also with prompt-lookup speculative decoding (``EngineConfig.speculative_tokens``), at batch 1
    (where the engine uses it), as a system of its own."""
    llama_threads = llama_threads or threads or usable_cores()
    runners: list[Runner] = []
    info: dict[str, Any] = {}
    for artifact in artifacts:
        label, weights = artifact_label(artifact)
        info[label] = {"system": "moeforge", "artifact": str(artifact), "weights": weights,
                       "scheme": label.removeprefix("moeforge ")}
        for batch in batches:
            runners.append(MoeforgeRunner(label, artifact, batch, max(batch * prompt_len, prefill_len), threads))
        if speculative_tokens and 1 in batches:
            spec_label = f"{label} + prompt lookup k={speculative_tokens}"
            info[spec_label] = {**info[label], "speculative_tokens": speculative_tokens}
            runners.append(MoeforgeRunner(spec_label, artifact, 1, max(prompt_len, prefill_len), threads,
                                          speculative_tokens))
    for name, model_dir in genai_models.items():
        label = f"genai-builder {name}"
        info[label] = {"system": "onnxruntime-genai", "model_dir": str(model_dir), "weights": GENAI_BUILDS[name][0],
                       "graph": describe_onnx(model_dir / "model.onnx")}
        runners.extend(GenaiRunner(label, model_dir, batch, threads) for batch in batches)
    if gguf is not None:
        weights = gguf_type_name(gguf)
        label = f"llama.cpp {weights}"
        info[label] = {"system": "llama.cpp", "gguf": str(gguf), "weights": weights, "batches": [1],
                       "threads": llama_threads,
                       "note": "batch 1 only (llama-cpp-python's high-level API runs one sequence)"}
        try:
            import llama_cpp  # optional: built from source, not a dependency

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
    the same random prompts within a round (``moeforge.cli.bench._prompts``), new ones each round, so that no
    prefix cache (moeforge's paged artifacts have one) serves a prompt from an earlier round."""
    for runner in runners:  # warm-up: first-run allocations, thread pools
        runner.decode(_prompts(vocab, runner.batch, prompt_len, seed=10_000), 4)
        if runner.batch == 1:
            runner.prefill(_prompts(vocab, 1, prefill_len, seed=10_001)[0])
    time.sleep(SETTLE_S)
    records: list[dict[str, Any]] = []
    for r, order in Rounds(rounds).orders(runners):
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
        stats: dict[str, float] = {m: round(statistics.median(r[m] for r in mine), 2)
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
        llama = [peer for peer, i in info.items() if i["system"] == "llama.cpp"]
        candidates = (f"genai-builder {mine['weights']}", f"genai-builder {mine['scheme']}", *llama)
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
    ratios = {name: value for name, value in ratios.items() if value is not None}  # a system absent at a batch
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


def builder_commands(hf_dir: Path, genai_models: dict[str, Path], work_dir: Path) -> dict[str, str]:
    """``{name: the builder command line}`` that made each of ``genai_models`` (for the results)."""
    return {n: " ".join(["python", *builder_command(hf_dir, d, n, work_dir / "cache_dir")[1:]])
            for n, d in genai_models.items()}


def public_records(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``run_rounds``' records without their generated ids (kept for ``summarize`` only)."""
    return [{k: v for k, v in r.items() if k != "row0"} for r in records]


def genai_builds_for(artifact: Path) -> list[str]:
    """The GenAI builder precision to set against an artifact: int4 for int4 weights (any int4 scheme), else fp32."""
    _, weights = artifact_label(artifact)
    return ["int4"] if weights.startswith("int4") else ["fp32"]


def default_peer_dir(source: Path) -> Path:
    """Where builder outputs for checkpoint ``source`` are cached: ``$MOEFORGE_PEER_DIR`` or
    ``~/.cache/moeforge/peers``, one folder per checkpoint."""
    root = Path(os.environ.get("MOEFORGE_PEER_DIR", Path.home() / ".cache" / "moeforge" / "peers"))
    return root / (source.stem if source.is_file() else source.resolve().name)


def compare_with_genai_builder(artifact: Path, *, batches: Sequence[int] = (1,), rounds: int = 3,
                               prompt_len: int = 8, new_tokens: int = 128, prefill_len: int = 512,
                               threads: int | None = None, genai: Sequence[str] | None = None,
                               peer_dir: Path | None = None, llama: bool = True,
                               log: bool = True, speculative_tokens: int = 0) -> dict[str, Any]:
    """``artifact`` against GenAI's builder models of its own source checkpoint (``genai``: precisions of
    ``GENAI_BUILDS``, default ``genai_builds_for``) and, when the source is a GGUF and llama-cpp-python is
    installed, llama.cpp on it: ``rounds`` alternating rounds in this process, every system with ``threads``
    intra-op threads (default: the usable cores for all; left to its own default, onnxruntime-genai takes fewer
    here); ``speculative_tokens``: see ``make_runners``.
    Returns the settings, the systems, ``summarize``'s medians / ratios / greedy agreement, the markdown
    and every measurement."""
    threads = threads or usable_cores()
    manifest = load_artifact(artifact).manifest
    source = Path(manifest.source)
    names = list(genai) if genai is not None else genai_builds_for(artifact)
    unknown = [n for n in names if n not in GENAI_BUILDS]
    if unknown:
        raise ValueError(f"unknown GenAI builds {unknown}; choose from {sorted(GENAI_BUILDS)}")
    folder = peer_dir or default_peer_dir(source)
    hf_dir = checkpoint_folder(source, folder / "hf")
    genai_models = ensure_peer_models(folder, hf_dir, names)
    gguf = source if llama and source.suffix == ".gguf" and source.is_file() else None
    batches = sorted(set(batches))
    runners, info = make_runners([artifact], genai_models, gguf, batches, prompt_len, prefill_len, threads,
                                 speculative_tokens=speculative_tokens)
    vocab = int(manifest.model_config["vocab_size"])
    records = run_rounds(runners, rounds, prompt_len, new_tokens, prefill_len, vocab, log=log)
    summary = summarize(records, info)
    return {"artifact": str(artifact), "source": str(source), "peer_dir": str(folder), "rounds": rounds,
            "batches": batches, "prompt_len": prompt_len, "new_tokens": new_tokens, "prefill_len": prefill_len,
            "threads": threads, "builder_commands": builder_commands(hf_dir, genai_models, folder),
            "systems": info, **summary, "markdown": markdown(summary, batches, prefill_len),
            "records": public_records(records)}
