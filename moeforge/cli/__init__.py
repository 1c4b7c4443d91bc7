"""The ``moeforge`` command line (the top layer): argument parsing and one function per command."""

from moeforge.cli.commands import main

__all__ = ["main"]
