"""``python -m moeforge.cli``: the ``moeforge`` command (torchrun and the self-spawned ranks start it this way)."""

import sys

from moeforge.cli.commands import main

sys.exit(main())
