"""``kvedit``'s help and argument errors (#69): the light name lists the parsers read
(:mod:`kvedit.cli.names`) are the registries' own; every option of every subcommand has a help
that says its default; an argument a subcommand does not take, or a bad value, is refused under
the subcommand's own usage and name, exit status 2."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from kvedit.cli import names
from kvedit.cli.chat_options import CHAT_HELP
from kvedit.cli.main import build_parser, main

# ------------------------------------------------------------------- the light name lists


def test_the_light_names_are_the_registries_own():
    """Each copy in kvedit/cli/names.py against its source, in a fresh interpreter (nothing
    registered by other tests): a scorer or task added without its line there fails here."""
    code = (
        "import json\n"
        "from kvedit.cache.packed import BITS\n"
        "from kvedit.compress.scorers import SCORERS\n"
        "from kvedit.evals import conversation_files, engines\n"
        "from kvedit.evals.tasks import MEMORY_TASKS, TASKS\n"
        "from kvedit.memory import budget, forgetting\n"
        "from kvedit.integrations.vllm.conversations import servable_policies\n"
        "from kvedit.cli import names\n"
        "print(json.dumps({\n"
        "    'SCORERS_READING_MODEL': {n: c.reads_model for n, c in SCORERS.items()},\n"
        "    'DEFAULT_POLICY': forgetting.DEFAULT_POLICY,\n"
        "    'FALLBACK_POLICY': forgetting.FALLBACK_POLICY,\n"
        "    'RECENT_TOKENS': budget.RECENT_TOKENS,\n"
        "    'QUANTIZE_BITS': list(BITS),\n"
        "    'LITM_TASKS': list(TASKS.names()),\n"
        "    'MEMORY_TASK_HELP': {n: dict(t.help) for n, t in MEMORY_TASKS.items()},\n"
        "    'ENGINES': list(engines.ENGINES),\n"
        "    'VLLM_BATCH': engines.VLLM_BATCH,\n"
        "    'SPEAKER_MODES': list(conversation_files.SPEAKER_MODES),\n"
        "    'policies': [list(forgetting.policies()), list(names.policies())],\n"
        "    'servable': [list(servable_policies()), list(names.servable_policies())],\n"
        "}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=180, check=True
    )
    source = json.loads(done.stdout.strip().splitlines()[-1])
    registered, read = source.pop("policies")
    assert read == registered  # the registry itself, once loaded
    registered, read = source.pop("servable")
    assert read == registered
    light = {key: getattr(names, key) for key in source}
    light = json.loads(json.dumps(light))  # tuples as lists, mappings as dicts, in order
    differ = {key: (light[key], value) for key, value in source.items() if light[key] != value}
    assert differ == {}, f"kvedit/cli/names.py (copy, source) differ: {differ}"
    # and without the registries loaded, the copies give the same answers
    assert list(names.policies()) == sorted(source["SCORERS_READING_MODEL"])
    assert list(names.litm_tasks()) == source["LITM_TASKS"]


def test_the_chat_epilog_is_the_loops_own():
    """``kvedit chat --help``'s epilog lives in the light chat_options; chat_loop, which says
    what the commands do, imports it: one copy."""
    from kvedit.cli import chat_loop

    assert chat_loop.CHAT_HELP is CHAT_HELP
    assert all(command in CHAT_HELP for command in chat_loop.COMMANDS)


# ------------------------------------------------------------ every option's help, its default


def _parsers(parser: argparse.ArgumentParser, prog: str = "kvedit"):
    yield prog, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _parsers(child, f"{prog} {name}")


def _shown(default) -> list[str]:
    """How a default may read in a help text."""
    out = [str(default)]
    if isinstance(default, float) and default.is_integer():
        out.append(str(int(default)))
    if isinstance(default, (list, tuple)):
        out.append(",".join(map(str, default)))
    return out


def _no_default(default) -> bool:
    """A default with nothing to say: none given, or an empty list."""
    empty = isinstance(default, (list, tuple, str)) and len(default) == 0
    return default is None or default is argparse.SUPPRESS or empty


def _undocumented(parser: argparse.ArgumentParser, prog: str) -> list[str]:
    """``parser``'s options with no help, or whose help does not say their default (a flag
    that takes no value defaults to its absence and need not say it)."""
    out = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            continue
        if isinstance(action, argparse._SubParsersAction):
            out += [f"{prog} {c.dest}: no summary" for c in action._choices_actions if not c.help]
            continue
        name = f"{prog} {'/'.join(action.option_strings) or action.dest}"
        if not action.help:
            out.append(f"{name}: no help")
            continue
        if action.help is argparse.SUPPRESS or action.nargs == 0:
            continue
        if _no_default(action.default):
            continue
        text = parser._get_formatter()._expand_help(action)
        if "default" not in text or not any(s in text for s in _shown(action.default)):
            out.append(f"{name}: default {action.default!r} not in {text!r}")
    return out


def test_every_option_has_help_that_says_its_default():
    found = [
        line for prog, parser in _parsers(build_parser()) for line in _undocumented(parser, prog)
    ]
    assert found == []


def test_the_check_sees_a_missing_help_and_an_unsaid_default():
    parser = build_parser(["demo"])
    demo = next(p for prog, p in _parsers(parser) if prog == "kvedit demo")
    demo.add_argument("--bare", default=None)
    demo.add_argument("--said", default=7, help="a number (default 7)")
    demo.add_argument("--unsaid", default=7, help="a number, by default small", type=int)
    assert _undocumented(demo, "kvedit demo") == [
        "kvedit demo --bare: no help",
        "kvedit demo --unsaid: default 7 not in 'a number, by default small'",
    ]


def test_a_default_is_said_once():
    """The formatter adds ``(default: X)`` only where the help does not say it already."""
    text = build_parser(["chat"])
    chat = next(p for prog, p in _parsers(text) if prog == "kvedit chat").format_help()
    assert "(default: smollm2-135m-instruct)" in chat  # --model: added
    assert "(default 128)" in chat and "(default: 128)" not in chat  # said in its own words


# ---------------------------------------------------------------- errors under their own usage


@pytest.mark.parametrize(
    ("argv", "prog", "said"),
    [
        (["chat", "--max-bytes", "2", "MiB"], "kvedit chat", "unrecognized arguments: MiB"),
        (["chat", "--max-bytes", "zz"], "kvedit chat", "argument --max-bytes"),
        (["chat", "--forget", "nope"], "kvedit chat", "argument --forget: invalid choice"),
        (["eval", "memory", "--budgets", "0.5", "0.25"], "kvedit eval memory", "arguments: 0.25"),
        (["eval", "memory", "--n-examples", "0"], "kvedit eval memory", "--n-examples"),
        (["eval", "--bogus", "litm"], "kvedit eval", "unrecognized arguments: --bogus"),
    ],
)
def test_an_argument_error_is_the_subcommands_own(argv, prog, said, capsys):
    """Refused by the subcommand: its usage, then one error line naming it, status 2 (an extra
    argument was once refused by ``kvedit`` itself, under the top-level usage)."""
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert lines[0].startswith(f"usage: {prog} [-h]")
    errors = [line for line in lines if "error:" in line]
    assert errors == [lines[-1]] and lines[-1].startswith(f"{prog}: error: ")
    assert said in lines[-1]


def test_a_value_with_a_space_is_told_to_quote_it(capsys):
    assert main(["chat", "--max-bytes", "2", "MiB"]) == 2
    assert "quoted" in capsys.readouterr().err.splitlines()[-1]
    assert build_parser(["chat"]).parse_args(["chat", "--max-bytes", "2 MiB"]).max_bytes == 2**21
