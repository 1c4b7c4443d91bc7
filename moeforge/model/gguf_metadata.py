"""Typed access to one architecture's GGUF metadata keys (``{arch}.block_count``, ...): values checked and bounded
under the key's own name before any arithmetic uses them, so a crafted file gets a ConfigError naming the key."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moeforge.core.config_fields import check_bool, check_float, check_int
from moeforge.core.errors import ConfigError


def uniform(key: str, value: Any) -> Any:
    """llama.cpp allows per-layer arrays for head counts; one value for all layers is supported."""
    if isinstance(value, list):
        if not value or any(v != value[0] for v in value):
            raise ConfigError(f"GGUF key {key!r} varies per layer ({value}); only uniform layers are supported",
                              field=key)
        return value[0]
    return value


@dataclass(frozen=True)
class ArchMetadata:
    """The metadata of a GGUF whose ``general.architecture`` is ``arch``."""

    meta: dict[str, Any]
    arch: str

    def key(self, suffix: str) -> str:
        return f"{self.arch}.{suffix}"

    def has(self, suffix: str) -> bool:
        return self.key(suffix) in self.meta

    def need(self, suffix: str) -> Any:
        key = self.key(suffix)
        if key not in self.meta:
            raise ConfigError(f"GGUF metadata is missing the required key {key!r}", field=key)
        return uniform(key, self.meta[key])

    def get(self, suffix: str, default: Any = None) -> Any:
        key = self.key(suffix)
        return uniform(key, self.meta[key]) if key in self.meta else default

    def need_int(self, suffix: str, limits: str | None) -> int:
        return check_int(self.need(suffix), self.key(suffix), limits)

    def get_int(self, suffix: str, default: int, limits: str | None) -> int:
        value = self.get(suffix)
        return default if value is None else check_int(value, self.key(suffix), limits)

    def get_float(self, suffix: str, default: float | None, positive: bool = False) -> float | None:
        value = self.get(suffix)
        return default if value is None else check_float(value, self.key(suffix), positive=positive)

    def get_bool(self, suffix: str, default: bool) -> bool:
        value = self.get(suffix)
        return default if value is None else check_bool(value, self.key(suffix))
