"""The import graph of kvedit has no cycles, and no module takes names from its own parents.

Built with the standard library's ``ast`` from the source files: every import counts, including
one inside a function and one under ``if TYPE_CHECKING:`` (a cycle of type-only imports still
ties the modules together: neither can be read, typed or moved without the other). Importing a
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


def imported(name: str) -> set[str]:
    """The kvedit modules ``name`` imports (anywhere in its source)."""
    tree = ast.parse(MODULES[name].read_text())
    package = name if is_package(name) else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(tree):
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


def parent_names(name: str) -> list[str]:
    """``package.name`` for each name ``name`` imports from one of its own parent packages
    (``from . import __version__``, ``from .. import x`` where ``x`` is not a submodule),
    anywhere in its source: the parent is still initialising when the module runs, so such an
    import is a hidden cycle the graph does not show."""
    tree = ast.parse(MODULES[name].read_text())
    package = name if is_package(name) else name.rpartition(".")[0]
    ancestors = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod not in ancestors:
                continue
            found += [f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" not in MODULES]
    return found


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


def test_the_graph_sees_imports_inside_functions_and_under_type_checking(tmp_path, monkeypatch):
    graph = {name: imported(name) for name in MODULES}
    assert "kvedit.states.passes" in graph["kvedit.states.continuing"]
    assert "kvedit.runtime" in graph["kvedit.checks.state_fits"]  # imported inside a function
    pkg = tmp_path / "kvedit" / "sub"
    pkg.mkdir(parents=True)
    (pkg / "mod.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "import typing\n"
        "if TYPE_CHECKING:\n    from .low import Thing\n"
        "if typing.TYPE_CHECKING:\n    import kvedit.sub.other\n"
    )
    for name in ("mod", "low", "other"):
        monkeypatch.setitem(MODULES, f"kvedit.sub.{name}", pkg / f"{name}.py")
    assert {"kvedit.sub.low", "kvedit.sub.other"} <= imported("kvedit.sub.mod")
    fake = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(fake) == [["a", "b", "c"]]


def test_kvedit_has_no_import_cycles():
    graph = {name: imported(name) for name in MODULES}
    assert cycles(graph) == []


def test_parent_names_are_found_at_module_level_and_inside_functions(tmp_path, monkeypatch):
    pkg = tmp_path / "kvedit" / "sub"
    pkg.mkdir(parents=True)
    (pkg / "mod.py").write_text(
        "from . import sibling\nfrom .. import __version__\n"
        "def f():\n    from ... import kvedit_name\n    from .. import x as y\n"
    )
    monkeypatch.setitem(MODULES, "kvedit.sub.mod", pkg / "mod.py")
    monkeypatch.setitem(MODULES, "kvedit.sub.sibling", pkg / "sibling.py")
    assert parent_names("kvedit.sub.mod") == ["kvedit.__version__", "kvedit.x"]


def test_no_module_imports_its_parent_packages_own_names():
    found = {name: parent_names(name) for name in MODULES}
    assert {name: names for name, names in found.items() if names} == {}
