"""The package's layers (docs/architecture.md): a module imports only from lower layers of
the package, never from its own callers. Counted as ``tests/test_imports.py`` counts imports
(anywhere in a module's source, ``TYPE_CHECKING`` included)."""

from __future__ import annotations

import ast

import pytest
from test_imports import MODULES, imported

# Bottom up: a unit (a top-level module, or a subpackage with everything in it) may import the
# units of lower ranks and itself. Equal ranks do not import each other.
RANKS = {
    "errors": 0,
    "compat": 0,
    "version": 0,
    "registry": 0.5,  # imports only errors; cache registers with it
    "atomic": 1,
    "cache": 1,
    "triton": 1,
    "fingerprint": 1,
    "attention": 2,
    "runtime": 3,
    "rope": 4,
    "state_fit": 4,
    "checks": 5,
    "spans": 6,
    "prompts": 6,
    "provenance": 6,
    "testing": 6,
    "models": 7,
    "states": 8,
    "compress": 9,
    "store": 9,
    "project": 9,
    "ops": 10,
    "reusing": 10,
    "focusing": 11,
    "steering": 12,
    "memory": 12,
    "integrations": 13,
    "evals": 14,
    "cli": 15,
    "__main__": 16,
    "": 16,  # kvedit/__init__.py, the front door
}


def unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_unit_has_a_rank():
    assert {unit(m) for m in MODULES} <= set(RANKS), {unit(m) for m in MODULES} - set(RANKS)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_a_module_imports_only_lower_layers(module: str):
    mine = unit(module)
    wrong = [
        target
        for target in imported(module)
        if unit(target) != mine and RANKS[unit(target)] >= RANKS[mine]
    ]
    assert wrong == [], f"{module} (rank {RANKS[mine]}) imports {wrong}"


def front_door_names(module: str) -> list[str]:
    """The names ``module`` takes from the front door (``import kvedit``, ``from kvedit import
    x`` where ``x`` is no submodule, ``from .. import x`` reaching ``kvedit`` itself): an arrow
    up to the top layer, which :func:`imported` does not show (``kvedit`` is every module's
    ancestor)."""
    tree = ast.parse(MODULES[module].read_text())
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name == "kvedit"]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            mod = (
                ".".join(
                    base[: len(base) - (node.level - 1)] + ([node.module] if node.module else [])
                )
                if node.level
                else node.module or ""
            )
            if mod == "kvedit":
                found += [
                    f"kvedit.{a.name}" for a in node.names if f"kvedit.{a.name}" not in MODULES
                ]
    return found


@pytest.mark.parametrize("module", sorted(m for m in MODULES if RANKS[unit(m)] < RANKS[""]))
def test_no_module_below_the_front_door_imports_it(module: str):
    assert front_door_names(module) == [], f"{module} imports the front door kvedit"
