"""The import graph of kvedit has no cycles.

Built with the standard library's ``ast`` from the source files: every import counts, including
one inside a function; only imports under ``if TYPE_CHECKING:`` are exempt. Importing a
submodule counts as importing each of its parent packages (their ``__init__`` runs), except the
importing module's own ancestors, which are already initialising when it runs.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvedit

ROOT = Path(kvedit.__file__).parent


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES = {module_name(p): p for p in ROOT.rglob("*.py")}


def is_package(name: str) -> bool:
    return MODULES.get(name, Path()).name == "__init__.py"


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                skip.update(id(n) for n in ast.walk(child))
    return skip


def imported(name: str) -> set[str]:
    """The kvedit modules ``name`` imports (anywhere in its source)."""
    tree = ast.parse(MODULES[name].read_text())
    skip = _type_checking_nodes(tree)
    package = name if is_package(name) else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for alias in node.names:
                sub = f"{mod}.{alias.name}"
                targets.add(sub if sub in MODULES else mod)
    out = set()
    ancestors = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
    for target in targets:
        if target not in MODULES:
            continue
        parts = target.split(".")
        for i in range(1, len(parts) + 1):
            step = ".".join(parts[:i])
            if step in MODULES and step not in ancestors and step != name:
                out.add(step)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_imports_inside_functions_and_skips_type_checking():
    graph = {name: imported(name) for name in MODULES}
    assert "kvedit.runtime" in graph["kvedit.state"]
    assert "kvedit.runtime" in graph["kvedit.checks"]  # imported inside a function
    fake = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(fake) == [["a", "b", "c"]]


def test_kvedit_has_no_import_cycles():
    graph = {name: imported(name) for name in MODULES}
    assert cycles(graph) == []
