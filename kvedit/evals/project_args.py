"""``kvedit eval project``'s options, apart from :mod:`kvedit.evals.project` (which imports
torch), so that ``kvedit eval project --help`` prints at once; the run is given by the caller
(:func:`kvedit.evals.project.add_parser` gives its ``main``)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

__all__ = ["FIT_POOL", "PROJECT_SUMMARY", "add_parser"]

FIT_POOL = 2000
"""The NQ items the projector is fit on: calibration passages come from ``[0, FIT_POOL)``, and
evaluation passages from after it (:mod:`kvedit.evals.project`)."""

PROJECT_SUMMARY = "cross-model KV projection: B's loss with a projected cache of A"
"""``kvedit eval project``'s line in ``kvedit eval --help``."""


def add_parser(subparsers, run: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
    """Add ``project`` to the ``kvedit eval`` subcommands; ``run(args)`` runs it."""
    p = subparsers.add_parser("project", help=PROJECT_SUMMARY)
    p.add_argument(
        "--a", default="smollm2-135m-instruct", help="source model A (default: %(default)s)"
    )
    p.add_argument("--b", default="gemma3-270m", help="target model B (default: %(default)s)")
    p.add_argument("--out", default="runs/project", help="output directory (default: %(default)s)")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the results of an earlier run in --out (refused without it)",
    )
    p.add_argument(
        "--projector",
        default=None,
        help="load this projector instead of fitting one (default: fit one)",
    )
    p.add_argument(
        "--n-passages",
        type=_whole(2),
        default=100,
        help="held-out evaluation passages, at least 2 (default: %(default)s)",
    )
    p.add_argument(
        "--n-fit",
        type=_whole(1, FIT_POOL),
        default=600,
        help=f"calibration passages, at most {FIT_POOL} (default: %(default)s)",
    )
    p.add_argument(
        "--depth-window",
        type=_whole(1),
        default=3,
        help="A layers per B layer (default: %(default)s)",
    )
    p.add_argument(
        "--own-last",
        type=_whole(1),
        default=1,
        help="prefix tokens B computes itself (default: %(default)s)",
    )
    p.add_argument(
        "--prefix-fraction",
        type=_fraction,
        default=0.5,
        help="where each passage is cut, a fraction of its words in (0, 1) (default: %(default)s)",
    )
    p.add_argument(
        "--min-words",
        type=_whole(1),
        default=16,
        help="fewest words on each side of a passage's cut; shorter passages are skipped "
        "(default: %(default)s)",
    )
    p.add_argument("--device", default=None, help="default: CUDA when available, else CPU")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(run=run)
    return p


def _whole(low: int, high: int | None = None):
    """An argparse type: a whole number in ``[low, high]``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, not {text!r}") from None
        if value < low or (high is not None and value > high):
            bounds = f"at least {low}" if high is None else f"in {low}..{high}"
            raise argparse.ArgumentTypeError(f"must be {bounds}, not {value}")
        return value

    return parse


def _fraction(text: str) -> float:
    """An argparse type: a number strictly between 0 and 1."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, not {text!r}") from None
    if not (math.isfinite(value) and 0 < value < 1):
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, not {text}")
    return value
