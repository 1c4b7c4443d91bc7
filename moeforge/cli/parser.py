"""The ``moeforge`` argument parser, with nothing heavy imported: ``moeforge --help``, ``--version`` and every
argument error answer before torch, ONNX or the server stack load (``moeforge.cli.main`` parses first, then imports
the command). Every numeric flag has a bounded type (``arg_types``) and is checked here, once, by the process the
user started.

The choices and defaults that live in heavy modules (compile targets, backends, the server's limits, the KV tiers'
defaults) are restated here as plain values; ``tests/cli/test_parser.py`` checks each against its source, so they
cannot drift.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from moeforge import __version__
from moeforge.cli import arg_types
from moeforge.core.host_memory import parse_size
from moeforge.core.kv_layout import DEFAULT_BLOCK_SIZE, KV_CACHE_KINDS
from moeforge.quant.schemes import ACCURACY_LEVELS, ASYM_OFFSETS, KV_CHOICES, LM_HEAD_KINDS, SCHEMES

# Restated from heavy modules (checked against them by tests/cli/test_parser.py):
TARGET_NAMES = ("ort", "trt")  # compile.targets.TARGETS
BACKEND_NAMES = ("onnxruntime", "tensorrt")  # runtime.backends.registry.BACKENDS, in order
MAX_RANKS = 1024  # compile.options.MAX_RANKS
DEFAULT_MAX_BODY_BYTES = 16 * 2**20  # serve.app
DEFAULT_HEADER_TIMEOUT_S = 10.0  # serve.connections
DEFAULT_MAX_CONNECTIONS = 1024  # serve.connections
DEFAULT_STALL_TIMEOUT_S = 60.0  # serve.streams
DEFAULT_DISK_BYTES = 16 << 30  # runtime.engine_config
OFFLOAD_DTYPES = ("native", "int8")  # runtime.kv_tiers.block_codec

NO_HUGE_PAGES_HELP = ("keep the weights on 4 KiB pages (default: the memory the session allocates goes on transparent "
                      "huge pages, Linux; faster decode, ~4 ms per MB more load time)")
SPECULATIVE_HELP = ("prompt-lookup speculative decoding: greedy requests feed up to K draft tokens per decode, "
                    "copied from where the sequence's last tokens occurred before, and the model verifies them in the "
                    "same run (at most one running request; default 0: off)")
DESCRIPTION = ("Compile LLMs into ONNX Runtime (--target ort) or TensorRT (--target trt) artifacts, run them, and "
               "check them against PyTorch. Exit codes: 0 success, 1 failed check, 2 bad input.")


class _HelpFormatter(argparse.HelpFormatter):
    """Appends each option's default to its help, unless it is None / False, the help already says it, or the
    option is a switch (store_true / store_false: its default is just "not given")."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        switch = isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction)
        if (action.option_strings and default is not None and default is not False and default is not argparse.SUPPRESS
                and "default" not in text and not switch):
            text += " (default: %(default)s)"
        return text


def _subcommand(sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str,
                text: str) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=text, description=text, formatter_class=_HelpFormatter, allow_abbrev=False)


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.replace(" ", "").split(",") if part != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids wants comma-separated integers, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    """The parser of every ``moeforge`` command (the CLI reference in the docs is generated from it)."""
    # allow_abbrev=False (here and in every subcommand): --max-new-token must not pass for --max-new-tokens.
    parser = argparse.ArgumentParser(prog="moeforge", description=DESCRIPTION, formatter_class=_HelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"moeforge {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    run = _subcommand(sub, "run", "generate text from an artifact, a checkpoint, a .gguf or a preset")
    run.add_argument("model", help="artifact directory, HF folder, .gguf file, or a preset / built-in name")
    run.add_argument("--backend", choices=["torch", *BACKEND_NAMES], default=None,
                     help="default: the artifact's target decides (onnxruntime for --target ort; tensorrt, on a CUDA "
                          "GPU, for --target trt); torch (the PyTorch reference) for checkpoints")
    run.add_argument("--threads", type=arg_types.threads, default=None, help="ONNX Runtime intra-op threads")
    run.add_argument("--micro-batches", type=arg_types.count_or_zero, default=0, metavar="M",
                      help="pipeline artifacts (--pp): split each step into M micro-batches so the stages overlap "
                           "(default 0: one per stage, none below 32 tokens)")
    run.add_argument("--no-huge-pages", action="store_true",
                     help=NO_HUGE_PAGES_HELP)
    prompt = run.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (tokenised with the model's tokenizer)")
    prompt.add_argument("--prompt-ids", type=_parse_ids, help="prompt as token ids, e.g. 1,2,3")
    run.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate at most")
    run.add_argument("--speculative-tokens", type=arg_types.count_or_zero, default=0, metavar="K",
                     help="onnxruntime artifacts: " + SPECULATIVE_HELP)
    run.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    run.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = off)")
    run.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    run.add_argument("--seed", type=int, default=None, help="seed for sampling (reproducible)")
    run.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    run.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    run.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence tokens")
    run.add_argument("--mla-impl", choices=["absorb", "naive"], default="absorb", help="MLA cache layout")
    run.add_argument("--json", action="store_true", help='print {"token_ids": [...], "text": ...}')
    run.add_argument("--json-schema", type=Path, default=None, metavar="FILE",
                     help="constrain the output to JSON valid against the JSON schema in FILE (constrained decoding, "
                          "compiled artifacts)")
    run.add_argument("--quiet", action="store_true", help="no stage lines on stderr (loading, generating)")
    run.add_argument("--expert-load-out", type=Path, default=None, metavar="FILE",
                     help="write the expert-load statistics of this run (routed tokens per MoE layer and expert, per "
                          "rank when sharded, with the artifact's sha256) as JSON at exit, for moeforge eplb")
    run.add_argument("--force", action="store_true", help="replace an existing --expert-load-out file")
    add_tier_flags(run)
    run.add_argument("--no-weight-check", dest="check_weights", action="store_false",
                     help="skip the NaN/Inf scan of the weights at load (for very large checkpoints)")

    comp = _subcommand(sub, "compile", "compile a model into an artifact directory: an ONNX Runtime graph "
                       "(--target ort) or a TensorRT engine (--target trt)")
    comp.add_argument("model", help="HF folder, .gguf file, or a preset / built-in name")
    comp.add_argument("-o", "--output", help="artifact directory to create (required unless --plan)")
    comp.add_argument("--target", choices=list(TARGET_NAMES), default="ort",
                      help="ort (an ONNX Runtime graph; runs on CPU) or trt (a TensorRT engine; runs on an "
                           "NVIDIA GPU with TensorRT)")
    comp.add_argument("--trt-impl", choices=["auto", "tensorrt", "tensorrt-rtx"], default="auto",
                      help="trt: full TensorRT (builds for the local GPU) or TensorRT-RTX (ahead of time, "
                      "no GPU needed); auto: full TensorRT if installed, else TensorRT-RTX")
    comp.add_argument("--sm", type=arg_types.int_in(10, 999), default=None,
                      help="trt: target compute capability, e.g. 89 (default: 89 with TensorRT-RTX; full "
                      "TensorRT builds for the local GPU)")
    comp.add_argument("--dtype", choices=["fp16", "bf16"], default="fp16", help="trt: engine precision (default fp16)")
    comp.add_argument("--max-batch", type=arg_types.count, default=8,
                      help="trt: largest decode batch of the engine's profile")
    comp.add_argument("--max-seq-len", type=arg_types.count, default=None,
                      help="longest sequence the artifact serves (default: min(2048, the model's limit))")
    comp.add_argument("--kv-cache", choices=KV_CACHE_KINDS, default=None,
                      help="KV-cache layout: per-sequence buffers, or block pools (paged attention); default "
                           "contiguous, paged with --pp")
    comp.add_argument("--kv-block-size", type=int, default=None,
                      help=f"tokens per KV block (--kv-cache paged; default {DEFAULT_BLOCK_SIZE}, DeepSeek-V4: the "
                           "smallest multiple of it that every compress rate divides)")
    comp.add_argument("--tp", type=arg_types.int_in(1, MAX_RANKS), default=1,
                      help="tensor-parallel ranks: write one artifact per rank (DIR/rank0 ..) and DIR/sharded.json; "
                           "run it with moeforge run/serve/parity, which start one process per rank")
    comp.add_argument("--ep", type=arg_types.int_in(1, MAX_RANKS), default=1,
                      help="expert-parallel ranks with --tp: 1 (each expert split over the ranks) or equal to --tp "
                           "(whole experts per rank)")
    comp.add_argument("--pp", type=arg_types.int_in(1, MAX_RANKS), default=1,
                      help="pipeline stages: each stage holds a contiguous range of layers (stage 0 the embedding, "
                           "the last the head); with --tp N, pp x N ranks (DIR/rank0 ..); run with moeforge run/serve/"
                           "parity/bench as --tp")
    comp.add_argument("--pp-layers", default=None, metavar="RANGES",
                      help="with --pp P: each stage's layers, e.g. 0-13,14-27 (default: balanced by weight and KV "
                           "bytes)")
    comp.add_argument("--placement", type=Path, default=None, metavar="PLAN",
                      help="with --tp N --ep N: an expert placement written by moeforge eplb (each rank holds its "
                           "slots' experts, replicas of the heaviest included; outputs equal the unsharded model's)")
    comp.add_argument("--force", action="store_true", help="replace an existing output directory")
    comp.add_argument("--check", action="store_true", help="run the parity check before publishing the artifact")
    comp.add_argument("--build-only", action="store_true",
                      help="build an artifact no moeforge backend runs yet (TensorRT paged engines, TensorRT --tp "
                           "plans) for a runtime of your own; refused without this flag")
    comp.add_argument("--quiet", action="store_true",
                      help="no progress bar and no pass lines: only the parity verdict and where it wrote")
    comp.add_argument("--quant", choices=list(SCHEMES), default=None,
                      help="quantisation (default fp32): " + "; ".join(f"{s.name}: {s.help}" for s in SCHEMES.values()))
    comp.add_argument("--block-size", type=arg_types.count, default=None,
                      help="quantisation block along the input dimension, a power of two 16..256 that divides "
                           "it (default: int4 32, fp8 128, int8 per channel)")
    comp.add_argument("--calib", type=Path, default=None,
                      help="calibration text file, one prompt per line (UTF-8), tokenised with the model's "
                           "tokenizer; needed by int4-awq, w8a8, --keep-fp and --kv-quant")
    comp.add_argument("--calib-method", choices=["minmax", "percentile"], default=None,
                      help="w8a8: activation range per tensor, max |x| (default) or a percentile of |x|")
    comp.add_argument("--percentile", type=float, default=None, metavar="P",
                      help="w8a8 --calib-method percentile: the percentile of |x|, 50 < P <= 100 (default 99.99)")
    comp.add_argument("--smooth-alpha", type=float, default=None, metavar="A",
                      help="w8a8: SmoothQuant migration strength 0..1 (default 0.5, w8a8-fp8 0; 0 = off)")
    comp.add_argument("--act-keep-fp32", default=None, metavar="PATTERNS",
                      help="w8a8: comma-separated weight-name patterns whose MatMul activations stay fp32 "
                           "(default down_proj, where Llama-style models put massive activations; w8a8-fp8 and "
                           "'': none)")
    comp.add_argument("--kv-quant", choices=KV_CHOICES, default=None,
                      help="int8: KV cache stored as int8 with per-head scales calibrated on --calib, read and "
                           "written by GroupQueryAttention (4x smaller than fp32; works with or without --quant) "
                           "(default: the activations' type)")
    comp.add_argument("--lm-head", choices=LM_HEAD_KINDS, default=None,
                      help="precision of the LM head under --quant (default: int8 for int4 schemes, which costs "
                           "decode speed but keeps top-1 agreement; otherwise the scheme's own)")
    comp.add_argument("--accuracy-level", type=int, choices=list(ACCURACY_LEVELS), default=None,
                      help="ONNX Runtime MatMulNBits/QMoE compute type: "
                           + "; ".join(f"{level} = {what}" for level, what in ACCURACY_LEVELS.items())
                           + " (default: 4; ONNX Runtime's levels 1-3 compute in fp32 on CPU, like 0)")
    comp.add_argument("--asym-offsets", choices=list(ASYM_OFFSETS), default=None,
                      help="int4-asym / int8-asym on ONNX Runtime: "
                           + "; ".join(f"{name} = {what}" for name, what in ASYM_OFFSETS.items())
                           + " (default: exact)")
    comp.add_argument("--no-weight-check", dest="check_weights", action="store_false",
                      help="skip the NaN/Inf scan of the weights at load (for very large checkpoints)")
    comp.add_argument("--plan", action="store_true",
                      help="print what the compile would write and need (per-rank parameters and bytes, the streamed "
                           "compile's peak memory, a time estimate) from the config alone, and exit: no weights read")
    comp.add_argument("--max-memory", type=size_argument, metavar="SIZE",
                      help="memory the compile may use (3GiB, 3G, 3000MB; default: the container's limit, else the "
                           "physical memory): a compile whose plan exceeds it is refused before any weight is read")
    comp.add_argument("--stream", action=argparse.BooleanOptionalAction, default=None,
                      help="streamed compile (HF safetensors folders): the model is traced without its weights and "
                           "each weight (with --tp: each rank's slice) is read, transformed and written one at a "
                           "time, so memory stays far below the weights' size; --check runs PyTorch one layer at a "
                           "time; --calib and --target trt map the weights from disk. The default for an HF "
                           "folder; --no-stream loads the model whole")
    comp.add_argument("--workers", type=arg_types.int_in(1, MAX_RANKS), default=1, metavar="N",
                      help="with --stream --tp: build N ranks at once, each in its own process (memory: N x the "
                           "plan's per-rank peak, checked against --max-memory)")
    comp.add_argument("--no-argmax-head", dest="argmax_head", action="store_false",
                      help="leave a float32 LM head as one MatMul: no int8 copy for greedy steps (the certified "
                           "argmax head costs V x H bytes more and makes plain greedy decoding ~10%% faster)")
    comp.add_argument("--keep-fp", type=float, default=0.0, metavar="FRACTION",
                      help="keep this fraction of weights, the most quantisation-sensitive on --calib, in fp32")

    insp = _subcommand(sub, "inspect", "print an artifact's manifest, op counts and KV bytes per token")
    insp.add_argument("artifact", help="artifact directory")
    insp.add_argument("--json", action="store_true", help="print the manifest as JSON")
    insp.add_argument("--no-verify", action="store_true", help="skip checking file hashes")

    par = _subcommand(sub, "parity", "compare an artifact with the PyTorch model, teacher-forced (ONNX Runtime), "
                      "or a TensorRT artifact's engine with its golden logits (--backend tensorrt, GPU)")
    par.add_argument("artifact", help="artifact directory")
    par.add_argument("--model", help="the model to compare with (default: the artifact's source)")
    par.add_argument("--prompt-len", type=arg_types.count, default=16, help="tokens of the random prompt")
    par.add_argument("--steps", type=arg_types.count_or_zero, default=16, help="decode steps after the prefill")
    par.add_argument("--seed", type=arg_types.seed, default=0, help="seed of the random prompt")
    par.add_argument("--per-layer", action="store_true",
                     help="also compare every decoder layer's output and name the first that diverges")
    par.add_argument("--backend", choices=list(BACKEND_NAMES), default="onnxruntime",
                     help="tensorrt: run the artifact's engine (GPU) on its golden inputs and compare")
    par.add_argument("--reference", choices=["torch", "transformers"], default="torch",
                     help="what the artifact is compared with: moeforge's PyTorch model, or Hugging Face transformers "
                          "running the source checkpoint (an independent implementation: also proves the checkpoint "
                          "and its config were read as transformers reads them)")
    par.add_argument("--stream", action="store_true",
                     help="for a model larger than memory (Hugging Face folder): the artifact generates first, then "
                          "PyTorch runs once over those tokens with one decoder layer in memory at a time")
    par.add_argument("--json", action="store_true",
                     help="print the report as JSON: the aggregates, the thresholds applied, each step's row and the "
                          "verdict (with --per-layer, each layer's row); numbers that are not finite as null")
    par.add_argument("--quiet", action="store_true",
                     help="no stage lines or progress bars on stderr (loading, the reference run, comparing)")
    par.add_argument("--no-weight-check", dest="check_weights", action="store_false",
                     help="skip the NaN/Inf scan of the weights at load (for very large checkpoints)")

    bench = _subcommand(sub, "bench", "prefill/decode tokens/s, TTFT, RSS; compared with PyTorch, "
                        "transformers and onnxruntime-genai on the same work (benchmarks/genai_builder.py: "
                        "against GenAI's own builder models and llama.cpp)")
    bench.add_argument("artifact", help="artifact directory")
    bench.add_argument("--batch", type=arg_types.count, default=1, help="concurrent requests")
    bench.add_argument("--prompt-len", type=arg_types.count, default=64, help="prompt tokens per request")
    bench.add_argument("--new-tokens", type=arg_types.int_in(2, arg_types.INT32_MAX), default=64,
                       help="generated tokens per request")
    bench.add_argument("--threads", type=arg_types.threads, default=None, help="ONNX Runtime intra-op threads")
    bench.add_argument("--micro-batches", type=arg_types.count_or_zero, default=0, metavar="M",
                        help="pipeline artifacts (--pp): split each step into M micro-batches so the stages overlap "
                             "(default 0: one per stage, none below 32 tokens)")
    bench.add_argument("--no-compare", action="store_true", help="measure only moeforge")
    bench.add_argument("--speculative-tokens", type=arg_types.count_or_zero, default=0, metavar="K",
                       help=SPECULATIVE_HELP)
    bench.add_argument("--json", action="store_true", help="print the whole result as JSON")
    bench.add_argument("--quiet", action="store_true", help="no stage lines on stderr (each runtime as it is measured)")
    bench.add_argument("--expert-load-out", type=Path, default=None, metavar="FILE",
                     help="write the expert-load statistics of this run (routed tokens per MoE layer and expert, per "
                          "rank when sharded, with the artifact's sha256) as JSON at exit, for moeforge eplb")
    bench.add_argument("--force", action="store_true", help="replace an existing --expert-load-out file")
    bench.add_argument("--roofline", action="store_true",
                       help="measure decode against the memory roofline: the bytes a step reads (weights, the "
                            "experts its routing computed, the head, the KV cache) over this machine's read bandwidth, "
                            "probed in the same run (a short probe before and after the timed steps; each one's best "
                            "and median are reported), and the fraction achieved; a fraction above 1 re-probes once "
                            "and, if it persists, is not printed: the reason says whether the bandwidth or the byte "
                            "count is likely wrong")
    bench.add_argument("--remeasure-bandwidth", action="store_true",
                       help="--roofline: make the probe before the timed steps the full one (a larger buffer, more "
                            "rounds), and let it replace the cached number in ~/.cache/moeforge (the one "
                            "--cached-bandwidth uses)")
    bench.add_argument("--cached-bandwidth", action="store_true",
                       help="--roofline: skip the probes and use the cached read bandwidth (probed in full and cached "
                            "when there is none), reported with its age and conditions; a fraction above 1 still "
                            "re-probes once")
    bench.add_argument("--save", action="store_true",
                       help="also write benchmarks/results/bench_<model>_b<B>.json, relative to the current folder "
                            "(the path written is printed)")
    bench.add_argument("--multi-turn", action="store_true",
                       help="paged artifacts: a multi-turn chat workload (conversations sharing system prompts, each "
                            "turn resending its history) with the KV tiers given, against the pool alone: prefill "
                            "tokens computed, TTFT p50/p99, throughput, identical outputs")
    bench.add_argument("--conversations", type=arg_types.count, default=32, help="--multi-turn: conversations")
    bench.add_argument("--turns", type=arg_types.count, default=4, help="--multi-turn: turns per conversation")
    bench.add_argument("--kv-blocks", type=arg_types.count, default=None,
                       help="KV-cache blocks of the pool (--multi-turn default: a quarter of the workload's prefixes)")
    add_tier_flags(bench)

    cfg = _subcommand(sub, "config", "print a model's config, parameter count and KV bytes per token")
    cfg.add_argument("model", help="HF folder, .gguf file, or a preset name (full-size presets included)")
    cfg.add_argument("--json", action="store_true",
                     help="print the config, the parameter count and the KV-cache values and bytes per token as JSON")

    srv = _subcommand(sub, "serve", "serve an artifact over an OpenAI-compatible HTTP API (/v1/completions, "
                      "/v1/chat/completions, /v1/models, /health, /metrics) until SIGTERM")
    srv.add_argument("artifact", help="artifact directory")
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    srv.add_argument("--port", type=arg_types.port, default=8000, help="TCP port")
    srv.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer KEY' on /v1/* (default: $MOEFORGE_API_KEY, which keeps "
                          "the key out of the process list; no authentication if neither is set)")
    srv.add_argument("--max-num-seqs", type=arg_types.count, default=8, help="requests in the running batch at most")
    srv.add_argument("--max-queued", type=arg_types.count_or_zero, default=256,
                     help="requests that may wait beyond the running ones; more get 429 with Retry-After")
    srv.add_argument("--max-num-batched-tokens", type=arg_types.count, default=512,
                     help="tokens per engine step at most")
    srv.add_argument("--max-body-bytes", type=size_argument, default=DEFAULT_MAX_BODY_BYTES, metavar="SIZE",
                     help="a request body larger than this gets 413 before it is parsed (default: %(default)s)")
    srv.add_argument("--header-timeout", type=arg_types.timeout_s, default=DEFAULT_HEADER_TIMEOUT_S,
                     help="seconds a connection has to send its request line and headers, then it is closed "
                          "(default: %(default)s)")
    srv.add_argument("--max-connections", type=arg_types.count, default=DEFAULT_MAX_CONNECTIONS,
                     help="open connections at most; more are closed unanswered (default: %(default)s, and never "
                          "more than the open-file limit allows)")
    srv.add_argument("--stall-timeout", type=arg_types.timeout_s, default=DEFAULT_STALL_TIMEOUT_S,
                     help="seconds a client may read nothing of its stream while its requests produce; then they "
                          "are aborted and their KV blocks freed (default: %(default)s)")
    srv.add_argument("--kv-blocks", type=arg_types.count, default=None,
                     help="KV-cache blocks (default: every running request can reach max_seq_len)")
    add_tier_flags(srv)
    srv.add_argument("--threads", type=arg_types.threads, default=None, help="ONNX Runtime intra-op threads")
    srv.add_argument("--micro-batches", type=arg_types.count_or_zero, default=0, metavar="M",
                      help="pipeline artifacts (--pp): split each step into M micro-batches so the stages overlap "
                           "(default 0: one per stage, none below 32 tokens)")
    srv.add_argument("--speculative-tokens", type=arg_types.count_or_zero, default=0, metavar="K",
                     help=SPECULATIVE_HELP)
    srv.add_argument("--no-huge-pages", action="store_true",
                     help=NO_HUGE_PAGES_HELP)
    srv.add_argument("--chat-template", type=Path, default=None,
                     help="Jinja chat template file to use instead of the tokenizer's")
    srv.add_argument("--served-model-name", default=None,
                     help="the model name clients pass (default: the artifact directory's name)")
    srv.add_argument("--shutdown-timeout", type=arg_types.int_in(0, int(arg_types.MAX_TIMEOUT_S)), default=30,
                     help="seconds in-flight requests may run on after SIGTERM before they are aborted")
    srv.add_argument("--profile-steps", type=arg_types.count_or_zero, default=0,
                     help="profile the first N engine steps for moeforge:attention_time_share (0 = off)")
    srv.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"], default="info",
                     help="uvicorn's log level")
    srv.add_argument("--expert-load-out", type=Path, default=None, metavar="FILE",
                     help="write the expert-load statistics of the requests served (routed tokens per MoE layer and "
                          "expert, per rank when sharded, with the artifact's sha256) as JSON at exit, for eplb")
    srv.add_argument("--force", action="store_true", help="replace an existing --expert-load-out file")

    eplb = _subcommand(sub, "eplb", "plan expert placement with redundant experts from measured expert load (EPLB) "
                       "and report the predicted per-rank imbalance against contiguous and round-robin placement")
    eplb.add_argument("stats", help="expert-load statistics: JSON {\"layers\": [[load per expert], ...]} (or a plain "
                      "2-D list), or a scrape of the server's /metrics (moeforge:expert_routed_tokens_total)")
    eplb.add_argument("-o", "--output", required=True, type=Path, help="plan file to write (JSON)")
    eplb.add_argument("--force", action="store_true", help="replace an existing plan file")
    eplb.add_argument("--ep", type=int, required=True, help="expert-parallel ranks")
    eplb.add_argument("--redundant", type=int, required=True, metavar="R",
                      help="spare expert slots per MoE layer, over all ranks together (not per rank): each layer has "
                           "experts + R slots, (experts + R) / --ep on each rank, so experts + R must divide by --ep; "
                           "S spare slots on each rank is --redundant S x --ep (32 experts, --ep 4, 2 per rank: "
                           "--redundant 8)")
    eplb.add_argument("--nodes", type=int, default=1, help="nodes the ranks span (must divide --ep)")
    eplb.add_argument("--groups", type=int, default=None,
                      help="the model's expert groups (n_group; 1 if it has none): with --groups divisible by "
                           "--nodes, each group stays on one node (default: what the statistics record, else 1)")
    eplb.add_argument("--json", action="store_true", help="print the per-layer imbalance as JSON")
    return parser


def size_argument(text: str) -> int:
    """An argparse type for sizes such as 512M or 2G: whole bytes, 1 byte to 1 PiB (``core/host_memory.parse_size``;
    ``1.5G`` is whole bytes, ``0.5`` is refused rather than rounded to 0, which would mean "none")."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_tier_flags(parser: argparse.ArgumentParser) -> None:
    """``--kv-host-bytes``, ``--kv-disk-dir``, ``--kv-disk-bytes``, ``--kv-offload-dtype`` (paged artifacts)."""
    group = parser.add_argument_group("KV-cache tiers (paged artifacts: prefix blocks evicted from the pool are "
                                      "kept below it and promoted back instead of recomputed)")
    group.add_argument("--kv-host-bytes", type=size_argument, default=0, metavar="SIZE",
                       help="L2: host memory for evicted KV blocks, e.g. 2G (default 0: none)")
    group.add_argument("--kv-disk-dir", type=Path, default=None, metavar="DIR",
                       help="L3: a directory for KV blocks, kept across restarts and shared by servers of the same "
                            "artifact; a clean shutdown writes every cached block there. Blocks are authenticated "
                            "with the key file $MOEFORGE_KV_DISK_KEY (default: a per-user key in the moeforge cache "
                            "folder); servers of several users or machines sharing DIR need the same key file")
    group.add_argument("--kv-disk-bytes", type=size_argument, default=DEFAULT_DISK_BYTES, metavar="SIZE",
                       help="most bytes the L3 directory holds for this artifact (least recently used out first; "
                            "default %(default)s bytes)")
    group.add_argument("--kv-offload-dtype", choices=OFFLOAD_DTYPES, default="native",
                       help="how L2/L3 store blocks: native (bit for bit) or int8 (4x smaller than fp32, lossy)")
