"""What several benchmarks share: the argument parser, the model option, timing, peak memory,
output files (JSON and markdown tables, written atomically), and how to start a benchmark in a
child process.

Benchmarks run from the repository root (``python -m benchmarks.NAME``); their default output
paths are relative to it, under ``runs/``.
"""

from __future__ import annotations

import argparse
import json
import resource
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from kvedit.atomic import atomic_write
from kvedit.errors import InvalidInputError
from kvedit.evals.jsonl import read_json, read_records

REPO = Path(__file__).resolve().parents[1]
"""The repository root: a child process started by :func:`module_command` runs there."""
RUNS = Path("runs")
"""Where benchmarks write by default (relative to the working directory, the repo root)."""
DEFAULT_MODEL = "smollm2-135m-instruct"
"""The bundled model, every benchmark's default ``--model``."""

T = TypeVar("T")


# ------------------------------------------------------------------------------- the command


def parser(doc: str | None) -> argparse.ArgumentParser:
    """An argument parser whose description is the first paragraph of a module docstring
    (``--help`` prints it, its lines joined)."""
    first = (doc or "").strip().split("\n\n")[0]
    return argparse.ArgumentParser(description=" ".join(first.split()))


def add_model(p: argparse.ArgumentParser, device: bool = False) -> None:
    """``--model`` (a registered name, a Hugging Face folder or a ``.gguf`` file; default the
    bundled SmolLM2) and, with ``device``, ``--device`` (default: CUDA when there is one)."""
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"model name or path ({DEFAULT_MODEL})")
    if device:
        p.add_argument("--device", default=None, help="cpu, cuda... (default: CUDA if any)")


def module_name(file: str) -> str:
    """``benchmarks.NAME`` of a benchmark's ``__file__``."""
    return f"{__package__}.{Path(file).stem}"


def command_line(file: str, argv: Sequence[str] | None = None) -> str:
    """``python -m benchmarks.NAME ARGS``: how this run was started (``argv`` default: the
    process's arguments), to be recorded next to its results."""
    args = sys.argv[1:] if argv is None else list(argv)
    return shlex.join(["python", "-m", module_name(file), *args])


def module_command(file: str, *args: str) -> list[str]:
    """The command that runs the benchmark of ``file`` in a child process (this interpreter,
    ``-m benchmarks.NAME``); run it with ``cwd=REPO``."""
    return [sys.executable, "-m", module_name(file), *args]


# ------------------------------------------------------------------------------------ timing


def timed(fn: Callable[[], T], repeats: int) -> tuple[float, T]:
    """``(median seconds, last result)`` of ``repeats`` calls of ``fn``."""
    times: list[float] = []
    out: Any = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def median_time(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of ``repeats`` calls of ``fn`` after one untimed warm-up call."""
    fn()
    return timed(fn, repeats)[0]


# ------------------------------------------------------------------------------- peak memory


def rss_kb() -> int:
    """This process's resident set size in KiB (Linux; 0 elsewhere)."""
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def reset_peak_rss() -> bool:
    """Linux: writing 5 to clear_refs resets the process's peak RSS (VmHWM). Whether it did."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_rss_kb(reset: bool) -> int:
    """The peak RSS in KiB: since :func:`reset_peak_rss` if it succeeded (``reset``), else the
    process's ``ru_maxrss``."""
    if reset:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


# ----------------------------------------------------------------------------------- outputs


def read_run(path: str | Path) -> dict:
    """The ``results.json`` of an eval run at ``path``; a missing, unreadable or non-JSON file
    ends the benchmark with one line naming it (``SystemExit``), not a traceback."""
    try:
        return read_json(path, "results")
    except InvalidInputError as e:
        raise SystemExit(f"{e} (an eval run's results.json)") from None


def read_partial(path: str | Path) -> list[dict]:
    """The records of a stopped eval run's ``partial.jsonl``, read as ``--resume`` reads them
    (a last line cut by the stop is dropped); a broken record ends the benchmark with one line
    naming the file and line (``SystemExit``)."""
    try:
        return read_records(path, "partial")
    except InvalidInputError as e:
        raise SystemExit(str(e)) from None


def write_json(path: str | Path | None, payload: object, indent: int | None = 2) -> bool:
    """Write ``payload`` as JSON to ``path`` atomically (folders created); False if ``path`` is
    None (nothing asked), True once written."""
    if path is None:
        return False
    atomic_write(path, json.dumps(payload, indent=indent) + "\n")
    return True


def write_file(path: str | Path, data: str | Callable[[str], object]) -> Path:
    """Write ``data`` to ``path`` atomically (folders created): a text, or a callable that
    writes the whole file at the temporary path it is given (``lambda tmp: fig.savefig(tmp)``;
    the temporary file has ``path``'s name, so its suffix says the format)."""
    return atomic_write(path, data)


def markdown_table(head: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    """The lines of a markdown table: ``| a | b |``, ``|---|---|``, then one line per row."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
