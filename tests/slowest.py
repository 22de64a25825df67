"""The suite's slowest tests, kept after a whole run (``make test``: ``pytest`` with no paths).

``conftest.py`` adds each test's setup, call and teardown seconds (:func:`add`) and, at the end
of a session whose paths came from ``testpaths`` (a whole-suite run), writes the
:data:`COUNT` slowest to :data:`FILE` (``runs/`` is git-ignored) with :func:`write`.
``KVEDIT_SLOWEST_OUT=PATH`` writes them after any run, to ``PATH``: how
``reports/tests/slowest.md``'s baseline was made.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from kvedit.atomic import atomic_write

REPO = Path(__file__).resolve().parent.parent
FILE = REPO / "runs" / "slowest-tests.txt"
COUNT = 25


def add(seconds: dict[str, float], report: pytest.TestReport) -> None:
    """Add ``report``'s phase to its test's seconds."""
    seconds[report.nodeid] = seconds.get(report.nodeid, 0.0) + report.duration


def slowest(seconds: dict[str, float], count: int = COUNT) -> list[tuple[str, float]]:
    """The ``count`` slowest ``(test id, seconds)``, slowest first (ties by id)."""
    return sorted(seconds.items(), key=lambda item: (-item[1], item[0]))[:count]


def text(seconds: dict[str, float], count: int = COUNT) -> str:
    """The slowest tests as lines ``seconds  test id``, under a line saying of how many."""
    rows = slowest(seconds, count)
    head = f"# the {len(rows)} slowest of {len(seconds)} tests, seconds (setup + call + teardown)"
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    return "\n".join([head, f"# {stamp}", *(f"{s:8.2f}  {node}" for node, s in rows)]) + "\n"


def target(config: pytest.Config) -> Path | None:
    """Where a session writes its slowest tests: ``KVEDIT_SLOWEST_OUT`` if set, else
    :data:`FILE` for a whole-suite run (paths from ``testpaths``), else nowhere."""
    if os.environ.get("KVEDIT_SLOWEST_OUT"):
        return Path(os.environ["KVEDIT_SLOWEST_OUT"])
    whole = config.args_source == pytest.Config.ArgsSource.TESTPATHS
    return FILE if whole else None


def write(config: pytest.Config, seconds: dict[str, float]) -> Path | None:
    """Write the slowest tests where :func:`target` says; returns the path written, if any."""
    path = target(config)
    if path is None or not seconds:
        return None
    return atomic_write(path, text(seconds))
