"""The ``kvedit`` command line starts light: the parser lists a command by its summary alone
unless the command line names it, and the listing reads the same as the whole parser's; a named
command gets its whole parser; errors keep their usage and status. ``kvedit/__init__.py``
loads its names on first use: ``import kvedit`` and the help of every command, nested ones
included (their option lists come from :mod:`kvedit.cli.names`), import none of torch,
transformers, numpy, gradio, vllm or safetensors (a fresh interpreter's ``sys.modules``, not a
timing) (#69)."""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys

import pytest

import kvedit
from kvedit.cli.main import build_parser, main

HEAVY = ("torch", "transformers", "numpy", "gradio", "vllm", "safetensors")

LIGHT_HELP = (
    ["--help"],
    ["--version"],
    ["demo", "--help"],
    ["eval", "--help"],
    ["app", "--help"],
    ["publish", "--help"],
    ["memory", "--help"],
    ["memory", "fit-scorer", "--help"],
)


def _fresh(code: str) -> dict:
    """Run ``code`` in a new interpreter; it prints one JSON object, returned."""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_help_and_version_import_nothing_heavy():
    code = (
        "import contextlib, io, json, sys\n"
        "from kvedit.cli.main import build_parser, main\n"
        "build_parser([]).format_help()\n"
        "statuses = []\n"
        f"for argv in {[list(a) for a in LIGHT_HELP]!r}:\n"
        "    with contextlib.redirect_stdout(io.StringIO()) as out:\n"
        "        statuses.append((main(argv), len(out.getvalue())))\n"
        f"heavy = [n for n in {HEAVY!r} if n in sys.modules]\n"
        "print(json.dumps({'statuses': statuses, 'heavy': heavy}))\n"
    )
    seen = _fresh(code)
    assert seen["heavy"] == []
    assert all(status == 0 and printed > 0 for status, printed in seen["statuses"])


def test_import_kvedit_is_light_and_a_name_loads_on_use():
    code = (
        "import json, sys, kvedit\n"
        f"before = [n for n in {HEAVY[:2]!r} if n in sys.modules]\n"
        "kvedit.KVState\n"
        "print(json.dumps({'before': before, 'after': 'torch' in sys.modules}))\n"
    )
    assert _fresh(code) == {"before": [], "after": True}


def test_every_public_name_resolves_to_its_home():
    for name in kvedit.__all__:
        assert hasattr(kvedit, name), name
        assert name in dir(kvedit)
    assert kvedit.compress is importlib.import_module("kvedit.compress")
    assert kvedit.project.Projector is kvedit.Projector  # a subpackage, as an attribute
    assert kvedit.focusing.choice.choose is kvedit.choose  # one the public names' imports bring
    from kvedit import Memory, capture  # noqa: F401  the from-import form works too

    with pytest.raises(AttributeError, match="no_such_name"):
        kvedit.no_such_name  # noqa: B018


def _eval(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices["eval"]


def test_commands_listed_but_not_built_read_as_built():
    """A command the command line does not name is listed by its summary alone: the same line
    its own parser gives (chat's and eval project's summaries live apart from their parsers)."""
    full, light = build_parser(), build_parser([])
    assert light.format_help() == full.format_help()
    assert _eval(light).format_help() == _eval(full).format_help()


@pytest.mark.parametrize(
    ("argv", "option"),
    [
        (["chat", "--help"], "--max-bytes"),
        (["eval", "memory", "--help"], "--conversations"),
        (["eval", "litm", "--help"], "--n-docs"),
        (["memory", "fit-scorer", "--help"], "--out"),
    ],
)
def test_a_named_command_gets_its_whole_parser(argv, option, capsys):
    assert main(argv) == 0
    assert option in capsys.readouterr().out


def test_errors_keep_their_usage_and_status(capsys):
    assert main(["bogus"]) == 2
    assert "invalid choice: 'bogus'" in capsys.readouterr().err
    assert main(["eval", "litm", "--n-docs", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: kvedit eval litm") and "--n-docs" in err


def test_every_subcommand_help_imports_nothing_heavy():
    """Every command path, found by walking the parser (nested ones included): its ``--help``
    prints its own usage, and neither that nor building the whole parser and formatting every
    help imports a heavy module. What first imported one is named."""
    code = (
        "import argparse, contextlib, io, json, sys\n"
        "from kvedit.cli.main import build_parser, main\n"
        f"HEAVY = {HEAVY!r}\n"
        "def children(path):\n"
        "    node = build_parser(path)\n"
        "    for word in path:\n"
        "        sub = [a for a in node._actions if isinstance(a, argparse._SubParsersAction)]\n"
        "        node = sub[0].choices[word]\n"
        "    sub = [a for a in node._actions if isinstance(a, argparse._SubParsersAction)]\n"
        "    return list(sub[0].choices) if sub else []\n"
        "paths, todo, seen = [], [[]], {}\n"
        "while todo:\n"
        "    path = todo.pop(0)\n"
        "    with contextlib.redirect_stdout(io.StringIO()) as out:\n"
        "        status = main([*path, '--help'])\n"
        "    paths.append((path, status, out.getvalue().splitlines()[0]))\n"
        "    heavy = [n for n in HEAVY if n in sys.modules and n not in seen]\n"
        "    seen.update({n: ' '.join(path) or '--help' for n in heavy})\n"
        "    todo += [[*path, name] for name in children(path)]\n"
        "parser = build_parser()\n"
        "def walk(p):\n"
        "    p.format_help()\n"
        "    for a in p._actions:\n"
        "        if isinstance(a, argparse._SubParsersAction):\n"
        "            for child in a.choices.values():\n"
        "                walk(child)\n"
        "walk(parser)\n"
        "seen.update({n: 'the whole parser' for n in HEAVY if n in sys.modules and n not in seen})\n"
        "print(json.dumps({'paths': paths, 'heavy': seen}))\n"
    )
    seen = _fresh(code)
    assert seen["heavy"] == {}  # module -> the command whose help first imported it
    paths = {" ".join(path): (status, first) for path, status, first in seen["paths"]}
    every = {"", "demo", "app", "publish", "serve", "chat", "eval", "memory"}
    every |= {"eval litm", "eval memory", "eval project", "memory fit-scorer"}
    assert every <= set(paths), every - set(paths)
    for path, (status, first) in paths.items():
        assert status == 0, path
        assert first.startswith(f"usage: kvedit {path}".rstrip()), (path, first)
