"""The ``moeforge`` command line (the top layer). ``main`` parses the command line with ``cli/parser`` (nothing heavy
imported: ``--help``, ``--version`` and argument errors answer at once), then imports ``cli/commands``, which holds
one function per command and the torch / ONNX / server stack they need."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from moeforge.cli.parser import build_parser

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script: parse, then run the command (exit codes 0 ok, 1 failed check, 2 bad
    input)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    # The heavy stack (torch, ONNX, the server), imported once the command line is known to be good.
    from moeforge.cli.commands import run_command

    return run_command(args, parser)
