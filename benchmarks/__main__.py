"""The suite's entry point, run from the repository root::

    python -m benchmarks list              the published benchmarks, one line each, and the tools
    python -m benchmarks NAME [ARGS...]    run benchmarks/NAME.py with ARGS (NAME --help: its options)
    python -m benchmarks tables [--print]  render docs/performance.md's measured tables from results/
    python -m benchmarks results           every results file: its benchmark, date and machine
    python -m benchmarks machine           the machine description every results file records

NAME runs exactly as ``python benchmarks/NAME.py ARGS`` does (the process is replaced by it).
"""

from __future__ import annotations

import difflib
import json
import os
import sys
from collections.abc import Sequence

from benchmarks.suite import PUBLISHED, RESULTS, SHARED, TOOLS, by_name, owner


def list_benchmarks() -> str:
    """The published benchmarks by group, then the tools and the shared modules."""
    width = max(len(name) for name in [*by_name(), *SHARED])
    lines = ["Published benchmarks (docs/performance.md; `python -m benchmarks NAME --help`):"]
    group = None
    for benchmark in PUBLISHED:
        if benchmark.group != group:
            group = benchmark.group
            lines.append(f"\n  {group}")
        lines.append(f"    {benchmark.name:<{width}}  {benchmark.summary}")
    lines.append("\nTools:")
    lines += [f"    {name:<{width}}  {summary}" for name, (_, summary) in TOOLS.items()]
    lines.append("\nShared modules (imported by the scripts, not run):")
    lines += [f"    {name:<{width}}  {summary}" for name, summary in SHARED.items()]
    return "\n".join(lines)


def list_results() -> str:
    """One line per results file: the benchmark that writes it, when, and on what."""
    lines = []
    for path in sorted(RESULTS.glob("*.json")):
        benchmark = owner(path)
        payload = json.loads(path.read_text())
        machine = payload.get("machine") or {}
        described = f"{machine.get('cpu', '?')}, {machine.get('usable_cores', '?')} cores" if machine else "no machine"
        lines.append(f"{path.name:<48} {benchmark.name if benchmark else '(no benchmark)':<21} "
                     f"{str(payload.get('date_utc', '?'))[:10]}  {described}")
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    if not argv or argv[0] in ("list", "-h", "--help"):
        print(__doc__ if argv and argv[0] != "list" else list_benchmarks())
        return 0
    command, args = argv[0], list(argv[1:])
    if command == "results":
        print(list_results())
        return 0
    if command == "machine":
        from moeforge.cli.bench import machine_info

        print(json.dumps(machine_info(), indent=2))
        return 0
    scripts = by_name()
    if command not in scripts:
        if command in SHARED:
            why = f"{command!r} is a shared module that the benchmarks import, not a benchmark"
        else:
            hint = difflib.get_close_matches(command, scripts, n=1)
            why = f"no benchmark {command!r}" + (f" (did you mean {hint[0]!r}?)" if hint else "")
        print(f"{why}; `python -m benchmarks list` names them", file=sys.stderr)
        return 2
    script = str(scripts[command])
    os.execv(sys.executable, [sys.executable, script, *args])  # exactly `python benchmarks/NAME.py ARGS`


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except BrokenPipeError:  # `python -m benchmarks list | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
