"""Typed reads of configuration values: each check names the field and the fix, and bounds every size.

A crafted config.json or GGUF header must fail with a ``ConfigError`` that says which field is wrong, never with a
TypeError deep in the model, a rounded value or a loop sized by a huge number. ``moeforge.core.config`` checks
its own fields with these; ``hf_config`` and the GGUF readers read raw values through them.
"""

from __future__ import annotations

import math
from typing import Any, overload

from moeforge.core.errors import ConfigError

# Inclusive bounds for every size in a config. They sit far above any released model (DeepSeek-V3: 61 layers,
# hidden 7168, 128 heads, 256 experts, vocab 129280, 163840 positions) yet low enough that no loop or
# allocation scaled by one of them can hang or exhaust memory before the weights are read (a crafted
# num_hidden_layers of 10^9 would). Integers only: JSON true or 64.5 is refused, never rounded.
SIZE_LIMITS: dict[str, tuple[int, int]] = {
    "vocab_size": (1, 2**22), "hidden_size": (1, 2**17), "intermediate_size": (1, 2**20),
    "num_hidden_layers": (1, 1024), "num_attention_heads": (1, 2**12), "num_key_value_heads": (1, 2**12),
    "head_dim": (1, 2**12), "max_position_embeddings": (1, 2**24), "original_max_position_embeddings": (1, 2**24),
    "sliding_window": (1, 2**24),
    # MLA
    "q_lora_rank": (1, 2**16), "kv_lora_rank": (1, 2**16), "qk_nope_head_dim": (1, 2**12),
    "qk_rope_head_dim": (1, 2**12), "v_head_dim": (1, 2**12),
    # MoE
    "n_routed_experts": (1, 2**14), "n_shared_experts": (0, 2**14), "num_experts_per_tok": (1, 2**14),
    "moe_intermediate_size": (1, 2**20), "first_k_dense_replace": (0, 1024), "n_group": (1, 2**14),
    "topk_group": (1, 2**14),
    # DSA (DeepSeek-V3.2)
    "index_topk": (1, 2**24), "index_head_dim": (1, 2**12), "index_n_heads": (1, 2**12),
    # DeepSeek-V4
    "o_groups": (1, 2**12), "o_lora_rank": (1, 2**16), "compress_rate": (1, 2**16), "hc_mult": (1, 64),
    "hc_sinkhorn_iters": (1, 1000), "num_nextn_predict_layers": (0, 64),
    "token_id": (0, 2**31 - 1),
}


def show(value: object, limit: int = 60) -> str:
    """A short repr for error messages (a crafted value may be huge, or an int too long to print)."""
    try:
        text = repr(value)
    except ValueError:  # int beyond sys.get_int_max_str_digits()
        return f"a {type(value).__name__} too large to print"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_int(value: object, field: str, limits: str | None = None) -> int:
    """``value`` as an int, within ``SIZE_LIMITS[limits]`` when given; else ConfigError naming ``field``."""
    # bool is an int subclass: JSON ``true`` must not pass as 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(
            f"{field} must be an integer, got {show(value)} ({type(value).__name__}); fix it in the model's config",
            field=field,
        )
    if limits is not None:
        lo, hi = SIZE_LIMITS[limits]
        if not lo <= value <= hi:
            raise ConfigError(
                f"{field} must be in {lo}..{hi}, got {show(value)}; fix it in the model's config", field=field
            )
    return int(value)


def check_float(value: object, field: str, positive: bool = False) -> float:
    """``value`` as a finite float (> 0 when ``positive``); else ConfigError naming ``field``."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(
            f"{field} must be a number, got {show(value)} ({type(value).__name__}); fix it in the model's config",
            field=field,
        )
    try:
        number = float(value)
    except OverflowError:  # an int beyond float range
        number = math.inf
    if not math.isfinite(number) or (positive and number <= 0):
        raise ConfigError(
            f"{field} must be a finite number{' > 0' if positive else ''}, got {show(value)}; "
            "fix it in the model's config",
            field=field,
        )
    return number


def check_bool(value: object, field: str) -> bool:
    """``value`` if it is a bool; else ConfigError (the string "false" must not read as True)."""
    if not isinstance(value, bool):
        raise ConfigError(f"{field} must be true or false, got {show(value)}", field=field)
    return value


# A JSON null reads as absent (HF writes null for unset optional fields); any other wrong type is refused.
@overload
def opt_int(d: dict[str, Any], key: str, default: int, limits: str | None = None, prefix: str = "") -> int: ...
@overload
def opt_int(
    d: dict[str, Any], key: str, default: None = None, limits: str | None = None, prefix: str = ""
) -> int | None: ...
def opt_int(
    d: dict[str, Any], key: str, default: int | None = None, limits: str | None = None, prefix: str = ""
) -> int | None:
    """``d[key]`` checked as an int (``check_int``, the error naming ``prefix + key``), or ``default`` when absent."""
    value = d.get(key)
    return default if value is None else check_int(value, prefix + key, limits)


@overload
def opt_float(d: dict[str, Any], key: str, default: float, prefix: str = "", positive: bool = False) -> float: ...
@overload
def opt_float(
    d: dict[str, Any], key: str, default: None = None, prefix: str = "", positive: bool = False
) -> float | None: ...
def opt_float(
    d: dict[str, Any], key: str, default: float | None = None, prefix: str = "", positive: bool = False
) -> float | None:
    """``d[key]`` checked as a finite float (``check_float``), or ``default`` when absent."""
    value = d.get(key)
    return default if value is None else check_float(value, prefix + key, positive)


def opt_bool(d: dict[str, Any], key: str, default: bool, prefix: str = "") -> bool:
    """``d[key]`` checked as a bool (``check_bool``), or ``default`` when absent."""
    value = d.get(key)
    return default if value is None else check_bool(value, prefix + key)


def opt_dict(d: dict[str, Any], key: str) -> dict[str, Any]:
    """``d[key]`` if it is a JSON object, {} when absent; else ConfigError naming ``key``."""
    value = d.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(
            f"{key} must be a JSON object (e.g. {{\"rope_type\": \"yarn\", \"factor\": 4.0, ...}}), "
            f"got {show(value)}",
            field=key,
        )
    return value
