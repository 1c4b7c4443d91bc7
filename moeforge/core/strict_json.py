"""One reader for every JSON file moeforge reads back: plans, statistics, ``sharded.json``, ``resume.json``, caches.

A file a user's path points at may be anything an attacker or an accident left there: a 10 GB file, a nesting
bomb (``'[' * 200000``, which makes Python's decoder raise ``RecursionError``), ``NaN`` / ``Infinity`` (not JSON,
but Python writes and reads them), ``1e400`` (read as ``inf``), integers of 400 digits, ``true`` where a count
belongs (``bool`` is an ``int`` in Python), ``2.9`` or ``"2"`` where an integer belongs, a key given twice (Python
keeps the last, other readers the first: two tools would read two different files), a lone surrogate escape
(``"\\ud800"``: not text, and a traceback wherever it is printed or encoded later), a pseudo file of /proc or /sys
(``/proc/kmsg`` is consumed by reading it). Every reader goes through
``read_json_file`` / ``parse_json_text`` (size, depth, finite numbers) and the ``json_*`` field checks (strict types
and ranges), so each of these ends in one ``JsonFileError`` that names the file, the field and the fix, never in a
traceback and never in a silently coerced value.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from moeforge.core.errors import MoeforgeError

MAX_JSON_BYTES = 64 * 2**20  # far above any plan, statistics or manifest moeforge writes
MAX_JSON_DEPTH = 32  # moeforge's own files nest at most 5 deep
MAX_NUMBER_CHARS = 40  # digits of one number: an int64 has 19, a double's repr at most 24


class JsonFileError(MoeforgeError):
    """A JSON file moeforge reads back that is unreadable, malformed or out of range; the message names the file,
    the field and the fix."""


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    if len(text) > MAX_NUMBER_CHARS:
        raise ValueError(f"a number of {len(text)} characters")
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of a double's range")
    return value


def _bounded_int(text: str) -> int:
    if len(text) > MAX_NUMBER_CHARS:
        raise ValueError(f"an integer of {len(text)} digits")
    return int(text)


_SURROGATE = re.compile("[\ud800-\udfff]")
_PSEUDO_ROOTS = (Path("/proc"), Path("/sys"))


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's members as a dict; a key given twice, or one that is not text, raises ``ValueError``."""
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise ValueError(f"the key {key!r:.60} appears twice")
        if _SURROGATE.search(key):
            raise ValueError(f"the key {key!r:.60} holds a lone surrogate escape, which is not text")
        obj[key] = value
    return obj


def _depth(value: Any, limit: int) -> int:
    """The nesting depth of a parsed value (iterative: a deep value cannot overflow the stack here); a string with a
    lone surrogate (``"\\ud800"``, which no UTF-8 text holds) raises ``ValueError``."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str) and _SURROGATE.search(item):
            raise ValueError(f"the string {item[:40]!r} holds a lone surrogate escape, which is not text")
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            if deepest > limit:
                return deepest
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return deepest


def parse_json_text(text: str | bytes, *, source: str, fix: str = "", max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Parse ``text`` as strict JSON (no NaN / Infinity, finite numbers of at most 40 characters, at most
    ``max_depth`` levels); ``source`` names it in the error, ``fix`` says what to do about it."""
    hint = f"; {fix}" if fix else ""
    try:
        value = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float, parse_int=_bounded_int,
                           object_pairs_hook=_unique_keys)
        deep = _depth(value, max_depth) > max_depth
    except RecursionError:
        raise JsonFileError(f"{source} nests deeper than {max_depth} levels: it is not a file moeforge wrote{hint}") \
            from None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise JsonFileError(f"{source} is not valid JSON ({exc}){hint}") from None
    if deep:
        raise JsonFileError(f"{source} nests deeper than {max_depth} levels: it is not a file moeforge wrote{hint}")
    return value


def read_json_file(path: str | Path, *, what: str, fix: str = "", max_bytes: int = MAX_JSON_BYTES,
                   max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Read ``path`` (``what`` says which file it is, e.g. "placement plan") as strict JSON: a regular file (not a
    FIFO or device, which could block or never end) of at most ``max_bytes``, parsed by ``parse_json_text``."""
    data = read_regular_file(path, what=what, fix=fix, max_bytes=max_bytes)
    return parse_json_text(data, source=f"{what} {Path(path)}", fix=fix, max_depth=max_depth)


def read_regular_file(path: str | Path, *, what: str, fix: str = "", max_bytes: int = MAX_JSON_BYTES) -> bytes:
    """The bytes of ``path``, a regular file (not a FIFO or device, which could block or never end) of at most
    ``max_bytes``; else ``JsonFileError``. For a file that may hold JSON or another text format (a /metrics
    scrape) before the caller knows which."""
    path = Path(path)
    source = f"{what} {path}"
    hint = f"; {fix}" if fix else ""
    try:
        resolved = path.resolve(strict=False)
    except (OSError, RuntimeError):  # a link loop (RuntimeError before Python 3.13): os.open says so below
        resolved = path
    if any(resolved == root or root in resolved.parents for root in _PSEUDO_ROOTS):
        raise JsonFileError(f"{source} is a pseudo file of /proc or /sys, not a file moeforge wrote{hint}")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise JsonFileError(f"{source} does not exist{hint}") from None
    except OSError as exc:
        raise JsonFileError(f"{source} cannot be read ({exc.strerror or exc}){hint}") from None
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise JsonFileError(f"{source} is a directory, not a JSON file{hint}")
        if not stat.S_ISREG(info.st_mode):
            raise JsonFileError(f"{source} is not a regular file (a device, FIFO or socket){hint}")
        if info.st_size > max_bytes:
            raise JsonFileError(f"{source} is {info.st_size} bytes, over the {max_bytes} a {what} can be{hint}")
        with os.fdopen(os.dup(fd), "rb") as handle:
            data = handle.read(max_bytes + 1)
    except OSError as exc:
        raise JsonFileError(f"{source} cannot be read ({exc.strerror or exc}){hint}") from None
    finally:
        os.close(fd)
    if len(data) > max_bytes:  # grew while read
        raise JsonFileError(f"{source} is over the {max_bytes} bytes a {what} can be{hint}")
    return data


# ------------------------------------------------------------------------------------------- field checks
def _where(source: str, field: str) -> str:
    return f"{source}: {field!r}" if field else source


def json_object(value: Any, *, source: str, field: str = "", fix: str = "") -> Mapping[str, Any]:
    """``value`` as a JSON object (dict), else ``JsonFileError``."""
    if not isinstance(value, dict):
        hint = f"; {fix}" if fix else ""
        raise JsonFileError(f"{_where(source, field)} must be a JSON object, got {type(value).__name__}{hint}")
    return value


def json_list(value: Any, *, source: str, field: str = "", max_len: int | None = None,
              fix: str = "") -> Sequence[Any]:
    """``value`` as a JSON array of at most ``max_len`` items, else ``JsonFileError``."""
    hint = f"; {fix}" if fix else ""
    if not isinstance(value, list):
        raise JsonFileError(f"{_where(source, field)} must be a JSON array, got {type(value).__name__}{hint}")
    if max_len is not None and len(value) > max_len:
        raise JsonFileError(f"{_where(source, field)} has {len(value)} items, over the {max_len} allowed{hint}")
    return value


def json_int(value: Any, *, source: str, field: str, lo: int, hi: int, fix: str = "") -> int:
    """``value`` as an integer in ``lo..hi``: a JSON integer, never a bool, a float (``2.9``, ``2.0``) or a string."""
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        hint = f"; {fix}" if fix else ""
        shown = repr(value) if len(repr(value)) <= 40 else f"{repr(value)[:37]}..."
        raise JsonFileError(f"{_where(source, field)} must be an integer in {lo}..{hi}, got {shown}{hint}")
    return value


def json_number(value: Any, *, source: str, field: str, lo: float, hi: float, fix: str = "") -> float:
    """``value`` as a finite number in ``lo..hi`` (a JSON integer or float, never a bool or a string)."""
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    number = float(value) if ok and (not isinstance(value, int) or abs(value) < 2**1023) else math.nan
    if not (ok and math.isfinite(number) and lo <= number <= hi):
        hint = f"; {fix}" if fix else ""
        shown = repr(value) if len(repr(value)) <= 40 else f"{repr(value)[:37]}..."
        raise JsonFileError(f"{_where(source, field)} must be a number in {lo:g}..{hi:g}, got {shown}{hint}")
    return number


def json_str(value: Any, *, source: str, field: str, max_len: int = 4096, fix: str = "") -> str:
    """``value`` as a string of at most ``max_len`` characters."""
    if not isinstance(value, str) or len(value) > max_len:
        hint = f"; {fix}" if fix else ""
        raise JsonFileError(f"{_where(source, field)} must be a string of at most {max_len} characters{hint}")
    return value


def dumps_strict(value: Any, **kwargs: Any) -> str:
    """``json.dumps`` that refuses NaN / Infinity (standard JSON: other languages' parsers reject them)."""
    return json.dumps(value, allow_nan=False, **kwargs)
