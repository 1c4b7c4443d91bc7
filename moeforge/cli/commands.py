"""The ``moeforge`` command line. Exit codes: 0 success, 1 failed check, 2 bad input."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm import tqdm

from moeforge.cli import main as main  # re-exported: `from moeforge.cli.commands import main` keeps working
from moeforge.cli.bench import bench_engine, run_bench, write_result
from moeforge.cli.inspect import summarize, summarize_sharded
from moeforge.cli.json_output import to_json
from moeforge.cli.kv_tier_flags import cache_options
from moeforge.cli.multi_turn import bench_multi_turn
from moeforge.cli.preflight import ArtifactShape, check_bench, check_engine_config, check_parity, read_shape
from moeforge.compile.driver import CompileOptions, ParityCheckFailed, compile_model
from moeforge.compile.options import check_flags
from moeforge.compile.plan import check_compile, kv_plan_lines, plan_compile
from moeforge.compile.sharded_compile import is_sharded, load_rank, rank_dir, read_sharded
from moeforge.core.artifact import load_artifact, restore_interrupted
from moeforge.core.bandwidth import usable_cores
from moeforge.core.errors import GroupArtifactError, MoeforgeError
from moeforge.core.manifest import Manifest
from moeforge.core.ort_session import UNPACKED_WEIGHTS
from moeforge.core.progress import StageLog, ticking
from moeforge.core.run_bandwidth import RunBandwidth
from moeforge.core.safe_paths import check_output_file, expand_user
from moeforge.core.strict_json import read_regular_file
from moeforge.model.lazy_weights import check_streamable, open_lazy_model
from moeforge.model.loader import LoadedModel, load_config, load_model, resolve_source
from moeforge.model.tokenizer import Tokenizer
from moeforge.parallel.eplb import check_plan_args, read_stats, rebalance, round_robin, write_plan
from moeforge.parallel.launch import (
    World,
    check_sharded_target,
    open_rank_session,
    rank_worker,
    run_worker,
    sharded_backend,
    start_world,
)
from moeforge.runtime.backends.registry import BackendSpec, backend_for, backend_named
from moeforge.runtime.engine import BackendOptions, EngineConfig, LLMEngine, SchedulingOptions, SpeculativeOptions
from moeforge.runtime.expert_stats import check_expert_load_out, save_expert_load
from moeforge.runtime.request import check_room, prompt_token_ids
from moeforge.runtime.roofline import format_roofline
from moeforge.runtime.sampler import SamplingParams
from moeforge.runtime.structured_output import StructuredOutput, StructuredOutputError
from moeforge.serve import ServeOptions, serve
from moeforge.serve.listener import bind_listeners
from moeforge.serve.runner import engine_config, model_name, server_config
from moeforge.verify.generate import generate_stream
from moeforge.verify.golden import check_engine
from moeforge.verify.parity import (
    TorchReference,
    compare_with_reference,
    default_prompt,
    layer_table,
    run_layer_parity,
    streamed_parity,
    torch_hidden_states,
    torch_reference,
)
from moeforge.verify.transformers_reference import load_transformers_model, transformers_reference

EXIT_OK, EXIT_CHECK_FAILED, EXIT_BAD_INPUT = 0, 1, 2
def run_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run the parsed command ``args.command``; a user error (``MoeforgeError``) is printed and exits 2."""
    commands = {"run": _cmd_run, "config": _cmd_config, "compile": _cmd_compile, "inspect": _cmd_inspect,
                "parity": _cmd_parity, "bench": _cmd_bench, "serve": _cmd_serve,
                "eplb": _cmd_eplb}
    try:
        if args.command in commands:
            code = commands[args.command](args)
            sys.stdout.flush()  # here, not at exit: a closed pipe is handled below
            return code
    except BrokenPipeError:
        # The reader went away (`moeforge inspect DIR | head`): what it wanted was written. Point stdout at
        # /dev/null so the interpreter's final flush cannot fail again (Python docs, "Note on SIGPIPE").
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except MoeforgeError as exc:
        if not (isinstance(exc, GroupArtifactError) and os.environ.get("RANK", "0") != "0"):  # rank 0 speaks for all
            print(f"moeforge {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    parser.error(f"unknown command {args.command}")
    return EXIT_BAD_INPUT


def _is_artifact(path: str) -> bool:
    restore_interrupted(path)  # a compile killed mid-replace left the artifact aside: put it back first
    return (Path(path) / "manifest.json").is_file() or is_sharded(path)


# ``moeforge run``'s flags by the SamplingParams field each sets: errors name what the user typed.
RUN_FLAGS = {"max_tokens": "--max-new-tokens", "temperature": "--temperature", "top_k": "--top-k",
             "top_p": "--top-p", "seed": "--seed"}


def _sampling_params(args: argparse.Namespace, vocab_size: int, prompt_len: int, limit: int, limit_name: str,
                     stop_token_ids: tuple[int, ...] = ()) -> SamplingParams:
    """The run's SamplingParams, checked up front by the rules the engine and the reference apply, in flag names."""
    params = SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, ignore_eos=args.ignore_eos,
                            stop_token_ids=stop_token_ids, structured_output=_json_schema(args))
    params.validate(vocab_size, RUN_FLAGS)
    check_room(prompt_len, params.max_tokens, limit, limit_name, RUN_FLAGS)
    return params


def _json_schema(args: argparse.Namespace) -> StructuredOutput | None:
    """``--json-schema FILE`` as the output's constraint, refused naming the file when it is not a JSON schema."""
    path = getattr(args, "json_schema", None)
    if path is None:
        return None
    # A regular file of bounded size (a FIFO would block, a huge file would be read whole): refused naming the fix.
    text = read_regular_file(path, what="--json-schema", fix="give the path of a JSON schema file")
    try:
        spec = StructuredOutput.json_schema(text.decode("utf-8"))
        spec.validate()
    except UnicodeDecodeError as exc:
        raise MoeforgeError(f"--json-schema {path} is not UTF-8 text: {exc}") from None
    except StructuredOutputError as exc:
        raise MoeforgeError(f"--json-schema {path}: {exc}") from None
    return spec


def _check_sampling_flags(args: argparse.Namespace) -> None:
    """The sampling flags by SamplingParams' rules (the one set), right after parsing: before a model loads or a rank
    starts. What needs the model (its vocabulary, its context) is checked once it is known (``_sampling_params``)."""
    _json_schema(args)
    SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                   top_p=args.top_p, seed=args.seed).validate(vocab_size=0, names=RUN_FLAGS)


def _cmd_run(args: argparse.Namespace) -> int:
    _check_sampling_flags(args)
    artifact = _is_artifact(args.model)
    if args.backend == "torch" or (args.backend is None and not artifact):
        if artifact:
            raise MoeforgeError("--backend torch runs checkpoints; for an artifact leave --backend out (the "
                                "artifact's target decides) or give its backend")
        if args.backend is None:  # a MODEL that names nothing is told what run takes, an artifact first
            resolve_source(args.model, artifacts=True)
        return _run_torch(args)
    if not artifact:
        raise MoeforgeError(f"{args.model} is not an artifact directory; compile it first "
                            "(moeforge compile MODEL -o DIR) or use --backend torch")
    shape = read_shape(args.model)  # sizes only: the engine verifies hashes
    if shape.checked_here:
        if shape.sharded:  # a target whose backend runs no ranks (TensorRT plans), before what this host lacks
            check_sharded_target(args.model, shape.manifest)
        _check_runnable(args.model, shape.manifest, args.backend)
    return _run_artifact(args, shape)


def _check_request(args: argparse.Namespace, shape: ArtifactShape) -> None:
    """The prompt and the sampling flags against the artifact's tokenizer, vocabulary and max_seq_len, as the engine
    checks them once it has loaded (``_generate``)."""
    vocab = int(shape.manifest.model_config["vocab_size"])
    tokenizer = shape.tokenizer() if args.prompt is not None else None
    prompt = prompt_token_ids(_prompt_ids(args, tokenizer, args.model), vocab)
    _sampling_params(args, vocab, len(prompt), shape.manifest.kv_cache.max_seq_len, "the artifact's max_seq_len")


def _check_runnable(path: str, manifest: Manifest, wanted: str | None = None) -> BackendSpec:
    """The backend that runs the artifact (the registry's, by its target), refusing a ``--backend`` that is not it
    and a backend this host cannot run, with what does work."""
    spec = backend_for(manifest)
    if wanted is not None and wanted != spec.name:
        raise MoeforgeError(_backend_only(path, manifest, spec, f"the {wanted} backend does not run it"))
    why = spec.unavailable()
    if why:
        raise MoeforgeError(_backend_only(path, manifest, spec, why))
    return spec


def _backend_only(path: str, manifest: Manifest, spec: BackendSpec, why: str) -> str:
    """Why an artifact cannot run or be compared here, and what does work (a TensorRT artifact's model.onnx is the
    graph lowered for TensorRT, which the engine and golden files are built from, not an ONNX Runtime artifact)."""
    if spec.target == "ort":
        return f"{path} is an ONNX Runtime artifact (no engine): {why}"
    return (f"{path} is a {spec.title} artifact (--target {spec.target}): {why}. To run or check this model on CPU, "
            f"compile it for ONNX Runtime: moeforge compile {manifest.source} -o DIR --target ort. On a host with a "
            f"CUDA GPU and TensorRT, 'moeforge run {path}' runs the engine and 'moeforge parity {path} --backend "
            f"{spec.name}' checks it against the golden logits saved at compile time")


def _prompt_ids(args: argparse.Namespace, tokenizer: Tokenizer | None, model: str) -> list[int]:
    """The prompt as token ids: --prompt-ids as given, or --prompt encoded (in the chat template with --chat)."""
    if args.prompt is None:
        if args.chat:
            raise MoeforgeError("--chat needs a text --prompt")
        return list(args.prompt_ids)
    if tokenizer is None:
        raise MoeforgeError(f"{model} ships no tokenizer: pass --prompt-ids instead of --prompt")
    if args.chat:
        return tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
    ids: list[int] = tokenizer.encode(args.prompt)
    return ids


class _Printer:
    """Prints a generation: streamed text as it grows (--stream), then the result (text or --json)."""

    def __init__(self, args: argparse.Namespace, tokenizer: Tokenizer | None) -> None:
        self.args, self.tokenizer, self.printed = args, tokenizer, ""

    def _text(self, token_ids: list[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def progress(self, token_ids: list[int]) -> None:
        if self.args.stream and not self.args.json and self.tokenizer is not None:
            # Decode the whole output each time: byte-level BPE pieces only form text together.
            text = self._text(token_ids) or ""
            print(text[len(self.printed):], end="", flush=True)
            self.printed = text

    def done(self, token_ids: list[int]) -> None:
        text = self._text(token_ids)
        if self.args.json:
            print(to_json({"token_ids": token_ids, "text": text}))
        elif self.args.stream and text is not None:
            print()
        else:
            print(text if text is not None else ",".join(map(str, token_ids)))


def _run_artifact(args: argparse.Namespace, shape: ArtifactShape) -> int:
    check_expert_load_out(args.expert_load_out, args.model, force=args.force)  # before the model loads
    config = EngineConfig(
        scheduling=SchedulingOptions(max_num_seqs=1), cache=cache_options(args),
        backend=BackendOptions(threads=args.threads, huge_pages=not args.no_huge_pages,
                               track_expert_load=args.expert_load_out is not None,
                               micro_batches=args.micro_batches),
        speculative=SpeculativeOptions(tokens=args.speculative_tokens))
    if shape.checked_here:  # before the model loads and any rank starts: once, not once per rank
        check_engine_config(shape, config)
        _check_request(args, shape)
    if is_sharded(args.model):
        return _sharded(args.model, lambda world: rank_worker(args.model, world, config),
                        lambda backend: _generate(args, LLMEngine.from_artifact(Path(args.model) / rank_dir(0), config,
                                                                                backend=backend)),
                        lambda world: _stage_log(args).run(f"loading {args.model} ({world.world_size} ranks)",
                                                           lambda: sharded_backend(args.model, world, config)[0]))
    with _stage_log(args).stage(f"loading {args.model}"):
        engine = LLMEngine.from_artifact(args.model, config)
    return _generate(args, engine)


def _stage_log(args: argparse.Namespace) -> StageLog:
    """The command's stage lines on stderr ("loading DIR ... 3.2 s"); none with --quiet."""
    return StageLog(not args.quiet)


def _sharded(path: str, worker: Callable[[World], tuple[Any, Any]], main: Callable[[Any], int],
             rank0: Callable[[World], Any]) -> int:
    """Run a command on a sharded artifact: start or join the ranks; rank 0 opens its side (``rank0``) and runs
    ``main`` on it, the others serve it (``worker`` opens their side: (backend or session, KV-tier handler or None)).
    Always tells the ranks to stop."""
    world = start_world(path)
    if world.rank != 0:
        try:
            local, kv_tiers = worker(world)
        except BaseException:
            # Every rank found the problem together (the group is whole): tear the group down before the error
            # ends the process. A gloo group left to the interpreter's exit can abort it ("terminate called ...").
            world.finish(EXIT_BAD_INPUT)
            raise
        return run_worker(local, world, kv_tiers)
    side, code = None, EXIT_BAD_INPUT
    try:
        side = rank0(world)
        code = main(side)
    finally:  # on an error too: stop the other ranks and wait for them (the error propagates)
        if side is not None:
            side.close()
        code = world.finish(code)
    return code


def _generate(args: argparse.Namespace, engine: LLMEngine) -> int:
    prompt = _prompt_ids(args, engine.tokenizer, args.model)
    params = _sampling_params(args, engine.backend.vocab_size, len(prompt), engine.backend.max_seq_len,
                              "the artifact's max_seq_len")
    printer = _Printer(args, engine.tokenizer)
    final = None
    try:
        # --stream prints the tokens as they come: a stage line would only be drawn over them
        with StageLog(not (args.quiet or args.stream)).stage(f"generating up to {params.max_tokens} tokens"):
            for out in engine.stream(prompt, params):
                final = out
                printer.progress(out.token_ids)
    finally:
        engine.shutdown()  # with --kv-disk-dir: the prompt's blocks stay on disk for the next run
    assert final is not None
    if final.error:
        raise MoeforgeError(final.error)
    printer.done(final.token_ids)
    if args.expert_load_out is not None:
        save_expert_load(args.expert_load_out, engine.expert_load(), engine.rank_expert_load(), args.model,
                         model_name(Path(args.model)), force=args.force)
    return EXIT_OK


def _run_torch(args: argparse.Namespace) -> int:
    if args.kv_host_bytes or args.kv_disk_dir is not None:
        raise MoeforgeError("--kv-host-bytes / --kv-disk-dir tier a paged artifact's KV cache; PyTorch has none: "
                            "run a compiled paged artifact, or leave the flags out")
    if args.expert_load_out is not None:
        raise MoeforgeError("--expert-load-out counts an artifact's routing (the graph's expert_hits); run a compiled "
                            "artifact, or leave the flag out with --backend torch")
    if getattr(args, "json_schema", None) is not None:
        raise MoeforgeError("--json-schema: constrained decoding runs on compiled artifacts (their engine masks the "
                            "tokens): compile the model (moeforge compile MODEL -o DIR) and run the artifact")
    if args.speculative_tokens:
        raise MoeforgeError("--speculative-tokens: speculative decoding runs on compiled artifacts (their engine "
                            "verifies the drafts); PyTorch generates one token per step: compile the model (moeforge "
                            "compile MODEL -o DIR) and run the artifact, or leave the flag out")
    with _stage_log(args).stage(f"loading {args.model} (PyTorch)"):
        loaded = load_model(args.model, mla_impl=args.mla_impl, check_finite=args.check_weights)
    tokenizer = loaded.tokenizer
    prompt_ids = _prompt_ids(args, tokenizer, args.model)
    stop_ids: tuple[int, ...] = ()
    if not args.ignore_eos:
        stop_ids = tuple(tokenizer.eos_token_ids) if tokenizer is not None else loaded.config.eos_token_ids
    config = loaded.config
    sampling = _sampling_params(args, config.vocab_size, len(prompt_ids), config.max_position_embeddings,
                                "the model's positions", stop_ids)
    printer = _Printer(args, tokenizer)
    generated: list[int] = []
    with StageLog(not (args.quiet or args.stream)).stage(f"generating up to {sampling.max_tokens} tokens (PyTorch)"):
        for token, _ in generate_stream(loaded.model, prompt_ids, sampling):
            generated.append(token)
            printer.progress(generated)
    printer.done(generated)
    return EXIT_OK


# `moeforge compile` flags that are not CompileOptions fields (every other flag's dest is its field name).
_NOT_OPTIONS = ("command", "verbose", "model", "output", "quiet", "plan")


def compile_options(args: argparse.Namespace) -> CompileOptions:
    """The CompileOptions a parsed ``moeforge compile`` command line asks for (also used by gpu_check's dry run)."""
    flags = {k: v for k, v in vars(args).items() if k not in _NOT_OPTIONS}
    if flags.get("kv_cache") is None:  # pipeline stages run on the paged cache only
        flags["kv_cache"] = "paged" if flags.get("pp", 1) > 1 else "contiguous"
    output = args.output if args.output is not None else "."  # --plan writes nothing
    return CompileOptions.from_flags(model=args.model, output_dir=output, progress=not args.quiet, **flags)


def _cmd_compile(args: argparse.Namespace) -> int:
    if args.output is None and not args.plan:
        raise MoeforgeError("-o/--output DIR is required: the artifact directory to create (--plan needs none)")
    options = compile_options(args)
    check_flags(options)  # every count in its bounds before anything loads
    if args.plan:  # refuses what the compile refuses: the same check_compile
        config = check_compile(options).config
        print(plan_compile(args.model, config, args.quant, args.tp, args.ep, args.block_size, args.pp,
                           args.pp_layers).table())
        print("\n".join(kv_plan_lines(options, config)))
        return EXIT_OK
    try:
        result = compile_model(options)
    except ParityCheckFailed as failed:
        print(failed.report.table(), file=sys.stderr)
        print(f"moeforge compile: {failed}; nothing was written to {args.output}", file=sys.stderr)
        return EXIT_CHECK_FAILED
    for report in [] if args.quiet else result.manifest.passes:
        print(f"  pass {report['name']:<14} {report['matches']:>5} match(es)  {report['seconds']:.2f}s")
    if result.parity is not None:
        print("\n".join(result.parity.table().splitlines()[-2:]))  # the verdict and the thresholds it applied
    if result.manifest.engine is not None:
        engine = result.manifest.engine
        print(f"  engine {engine['plan_file']}: {engine['impl']} {engine['tensorrt_version']}, "
              f"{engine['compute_capability']}, {engine['plan_bytes'] / 2**20:.1f} MiB, "
              f"built in {engine['build_seconds']:.1f}s")
    why = backend_for(result.manifest).unavailable()
    if why and not args.quiet:
        print(f"  note: this host cannot run it ({why}); it runs on a GPU host with 'moeforge run'")
    print(f"wrote {result.output_dir}")
    return EXIT_OK


def _cmd_inspect(args: argparse.Namespace) -> int:
    if is_sharded(args.artifact):
        sharded = read_sharded(args.artifact)
        for rank in range(sharded.world_size):  # each rank's manifest (and, verified, its files) is the recorded one
            load_rank(args.artifact, rank, sharded.world_size, verify=not args.no_verify)
        print(to_json(sharded.to_dict(), indent=2) if args.json else
              summarize_sharded(expand_user(args.artifact).absolute(), sharded))
        return EXIT_OK
    artifact = load_artifact(args.artifact, verify=not args.no_verify)
    print(artifact.manifest.to_json() if args.json else summarize(artifact))
    return EXIT_OK


def _cmd_parity(args: argparse.Namespace) -> int:
    if not backend_named(args.backend).teacher_forced_parity:
        return _golden_parity(args)
    if is_sharded(args.artifact):
        return _sharded_parity(args)
    stages = _stage_log(args)
    with stages.stage(f"verifying {args.artifact}"):  # every file's sha256
        artifact = load_artifact(args.artifact)
    spec = backend_for(artifact.manifest)
    if not spec.teacher_forced_parity:
        raise MoeforgeError(_backend_only(args.artifact, artifact.manifest, spec,
                                          "parity against PyTorch runs ONNX graphs token by token, not engines; "
                                          f"use --backend {spec.name} for its golden check"))
    if args.prompt_len < 1 or args.steps < 0:
        raise MoeforgeError("--prompt-len must be >= 1 and --steps >= 0")
    if args.per_layer and args.reference == "transformers":
        raise MoeforgeError("--per-layer compares each layer with moeforge's PyTorch model: drop --reference "
                            "transformers (or run the two checks one after the other)")
    if args.per_layer and not artifact.manifest.layer_outputs:
        raise MoeforgeError("this artifact records no layer outputs; recompile it to use --per-layer")
    if args.stream and args.reference == "transformers":
        raise MoeforgeError("--stream runs moeforge's PyTorch model one layer at a time; transformers loads the model "
                            "whole: drop --reference transformers or --stream")
    if args.stream:  # the more basic refusal first: a reference that cannot stream at all
        check_streamable(args.model or artifact.manifest.source)
    check_parity(args, ArtifactShape(args.artifact, Path(args.artifact), artifact.manifest))  # before a model loads
    spec_name, kv = args.model or artifact.manifest.source, artifact.manifest.kv_cache
    session_config: tuple[tuple[str, str], ...] = ()
    if args.stream:
        with stages.stage(f"opening {spec_name}"):
            _, weights = open_lazy_model(spec_name, mla_impl="absorb", check_finite=args.check_weights)
        prompt = default_prompt(weights.model.config.vocab_size, args.prompt_len, args.seed)
        with tqdm(total=weights.model.config.num_hidden_layers, desc="the artifact generates, then PyTorch layers",
                  unit="layer", leave=False, disable=args.json or args.quiet) as layers_bar, ticking(layers_bar):
            report, layered = streamed_parity(artifact.model_path, kv, weights, prompt, args.steps,
                                              precision=artifact.manifest.precision,
                                              on_layer=lambda _i: layers_bar.update())
        hidden, session_config = layered.hidden, UNPACKED_WEIGHTS
    else:
        reference, loaded = _parity_reference(args, spec_name)
        prompt = reference.prompt_ids
        with stages.stage("running the artifact and comparing"):
            report = compare_with_reference(artifact.model_path, kv, reference, precision=artifact.manifest.precision)
        hidden = []
        if args.per_layer and loaded is not None:
            with stages.stage("PyTorch layer outputs"):
                hidden = torch_hidden_states(loaded.model, prompt)
    result = {**report.to_dict(), "reference": args.reference, "stream": args.stream}
    passed = report.passed
    layer_text = ""
    if args.per_layer:
        with stages.stage("comparing each layer"):
            rows, first = run_layer_parity(artifact.model_path, kv, artifact.manifest.layer_outputs, hidden, prompt,
                                           session_config=session_config)
        result["layers"] = [vars(row) for row in rows]
        result["first_diverging_layer"] = first
        layer_text = "\n" + layer_table(rows, first)
        passed = passed and first is None
    text = f"reference: {args.reference}\n" + report.table() + layer_text
    print(to_json(result, indent=2) if args.json else text)
    return EXIT_OK if passed else EXIT_CHECK_FAILED


def _parity_reference(args: argparse.Namespace, spec: str) -> tuple[TorchReference, LoadedModel | None]:
    """The greedy reference run ``--reference`` names, on ``spec``'s checkpoint: moeforge's PyTorch model (returned
    too, for --per-layer) or transformers running the checkpoint (``moeforge/verify/transformers_reference.py``)."""
    stages, tokens = _stage_log(args), f"{args.prompt_len} + {args.steps} tokens"
    if args.reference == "transformers":
        with stages.stage(f"loading {spec} with transformers"):
            model = load_transformers_model(spec)
        prompt = default_prompt(int(model.config.vocab_size), args.prompt_len, args.seed)
        with stages.stage(f"running the transformers reference ({tokens})"):
            return transformers_reference(model, prompt, args.steps), None
    with stages.stage(f"loading {spec} (PyTorch)"):
        loaded = load_model(spec, mla_impl="absorb", check_finite=args.check_weights)
    prompt = default_prompt(loaded.config.vocab_size, args.prompt_len, args.seed)
    with stages.stage(f"running the PyTorch reference ({tokens})"):
        return torch_reference(loaded.model, prompt, args.steps), loaded


def _sharded_parity(args: argparse.Namespace) -> int:
    """``moeforge parity DIR`` on a sharded artifact: its ranks against the unsharded PyTorch model."""
    sharded = read_sharded(args.artifact)
    if args.stream:
        raise MoeforgeError("--stream checks one graph; a sharded artifact has one per rank: check it without "
                            "--stream")
    if args.per_layer:
        raise MoeforgeError("--per-layer reads one graph's intermediate values; a sharded artifact has one graph per "
                            "rank: check it without --per-layer")
    if args.prompt_len < 1 or args.steps < 0:
        raise MoeforgeError("--prompt-len must be >= 1 and --steps >= 0")
    shape = read_shape(args.artifact)
    if shape.checked_here:  # before any rank starts: once
        check_sharded_target(args.artifact, shape.manifest)
        check_parity(args, shape)
    max_len = args.prompt_len + args.steps + 1

    def main(session: Any) -> int:
        manifest = load_artifact(Path(args.artifact) / rank_dir(0), verify=False).manifest
        reference, _ = _parity_reference(args, args.model or sharded.source)
        with _stage_log(args).stage(f"running the {sharded.world_size} ranks and comparing"):
            report = compare_with_reference(Path(args.artifact) / rank_dir(0) / "model.onnx", manifest.kv_cache,
                                            reference, precision=manifest.precision, session=session)
        result = {**report.to_dict(), "tp": sharded.tp, "ep": sharded.ep, "pp": sharded.pp,
                  "reference": args.reference}
        print(to_json(result, indent=2) if args.json else
              f"sharded tp {sharded.tp} ep {sharded.ep} pp {sharded.pp}, reference: {args.reference}\n"
              + report.table())
        return EXIT_OK if report.passed else EXIT_CHECK_FAILED

    return _sharded(args.artifact, lambda world: (open_rank_session(args.artifact, world, max_len)[0], None), main,
                    lambda world: _stage_log(args).run(f"loading {args.artifact} ({world.world_size} ranks)",
                                                       lambda: open_rank_session(args.artifact, world, max_len)[0]))


def _golden_parity(args: argparse.Namespace) -> int:
    manifest = load_artifact(args.artifact, verify=False).manifest  # check_engine verifies the hashes
    spec = backend_for(manifest)
    if spec.teacher_forced_parity:
        raise MoeforgeError(_backend_only(args.artifact, manifest, spec, f"drop --backend {args.backend}"))
    _check_runnable(args.artifact, manifest)
    with _stage_log(args).stage("running the engine on the golden inputs"):
        check, tolerance = check_engine(args.artifact)
    passed = check.max_abs_err <= tolerance
    result = {"backend": "tensorrt", "max_abs_err": check.max_abs_err, "tolerance": tolerance,
              "top1_agreement": check.top1_agreement, "passed": passed}
    print(to_json(result, indent=2) if args.json else
          f"engine vs golden (ONNX Runtime CPU): max_abs_err {check.max_abs_err:.3e} (tolerance {tolerance:.3e}), "
          f"top1 {check.top1_agreement:.3f} -> {'PASS' if passed else 'FAIL'}")
    return EXIT_OK if passed else EXIT_CHECK_FAILED


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.batch < 1 or args.prompt_len < 1 or args.new_tokens < 2 or args.speculative_tokens < 0:
        raise MoeforgeError("--batch and --prompt-len must be >= 1, --new-tokens >= 2, --speculative-tokens >= 0")
    if args.multi_turn and args.expert_load_out is not None:
        raise MoeforgeError("--expert-load-out records the single-batch bench; --multi-turn does not write it: "
                            "leave one of them out")
    check_expert_load_out(args.expert_load_out, args.artifact, force=args.force)  # before the model loads
    if args.multi_turn:
        return bench_multi_turn(args)
    if args.kv_host_bytes or args.kv_disk_dir is not None or args.kv_blocks is not None:
        raise MoeforgeError("--kv-blocks and the KV tier flags shape the --multi-turn workload's cache: add "
                            "--multi-turn, or leave them out")
    for flag, given in (("--remeasure-bandwidth", args.remeasure_bandwidth),
                        ("--cached-bandwidth", args.cached_bandwidth)):
        if given and not args.roofline:
            raise MoeforgeError(f"{flag} goes with --roofline: add it, or leave the flag out")
    if args.remeasure_bandwidth and args.cached_bandwidth:
        raise MoeforgeError("--cached-bandwidth uses the cached number and --remeasure-bandwidth replaces it (probing "
                            "in this run): pass one of them")
    shape = read_shape(args.artifact)
    if shape.checked_here:  # before the model loads and any rank starts: once
        check_bench(args, shape)
        if shape.sharded:
            check_engine_config(shape, EngineConfig())
    if is_sharded(args.artifact):
        if not args.no_compare or args.speculative_tokens:
            raise MoeforgeError(f"{args.artifact} is sharded: bench measures its engine only; pass --no-compare "
                                "(and no --speculative-tokens)")
        if args.roofline and read_sharded(args.artifact).pp > 1:
            raise MoeforgeError(f"{args.artifact} is a pipeline (--pp): --roofline sums what tp / ep ranks read at "
                                "once, and a pipeline's stages run one after another; measure a tp / ep or an "
                                "unsharded artifact, or leave --roofline out")
        result = _sharded_bench(args)
    else:
        bandwidth = _run_bandwidth(args, args.threads) if args.roofline else None
        result = run_bench(args.artifact, args.batch, args.prompt_len, args.new_tokens, args.threads,
                           compare=not args.no_compare, speculative_tokens=args.speculative_tokens,
                           expert_load_out=args.expert_load_out, expert_load_force=args.force, roofline=bandwidth,
                           stages=_stage_log(args))
    if result is None:  # a rank other than 0: it served rank 0's run
        return EXIT_OK
    if args.save:
        name = str(result["model"] or "model").lower().replace(" ", "-")
        write_result(f"benchmarks/results/bench_{name}_b{args.batch}.json", "bench", result)
    if args.json:
        print(to_json(result, indent=2))
        return EXIT_OK
    print(f"{result['model']}: batch {args.batch}, prompt {args.prompt_len}, {args.new_tokens} new tokens")
    print(f"{'runtime':<22} {'prefill tok/s':>14} {'decode tok/s':>13}")
    for key in ("moeforge_onnxruntime", "pytorch_eager", "transformers_eager", "onnxruntime_genai"):
        row = result.get(key)
        if row:
            print(f"{key:<22} {row['prefill_tokens_per_s']:>14.1f} {row['decode_tokens_per_s']:>13.1f}")
    ours = result["moeforge_onnxruntime"]
    print(f"TTFT median {ours['ttft_ms_median']:.1f} ms, peak RSS {ours['peak_rss_mib']:.0f} MiB, "
          f"attention {100 * ours['attention_time_share']:.0f}% of kernel time")
    for name, ratio in result.get("decode_speedup_vs", {}).items():
        print(f"decode speed vs {name}: {ratio:.2f}x")
    if "roofline" in ours:
        print(format_roofline(ours["roofline"]))
    experts = ours.get("expert_load")
    if experts:
        print(f"expert load imbalance (max / mean over experts, mean of layers): {experts['expert_imbalance_mean']:.3f}"
              + (f"; over ranks: {experts['rank_imbalance_mean']:.3f} (per layer "
                 + " ".join(f"{x:.2f}" for x in experts["rank_imbalance"]) + ")" if "rank_imbalance" in experts
                 else ""))
    return EXIT_OK


def _run_bandwidth(args: argparse.Namespace, threads: int | None) -> RunBandwidth:
    """``--roofline``'s bandwidth: probed in the run (the first probe the full one, replacing the cached number, with
    ``--remeasure-bandwidth``), or the cached number with ``--cached-bandwidth``."""
    if args.cached_bandwidth:
        return RunBandwidth.from_cache(threads)
    return RunBandwidth.probed(threads, refresh_cache=args.remeasure_bandwidth)


def _sharded_bench(args: argparse.Namespace) -> dict[str, Any] | None:
    """``moeforge bench`` on a sharded artifact: rank 0 runs the engine over all ranks (no peers compared)."""
    config = EngineConfig(backend=BackendOptions(threads=args.threads, track_expert_load=True,
                                                 micro_batches=args.micro_batches))
    results: list[dict[str, Any]] = []

    def main(backend: Any) -> int:
        top = Path(args.artifact)
        bandwidth, rank_dirs = None, []
        if args.roofline:  # rank 0 only, while the other ranks wait for its first step (all on this machine:
            # check_bench). They read together: the probe runs all their threads (the machine's cores when not given)
            threads = None if args.threads is None else min(args.threads * backend.world_size, usable_cores())
            bandwidth = _run_bandwidth(args, threads)
            rank_dirs = [top / rank_dir(rank) for rank in range(backend.world_size)]
        with _stage_log(args).stage(f"measuring moeforge over {backend.world_size} ranks"):
            measured = bench_engine(top / rank_dir(0), args.batch, args.prompt_len, args.new_tokens, args.threads,
                                    backend=backend, expert_load_out=args.expert_load_out,
                                    expert_load_force=args.force, stats_artifact=top, model_name=model_name(top),
                                    roofline=bandwidth, rank_dirs=rank_dirs)
        results.append({"artifact": str(top), "model": model_name(top), "batch": args.batch,
                        "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "ranks": backend.world_size,
                        "moeforge_onnxruntime": measured})
        return EXIT_OK

    code = _sharded(args.artifact, lambda world: rank_worker(args.artifact, world, config), main,
                    lambda world: _stage_log(args).run(f"loading {args.artifact} ({world.world_size} ranks)",
                                                       lambda: sharded_backend(args.artifact, world, config)[0]))
    if code != EXIT_OK:
        raise SystemExit(code)
    return results[0] if results else None


def _cmd_serve(args: argparse.Namespace) -> int:
    options = _serve_options(args)
    shape = read_shape(args.artifact)
    if shape.checked_here:  # before the model loads and any rank starts: once
        server_config(options)
        check_engine_config(shape, engine_config(options))
    if shape.sharded:
        return _sharded_serve(args, options)
    return serve(options)


def _sharded_serve(args: argparse.Namespace, options: ServeOptions) -> int:
    # Rank 0 (this process, or torchrun's rank 0) binds the address before any rank starts: one it cannot have is
    # refused at once, not after every rank has loaded its shard.
    sockets = tuple(bind_listeners(args.host, args.port)) if os.environ.get("RANK", "0") == "0" else ()
    options = dataclasses.replace(options, served_model_name=options.served_model_name or model_name(options.artifact),
                                  sockets=sockets)
    config = engine_config(options)
    worlds: list[World] = []

    def rank0(world: World) -> Any:
        worlds.append(world)
        return sharded_backend(args.artifact, world, config)[0]

    try:
        return _sharded(args.artifact, lambda world: rank_worker(args.artifact, world, config),
                        lambda backend: serve(dataclasses.replace(options, artifact=Path(args.artifact) / rank_dir(0),
                                                                  backend=backend, liveness=worlds[0].dead_rank)),
                        rank0)
    finally:
        for sock in sockets:  # uvicorn has closed them if it served: closing again does nothing
            sock.close()


def _serve_options(args: argparse.Namespace, check: bool = True) -> ServeOptions:
    if check and not _is_artifact(args.artifact):
        raise MoeforgeError(f"{args.artifact} is not an artifact directory; compile it first (moeforge compile "
                            "MODEL -o DIR)")
    check_expert_load_out(args.expert_load_out, args.artifact, force=args.force)  # before any rank loads a model
    return ServeOptions(
        artifact=Path(args.artifact), host=args.host, port=args.port, max_queued=args.max_queued,
        api_key=args.api_key if args.api_key is not None else os.environ.get("MOEFORGE_API_KEY") or None,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        kv_blocks=args.kv_blocks, threads=args.threads, huge_pages=not args.no_huge_pages,
        kv_host_bytes=args.kv_host_bytes, kv_disk_dir=args.kv_disk_dir, kv_disk_bytes=args.kv_disk_bytes,
        kv_offload_dtype=args.kv_offload_dtype, micro_batches=args.micro_batches,
        speculative_tokens=args.speculative_tokens,
        chat_template=args.chat_template, max_body_bytes=args.max_body_bytes, stall_timeout=args.stall_timeout,
        header_timeout=args.header_timeout, max_connections=args.max_connections,
        served_model_name=args.served_model_name, shutdown_timeout=args.shutdown_timeout,
        profile_steps=args.profile_steps, log_level=args.log_level, expert_load_out=args.expert_load_out,
        expert_load_force=args.force)


def _cmd_config(args: argparse.Namespace) -> int:
    config = load_config(args.model)
    params = config.num_parameters()
    per_token = {impl: config.kv_cache_values_per_token(impl) for impl in ("absorb", "naive")}
    summary = {
        "config": config.to_dict(),
        "parameters": params,
        "kv_cache_values_per_token_per_layer": per_token if config.mla else per_token["naive"],
        "kv_cache_bytes_per_token_fp16": {
            impl: 2 * v * config.num_hidden_layers for impl, v in per_token.items()
        } if config.mla else 2 * per_token["naive"] * config.num_hidden_layers,
    }
    if args.json:
        print(to_json(summary, indent=2))
        return EXIT_OK
    print(f"{config.name} ({config.model_type}, {config.attention_kind}"
          f"{', MoE' if config.moe else ''}): {_count(params)} parameters")
    print(f"  layers {config.num_hidden_layers}, hidden {config.hidden_size}, heads "
          f"{config.num_attention_heads}/{config.num_key_value_heads}, vocab {config.vocab_size}")
    if config.moe:
        m = config.moe
        print(f"  experts {m.n_routed_experts} routed + {m.n_shared_experts} shared, top-{m.num_experts_per_tok}, "
              f"{m.scoring_func} {m.topk_method} (groups {m.topk_group}/{m.n_group})")
    kv = summary["kv_cache_bytes_per_token_fp16"]
    if config.dsa is not None and isinstance(kv, dict):  # DeepSeek-V3.2: the indexer's keys are cached too
        d, index_bytes = config.dsa, 2 * config.dsa.index_head_dim * config.num_hidden_layers
        print(f"  sparse attention (DSA): indexer {d.index_n_heads} heads x {d.index_head_dim}, top-{d.index_topk} "
              f"tokens; absorbed cache = latent {kv['absorb'] - index_bytes} B + indexer {index_bytes} B")
    if config.compressed_attention is not None:  # DeepSeek-V4: the compressed entries grow, the rings do not
        a = config.compressed_attention
        kinds = ", ".join(f"{a.layer_types.count(k)} {n}" for k, n in (
            ("sliding_attention", "sliding"), ("compressed_sparse_attention", f"CSA (every {a.csa_rate})"),
            ("heavily_compressed_attention", f"HCA (every {a.hca_rate})")) if k in a.layer_types)
        print(f"  attention: {kinds}; window {config.sliding_window}; indexer top-{a.indexer.index_topk}")
        print(f"  KV cache per token (fp16, all layers): {kv} B of compressed entries, plus each layer's "
              f"{config.sliding_window}-token window ring per sequence (moeforge inspect / compile --plan: the rest)")
    elif isinstance(kv, dict):
        print(f"  KV cache per token (fp16, all layers): absorbed MLA {kv['absorb']} B, naive {kv['naive']} B")
    else:
        print(f"  KV cache per token (fp16, all layers): {kv} B")
    return EXIT_OK


def _cmd_eplb(args: argparse.Namespace) -> int:
    check_plan_args(args.ep, args.redundant, args.nodes, args.groups)  # the flags' ranges, before any work
    check_output_file(args.output, force=args.force, flag="-o")
    stats = read_stats(args.stats)
    load = stats.load
    groups = args.groups if args.groups is not None else stats.groups or 1
    plan = rebalance(load, args.ep, args.redundant, args.nodes, groups, artifact_sha256=stats.artifact_sha256)
    write_plan(plan, args.output, force=args.force)
    robin = round_robin(load, args.ep, args.redundant).imbalance.tolist()
    rows = [{"layer": layer, "contiguous": before, "round_robin": robin[layer], "eplb": after}
            for layer, (before, after) in enumerate(zip(plan.imbalance_before.tolist(), plan.imbalance.tolist(),
                                                        strict=True))]
    if args.json:
        print(to_json({"plan": str(args.output), "mode": plan.mode, "ep": plan.ep, "redundant": plan.redundant,
                          "nodes": plan.nodes, "groups": plan.groups, "layers": rows}, indent=2))
        return EXIT_OK
    print(f"{plan.mode} EPLB plan: {load.shape[0]} layers x {load.shape[1]} experts, ep {plan.ep}, "
          f"{plan.redundant} redundant slots, {plan.nodes} node(s), {plan.groups} group(s) -> {args.output}")
    print("predicted imbalance (max / mean rank load; contiguous: no replicas; round-robin: EPLB's replicas)")
    print(f"{'layer':>5}  {'contiguous':>10}  {'round-robin':>11}  {'eplb':>6}")
    for row in rows:
        print(f"{row['layer']:>5}  {row['contiguous']:>10.3f}  {row['round_robin']:>11.3f}  {row['eplb']:>6.3f}")
    return EXIT_OK


def _count(n: int) -> str:
    """``n`` with a K/M/B unit and 3 significant digits: 671B, 135M, 82.4K."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            value = n / scale
            return f"{value:.3g}{unit}" if value < 1000 else f"{value:,.0f}{unit}"
    return str(n)

