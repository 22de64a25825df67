"""The ``kvedit`` command line: ``kvedit demo``, ``kvedit eval litm``, ``kvedit eval memory``,
``kvedit eval project``, ``kvedit app``, ``kvedit chat``, ``kvedit memory fit-scorer``,
``kvedit memory show``, ``kvedit publish`` and ``kvedit serve`` (vLLM).

Errors are one line on stderr, ``kvedit <command>: error: <message>``, and the exit status says
what kind they were (:data:`EXIT_USAGE`, :data:`EXIT_FAILURE`); ``--debug`` (or the environment
variable ``KVEDIT_DEBUG=1``) also prints the traceback. :func:`main` returns the status and
never raises; :func:`run` is the same command line without that handling (it raises).
One module per concern: :mod:`.main` (the parser, run, main), :mod:`.status` (exit statuses
and the error line), :mod:`.arguments` (argument types, input files, the ``--out`` lock),
:mod:`.litm`, :mod:`.memory` (``eval memory``), :mod:`.app`, :mod:`.chat` and
:mod:`.chat_loop` (its read-ask-print loop), :mod:`.chat_file` (``chat`` and its memory file),
:mod:`.chat_focus` (the lines ``--focus`` focuses for), :mod:`.scorer` (``memory fit-scorer``,
``memory show`` with :mod:`.memory_show`), :mod:`.serving` (``publish``, ``serve``),
:mod:`.names` (the names the parsers list, light copies of the registries': no ``--help``
imports torch); ``eval project``'s options are :mod:`kvedit.evals.project_args`'s.
"""

from __future__ import annotations

from .main import build_parser, main, run
from .status import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, UsageError, exit_status

__all__ = [
    "EXIT_FAILURE",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_USAGE",
    "UsageError",
    "build_parser",
    "exit_status",
    "main",
    "run",
]
