"""The one strict JSON reader (core/strict_json): size, depth, finite numbers, strict field types."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moeforge.core.strict_json import (
    JsonFileError,
    dumps_strict,
    json_int,
    json_list,
    json_number,
    parse_json_text,
    read_json_file,
)


@pytest.mark.parametrize("text", ["[" * 200000, '{"a":' * 50000, "[" * 40 + "]" * 40])
def test_nesting_bombs_are_refused_naming_the_file(text: str) -> None:
    with pytest.raises(JsonFileError, match=r"plan x\.json nests deeper than"):
        parse_json_text(text, source="plan x.json")


@pytest.mark.parametrize("text", ["NaN", "[Infinity]", '{"ep": -Infinity}', '{"ep": 1e400}', "1" * 400,
                                  '{"a": 1.' + "5" * 100 + "}"])
def test_non_finite_and_huge_numbers_are_refused(text: str) -> None:
    with pytest.raises(JsonFileError, match="is not valid JSON"):
        parse_json_text(text, source="f")


def test_regular_values_parse() -> None:
    assert parse_json_text('{"ep": 2, "x": [1.5, -3e10, null, true]}', source="f") == \
        {"ep": 2, "x": [1.5, -3e10, None, True]}


def test_read_json_file_refuses_directories_devices_and_big_files(tmp_path: Path) -> None:
    with pytest.raises(JsonFileError, match="is a directory"):
        read_json_file(tmp_path, what="plan")
    with pytest.raises(JsonFileError, match="not a regular file"):
        read_json_file("/dev/null", what="plan")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(JsonFileError, match="not a regular file"):  # would block forever if opened blocking
        read_json_file(fifo, what="plan")
    big = tmp_path / "big.json"
    big.write_text("[" + "0," * 600 + "0]")
    with pytest.raises(JsonFileError, match="over the 1000 a plan can be"):
        read_json_file(big, what="plan", max_bytes=1000)
    with pytest.raises(JsonFileError, match="does not exist; make one"):
        read_json_file(tmp_path / "none.json", what="plan", fix="make one")
    (tmp_path / "ok.json").write_text('{"a": [1]}')
    assert read_json_file(tmp_path / "ok.json", what="plan") == {"a": [1]}


@pytest.mark.parametrize("value", [True, 2.9, 2.0, "2", None, -1, 10**400, 9])
def test_json_int_is_strict(value: object) -> None:
    with pytest.raises(JsonFileError, match=r"f: 'ep' must be an integer in 0\.\.8"):
        json_int(value, source="f", field="ep", lo=0, hi=8)


def test_json_int_and_number_accept_their_range() -> None:
    assert json_int(8, source="f", field="ep", lo=0, hi=8) == 8
    assert json_number(3, source="f", field="x", lo=0, hi=10) == 3.0
    for bad in (float("inf"), float("nan"), 10**400, 1e308, "1", False, -0.5):
        with pytest.raises(JsonFileError, match="must be a number"):
            json_number(bad, source="f", field="x", lo=0, hi=1e300)
    with pytest.raises(JsonFileError, match="has 3 items, over the 2"):
        json_list([1, 2, 3], source="f", field="rows", max_len=2)


def test_dumps_strict_refuses_non_finite() -> None:
    with pytest.raises(ValueError):
        dumps_strict({"kl": float("inf")})


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300) | st.text(alphabet='[]{}":,0123456789.eE+-aNIfinty ', max_size=300))
def test_any_input_parses_or_raises_the_one_error(data: bytes | str) -> None:
    try:
        value = parse_json_text(data, source="fuzz")
    except JsonFileError:
        return
    json.dumps(value, allow_nan=False)  # whatever parses is standard, finite JSON
