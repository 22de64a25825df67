"""Size limits on the package's code: no module over 450 lines, no function body over 60.

Issues #39 and #66: long modules and functions mix concerns. ``kvedit/triton/`` is excluded (its kernels
are written as single functions on purpose). A function's body is counted from its first
statement after the docstring to its last line, so a long docstring does not count.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "kvedit"
EXCLUDED = PACKAGE / "triton"
MAX_MODULE_LINES = 450
MAX_BODY_LINES = 60

# The offenders left when the limits went from 500/80 to 450/60 (#66), each being split by the
# engineer who owns it: ``path`` for a module, ``path:function`` for a function body. Empty it
# as they land: a listed offender that no longer offends fails the test, so the list cannot go
# stale, and an offender not listed fails too.
PENDING: set[str] = set()


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


def _long_functions(path: Path) -> dict[str, str]:
    """``{"module:name": "module:line name (n lines)"}`` for each function in ``path`` with a body
    over the limit."""
    tree = ast.parse(path.read_text(), filename=str(path))
    module = path.relative_to(PACKAGE.parent).as_posix()
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            n = _body_lines(node)
            if n > MAX_BODY_LINES:
                found[f"{module}:{node.name}"] = f"{module}:{node.lineno} {node.name} ({n})"
    return found


def _offenders() -> dict[str, str]:
    """Every module over :data:`MAX_MODULE_LINES` and every function body over
    :data:`MAX_BODY_LINES`, keyed as :data:`PENDING` is."""
    found = {}
    for path in _modules(PACKAGE):
        module = path.relative_to(PACKAGE.parent).as_posix()
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES:
            found[module] = f"{module} ({n} lines)"
        found.update(_long_functions(path))
    return found


def test_the_walk_finds_the_package() -> None:
    modules = _modules(PACKAGE)
    assert PACKAGE / "__init__.py" in modules
    assert not any(EXCLUDED in p.parents for p in modules)


def test_body_lines_skip_the_docstring() -> None:
    src = 'def f():\n    """Doc.\n\n    More.\n    """\n    a = 1\n    return a\n'
    (fn,) = ast.parse(src).body
    assert _body_lines(fn) == 2


def test_no_module_or_function_over_the_limits_but_the_pending_ones() -> None:
    found = _offenders()
    new = [found[k] for k in sorted(set(found) - PENDING)]
    assert not new, (
        f"over {MAX_MODULE_LINES} lines a module or {MAX_BODY_LINES} a function body: "
        + ", ".join(new)
    )


def test_every_pending_offender_still_offends() -> None:
    """A split offender leaves :data:`PENDING`, so the list only shrinks."""
    done = sorted(PENDING - set(_offenders()))
    assert not done, f"no longer over the limits, remove from PENDING: {done}"


def test_the_limits_catch_a_long_function(monkeypatch) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_BODY_LINES + 1))
    path = PACKAGE / "long_for_the_test.py"  # never written: read_text is replaced
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: f"def f():\n{body}\n")
    assert list(_long_functions(path)) == ["kvedit/long_for_the_test.py:f"]
