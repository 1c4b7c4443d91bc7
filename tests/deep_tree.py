"""Folder chains deeper than the recursion limit and PATH_MAX, for the tests of tree walks and removals."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


def deep_tree(top: Path, depth: int, at_bottom: Callable[[int], None] | None = None) -> None:
    """``top/d/d/.../d``, ``depth`` folders deep, made by descriptor (the path outgrows PATH_MAX); ``at_bottom`` gets
    the deepest folder's descriptor to add what a test wants there (e.g. ``os.symlink(..., dir_fd=fd)``)."""
    top.mkdir()
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=fd)
            child = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = child
        if at_bottom is not None:
            at_bottom(fd)
    finally:
        os.close(fd)


def add_file(name: str) -> Callable[[int], None]:
    """An ``at_bottom`` that creates an empty file ``name``."""
    return lambda fd: os.close(os.open(name, os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))
