"""The package's import graph: folders are layers, no cycles, no imports hidden inside functions but lazy optional ones.

``moeforge/``'s subpackages are its layers, bottom to top (``LAYERS``, as docs/architecture.md draws them): a module
imports only modules of its own folder or of folders below it, never one above (an upward import) and never one of
another folder at its level (there is none: the order is total). The root ``moeforge/__init__.py`` holds the version
only and every other module lives in a layer.

Read from the source with ``ast`` (nothing is imported). Every ``import`` counts for the cycle check,
wherever it sits, so a cycle hidden behind a function-level import is still found. A function-level import
is allowed only for an optional heavy dependency (TensorRT, transformers, ...) or a moeforge module that needs
one, and must say so with a comment on its line or the line above.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The layers, bottom to top: each imports only itself and the folders before it.
LAYERS = ("core", "ops", "model", "passes", "quant", "runtime", "verify", "compile", "parallel", "serve", "cli")
# Third-party modules a function may import lazily: optional extras, or heavy imports only some commands need
# (torch: the runtime on ONNX Runtime needs none of it; only a GPU backend's CUDA probe does).
LAZY_ALLOWED = ("tensorrt", "tensorrt_rtx", "transformers", "onnxruntime_genai", "polygraphy", "ml_dtypes",
                "matplotlib", "hypothesis", "cuda", "jinja2", "onnxruntime_extensions", "llama_cpp", "torch")
# moeforge modules whose import needs an optional dependency (TensorRT) or the GPU runtime, or costs seconds of
# start-up that only some runs need (the sharded-rank collectives: torch.distributed; the commands' whole stack,
# which `moeforge --help` and argument errors never load).
LAZY_INTERNAL = ("moeforge.cli.commands", "moeforge.runtime.backends.tensorrt", "moeforge.ops.moe_router.tensorrt",
                 "moeforge.ops.paged_attention.tensorrt", "moeforge.ops.collectives.ort")


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    target: str  # the imported module
    line: int
    nested: bool  # inside a function
    commented: bool


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the package under ``root``: dotted name -> file."""
    return {".".join(path.relative_to(root).with_suffix("").parts[:-1] if path.stem == "__init__"
                     else path.relative_to(root).with_suffix("").parts): path
            for path in sorted((root / "moeforge").rglob("*.py"))}


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


def layer_of(module: str) -> int:
    """The layer index of a module (-1 for the root package ``moeforge``); KeyError for a module outside any layer."""
    parts = module.split(".")
    if len(parts) == 1:
        return -1
    if parts[1] not in LAYERS:
        raise KeyError(f"{module} is in no layer: put it in one of {LAYERS}")
    return LAYERS.index(parts[1])


def layer_violations(known: dict[str, Path]) -> list[str]:
    """Every import that goes up the layer order (wherever it sits, function-level imports included)."""
    bad = []
    for imp in imports(known):
        target = _resolve(imp.target, known)
        if target is None:
            continue
        source, dest = layer_of(imp.module), layer_of(target)
        if dest > source or (dest == -1 and target != "moeforge"):
            bad.append(f"{imp.module}:{imp.line} ({LAYERS[source]}) imports {target} ({LAYERS[dest]})")
    return bad


def test_every_module_lives_in_a_layer_folder() -> None:
    known = modules()
    loose = [m for m in known if m != "moeforge" and m.split(".")[1] not in LAYERS]
    assert loose == [], f"modules outside the layer folders {LAYERS}: {loose}"
    assert {p.name for p in (ROOT / "moeforge").iterdir() if p.is_dir() and p.name != "__pycache__"} == set(LAYERS)


def test_no_import_goes_up_the_layers() -> None:
    assert layer_violations(modules()) == []


def test_the_root_package_imports_nothing_of_its_own() -> None:
    known = modules()
    assert [i.target for i in imports(known) if i.module == "moeforge" and i.target.startswith("moeforge")] == []


def test_the_layer_check_catches_a_planted_upward_import(tmp_path: Path) -> None:
    """A copy of the package with one upward import (runtime -> serve) planted fails the check, and only there."""
    import shutil

    shutil.copytree(ROOT / "moeforge", tmp_path / "moeforge", ignore=shutil.ignore_patterns("__pycache__"))
    assert layer_violations(modules(tmp_path)) == []
    planted = tmp_path / "moeforge" / "runtime" / "scheduler.py"
    planted.write_text(planted.read_text() + "\nfrom moeforge.serve.protocol import CompletionRequest  # planted\n")
    bad = layer_violations(modules(tmp_path))
    assert len(bad) == 1 and bad[0].startswith("moeforge.runtime.scheduler:") and "(serve)" in bad[0]
    sideways = tmp_path / "moeforge" / "core" / "errors.py"  # the bottom layer reaching into the model layer
    sideways.write_text(sideways.read_text() + "\nimport moeforge.model.rope\n")
    assert len(layer_violations(modules(tmp_path))) == 2
