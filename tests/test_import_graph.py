"""The package's import graph: no cycles, and no imports hidden inside functions except lazy optional ones.

Read from the source with ``ast`` (nothing is imported). Every ``import`` counts for the cycle check,
wherever it sits, so a cycle hidden behind a function-level import is still found. A function-level import
is allowed only for an optional heavy dependency (TensorRT, transformers, ...) or a moeforge module that needs
one, and must say so with a comment on its line or the line above.
"""

from __future__ import annotations

import ast
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Third-party modules a function may import lazily: optional extras, or heavy imports only some commands need.
LAZY_ALLOWED = ("tensorrt", "tensorrt_rtx", "transformers", "onnxruntime_genai", "polygraphy", "ml_dtypes",
                "matplotlib", "hypothesis", "cuda", "jinja2", "onnxruntime_extensions", "llama_cpp")
# moeforge modules whose import needs an optional dependency (TensorRT) or the GPU runtime, or costs seconds of
# start-up that only some runs need (the sharded-rank collectives: torch.distributed).
LAZY_INTERNAL = ("moeforge.runtime.backends.tensorrt", "moeforge.plugins.moe_router.tensorrt",
                 "moeforge.plugins.paged_attention.tensorrt", "moeforge.runtime.collectives")


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    target: str  # the imported module
    line: int
    nested: bool  # inside a function
    commented: bool


def package_dirs() -> dict[str, Path]:
    """moeforge package name -> source folder, from pyproject's setuptools mapping."""
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapping = setup.get("package-dir", {})
    dirs = {}
    for package in setup["packages"]:
        if package in mapping:
            dirs[package] = ROOT / mapping[package]
        else:  # below a mapped parent
            parent = max((p for p in mapping if package.startswith(p + ".")), key=len)
            dirs[package] = ROOT / mapping[parent] / package[len(parent) + 1:].replace(".", "/")
    return dirs


def modules() -> dict[str, Path]:
    """Every module of the package: dotted name -> file."""
    out = {}
    for package, folder in package_dirs().items():
        for path in folder.glob("*.py"):
            out[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return out


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imports(known: dict[str, Path]) -> list[Import]:
    found = []
    for module, path in known.items():
        source = path.read_text()
        lines = source.splitlines()
        package = module if path.stem == "__init__" else module.rpartition(".")[0]
        tree = ast.parse(source)
        nested_nodes = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
                        for n in ast.walk(f) if isinstance(n, ast.Import | ast.ImportFrom)}
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], base]).strip(".")
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
            else:
                continue
            text = lines[node.lineno - 1] + (lines[node.lineno - 2] if node.lineno > 1 else "")
            for target in targets:
                found.append(Import(module, target, node.lineno, id(node) in nested_nodes, "#" in text))
    return found


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_package_has_no_import_cycle() -> None:
    known = modules()
    edges: dict[str, set[str]] = {m: set() for m in known}
    for imp in imports(known):
        target = _resolve(imp.target, known)
        # A package's __init__ importing its own submodules is not a cycle of concepts.
        if target is not None and target != imp.module and not target.startswith(imp.module + "."):
            edges[imp.module].add(target)
    assert cycles(edges) == []


def test_function_level_imports_are_only_lazy_optional_dependencies_with_a_reason() -> None:
    known = modules()
    bad = []
    for imp in imports(known):
        if not imp.nested:
            continue
        internal = _resolve(imp.target, known)
        allowed = internal in LAZY_INTERNAL if internal else imp.target.split(".")[0] in LAZY_ALLOWED
        if not (allowed and imp.commented):
            bad.append(f"{known[imp.module].relative_to(ROOT)}:{imp.line} imports {imp.target}")
    assert bad == []


def test_the_checker_sees_a_cycle_and_a_hidden_import(tmp_path: Path) -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    tree = ast.parse("def f():\n    import os\n")
    assert any(isinstance(n, ast.Import) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)
               for n in ast.walk(f))
