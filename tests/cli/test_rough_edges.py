"""Rough edges of the command line a new user met (issue 49): parity against a model of another vocabulary, what
``run`` takes when MODEL names nothing, ``--speculative-tokens`` on the PyTorch backend, flags without help, what
``eplb --redundant`` counts, and flags a sharded artifact's ranks refused one by one after they had all started."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from moeforge.cli import main
from moeforge.cli.parser import build_parser
from moeforge.cli.preflight import check_bench, check_engine_config, check_parity, read_shape
from moeforge.core.errors import MoeforgeError
from moeforge.parallel.eplb import rebalance
from moeforge.runtime.engine import CacheOptions, EngineConfig
from moeforge.verify.parity import TorchReference, parity_report

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _bad_input(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """``moeforge argv``'s one error line (exit 2, no traceback)."""
    code = main(list(argv))
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and err.count("error:") == 1, err
    return err


def _never(what: str) -> object:
    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"{what} before the flags were checked")
    return fail


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-llama (vocabulary 512, hidden 64, 2 layers) compiled for ONNX Runtime, max_seq_len 64."""
    from moeforge.compile.driver import CompileOptions, compile_model

    out = tmp_path_factory.mktemp("rough_edges") / "tiny"
    return compile_model(CompileOptions(model="tiny-llama", output_dir=out, max_seq_len=64, progress=False)).output_dir


def _llama_folder(folder: Path, vocab_size: int, hidden_size: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=64,
                                 num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2)).save_pretrained(folder)
    return folder


# ----------------------------------------------------------------------- parity against another model
def test_parity_against_another_vocabulary_names_both_sizes_and_the_fix(
        artifact: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: a numpy broadcast traceback, after both models had run."""
    other = _llama_folder(tmp_path / "vocab64", vocab_size=64, hidden_size=32)
    monkeypatch.setattr("moeforge.cli.commands.load_model", _never("the reference model loaded"))
    err = _bad_input(capsys, "parity", str(artifact), "--model", str(other))
    assert "vocabulary size 64" in err and "has 512" in err, err
    assert "compiled from, tiny-llama" in err and "without --model" in err, err


def test_parity_per_layer_needs_the_same_hidden_size(artifact: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    other = _llama_folder(tmp_path / "hidden32", vocab_size=512, hidden_size=32)
    err = _bad_input(capsys, "parity", str(artifact), "--model", str(other), "--per-layer")
    assert "hidden size 32" in err and "has 64" in err and "--per-layer" in err, err


def test_parity_report_refuses_logits_of_another_shape() -> None:
    """The Python API too: logits [P, 512] against [P, 64] are refused by name, never broadcast."""
    rng = np.random.default_rng(0)
    ours = [rng.standard_normal((4, 512)).astype(np.float32)]
    token = [int(ours[0][-1].argmax())]
    reference = TorchReference([1, 2, 3, 4], [rng.standard_normal((4, 64)).astype(np.float32)], token)
    with pytest.raises(MoeforgeError, match=r"vocabulary 512 vs 64"):
        parity_report(ours, token, reference, "fp32")
    assert parity_report(ours, token, TorchReference([1, 2, 3, 4], ours, token), "fp32").passed


# ------------------------------------------------------------------------------------- run's MODEL
def test_run_of_a_missing_model_lists_an_artifact_first(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = str(tmp_path / "nope")
    err = _bad_input(capsys, "run", missing, "--prompt-ids", "1")
    assert "not found: give an artifact directory (moeforge compile MODEL -o DIR" in err, err
    assert ".gguf file" in err and "tiny-llama" in err, err
    # a command that takes checkpoints only does not offer an artifact
    assert "artifact" not in _bad_input(capsys, "config", missing)


def test_speculative_tokens_on_the_torch_backend_is_refused(capsys: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: ignored without a word."""
    monkeypatch.setattr("moeforge.cli.commands.load_model", _never("the model loaded"))
    for backend in ([], ["--backend", "torch"]):
        err = _bad_input(capsys, "run", "tiny-llama", *backend, "--prompt-ids", "1", "--speculative-tokens", "2")
        assert "--speculative-tokens" in err and "runs on compiled artifacts" in err, err


# ------------------------------------------------------------------------------------------- help
def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    found = {parser.prog: parser}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found.update(_subparsers(sub))
    return found


def test_every_flag_has_help() -> None:
    """The docs' CLI reference is generated from the parser: a flag without help is a blank row there."""
    parsers = _subparsers(build_parser())
    assert {"moeforge parity", "moeforge config", "moeforge eplb"} <= set(parsers)
    bare = [f"{prog} {'/'.join(action.option_strings)}" for prog, parser in parsers.items()
            for action in parser._actions
            if action.option_strings and not isinstance(action, argparse._HelpAction)
            and not (action.help or "").strip()]
    assert not bare, bare


def test_eplb_redundant_counts_slots_per_layer_over_all_ranks() -> None:
    """--help, the placement guide and the planner agree: R spare slots per layer in all, (E + R) / ep per rank."""
    (action,) = [a for a in _subparsers(build_parser())["moeforge eplb"]._actions if "--redundant" in a.option_strings]
    assert action.help is not None
    assert "per MoE layer, over all ranks together" in action.help and "--redundant S x --ep" in action.help
    assert "`--redundant 8`: 40 slots, 10 per rank" in (DOCS / "guides" / "expert-placement.md").read_text()
    plan = rebalance(np.arange(1, 33, dtype=np.float64)[None], ep=4, redundant=8)  # 32 experts, 2 spares per rank
    assert plan.slots_per_rank == 10 and plan.physical_to_logical.shape == (1, 40)


# ---------------------------------------------- flags checked before the model loads or a rank starts
class _RankStarted(Exception):
    pass


def _as_sharded(monkeypatch: pytest.MonkeyPatch, artifact: Path, world_size: int = 2) -> None:
    """The CLI treats ``artifact`` as a sharded artifact whose rank 0 it is; starting its ranks raises
    ``_RankStarted`` (no process starts)."""
    shape = dataclasses.replace(read_shape(str(artifact)), sharded=True, world_size=world_size)
    monkeypatch.setattr("moeforge.cli.commands.read_shape", lambda path: shape)
    monkeypatch.setattr("moeforge.cli.commands.is_sharded", lambda path: True)
    monkeypatch.setattr("moeforge.cli.commands.read_sharded", lambda path: SimpleNamespace(
        source="tiny-llama", world_size=world_size, tp=world_size, ep=1, pp=1))
    monkeypatch.setattr("moeforge.cli.commands.bind_listeners", _never("serve bound its port"))

    def start_world(path: object) -> None:
        raise _RankStarted

    monkeypatch.setattr("moeforge.cli.commands.start_world", start_world)


@pytest.mark.parametrize("argv, message", [
    (["run", "ART", "--prompt-ids", "1,99999"], "outside the vocabulary [0, 512)"),
    (["run", "ART", "--prompt-ids", "1,2,3", "--max-new-tokens", "62"], "exceeds the artifact's max_seq_len 64"),
    (["run", "ART", "--prompt-ids", "1", "--kv-host-bytes", "1M"], "only paged artifacts have"),
    (["run", "ART", "--prompt-ids", "1", "--backend", "tensorrt"], "the tensorrt backend does not run it"),
    (["run", "ART", "--prompt", "hi", "--chat"], "chat template"),
    (["parity", "ART", "--prompt-len", "60", "--steps", "10"], "--prompt-len 60 + --steps 10 + 1 exceeds"),
    (["bench", "ART", "--no-compare", "--prompt-len", "60", "--new-tokens", "10"], "compile with --max-seq-len 70"),
    (["serve", "ART", "--kv-host-bytes", "1M"], "only paged artifacts have"),
    (["serve", "ART", "--chat-template", "/no/such/template"], "cannot read --chat-template"),
], ids=lambda value: value if isinstance(value, str) else " ".join(value[:1] + value[2:]))
def test_a_sharded_artifacts_flags_are_refused_once_before_any_rank_starts(
        argv: list[str], message: str, artifact: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: each rank refused them, after every rank had started and loaded its shard."""
    _as_sharded(monkeypatch, artifact)
    assert message in _bad_input(capsys, *[str(artifact) if a == "ART" else a for a in argv])


def test_good_flags_go_on_to_start_the_ranks(artifact: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _as_sharded(monkeypatch, artifact)
    for argv in (["run", str(artifact), "--prompt", "hi", "--max-new-tokens", "8"],
                 ["parity", str(artifact), "--prompt-len", "8", "--steps", "4"],
                 ["bench", str(artifact), "--no-compare", "--prompt-len", "8", "--new-tokens", "4"]):
        with pytest.raises(_RankStarted):
            main(argv)


def test_the_ranks_torchrun_starts_leave_the_checks_to_rank_0(artifact: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    shape = dataclasses.replace(read_shape(str(artifact)), sharded=True, world_size=2)
    monkeypatch.setenv("RANK", "1")
    assert not shape.checked_here and read_shape(str(artifact)).checked_here  # unsharded: every process checks
    monkeypatch.setenv("RANK", "0")
    assert shape.checked_here


def test_engine_settings_every_rank_would_refuse(artifact: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shape = read_shape(str(artifact))
    tiers = EngineConfig(cache=CacheOptions(host_bytes=2**20))
    paged = dataclasses.replace(shape.manifest, kv_cache=dataclasses.replace(shape.manifest.kv_cache, block_size=16))
    pipeline = dataclasses.replace(shape, manifest=paged, sharded=True, world_size=2, pp=2)
    with pytest.raises(MoeforgeError, match="only paged artifacts have"):
        check_engine_config(shape, tiers)
    with pytest.raises(MoeforgeError, match=r"pipeline artifact \(--pp\): KV tiers"):
        check_engine_config(pipeline, tiers)
    check_engine_config(dataclasses.replace(pipeline, pp=1), tiers)  # a paged tp / ep artifact tiers its shards
    # --roofline adds every rank's bytes over this machine's bandwidth: all of them must run here
    bench = build_parser().parse_args(["bench", "ART", "--no-compare", "--roofline", "--prompt-len", "8",
                                       "--new-tokens", "4"])
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    with pytest.raises(MoeforgeError, match="only 1 of the 2 ranks run here"):
        check_bench(bench, pipeline)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    check_bench(bench, pipeline)
    parity = build_parser().parse_args(["parity", "ART", "--prompt-len", "8", "--steps", "4"])
    check_parity(parity, shape)
