"""The ``kvedit`` parser, :func:`run` (raises) and :func:`main` (one error line, an exit status)."""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import sys
import traceback
from collections.abc import Sequence

from ..errors import (
    KVEditError,
)
from ..evals.project_args import PROJECT_SUMMARY
from ..evals.project_args import add_parser as project_parser
from ..version import __version__
from .app import run_app
from .arguments import CommandParser, port, positive
from .chat_options import CHAT_SUMMARY
from .litm import LITM_SUMMARY, litm_parser, run_demo
from .memory import MEMORY_SUMMARY, memory_parser
from .scorer import TOOLS_SUMMARY
from .scorer import memory_parser as memory_tools_parser
from .serving import PUBLISH_SUMMARY, SERVE_SUMMARY, publish_parser, serve_parser
from .status import EXIT_FAILURE, EXIT_OK, EXIT_STATUS_EPILOG, EXIT_USAGE, exit_status, message

DEMO_SUMMARY = "a short lost-in-the-middle run on the bundled model"
"""``kvedit demo``'s line in ``kvedit --help``."""
APP_SUMMARY = "the highlight app (Gradio) on http://HOST:PORT"
"""``kvedit app``'s line in ``kvedit --help``."""
_MODEL_HELP = "model name (a bundled one) or path"


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The ``kvedit`` parser. With ``argv``, only the commands it names get their options; the
    others are listed by their line in ``--help`` alone. Without it (the default), every
    command is built. Building any of them imports no torch (the names their options list come
    from :mod:`kvedit.cli.names`): every ``--help`` prints at once."""
    wanted = None if argv is None else frozenset(argv)
    parser = CommandParser(
        prog="kvedit",
        description="kvedit: edit a language model's KV cache to change what it attends to.",
        epilog=EXIT_STATUS_EPILOG,
    )
    parser.add_argument("--version", action="version", version=f"kvedit {__version__}")
    parser.add_argument(
        "--debug",
        action="store_true",
        default=False,
        help="on an error, also print the traceback (or set KVEDIT_DEBUG=1)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add(sub, "demo", DEMO_SUMMARY, _demo_parser, wanted)
    ev = sub.add_parser("eval", help="evaluations")
    ev_sub = ev.add_subparsers(dest="suite", required=True)
    suites = wanted if wanted is None or "eval" in wanted else frozenset()
    _add(ev_sub, "litm", LITM_SUMMARY, litm_parser, suites)
    _add(ev_sub, "memory", MEMORY_SUMMARY, memory_parser, suites)
    _add(ev_sub, "project", PROJECT_SUMMARY, _project_parser, suites)
    _add(sub, "app", APP_SUMMARY, _app_parser, wanted)
    _add(sub, "publish", PUBLISH_SUMMARY, publish_parser, wanted)
    _add(sub, "serve", SERVE_SUMMARY, serve_parser, wanted)
    _add(sub, "chat", CHAT_SUMMARY, _chat_parser, wanted)
    _add(sub, "memory", TOOLS_SUMMARY, memory_tools_parser, wanted)
    _label(parser)
    return parser


def _add(sub, name: str, summary: str, build, wanted: frozenset[str] | None) -> None:
    """Add the command ``name``: built by ``build(sub)`` when ``wanted`` (the command line's
    words) names it or is None, else only listed, by ``summary`` (what ``build`` gives it)."""
    if wanted is None or name in wanted:
        build(sub)
    else:
        sub.add_parser(name, help=summary, add_help=False)


def _demo_parser(sub) -> None:
    demo = sub.add_parser("demo", help=DEMO_SUMMARY)
    demo.add_argument("--model", default="smollm2-135m-instruct", help=_MODEL_HELP)
    demo.add_argument(
        "--trials", type=positive("--trials"), default=3, help="examples per gold position"
    )
    demo.add_argument("--seed", type=int, default=0, help="the examples' random seed")
    demo.add_argument("--out", default="runs/demo", help="the results folder, replaced every run")
    demo.set_defaults(run=run_demo)


def _app_parser(sub) -> None:
    app = sub.add_parser("app", help=APP_SUMMARY)
    app.add_argument("--model", default="smollm2-135m-instruct", help=_MODEL_HELP)
    app.add_argument("--port", type=port, default=7860, help="the port to serve on")
    app.add_argument(
        "--host",
        default="127.0.0.1",
        help="interface to bind (default: %(default)s, this machine only)",
    )
    app.set_defaults(run=run_app)


def _project_parser(sub) -> None:
    project_parser(sub, run=_run_project)


def _run_project(args) -> int:
    from ..evals.project import main as run_project

    return run_project(args)


def _chat_parser(sub) -> None:
    from .chat import chat_parser

    chat_parser(sub)


def _subparsers(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            yield from action.choices.values()


def _label(parser: argparse.ArgumentParser) -> None:
    """Give every subcommand its name (for the error line) and a ``--debug`` of its own."""
    for child in _subparsers(parser):
        child.set_defaults(prog_name=child.prog)
        if not any("--debug" in a.option_strings for a in child._actions):
            child.add_argument(
                "--debug",
                action="store_true",
                default=argparse.SUPPRESS,
                help="on an error, also print the traceback (or set KVEDIT_DEBUG=1)",
            )
        _label(child)


def run(argv: list[str] | None = None) -> int:
    """The command line without error handling: parses ``argv`` and runs the command; errors
    propagate (argparse's own as ``SystemExit``)."""
    return _execute(build_parser().parse_args(argv))


def _execute(args) -> int:
    """Run the parsed command (its settings, such as ``--max-positions``, travel in ``args``
    to the calls that use them: nothing global is set)."""
    return int(args.run(args) or 0)


def _command_name(argv: list[str]) -> str:
    """``kvedit <command>`` for an error that happened before the arguments were parsed."""
    words = ["kvedit"]
    for word in argv:
        if word.startswith("-"):
            continue
        words.append(word)
        if word != "eval" or len(words) > 2:
            break
    return " ".join(words)


def _stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader went away (the write end polls as an error)."""
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poll.poll(0))
    except (OSError, ValueError, AttributeError):  # no file descriptor, or no poll here
        return False


def _drop_stdout() -> None:
    """Point stdout at the null device, so that the interpreter's last flush of a closed pipe
    raises nothing more (Python's documented way out of a SIGPIPE)."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


def main(argv: list[str] | None = None) -> int:
    """Run the ``kvedit`` command line; returns the exit status (never raises, except that
    ``--help`` and ``--version`` return 0 after printing).

    Errors print ``kvedit <command>: error: <message>`` on stderr: status 2 for bad arguments
    and input, 1 for other failures (:func:`exit_status`); with ``--debug`` or
    ``KVEDIT_DEBUG=1`` the traceback is printed first.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = os.environ.get("KVEDIT_DEBUG", "").strip().lower() not in ("", "0", "false", "no")
    name = _command_name(argv)
    try:
        args = build_parser(argv).parse_args(argv)
    except SystemExit as e:  # argparse printed its message (status 2) or --help / --version
        return e.code if isinstance(e.code, int) else (EXIT_USAGE if e.code else EXIT_OK)
    debug = debug or bool(getattr(args, "debug", False))
    name = getattr(args, "prog_name", name)
    try:
        return _execute(args)
    except SystemExit as e:  # a command asked to exit
        if e.code is None or isinstance(e.code, int):
            return e.code or EXIT_OK
        error: BaseException = KVEditError(str(e.code))
    except BrokenPipeError as e:
        if not _stdout_closed():
            error = e
            if debug:
                traceback.print_exc()
        else:  # whatever read the output (``| head``) stopped reading: nothing to say
            _drop_stdout()
            return EXIT_FAILURE
    except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001  the CLI's one error handler
        error = e
        if debug:
            traceback.print_exc()
    print(f"{name}: error: {message(error)}", file=sys.stderr)
    if not debug and exit_status(error) == EXIT_FAILURE and not isinstance(error, KVEditError):
        print(f"{name}: (an unexpected error: --debug shows the traceback)", file=sys.stderr)
    return exit_status(error)
