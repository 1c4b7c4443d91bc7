"""moeforge's benchmark suite: ``python -m benchmarks list`` names the benchmarks, ``python -m benchmarks NAME
[ARGS]`` runs one (benchmarks/README.md). Each is also a script, ``python benchmarks/NAME.py``; the scripts import
their shared modules as siblings (``from timer import Rounds``), not through this package."""
