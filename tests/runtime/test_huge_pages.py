"""moeforge/core/huge_pages.py: the memory a session allocates goes on transparent huge pages, only that memory, and the
session computes the same; where huge pages cannot be used nothing is done and the report says why."""

import inspect
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from moeforge.core.huge_pages import (
    HUGE_PAGE,
    Region,
    anonymous_regions,
    new_memory,
    session_memory_on_huge_pages,
    unavailable,
)
from moeforge.runtime.engine import BackendOptions, EngineConfig, EngineConfigError

SMAPS = """\
7f0000000000-7f0000400000 rw-p 00000000 00:00 0
Size:               4096 kB
Rss:                1024 kB
VmFlags: rd wr mr mw me ac
7f0000400000-7f0000600000 r--p 00000000 00:00 0
Rss:                   0 kB
7f0000600000-7f0000800000 rw-s 00000000 00:05 12 /dev/zero (deleted)
Rss:                 512 kB
7f0000800000-7f0000a00000 rw-p 00001000 08:01 4242 /work/model.onnx.data
Rss:                2048 kB
55d000000000-55d000100000 rw-p 00000000 00:00 0 [heap]
Rss:                 100 kB
7ffc00000000-7ffc00100000 rw-p 00000000 00:00 0 [stack]
Rss:                  64 kB
"""


def test_anonymous_regions_are_private_writable_and_unnamed(tmp_path: Path):
    smaps = tmp_path / "smaps"
    smaps.write_text(SMAPS)
    assert anonymous_regions(smaps) == {0x7F0000000000: Region(0x7F0000000000, 0x7F0000400000, 1024 * 1024),
                                        0x55D000000000: Region(0x55D000000000, 0x55D000100000, 100 * 1024)}


def test_new_memory_is_what_appeared_grew_or_filled_up():
    mib = 2**20
    before = {0x1000: Region(0x1000, 0x5000, mib), 0x9000: Region(0x9000, 0xA000, mib),
              0x100000: Region(0x100000, 0x900000, mib)}
    after = {0x1000: Region(0x1000, 0x8000, mib), 0x9000: Region(0x9000, 0xA000, 2 * mib),
             0x100000: Region(0x100000, 0x900000, 40 * mib), 0x20000: Region(0x20000, 0x30000, 0)}
    # new region; grown tail; a region whose resident memory grew by >= 16 MiB (reused address space), whole
    assert new_memory(before, after) == [(0x5000, 0x8000), (0x20000, 0x30000), (0x100000, 0x900000)]
    assert new_memory(after, after) == []


def _matmul_model(rows: int, cols: int) -> onnx.ModelProto:
    """Y = X @ W with a constant W [rows, cols]: ONNX Runtime prepacks W into memory it allocates at load."""
    weight = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W"], ["Y"])], "g",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", rows])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", cols])],
        [numpy_helper.from_array(weight, "W")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


# Run in a fresh process: huge pages are a property of the process's memory, and a test process that has loaded
# and freed many models before may hand a session address space advised (or not) by earlier sessions.
SESSIONS = """
import json, sys
import numpy as np, onnxruntime as ort
from moeforge.runtime.backends.onnxruntime import make_session
from moeforge.core.huge_pages import huge_bytes, session_memory_on_huge_pages
path = sys.argv[1]
x = np.random.default_rng(1).standard_normal((3, 2048)).astype(np.float32)
before = huge_bytes()
plain = make_session(path, huge_pages=False)
plain_growth = huge_bytes() - before
with session_memory_on_huge_pages() as report:
    huge = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
before = huge_bytes()
default = make_session(path)
default_growth = huge_bytes() - before
(want,) = plain.run(None, {"X": x})
same = all(np.array_equal(s.run(None, {"X": x})[0], want) for s in (huge, default))
print(json.dumps({"plain_growth": plain_growth, "default_growth": default_growth, "skipped": report.skipped,
                  "errors": report.errors, "advised": report.bytes_advised,
                  "collapsed_now": report.huge_bytes_after - report.huge_bytes_before, "same": same}))
"""


@pytest.mark.skipif(unavailable() is not None, reason=f"no transparent huge pages here: {unavailable()}")
def test_session_weights_go_on_huge_pages_and_compute_the_same(tmp_path: Path):
    path = tmp_path / "matmul.onnx"
    onnx.save(_matmul_model(2048, 2048), path)  # 16 MiB of weights, prepacked by ONNX Runtime at load
    done = subprocess.run([sys.executable, "-P", "-c", SESSIONS, str(path)], capture_output=True, text=True,
                          timeout=300, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["plain_growth"] < 8 * HUGE_PAGE  # huge_pages=False: the weights stay on 4 KiB pages
    assert result["skipped"] is None and not result["errors"]
    assert result["advised"] >= 12 * 2**20  # the prepacked 16 MiB, less partial huge pages at the ends
    assert result["collapsed_now"] >= 12 * 2**20  # collapsed at load, not some day by khugepaged
    # make_session's default is off: one-shot sessions (golden logits, parity) would pay the collapse for nothing
    assert result["default_growth"] < 8 * HUGE_PAGE
    assert result["same"]  # and every session computes the same


def test_disabled_does_nothing_and_says_so():
    with session_memory_on_huge_pages(False) as report:
        block = np.ones(16 << 20, np.uint8)  # noqa: F841 -- memory that appears inside the block
    assert report.skipped == "huge_pages=False" and report.regions == 0 and report.bytes_advised == 0


def test_the_serving_path_turns_huge_pages_on_by_default():
    from moeforge.core.ort_session import make_session
    from moeforge.runtime.backends.onnxruntime import OrtBackend, OrtSession
    from moeforge.runtime.backends.onnxruntime_paged import PagedOrtBackend

    # The one default: BackendOptions, which the engine hands to the backend it builds as it is.
    assert EngineConfig().backend.huge_pages is True and BackendOptions().huge_pages is True
    for backend in (OrtBackend, PagedOrtBackend):
        assert inspect.signature(backend).parameters["options"].default.huge_pages is True
    for one_shot in (make_session, OrtSession):
        assert inspect.signature(one_shot).parameters["huge_pages"].default is False


def test_engine_config_checks_huge_pages():
    with pytest.raises(EngineConfigError, match=r"huge_pages='no'\) must be True or False"):
        EngineConfig(backend=BackendOptions(huge_pages="no"))  # type: ignore[arg-type]


def test_run_and_serve_pass_no_huge_pages_to_the_engine():
    from moeforge.cli.commands import _serve_options
    from moeforge.cli.parser import build_parser
    from moeforge.serve.runner import engine_config

    parser = build_parser()
    for flags, expected in (([], True), (["--no-huge-pages"], False)):
        serve = parser.parse_args(["serve", "artifacts/x", *flags])
        assert engine_config(_serve_options(serve, check=False)).backend.huge_pages is expected
        run = parser.parse_args(["run", "artifacts/x", "--prompt", "hi", *flags])
        assert run.no_huge_pages is not expected
