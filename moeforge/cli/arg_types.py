"""argparse types with ranges: every numeric flag is checked as the command line is parsed, before a model loads or
a rank starts, and once, by the process the user started (the ranks a sharded command starts parse the same line,
which has passed by then). A value out of range is argparse's error (exit code 2) naming the flag and the range.

Every range has an upper bound too: a number past it is a typo, and would otherwise end in an ``OverflowError``
deep in ONNX Runtime, numpy or the socket layer (``--threads`` of 400 digits, ``--port 99999``). Integers are
written in ASCII digits (``int()`` would take ``1_000`` and Arabic-Indic digits); numbers are finite decimals
(``float()`` would take ``nan`` and ``inf``).
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable

MAX_DIGITS = 20  # of an integer flag: an int64 has 19
MAX_NUMBER_CHARS = 40  # of a decimal number flag
INT32_MAX = 2**31 - 1  # tokens, blocks, steps, requests: what the graphs and the scheduler count in
MAX_THREADS = 4096
MAX_PORT = 65535
MAX_SEED = 2**64 - 1  # numpy's and torch's generators take 64-bit seeds
MAX_TIMEOUT_S = 7 * 86400.0  # a week: longer is a typo
_INTEGER = re.compile(r"\s*[+-]?[0-9]+\s*")
_NUMBER = re.compile(r"\s*[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?\s*")


def _shown(text: str) -> str:
    return repr(text) if len(text) <= 24 else f"{text[:21]!r}..."


def int_in(lo: int, hi: int) -> Callable[[str], int]:
    """An argparse type: an integer in ``lo..hi``."""

    def parse(text: str) -> int:
        if not _INTEGER.fullmatch(text) or len(text.strip().lstrip("+-")) > MAX_DIGITS or not lo <= int(text) <= hi:
            raise argparse.ArgumentTypeError(f"must be an integer in {lo}..{hi}, got {_shown(text)}")
        return int(text)

    parse.__name__ = f"integer in {lo}..{hi}"  # argparse names the type by it in some messages
    return parse


def number_in(lo: float, hi: float, *, above: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite decimal number in ``[lo, hi]`` (``above``: greater than ``lo``, not equal)."""
    interval = f"{'(' if above else '['}{lo:g}, {hi:g}]"

    def parse(text: str) -> float:
        value = float(text) if _NUMBER.fullmatch(text) and len(text) <= MAX_NUMBER_CHARS else math.nan
        if not (math.isfinite(value) and (value > lo if above else value >= lo) and value <= hi):
            raise argparse.ArgumentTypeError(f"must be a number in {interval}, got {_shown(text)}")
        return value

    parse.__name__ = f"number in {interval}"
    return parse


# The ranges the commands share.
port = int_in(1, MAX_PORT)
threads = int_in(0, MAX_THREADS)  # 0: ONNX Runtime's own choice, as BackendOptions(threads=0)
count = int_in(1, INT32_MAX)  # tokens, blocks, requests, steps: at least one
count_or_zero = int_in(0, INT32_MAX)  # the same where 0 means none, off or automatic
seed = int_in(0, MAX_SEED)
timeout_s = number_in(0.0, MAX_TIMEOUT_S, above=True)
