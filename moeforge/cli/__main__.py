"""``python -m moeforge.cli``: the ``moeforge`` command (torchrun and the self-spawned ranks start it this way)."""

import sys

from moeforge.cli import main

if __name__ == "__main__":  # not when a spawned worker (compile --workers) imports the parent's main module
    sys.exit(main())
