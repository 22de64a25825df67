"""Exit statuses and the one-line error message of the ``kvedit`` command line."""

from __future__ import annotations

from ..errors import (
    EmptySelectionError,
    InvalidExampleError,
    InvalidInputError,
    KVEditError,
    SpanNotFoundError,
)

EXIT_OK = 0


EXIT_FAILURE = 1
"""Exit status of a command that failed for another reason than its input (a model that cannot
be loaded, a file that cannot be written, vLLM missing, a bug)."""


EXIT_USAGE = 2
"""Exit status of a command refused for its arguments or input files (argparse's own status for
bad arguments): nothing was computed."""


EXIT_INTERRUPTED = 130


EXIT_STATUS_EPILOG = """exit status: 0 done; 2 bad arguments or input (a missing, empty, binary or malformed file, a
value out of range, a context longer than the model attends to), nothing computed; 1 any other
failure. Errors are one line on stderr, "kvedit <command>: error: <message>"; --debug (or
KVEDIT_DEBUG=1) also prints the traceback.
"""


_USAGE_ERRORS = (InvalidInputError, InvalidExampleError, SpanNotFoundError, EmptySelectionError)


class UsageError(InvalidInputError):
    """A command-line argument or input file the CLI refuses (exit status 2)."""


def exit_status(error: BaseException) -> int:
    """The exit status for ``error``: :data:`EXIT_USAGE` for bad arguments and input (kvedit's
    ``InvalidInputError``, ``InvalidExampleError``, ``SpanNotFoundError``), 130 for an
    interrupt, else :data:`EXIT_FAILURE`."""
    if isinstance(error, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    if isinstance(error, _USAGE_ERRORS):
        return EXIT_USAGE
    return EXIT_FAILURE


def message(error: BaseException) -> str:
    if isinstance(error, KeyboardInterrupt):
        return "interrupted"
    text = str(error).strip()
    if isinstance(error, KVEditError) and isinstance(error, OSError) and error.strerror:
        text = str(error.strerror).strip()  # kvedit's message, without "[Errno 13] "
    if isinstance(error, KVEditError) and text:
        return " ".join(text.splitlines()) if len(text) < 2000 else text
    if isinstance(error, OSError) and error.filename is not None:
        return f"{error.strerror or error}: {error.filename}"
    name = type(error).__name__
    return f"{name}: {text}" if text else name
