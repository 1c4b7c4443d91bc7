"""The ``moeforge`` command line (the top layer): argument parsing and one function per command."""

from moeforge.cli import main

__all__ = ["main"]
