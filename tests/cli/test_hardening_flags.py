"""Hardening of the command line's flags: sizes are whole bytes up to 1 PiB, every numeric flag is refused out of range
by the parser (before a model loads or a rank starts, once), no flag is taken by an abbreviation, the JSON printed is
standard JSON, and a port the server cannot have is a clean error before the model loads."""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moeforge.cli import main
from moeforge.cli.json_output import to_json
from moeforge.cli.parser import build_parser
from moeforge.core.errors import MoeforgeError
from moeforge.core.host_memory import MAX_SIZE, parse_size
from moeforge.serve.listener import bind_listeners

RUN = ["run", "tiny-llama", "--prompt-ids", "1"]
SERVE = ["serve", "artifact"]
BENCH = ["bench", "artifact"]
PARITY = ["parity", "artifact"]
COMPILE = ["compile", "tiny-llama", "-o", "out"]


def _refused(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """argparse's refusal of ``argv``: exit code 2 and its one message (never a traceback)."""
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err, err
    return err


def _strict_json(text: str) -> Any:
    """``text`` parsed as standard JSON: NaN / Infinity refused, as JavaScript's JSON.parse refuses them."""

    def refuse(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


# ------------------------------------------------------------------------------------------------- sizes
def test_sizes_are_whole_bytes_up_to_one_pib() -> None:
    assert parse_size("1.5G") == 3 * 2**29 and parse_size("1.5M") == 3 * 2**19 and parse_size(" 2 kb ") == 2000
    assert parse_size("1P") == parse_size("1PiB") == MAX_SIZE == 2**50
    for bad, why in (("0.5", "0.5 bytes, not a whole number"), ("0.1K", "102.4 bytes, not a whole number"),
                     ("1.5", "not a whole number"), ("0", "positive"), ("2P", "over the largest, 1 PiB"),
                     ("1025TiB", "1 PiB"), ("9" * 400, "1 PiB"), ("1e9", "not a size"), ("\u0661", "not a size")):
        with pytest.raises(ValueError, match=why):
            parse_size(bad)


@pytest.mark.parametrize("argv", [[*RUN, "--kv-disk-bytes"], [*RUN, "--kv-host-bytes"], [*SERVE, "--kv-host-bytes"],
                                  [*BENCH, "--kv-disk-bytes"], [*COMPILE, "--max-memory"],
                                  [*SERVE, "--max-body-bytes"]], ids=lambda argv: f"{argv[0]} {argv[-1]}")
@pytest.mark.parametrize("value", ["9" * 400, "0.5", "0.1K", "2P", "0"])
def test_size_flags_are_refused_by_the_parser(capsys: pytest.CaptureFixture[str], argv: list[str],
                                              value: str) -> None:
    err = _refused(capsys, [*argv, value])
    assert f"argument {argv[-1]}:" in err and "not a size" in err, err


def test_a_size_flag_takes_whole_bytes_with_units() -> None:
    args = build_parser().parse_args([*RUN, "--kv-host-bytes", "1.5G", "--kv-disk-bytes", "3000MB"])
    assert args.kv_host_bytes == 3 * 2**29 and args.kv_disk_bytes == 3 * 10**9
    assert build_parser().parse_args([*SERVE, "--max-body-bytes", "16M"]).max_body_bytes == 16 * 2**20


@settings(max_examples=500, deadline=None)
@given(st.one_of(st.text(max_size=60),
                 st.from_regex(r"\s?[0-9]{1,45}(\.[0-9]{1,20})?\s?([KMGTPkmgtp](i?[Bb])?|[Bb])?\s?", fullmatch=True)))
def test_parse_size_returns_a_size_in_range_or_raises_value_error(text: str) -> None:
    try:
        size = parse_size(text)
    except ValueError as exc:
        assert "not a size" in str(exc)
        return
    assert type(size) is int and 1 <= size <= MAX_SIZE


# ------------------------------------------------------------------------------------ numeric flags
NUMERIC = [
    (RUN, "--micro-batches", "-1"), (RUN, "--threads", "9" * 400), (RUN, "--threads", "-2"),
    (RUN, "--speculative-tokens", "-1"), (RUN, "--threads", "1_000"),
    (SERVE, "--port", "99999"), (SERVE, "--port", "0"), (SERVE, "--max-num-seqs", "0"), (SERVE, "--max-queued", "-1"),
    (SERVE, "--max-num-batched-tokens", "0"), (SERVE, "--header-timeout", "inf"), (SERVE, "--stall-timeout", "nan"),
    (SERVE, "--stall-timeout", "0"), (SERVE, "--max-connections", "0"), (SERVE, "--kv-blocks", "0"),
    (SERVE, "--shutdown-timeout", "-1"), (SERVE, "--profile-steps", "-1"), (SERVE, "--micro-batches", "-1"),
    (SERVE, "--threads", "x"),
    (BENCH, "--batch", "0"), (BENCH, "--prompt-len", "0"), (BENCH, "--new-tokens", "1"),
    (BENCH, "--conversations", "0"), (BENCH, "--turns", "0"), (BENCH, "--kv-blocks", "-5"),
    (BENCH, "--micro-batches", "-1"), (BENCH, "--speculative-tokens", "-1"),
    (PARITY, "--prompt-len", "0"), (PARITY, "--steps", "-1"), (PARITY, "--seed", "-1"),
    (COMPILE, "--tp", "0"), (COMPILE, "--pp", "100000"), (COMPILE, "--ep", "x"), (COMPILE, "--workers", "0"),
    (COMPILE, "--max-seq-len", "0"), (COMPILE, "--sm", "0"), (COMPILE, "--max-batch", "0"),
    (COMPILE, "--block-size", "0"),
]
# Left to the one check that owns each (it names the flag, exit code 2, before any model loads): the sampling flags
# (SamplingParams, test below), --kv-block-size (the KV layout), --percentile / --smooth-alpha / --keep-fp (the quant
# spec, which knows the scheme); eplb's flags (parallel/eplb.check_plan_args, before the statistics are read).


@pytest.mark.parametrize(("argv", "flag", "value"), NUMERIC, ids=[f"{a[0]} {f} {v[:8]}" for a, f, v in NUMERIC])
def test_numeric_flags_out_of_range_are_refused_by_the_parser(capsys: pytest.CaptureFixture[str], argv: list[str],
                                                              flag: str, value: str) -> None:
    err = _refused(capsys, [*argv, flag, value])
    assert f"argument {flag}: must be" in err and "got" in err, err


def test_numeric_flags_in_range_parse_to_numbers() -> None:
    args = build_parser().parse_args([*SERVE, "--port", "65535", "--header-timeout", "2.5", "--max-queued", "0",
                                      "--threads", "0", "--shutdown-timeout", "0"])
    assert (args.port, args.header_timeout, args.max_queued, args.threads) == (65535, 2.5, 0, 0)
    args = build_parser().parse_args([*COMPILE, "--max-seq-len", "64", "--workers", "1024", "--tp", "2"])
    assert (args.max_seq_len, args.workers, args.tp) == (64, 1024, 2)
    assert build_parser().parse_args([*PARITY, "--seed", str(2**64 - 1)]).seed == 2**64 - 1


@pytest.mark.parametrize("argv", [[*RUN, "--micro-batches", "-1"], ["serve", "/no/such/artifact", "--port", "99999"]],
                         ids=["run --micro-batches", "serve --port"])
def test_a_bad_flag_is_one_message_from_the_parent_before_anything_starts(argv: list[str], tmp_path: Path) -> None:
    """Before: ``--micro-batches -1`` was refused by each rank once they had started (~21 s), ``--port 99999`` ended
    in a 74-line traceback and SIGABRT after the model had loaded."""
    done = subprocess.run([sys.executable, "-m", "moeforge.cli", *argv], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.count("error:") == 1 and f"argument {argv[-2]}: must be an integer in" in done.stderr


def test_sampling_flags_are_refused_before_the_model_loads(capsys: pytest.CaptureFixture[str],
                                                           tmp_path: Path) -> None:
    missing = str(tmp_path / "nope")  # loading it would fail with "not found": the flag is checked first
    for flag, value in (("--max-new-tokens", "0"), ("--max-new-tokens", "-1"), ("--temperature", "nan"),
                        ("--top-p", "0"), ("--top-k", "-1"), ("--seed", "-1")):
        assert main(["run", missing, "--prompt-ids", "1", flag, value]) == 2
        err = capsys.readouterr().err
        assert flag in err and "not found" not in err and "Traceback" not in err, err


# ------------------------------------------------------------------------------------ abbreviations
def _parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += _parsers(sub)
    return found


def test_no_flag_is_taken_by_an_abbreviation(capsys: pytest.CaptureFixture[str]) -> None:
    parsers = _parsers(build_parser())
    assert len(parsers) > 8 and all(not p.allow_abbrev for p in parsers), [p.prog for p in parsers if p.allow_abbrev]
    err = _refused(capsys, [*RUN, "--max-new-token", "5"])
    assert "unrecognized arguments: --max-new-token" in err, err
    assert "unrecognized arguments: --verb" in _refused(capsys, ["--verb", *RUN])


# ------------------------------------------------------------------------------------- JSON output
def test_json_output_writes_non_finite_numbers_as_null() -> None:
    text = to_json({"kl_max": float("inf"), "x": [float("nan"), -float("inf"), 1.5, (2, float("inf"))], "n": 3},
                   indent=2)
    assert _strict_json(text) == {"kl_max": None, "x": [None, None, 1.5, [2, None]], "n": 3}


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-llama compiled for ONNX Runtime (fp32: its parity thresholds hold kl_max = inf)."""
    from moeforge.compile.driver import CompileOptions, compile_model  # the compile stack: only this fixture

    out = tmp_path_factory.mktemp("hardening_flags") / "tiny"
    return compile_model(CompileOptions(model="tiny-llama", output_dir=out, max_seq_len=64, progress=False)).output_dir


def test_parity_json_is_standard_json(artifact: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: ``"kl_max": Infinity``, which JSON.parse rejects."""
    assert main(["parity", str(artifact), "--json", "--prompt-len", "4", "--steps", "2"]) == 0
    result = _strict_json(capsys.readouterr().out)
    assert result["passed"] is True and result["thresholds"]["kl_max"] is None


# ----------------------------------------------------------------------------------- the server's port
def test_a_port_in_use_is_refused_before_the_model_loads(artifact: Path, capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    def no_load(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model loaded before the port was bound")

    monkeypatch.setattr("moeforge.serve.runner.LLMEngine.from_artifact", no_load)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", str(artifact), "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}: the port is in use" in err and "Traceback" not in err, err


def test_addresses_that_cannot_be_bound_name_the_flag() -> None:
    for host, port, why in (("no-such-host.invalid", 8000, "--host 'no-such-host.invalid' is not an address"),
                            ("127.0.0.1", 70000, "--port must be in 0..65535"),
                            ("127.0.0.1", True, "--port must be in")):
        with pytest.raises(MoeforgeError, match=why):
            bind_listeners(host, port)  # True: a caller's mistake (a bool is an int), refused
    sockets = bind_listeners("localhost", 0)
    try:
        assert sockets and all(s.getsockname()[1] > 0 for s in sockets)
    finally:
        for sock in sockets:
            sock.close()
