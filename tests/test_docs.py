"""Every kvedit name the README, docs/*.md and the docstrings show resolves as written, and
every repository path the README and docs/*.md show exists.

Walks the fenced code blocks and the inline code spans of README.md and docs/*.md, and resolves
each dotted ``kvedit.<name>...`` by attribute access from ``import kvedit`` alone, and each
``from kvedit... import a, b`` by importing the module and reading the names, in a fresh
interpreter where a deprecated path is an error (the docs teach the current paths).

The docstrings of kvedit/ and apps/ (modules, classes, functions, and the string after an
assignment) name modules that ``import kvedit`` does not import: there a dotted name resolves
by attribute access or, where that fails, by importing the submodule; a module that needs a
missing extra (vLLM) is read instead of imported. A dataclass field counts as an attribute.

The paths are the markdown links and images (relative to their file) and the repository paths
(``kvedit/``, ``tests/``, ``benchmarks/``, ``reports/``, ``docs/``, ...) in code.

The docs that list registered things name every one: each forgetting policy
(``kvedit.compress.SCORERS``) in docs/memory.md or docs/compression.md, each blend rule in
docs/reuse.md, each eval method and task in docs/evals.md; and every option of every ``kvedit``
subcommand has help text or is named in a doc.
"""

from __future__ import annotations

import argparse
import ast
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
SOURCES = sorted([*(REPO / "kvedit").rglob("*.py"), *(REPO / "apps").rglob("*.py")])
# Strings that look like names but are not attribute paths: file formats' names.
NOT_NAMES = {"kvedit.kvstate", "kvedit.spans", "kvedit.vllm"}


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
        dotted |= dotted_names(FROM_IMPORT.sub("", code))
    return dotted, froms


def dotted_names(text: str) -> set[str]:
    """The dotted ``kvedit.`` names in ``text`` (not file names, not format names)."""
    found = (m.group(0) for m in DOTTED.finditer(text))
    return {n for n in found if n not in NOT_NAMES and not re.search(r"\.(py|md|json|kv)$", n)}


def docstrings(source: str) -> list[str]:
    """The docstrings of a module's source: of the module, its classes and functions, and the
    string literal right after an assignment (an attribute's docstring)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                out.append(doc)
        if isinstance(node, ast.Module | ast.ClassDef):
            for a, b in zip(node.body, node.body[1:]):
                if (
                    isinstance(a, ast.Assign | ast.AnnAssign)
                    and isinstance(b, ast.Expr)
                    and isinstance(b.value, ast.Constant)
                    and isinstance(b.value.value, str)
                ):
                    out.append(b.value.value)
    return out


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


# Resolves a dotted name as a docstring means it: an attribute path, through submodules
# that ``import kvedit`` leaves out; a module needing a missing extra is read, not imported.
RESOLVE_IMPORTING = r"""
import ast, importlib, importlib.util, json, os, sys, types
import kvedit

def defined(body, name):
    for node in body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            if node.name == name:
                return node
        elif isinstance(node, ast.Assign):
            if any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                return node
        elif isinstance(node, ast.AnnAssign):
            if isinstance(node.target, ast.Name) and node.target.id == name:
                return node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            if any((a.asname or a.name) == name for a in node.names):
                return node
        elif isinstance(node, ast.If):
            found = defined(node.body, name) or defined(node.orelse, name)
            if found:
                return found
    return None

def read(origin, parts):
    node = ast.parse(open(origin, encoding="utf-8").read())
    for part in parts:
        if not isinstance(node, (ast.Module, ast.ClassDef)):
            raise AttributeError(f"{part!r}: not a class or module")
        node = defined(node.body, part)
        if node is None:
            raise AttributeError(f"{part!r} is not defined in {os.path.relpath(origin)}")

def attribute(obj, part):
    try:
        return getattr(obj, part)
    except AttributeError:
        if isinstance(obj, type) and any(
            part in getattr(c, "__annotations__", {}) for c in obj.__mro__
        ):
            return None  # an instance attribute: a dataclass field, an annotated attribute
        if isinstance(obj, types.ModuleType) and hasattr(obj, "__path__"):
            sub = f"{obj.__name__}.{part}"
            spec = importlib.util.find_spec(sub)
            if spec is not None:
                try:
                    return importlib.import_module(sub)
                except ModuleNotFoundError as e:
                    if (e.name or "").split(".")[0] in ("kvedit", "apps"):
                        raise
                    raise Unimportable(spec.origin) from e
        raise

class Unimportable(Exception):
    pass

def resolve(name):
    parts = name.split(".")
    obj = kvedit
    for i, part in enumerate(parts[1:], start=2):
        try:
            obj = attribute(obj, part)
        except Unimportable as e:
            return read(e.args[0], parts[i:])
        if obj is None and i < len(parts):
            raise AttributeError(f"{'.'.join(parts[:i])} is an instance attribute")
        if obj is None:
            return

bad = []
for name in json.loads(sys.stdin.read()):
    try:
        resolve(name)
    except Exception as e:
        bad.append(f"{name}: {type(e).__name__}: {e}")
print(json.dumps(sorted(bad)))
"""


def unresolved_importing(dotted: set[str]) -> list[str]:
    """The names of ``dotted`` that resolve neither as attributes nor as modules."""
    out = subprocess.run(
        [sys.executable, "-c", RESOLVE_IMPORTING],
        input=json.dumps(sorted(dotted)),
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


def test_the_docstring_walker_finds_every_kind_of_docstring():
    source = (
        '"""The module: see :func:`~kvedit.a`."""\n'
        'X = 1\n"""An attribute: :data:`kvedit.b`."""\n'
        'class C:\n    """kvedit.c"""\n    def f(self):\n        """kvedit.d"""\n'
        '        y = "kvedit.not_a_docstring"\n'
        "# kvedit.not_a_comment_either\n"
    )
    found = set().union(*map(dotted_names, docstrings(source)))
    assert found == {"kvedit.a", "kvedit.b", "kvedit.c", "kvedit.d"}


def test_a_docstring_name_resolves_through_submodules_fields_and_unimportable_modules():
    good = {
        "kvedit.focusing.choice.Focus.generate",  # a submodule's class's method
        "kvedit.KVState.history",  # a dataclass field
        "kvedit.checks.MAX_DUPLICATE_COPIES",
        "kvedit.integrations.vllm.heads",  # a module `import kvedit` does not import
        "kvedit.integrations.vllm.connector.KVEditConnector.get_num_new_matched_tokens",
    }
    bad = {
        "kvedit.focus.Focus",  # kvedit.focus is a function
        "kvedit.storage.read_verified",  # an old module
        "kvedit.KVState.history.steps",  # past an instance attribute
        "kvedit.integrations.vllm.connector.KVEditConnector.no_such_method",
        "kvedit.integrations.vllm.connector.NoSuchClass",
    }
    got = unresolved_importing(good | bad)
    assert sorted(b.split(": ")[0] for b in got) == sorted(bad), got


@functools.cache
def docstring_names() -> dict[str, tuple[str, ...]]:
    """Every dotted kvedit name in the docstrings of kvedit/ and apps/: the files naming it."""
    where: dict[str, set[str]] = {}
    for path in SOURCES:
        for doc in docstrings(path.read_text(encoding="utf-8")):
            for name in dotted_names(doc):
                where.setdefault(name, set()).add(str(path.relative_to(REPO)))
    return {name: tuple(sorted(files)) for name, files in where.items()}


def test_every_kvedit_name_in_the_docstrings_resolves():
    names = docstring_names()
    assert len(names) > 100  # the walker sees the docstrings
    bad = unresolved_importing(set(names))
    assert [f"{b} (in {', '.join(names[b.split(': ')[0]])})" for b in bad] == []


# ------------------------------------------------------------------------ paths

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
REPO_PATH = re.compile(
    r"(?<![\w./\-~$])(?:kvedit|apps|tests|benchmarks|reports|docs|notebooks)/[\w./*\-]*"
)


def links(text: str) -> set[str]:
    """The relative targets of the links and images of a markdown text's prose (an
    ``#anchor`` dropped; web addresses, absolute paths and bare anchors left out)."""
    found = (m.group(1) for m in LINK.finditer(FENCE.sub("", text)))
    targets = {t.split("#")[0] for t in found if not re.match(r"[a-z][a-z+.\-]*:|#|/", t)}
    return targets - {""}


def code_paths(text: str) -> set[str]:
    """The repository paths in the code of a markdown text (a test id's ``::name`` and a
    ``:line`` dropped)."""
    return {m.group(0).rstrip(".") for code in code_of(text) for m in REPO_PATH.finditer(code)}


def missing(doc: Path, text: str) -> list[str]:
    """The links of ``text`` (relative to ``doc``'s folder) and its code paths (relative to
    the repository) that match no file; a path with ``*`` must match one."""

    def exists(base: Path, target: str) -> bool:
        return any(base.glob(target)) if "*" in target else (base / target).exists()

    out = [t for t in links(text) if not exists(doc.parent, t)]
    out += [t for t in code_paths(text) if not exists(REPO, t)]
    return sorted(set(out))


def test_the_path_walker_finds_links_images_and_code_paths():
    text = (
        "See [the guide](docs/app.md#setup), ![a plot](reports/x.png), [site](https://a.b), "
        "[here](#anchor) and `tests/states/test_state.py::test_x`.\n\n```bash\n"
        "python benchmarks/run.py --out runs/x\n```\nProse about kvedit/ is not code.\n"
    )
    assert links(text) == {"docs/app.md", "reports/x.png"}
    assert code_paths(text) == {"tests/states/test_state.py", "benchmarks/run.py"}
    assert missing(REPO / "README.md", text) == ["benchmarks/run.py", "reports/x.png"]
    in_docs = REPO / "docs" / "x.md"  # a link is relative to its file, a code path is not
    assert missing(in_docs, "[up](../README.md), [app](app.md): `notebooks/*.ipynb`") == []
    assert missing(in_docs, "[up](README.md), [app](docs/app.md): `notebooks/*.txt`") == [
        "README.md",
        "docs/app.md",
        "notebooks/*.txt",
    ]


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(REPO)) for d in DOCS])
def test_every_link_and_path_in_the_docs_exists(doc: Path):
    assert missing(doc, doc.read_text()) == []


# The opening and closing markers only: a line of "=" is also a markdown heading underline.
CONFLICT = re.compile(r"^(<<<<<<< |>>>>>>> )", re.M)


def conflict_lines(text: str) -> list[int]:
    """The 1-based lines of ``text`` that are a merge's conflict markers."""
    return [text.count("\n", 0, m.start()) + 1 for m in CONFLICT.finditer(text)]


def test_the_conflict_finder_finds_each_marker():
    text = "a\n<<<<<<< HEAD\nb\n=======\nc\n>>>>>>> branch\nd\n"
    assert conflict_lines(text) == [2, 6]
    assert conflict_lines("Heading\n=======\n<<<<<<<x\n") == []


def test_no_tracked_text_file_holds_a_merge_conflict():
    files = subprocess.run(
        ["git", "ls-files", "*.md", "*.py", "*.toml", "*.txt", "*.cfg", "*.sh", "Makefile"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    found = {
        name: lines
        for name in files
        if (REPO / name).is_file()
        and (lines := conflict_lines((REPO / name).read_text(errors="replace")))
    }
    assert not found, f"merge-conflict markers left in {found}"


# ------------------------------------------------------------ lists kept true

# The docs that list the registered things of a kind, and which kinds they must name. A name
# counts where it stands as a word in the doc's code (a code span or a fenced block).


def named_in(names, docs: list[str]) -> list[str]:
    """The names of ``names`` that no code of ``docs`` (paths under the repository) names."""
    code = "\n".join(c for d in docs for c in code_of((REPO / d).read_text()))
    word = r"(?<![\w\-]){}(?![\w\-])"
    return [n for n in sorted(names) if not re.search(word.format(re.escape(n)), code)]


def test_the_name_finder_reads_only_code_and_whole_words(tmp_path):
    assert named_in(["knorm", "tova", "h2o"], ["docs/compression.md"]) == []
    doc = tmp_path / "x.md"
    doc.write_text("Prose names knorm. `knorm-ish` and `tova`\n```\nh2o(x)\n```\n")
    assert named_in(["knorm", "tova", "h2o"], [str(doc)]) == ["knorm"]


def test_every_forgetting_policy_is_named_in_the_memory_or_compression_doc():
    from kvedit.compress import SCORERS

    assert len(SCORERS) >= 5
    assert named_in(SCORERS, ["docs/memory.md", "docs/compression.md"]) == []


def test_every_blend_rule_is_named_in_the_reuse_doc():
    from kvedit.reusing.blend_rules import BLEND_RULES

    assert named_in(BLEND_RULES, ["docs/reuse.md"]) == []


def test_every_eval_method_is_named_in_the_evals_doc():
    import kvedit.evals  # noqa: F401  (registers the methods)
    from kvedit.evals.methods.registry import METHODS

    assert len(METHODS) >= 5
    assert named_in(METHODS, ["docs/evals.md"]) == []


def test_every_eval_task_is_named_in_the_evals_doc():
    import kvedit.evals  # noqa: F401  (registers the tasks)
    from kvedit.evals.tasks.registry import MEMORY_TASKS, TASKS

    assert len(TASKS) >= 2 and len(MEMORY_TASKS) >= 2
    assert named_in([*TASKS, *MEMORY_TASKS], ["docs/evals.md"]) == []


def cli_options() -> list[tuple[str, argparse.Action]]:
    """Every option of every ``kvedit`` subcommand: ``("kvedit eval litm", action)``."""
    from kvedit.cli.main import build_parser

    def walk(parser: argparse.ArgumentParser, prog: str):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    yield from walk(child, f"{prog} {name}")
            elif action.option_strings and action.dest != "help":
                yield prog, action

    return list(walk(build_parser(), "kvedit"))


def undocumented_options() -> list[str]:
    """The options that have no help text and that no doc (README.md, docs/*.md) names."""
    text = "\n".join(d.read_text() for d in DOCS)
    out = []
    for prog, action in cli_options():
        if action.help not in (None, "", argparse.SUPPRESS):
            continue
        flags = action.option_strings
        if not any(re.search(rf"(?<![\w\-]){re.escape(f)}(?![\w\-])", text) for f in flags):
            out.append(f"{prog} {'/'.join(flags)}")
    return out


def test_the_option_walker_reaches_every_subcommand():
    progs = {prog for prog, _ in cli_options()}
    assert {"kvedit eval litm", "kvedit eval memory", "kvedit serve", "kvedit chat"} <= progs
    assert len(cli_options()) > 50


def test_every_cli_option_has_help_text_or_a_doc():
    assert undocumented_options() == []
