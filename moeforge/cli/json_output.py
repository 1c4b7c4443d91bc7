"""The JSON the command line prints or writes is standard JSON (RFC 8259): no ``NaN`` or ``Infinity``, which Python's
``json`` writes by default and which JavaScript's ``JSON.parse``, jq and Go's ``encoding/json`` reject.

A non-finite number is written as ``null``, as JavaScript's ``JSON.stringify`` and pydantic write it: in moeforge's
results an infinite number is a limit that does not apply (a precision's ``kl_max`` or ``atol``) or a measurement
with nothing to divide by, and ``null`` says "no number" in every language. The text is then written by
``dumps_strict``, so a value this mapping misses raises instead of leaving as something that is not JSON.
"""

from __future__ import annotations

import math
from typing import Any

from moeforge.core.strict_json import dumps_strict


def finite_or_null(value: Any) -> Any:
    """``value`` with every non-finite float in it (inside dicts, lists and tuples too) replaced by None."""
    if isinstance(value, float):  # numpy's float64 too
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite_or_null(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [finite_or_null(item) for item in value]
    return value


def to_json(value: Any, **kwargs: Any) -> str:
    """``value`` as standard JSON text (``json.dumps`` keywords apply), non-finite numbers as null."""
    return dumps_strict(finite_or_null(value), **kwargs)
