"""No kvedit module uses another kvedit module's private names (#65): a name with one leading
underscore is its module's own, so that module may change it without a look elsewhere. What one
module needs of another is public (in its ``__all__`` where it has one). Checked on the source:
``from .x import _name``, and ``mod._name`` where ``mod`` was imported from kvedit (``from .
import mod``, ``import kvedit.x as mod``, a class imported from a kvedit module). Dunders
(``__version__``) are not private. Private names of other packages (transformers, torch) are
not this test's concern; tests may use kvedit's private names."""

from __future__ import annotations

import ast
from pathlib import Path

import kvedit

ROOT = Path(kvedit.__file__).parent


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _ours(node: ast.ImportFrom) -> bool:
    return node.level > 0 or (node.module or "").split(".")[0] == "kvedit"


def private_uses(source: str) -> list[str]:
    """Each use of another kvedit module's private name in ``source``, as ``line: name``."""
    tree = ast.parse(source)
    bound: set[str] = set()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and _ours(node):
            for alias in node.names:
                if _private(alias.name):
                    found.append(f"{alias.lineno}: {alias.name}")
                bound.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "kvedit":
                    bound.add(alias.asname or alias.name.split(".")[0])
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and _private(node.attr)
            and isinstance(node.value, ast.Name)
            and node.value.id in bound
        ):
            found.append(f"{node.lineno}: {node.value.id}.{node.attr}")
    return sorted(found, key=lambda use: int(use.split(":")[0]))


def test_the_finder_sees_each_way_of_reaching_a_private_name():
    source = (
        "from .attached import (\n    PUBLIC,\n    _checker,\n)\n"
        "from .. import checks\nimport kvedit.memory.files as files\nimport torch\n"
        "from transformers import modeling_utils\nfrom ..version import __version__\n"
        "checks._limit(1)\nfiles._merged\ntorch._C\nmodeling_utils._init_weights\n"
        "PUBLIC._inner\nself._own\n"
    )
    assert private_uses(source) == [
        "3: _checker",
        "10: checks._limit",
        "11: files._merged",
        "14: PUBLIC._inner",
    ]


def test_no_module_uses_another_modules_private_names():
    found = {
        str(path.relative_to(ROOT.parent)): uses
        for path in sorted(ROOT.rglob("*.py"))
        if (uses := private_uses(path.read_text(encoding="utf-8")))
    }
    assert found == {}
