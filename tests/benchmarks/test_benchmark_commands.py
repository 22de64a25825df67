"""Every module of ``benchmarks/`` runs as ``python -m benchmarks.NAME --help``: it imports (its
siblings as ``benchmarks.x``, no path edits), exits 0 and prints its description, the first
paragraph of its docstring. All in one child process: some benchmarks set environment variables
when imported (``TRITON_INTERPRET`` without CUDA), which must not reach this process."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FOLDER = REPO / "benchmarks"
NOT_COMMANDS = {"__init__", "common", "focus_wordings"}  # the docstring; shared helpers; data

_RUN_ALL = """
import contextlib, io, json, runpy, sys
out = {}
for name in sys.argv[1:]:
    sys.argv = [name, "--help"]
    text = io.StringIO()
    code = "returned"
    with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
        try:
            runpy.run_module(name, run_name="__main__", alter_sys=True)
        except SystemExit as e:
            code = e.code
        except BaseException as e:
            code = f"{type(e).__name__}: {e}"
    out[name] = [code, text.getvalue()]
print(json.dumps(out))
"""


def commands(folder: Path = FOLDER, prefix: str = "") -> list[str]:
    """The benchmarks of ``folder`` (``prefix``: their package below ``benchmarks``)."""
    return sorted(prefix + p.stem for p in folder.glob("*.py") if p.stem not in NOT_COMMANDS)


def tuning() -> list[str]:
    """The tuning tools (``benchmarks/tuning/``)."""
    return commands(FOLDER / "tuning", "tuning.")


def description(name: str) -> str:
    """The first paragraph of the module's docstring, its whitespace collapsed."""
    path = FOLDER / f"{name.replace('.', '/')}.py"
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return " ".join(doc.split("\n\n")[0].split())


@pytest.fixture(scope="module")
def helps() -> dict[str, list]:
    names = [f"benchmarks.{name}" for name in commands() + tuning()]
    env = {**os.environ, "COLUMNS": "1000"}  # argparse wraps at hyphens ("flash-\nattn")
    done = subprocess.run(
        [sys.executable, "-c", _RUN_ALL, *names],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_suite_lists_the_benchmarks_it_has():
    assert "focus_scale" in commands() and "reuse" in commands()
    doc = (FOLDER / "__init__.py").read_text()
    missing = [name for name in commands() if f"``{name}``" not in doc]
    assert not missing, f"benchmarks/__init__.py does not describe {missing}"
    readme = (FOLDER / "README.md").read_text()
    missing = [name for name in commands() if f"benchmarks.{name}" not in readme]
    assert not missing, f"benchmarks/README.md has no command for {missing}"
    assert tuning(), "benchmarks/tuning/ holds the tuning tools"
    doc = (FOLDER / "tuning" / "__init__.py").read_text()
    readme = (FOLDER / "tuning" / "README.md").read_text()
    for name in tuning():
        short = name.split(".", 1)[1]
        assert f"``{short}``" in doc and f"benchmarks.{name}" in readme, name


@pytest.mark.parametrize("name", commands() + tuning())
def test_each_benchmark_prints_its_help(name, helps):
    code, text = helps[f"benchmarks.{name}"]
    assert code == 0, text[-2000:]
    assert description(name) and description(name) in " ".join(text.split()), text[:1000]
    assert "usage:" in text
