"""The parser answers at once: nothing heavy is imported before the command line is parsed, and the values it
restates from heavy modules are the modules' own."""

from __future__ import annotations

import json
import subprocess
import sys

from moeforge.cli import parser

HEAVY = ("torch", "onnx", "onnxruntime", "numpy", "fastapi", "uvicorn", "transformers", "tensorrt_rtx")


def test_parsing_imports_nothing_heavy() -> None:
    code = ("import sys, json, moeforge.cli, moeforge.cli.parser as p; p.build_parser().format_help();\n"
            "try:\n    moeforge.cli.main(['--help'])\nexcept SystemExit:\n    pass\n"
            f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1]) == []


def test_a_bad_flag_is_refused_before_the_heavy_stack_loads() -> None:
    code = ("import sys, moeforge.cli\ntry:\n"
            "    moeforge.cli.main(['run', 'x', '--prompt', 'hi', '--max-new-token', '3'])\n"
            "except SystemExit as exc:\n    print(exc.code, 'torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == ["2", "False"], proc.stderr
    assert "unrecognized arguments: --max-new-token" in proc.stderr


def test_restated_values_equal_their_sources() -> None:
    from moeforge.compile.options import MAX_RANKS
    from moeforge.compile.targets import TARGETS
    from moeforge.runtime.backends.registry import BACKENDS
    from moeforge.runtime.engine_config import DEFAULT_DISK_BYTES
    from moeforge.runtime.kv_tiers.block_codec import OFFLOAD_DTYPES
    from moeforge.serve.app import DEFAULT_MAX_BODY_BYTES
    from moeforge.serve.connections import DEFAULT_HEADER_TIMEOUT_S, DEFAULT_MAX_CONNECTIONS
    from moeforge.serve.streams import DEFAULT_STALL_TIMEOUT_S

    assert parser.TARGET_NAMES == tuple(TARGETS)
    assert parser.BACKEND_NAMES == tuple(spec.name for spec in BACKENDS.values())
    assert parser.MAX_RANKS == MAX_RANKS
    assert parser.DEFAULT_DISK_BYTES == DEFAULT_DISK_BYTES
    assert parser.OFFLOAD_DTYPES == tuple(OFFLOAD_DTYPES)
    assert parser.DEFAULT_MAX_BODY_BYTES == DEFAULT_MAX_BODY_BYTES
    assert parser.DEFAULT_HEADER_TIMEOUT_S == DEFAULT_HEADER_TIMEOUT_S
    assert parser.DEFAULT_MAX_CONNECTIONS == DEFAULT_MAX_CONNECTIONS
    assert parser.DEFAULT_STALL_TIMEOUT_S == DEFAULT_STALL_TIMEOUT_S
