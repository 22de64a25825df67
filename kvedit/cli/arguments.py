"""The parser class and help formatter of ``kvedit`` and its subcommands, argument types,
input-file reading and the eval suites' ``--out`` lock, shared by the ``kvedit`` subcommands."""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
from collections.abc import Iterator
from pathlib import Path

from .status import UsageError


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every ``kvedit`` parser's help: descriptions and epilogs as written, and an option that
    takes a value and has a default (not None, not empty) says it, `` (default: X)`` after its
    help, unless the help already says its default in its own words."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        shown = (
            action.option_strings
            and action.nargs != 0  # a flag: its default is its absence
            and default is not None
            and default is not argparse.SUPPRESS
            and not (isinstance(default, (list, tuple, str)) and len(default) == 0)
            and "default" not in text
        )
        return f"{text} (default: %(default)s)" if shown else text


class CommandParser(argparse.ArgumentParser):
    """The parser of ``kvedit`` and of each of its subcommands (their subparsers are of this
    class too): help by :class:`HelpFormatter`, and arguments a subcommand does not take are
    refused by the subcommand itself, under its own usage and name (``kvedit chat: error:
    unrecognized arguments: MiB``), not passed up to ``kvedit``'s."""

    def __init__(self, *args, formatter_class=HelpFormatter, **kwargs) -> None:
        super().__init__(*args, formatter_class=formatter_class, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            hint = "" if extras[0].startswith("-") else _SPACE_HINT
            self.error(f"unrecognized arguments: {' '.join(extras)}{hint}")
        return namespace, extras


_SPACE_HINT = " (a value with a space in it is one argument only when quoted)"


def positive(name: str):
    """An argparse type: an int >= 1 (``name`` is the option, for the message)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, not {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
        return value

    parse.__name__ = name
    return parse


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9}
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30})


def finite(name: str):
    """An argparse type: a finite number (``name`` is the option, for the message)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, not {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, not {text!r}")
        return value

    parse.__name__ = name
    return parse


def byte_size(name: str):
    """An argparse type: a size in bytes, ``1000000``, ``512KiB`` or ``1.5GB`` (units KB, MB,
    GB of 1000 and KiB, MiB, GiB of 1024, any case); at least one byte."""

    def parse(text: str) -> int:
        number = text.strip().rstrip("bBiIkKmMgG ")
        unit = text.strip()[len(number) :].strip().lower()
        try:
            value = float(number)
        except ValueError:
            value = None
        if value is None or unit not in _UNITS or not math.isfinite(value * _UNITS[unit]):
            raise argparse.ArgumentTypeError(
                f"expected a size such as 2000000, 512KiB or 1.5GB, not {text!r}"
            )
        size = int(value * _UNITS[unit])
        if size < 1:
            raise argparse.ArgumentTypeError(f"must be at least one byte, not {text!r}")
        return size

    parse.__name__ = name
    return parse


def port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, not {text!r}") from None
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"must be in 1..65535, not {value}")
    return value


def positions(text: str) -> list[int]:
    """``--positions``: comma-separated whole numbers >= 0, e.g. ``0,5,10``."""
    items = [item.strip() for item in text.split(",")]
    out = []
    for item in items:
        try:
            value = int(item)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated whole numbers such as 0,5,10, not {text!r} "
                f"({item!r} is not a number)"
            ) from None
        if value < 0:
            raise argparse.ArgumentTypeError(f"positions count from 0, not {value}")
        out.append(value)
    return out


def nonempty(what: str):
    def parse(text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError("must not be empty")
        return text

    parse.__name__ = what
    return parse


def read_input(path: str, option: str) -> str:
    """The UTF-8 text of the input file ``path`` (``-``: stdin), or a :class:`UsageError` naming
    the file (and the line, for text that is not UTF-8); an empty file is refused too."""
    name = "stdin" if path == "-" else path
    try:
        if path == "-":
            data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else None
            text = sys.stdin.read() if data is None else None
        else:
            data, text = Path(path).read_bytes(), None
    except FileNotFoundError:
        raise UsageError(f"{option} {name}: no such file") from None
    except IsADirectoryError:
        raise UsageError(f"{option} {name}: is a directory, not a file") from None
    except PermissionError:
        raise UsageError(f"{option} {name}: permission denied") from None
    except OSError as e:
        raise UsageError(f"{option} {name}: cannot read it: {e.strerror or e}") from None
    if text is None:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            line = data[: e.start].count(b"\n") + 1
            raise UsageError(
                f"{option} {name}:{line}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset "
                f"{e.start}); give a text file"
            ) from None
    if "\x00" in text:
        line = text[: text.index("\x00")].count("\n") + 1
        raise UsageError(f"{option} {name}:{line}: a NUL byte: this is a binary file, not text")
    if not text.strip():
        raise UsageError(f"{option} {name}: the file is empty")
    return text


def max_positions_arg(p) -> None:
    p.add_argument(
        "--max-positions",
        type=positive("--max-positions"),
        default=None,
        metavar="N",
        help="the most positions the model attends to, for a model whose config understates "
        "it (default: its max_position_embeddings); longer contexts are refused",
    )


def _out_lock(out: str, what: str):
    from ..evals.report import LOCK_NAME
    from ..store.lock import WriterLock

    return WriterLock(Path(out) / LOCK_NAME, what)


def _refuse_if_held(out: str, lock, holder) -> None:
    if holder is not None:
        raise UsageError(
            f"--out {out}: another kvedit eval run is writing there ({holder}; lock file "
            f"{lock.path}); wait for it to end, or choose another --out"
        )


def check_out_free(out: str) -> None:
    """Refuse an empty ``--out`` (the working directory), or one another run holds (naming
    its process, :func:`holding_out`); writes nothing. Checked before the folder's contents,
    so a second run on a running folder is told so, not told to ``--resume``."""
    if not out.strip():
        raise UsageError("--out is empty: name the folder the results go to")
    lock = _out_lock(out, "kvedit eval")
    _refuse_if_held(out, lock, lock.holder())


@contextlib.contextmanager
def holding_out(out: str, what: str) -> Iterator[Path]:
    """Hold ``--out``'s lock for the ``with`` block: one run per folder at a time.

    The lock is ``out/.lock``, a :class:`~kvedit.store.lock.WriterLock` naming the run
    (``what``, its process, since when), released by the kernel when the run dies and removed
    when it ends. The folder is made if needed, and removed again if the run leaves it empty
    (a run refused before its first result).

    Raises:
        UsageError: another run holds the folder (naming it).
    """
    folder = Path(out)
    made = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    lock = _out_lock(out, what)
    try:
        _refuse_if_held(out, lock, lock.acquire())
        yield folder
    finally:
        lock.release()
        if made:
            with contextlib.suppress(OSError):
                folder.rmdir()  # only when empty
