"""Errors that carry a message for the user. The CLI turns them into exit code 2."""

from __future__ import annotations


class MoeforgeError(Exception):
    """Base class: bad input that the user can fix. The message names the problem and the fix."""


class ConfigError(MoeforgeError):
    """An unsupported or inconsistent model configuration; ``field`` names the offending field."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class CheckpointError(MoeforgeError):
    """A checkpoint that cannot be read: missing or truncated file, missing shard, wrong shapes."""


class TokenizerError(MoeforgeError):
    """No usable tokenizer for the model, or text/ids it cannot handle."""


class ArtifactError(MoeforgeError):
    """An artifact directory that cannot be written or read: exists, unwritable, missing, corrupted."""


class GroupArtifactError(ArtifactError):
    """An artifact problem every rank of a sharded group found together (each raises the same message): rank 0
    reports it, the other ranks only exit with its code."""
