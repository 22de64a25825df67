"""Size limits on the package's code: no module over 500 lines, no function body over 80.

Issue #39: long modules and functions mix concerns. ``kvedit/triton/`` is excluded (its kernels
are written as single functions on purpose). A function's body is counted from its first
statement after the docstring to its last line, so a long docstring does not count.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "kvedit"
EXCLUDED = PACKAGE / "triton"
MAX_MODULE_LINES = 500
MAX_BODY_LINES = 80


def _modules(root: Path) -> list[Path]:
    """Every ``.py`` file under ``root``, outside ``EXCLUDED``, sorted."""
    return sorted(p for p in root.rglob("*.py") if EXCLUDED not in p.parents)


def _body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from the first statement after the docstring to the function's last line."""
    body = node.body
    if (
        len(body) > 1
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    ):
        body = body[1:]
    return node.end_lineno - body[0].lineno + 1


def _long_functions(path: Path) -> list[str]:
    """``module:line name (n lines)`` for each function in ``path`` with a body over the limit."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            n = _body_lines(node)
            if n > MAX_BODY_LINES:
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name} ({n})")
    return found


def test_the_walk_finds_the_package() -> None:
    modules = _modules(PACKAGE)
    assert PACKAGE / "__init__.py" in modules
    assert not any(EXCLUDED in p.parents for p in modules)


def test_body_lines_skip_the_docstring() -> None:
    src = 'def f():\n    """Doc.\n\n    More.\n    """\n    a = 1\n    return a\n'
    (fn,) = ast.parse(src).body
    assert _body_lines(fn) == 2


def test_no_module_over_500_lines() -> None:
    long = [
        f"{p.relative_to(PACKAGE.parent)} ({n})"
        for p in _modules(PACKAGE)
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    ]
    assert not long, f"modules over {MAX_MODULE_LINES} lines: " + ", ".join(long)


def test_no_function_body_over_80_lines() -> None:
    long = [f for p in _modules(PACKAGE) for f in _long_functions(p)]
    assert not long, f"function bodies over {MAX_BODY_LINES} lines: " + ", ".join(long)
