"""Every kvedit name the README and docs/*.md show in code resolves as written.

Walks the fenced code blocks and the inline code spans of README.md and docs/*.md, and resolves
each dotted ``kvedit.<name>...`` by attribute access from ``import kvedit`` alone, and each
``from kvedit... import a, b`` by importing the module and reading the names, in a fresh
interpreter where a deprecated path is an error (the docs teach the current paths).
"""

from __future__ import annotations

import functools
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
INLINE = re.compile(r"`([^`\n]+)`")
DOTTED = re.compile(r"(?<![\w./\-])kvedit(?:\.[A-Za-z_]\w*)+")
FROM_IMPORT = re.compile(r"from\s+(kvedit(?:\.\w+)*)\s+import\s+(\([^)]*\)|[^\n#]+)")
# Strings that look like names but are not attribute paths: the state file format's name.
NOT_NAMES = {"kvedit.kvstate", "kvedit.spans"}


def code_of(text: str) -> list[str]:
    """The fenced blocks and the inline code spans of a markdown text."""
    blocks = FENCE.findall(text)
    prose = FENCE.sub("", text)
    return blocks + INLINE.findall(prose)


def mentions(text: str) -> tuple[set[str], set[tuple[str, str]]]:
    """``(dotted names, (module, name) pairs of from-imports)`` in the code of ``text``."""
    dotted: set[str] = set()
    froms: set[tuple[str, str]] = set()
    for code in code_of(text):
        for m in FROM_IMPORT.finditer(code):
            names = m.group(2).strip("() \n")
            for item in names.split(","):
                name = item.strip().split(" as ")[0].strip()
                if name and name != "*":
                    froms.add((m.group(1), name))
        without_imports = FROM_IMPORT.sub("", code)
        for m in DOTTED.finditer(without_imports):
            name = m.group(0)
            if name not in NOT_NAMES and not re.search(r"\.(py|md|json|kv)$", name):
                dotted.add(name)
    return dotted, froms


RESOLVE = r"""
import importlib, json, sys, warnings
warnings.simplefilter("error", DeprecationWarning)
import kvedit
dotted, froms = json.loads(sys.stdin.read())
bad = []
for name in dotted:
    obj = kvedit
    try:
        for part in name.split(".")[1:]:
            obj = getattr(obj, part)
    except Exception as e:
        bad.append(f"{name}: {type(e).__name__}: {e}")
for module, name in froms:
    try:
        getattr(importlib.import_module(module), name)
    except Exception as e:
        bad.append(f"from {module} import {name}: {type(e).__name__}: {e}")
print(json.dumps(sorted(bad)))
"""


def unresolved(dotted: set[str], froms: set[tuple[str, str]]) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", RESOLVE],
        input=json.dumps([sorted(dotted), sorted(froms)]),
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_walker_finds_names_in_blocks_and_spans():
    text = (
        "Use `kvedit.ops.emphasize` or `kvedit/ops/bias.py`.\n\n```python\nimport kvedit\n"
        "from kvedit.focusing.choice import (choose,\n    Focus as F)\nkvedit.capture(m, t, x)\n```\n"
    )
    dotted, froms = mentions(text)
    assert dotted == {"kvedit.ops.emphasize", "kvedit.capture"}
    assert froms == {("kvedit.focusing.choice", "choose"), ("kvedit.focusing.choice", "Focus")}


def test_a_wrong_or_deprecated_path_is_reported():
    bad = unresolved(
        {"kvedit.focus.choose", "kvedit.states.state.templated_prompt", "kvedit.choose"},
        {("kvedit.focus", "choose"), ("kvedit.prompts", "templated_prompt")},
    )
    assert len(bad) == 3, bad
    assert any(b.startswith("kvedit.focus.choose") for b in bad)
    assert any(b.startswith("kvedit.states.state.templated_prompt") for b in bad)
    assert any(b.startswith("from kvedit.focus import choose") for b in bad)


@functools.cache
def unresolved_in_docs() -> tuple[str, ...]:
    """Every unresolved mention of every doc, resolved in one interpreter."""
    dotted: set[str] = set()
    froms: set[tuple[str, str]] = set()
    for doc in DOCS:
        d, f = mentions(doc.read_text())
        dotted |= d
        froms |= f
    return tuple(unresolved(dotted, froms))


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(REPO)) for d in DOCS])
def test_every_kvedit_name_in_the_docs_resolves(doc: Path):
    dotted, froms = mentions(doc.read_text())
    mine = {*dotted, *(f"from {m} import {n}" for m, n in froms)}
    bad = [b for b in unresolved_in_docs() if b.split(": ")[0] in mine]
    assert bad == []
