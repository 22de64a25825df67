"""Summaries, result files, tables and plots of lost-in-the-middle evaluations.

The input is one result record per (example, method)::

    {"id": str, "method": str, "gold_index": int, "prediction": str, "correct": bool | float}

:func:`summarize` turns them into per-method accuracies by gold position, :func:`write_results`
stores both in ``results.json``, :func:`format_table` prints the summary and
:func:`plot_curves` draws accuracy against gold position.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import math
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from numbers import Real
from pathlib import Path
from typing import Any

import filelock

from kvedit.atomic import atomic_write
from kvedit.errors import InvalidInputError, InvalidTypeError, KVEditError
from kvedit.evals.metrics import bootstrap_ci

__all__ = [
    "LOCK_NAME",
    "PLOT_HINT",
    "REQUIRED_KEYS",
    "accuracy_axes",
    "check_out",
    "format_table",
    "hold_out",
    "oracle_label",
    "plot_curves",
    "plotting_available",
    "save_accuracy_plot",
    "summarize",
    "write_results",
]

LOCK_NAME = ".lock"
"""The lock file an eval run holds in its output folder (one run per folder at a time)."""

PLOT_HINT = "plotting needs Matplotlib; install the plot extra: pip install 'kvedit[plot]'"

REQUIRED_KEYS = ("id", "method", "gold_index", "prediction", "correct")
"""Keys every result record must have (others are kept in ``results.json`` but ignored)."""

N_RESAMPLES = 1000
"""Bootstrap resamples of the 95% confidence interval (seed 0)."""


def _correctness(record: Mapping[str, Any], number: int) -> float:
    value = record["correct"]
    if hasattr(value, "item") and not isinstance(value, Real | str):
        value = value.item()  # a NumPy or torch scalar, e.g. numpy.bool_
    if not isinstance(value, Real) or not 0.0 <= float(value) <= 1.0:
        raise InvalidInputError(
            f"record {number}: 'correct' must be a bool or a number in [0, 1], got {value!r}"
        )
    return float(value)


def summarize(records: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per-method accuracy: overall, by gold position, worst position, and its 95% CI.

    Returns ``{method: {"mean", "worst", "by_position", "n", "ci95"}}`` with methods in the
    order they first appear (plus ``"seconds"``, the mean seconds per example, when records
    have them, and ``"hit_rate"`` / ``"hit_by_position"``, how often the gold document was
    among the ``"chosen"`` ones, for methods that record a choice, and ``"exact_share"``, the
    share of the method's records whose cache vLLM realised exactly, for records that say:
    ``--engine vllm``), where

    - ``by_position`` maps the gold position, as a string (``"0"``, ``"5"``, ...; sorted
      numerically), to the mean ``correct`` of that method's examples at that position;
    - ``mean`` is the mean ``correct`` over all of the method's examples, and ``n`` their
      number;
    - ``worst`` is the lowest accuracy in ``by_position``;
    - ``ci95`` is ``[low, high]``, the percentile bootstrap of ``mean`` over examples
      (1,000 resamples, seed 0).

    For a baseline whose prompt does not depend on the position (closed-book, gold-only),
    record the ``gold_index`` of the positioned example it stands for, so that it gets a value
    at every position like the other methods.

    Raises:
        ValueError: a record lacks a required key, has a ``correct`` that is not a bool or a
            number in [0, 1], or repeats the ``(method, id)`` of an earlier record.
    """
    by_method: dict[str, list[tuple[int, float]]] = {}
    seconds: dict[str, list[float]] = {}
    sizes: dict[str, list[float]] = {}
    exact: dict[str, list[float]] = {}
    hits: dict[str, dict[int, list[float]]] = {}
    seen: set[tuple[str, str]] = set()
    for number, record in enumerate(records):
        missing = [key for key in REQUIRED_KEYS if key not in record]
        if missing:
            raise InvalidInputError(f"record {number}: missing key(s) {', '.join(missing)}")
        key = (str(record["method"]), str(record["id"]))
        if key in seen:
            raise InvalidInputError(
                f"record {number}: duplicate result for method {key[0]!r}, id {key[1]!r}"
            )
        seen.add(key)
        by_method.setdefault(key[0], []).append(
            (int(record["gold_index"]), _correctness(record, number))
        )
        if "seconds" in record:
            seconds.setdefault(key[0], []).append(float(record["seconds"]))
        if "bytes" in record:
            sizes.setdefault(key[0], []).append(float(record["bytes"]))
        if "exact" in record:
            exact.setdefault(key[0], []).append(float(bool(record["exact"])))
        if "chosen" in record:
            hit = float(int(record["gold_index"]) in record["chosen"])
            hits.setdefault(key[0], {}).setdefault(int(record["gold_index"]), []).append(hit)

    summary: dict[str, dict[str, Any]] = {}
    for method, results in by_method.items():
        positions: dict[int, list[float]] = {}
        for position, value in results:
            positions.setdefault(position, []).append(value)
        by_position = {
            str(position): math.fsum(values) / len(values)
            for position, values in sorted(positions.items())
        }
        values = [value for _, value in results]
        low, high = bootstrap_ci(values, n_resamples=N_RESAMPLES, seed=0)
        summary[method] = {
            "mean": math.fsum(values) / len(values),
            "worst": min(by_position.values()),
            "by_position": by_position,
            "n": len(values),
            "ci95": [low, high],
        }
        if method in seconds:
            summary[method]["seconds"] = math.fsum(seconds[method]) / len(seconds[method])
        if method in sizes:
            summary[method]["bytes"] = math.fsum(sizes[method]) / len(sizes[method])
        if method in exact:
            summary[method]["exact_share"] = math.fsum(exact[method]) / len(exact[method])
        if method in hits:
            by_hit = {str(p): math.fsum(v) / len(v) for p, v in sorted(hits[method].items())}
            every = [h for v in hits[method].values() for h in v]
            summary[method]["hit_rate"] = math.fsum(every) / len(every)
            summary[method]["hit_by_position"] = by_hit
    return summary


def _json_default(value: Any) -> Any:
    """JSON for NumPy/torch scalars (via ``.item()``) and paths; anything else is an error."""
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    raise InvalidTypeError(f"{type(value).__name__} is not JSON serializable")


def write_results(
    out_dir: str | os.PathLike[str],
    model: str,
    task: str,
    records: Iterable[Mapping[str, Any]],
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``out_dir/results.json`` atomically and return its path.

    The file holds ``{"model", "task", "methods": summarize(records), "examples": records}``,
    plus ``"extra": extra`` when ``extra`` is given (settings, timings, ...). ``out_dir`` is
    created if needed.
    """
    records = [dict(record) for record in records]
    payload: dict[str, Any] = {
        "model": model,
        "task": task,
        "methods": summarize(records),
        "examples": records,
    }
    if extra is not None:
        payload["extra"] = dict(extra)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    text = json.dumps(payload, indent=2, ensure_ascii=False, default=_json_default) + "\n"
    return atomic_write(out / "results.json", text)


def _positions(summary: Mapping[str, Mapping[str, Any]]) -> list[int]:
    return sorted({int(p) for stats in summary.values() for p in stats["by_position"]})


def format_table(summary: Mapping[str, Mapping[str, Any]]) -> str:
    """The summary as a plain-text table, one row per method.

    Columns: the method, its accuracy at each gold position (``p<position>``; ``-`` where it
    was not measured), the mean, the worst position's accuracy, the 95% CI and ``n``; with
    ``--engine vllm`` also ``exact``, the share of the method's answers served from a cache
    vLLM realised exactly (below 1: served approximately, ``--approximate``). Accuracies are
    fractions with three decimals.
    """
    positions = _positions(summary)
    with_exact = any("exact_share" in stats for stats in summary.values())
    header = ["method", *(f"p{p}" for p in positions), "mean", "worst", "95% CI", "n"]
    header += ["exact"] if with_exact else []
    rows = [header]
    for method, stats in summary.items():
        by_position = stats["by_position"]
        low, high = stats["ci95"]
        rows.append(
            [
                method,
                *(
                    f"{by_position[str(p)]:.3f}" if str(p) in by_position else "-"
                    for p in positions
                ),
                f"{stats['mean']:.3f}",
                f"{stats['worst']:.3f}",
                f"[{low:.3f}, {high:.3f}]",
                str(stats["n"]),
                *(
                    [f"{stats['exact_share']:.3f}" if "exact_share" in stats else "-"]
                    if with_exact
                    else []
                ),
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        first = cells[0].ljust(widths[0])
        rest = (cell.rjust(width) for cell, width in zip(cells[1:], widths[1:]))
        return "  ".join([first, *rest]).rstrip()

    rule = "  ".join("-" * width for width in widths)
    return "\n".join([line(header), rule, *(line(row) for row in rows[1:])])


def plot_curves(
    summary: Mapping[str, Mapping[str, Any]],
    path: str | os.PathLike[str],
    title: str | None = None,
) -> Path:
    """Plot accuracy against gold position, one line per method, and save it as a PNG.

    A method whose name starts with ``"oracle"`` is drawn dashed and labelled for what it is
    (:func:`oracle_label`): told the gold passage, it edits it by a fixed rule, so it is an
    oracle of the choice, not of the edit, and no upper bound (``auto`` sizes its bias per
    layer and scores above it at some positions: ``reports/litm/README.md``). A method measured at a single position (a position-independent baseline) is drawn
    as a flat dotted line across all positions. Rendering uses Matplotlib's Agg canvas directly, so
    the global backend (pyplot) is left alone. The file is written atomically; returns its
    path.

    Raises:
        KVEditError: Matplotlib is not installed (the ``plot`` extra:
            ``pip install 'kvedit[plot]'``).
        InvalidInputError: ``summary`` is empty.
    """
    if not summary:
        raise InvalidInputError("nothing to plot: the summary has no methods")
    positions = _positions(summary)
    fig, ax = accuracy_axes(width=8.0)
    oracle_markers = iter("sD^vP*Xp<>" * 4)
    for method, stats in summary.items():
        points = sorted((int(p), acc) for p, acc in stats["by_position"].items())
        if len(points) == 1:
            xs, ys = positions, [points[0][1]] * len(positions)
        else:
            xs, ys = [p for p, _ in points], [acc for _, acc in points]
        if method.lower().startswith("oracle"):
            ax.plot(
                xs,
                ys,
                linestyle="--",
                color="gray",
                marker=next(oracle_markers),
                markersize=4,
                alpha=0.8,
                label=oracle_label(method),
            )
        elif len(points) == 1:
            ax.plot(xs, ys, linestyle=":", label=method)
        else:
            ax.plot(xs, ys, marker="o", label=method)
    ax.set_xticks(positions)
    ax.set_xlabel("Position of the gold document (0 = first)")
    return save_accuracy_plot(fig, ax, path, title)


ORACLE_STRENGTH = 2.0
"""The bias in nats the ``oracle`` method adds with its default parameters
(:class:`kvedit.evals.methods.edits.EditParams`' ``strength``), on every layer."""


def oracle_label(method: str) -> str:
    """The plot label of an ``oracle`` method (by its name, ``oracle`` or
    ``oracle:key=value...``): told the gold passage, a fixed edit (``oracle`` alone: +2 nats,
    :data:`ORACLE_STRENGTH`), no sizing, no guard, so an oracle of the choice, not of the
    edit."""
    edit = f"fixed +{ORACLE_STRENGTH:g} nats" if method.lower() == "oracle" else "fixed edit"
    return f"{method} (gold passage, {edit}: an oracle of the choice, not of the edit)"


def accuracy_axes(width: float):
    """``(figure, axes)`` of a ``width`` x 4 inch plot on Matplotlib's Agg canvas (the global
    pyplot backend is left alone).

    Raises:
        KVEditError: Matplotlib is not installed (:data:`PLOT_HINT`).
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise KVEditError(
            f"plotting needs Matplotlib ({e}); install the plot extra: pip install 'kvedit[plot]'"
        ) from e
    fig = Figure(figsize=(width, 4.0))
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def save_accuracy_plot(fig, ax, path: str | os.PathLike[str], title: str | None) -> Path:
    """Finish an accuracy plot (y axis 0-1, grid, legend to the right, ``title``) and write it
    to ``path`` as a PNG, atomically; returns the path."""
    ax.set_ylabel("Accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)
    if title:
        ax.set_title(title)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=120, bbox_inches="tight")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write(path, buffer.getvalue())


def plotting_available() -> bool:
    """Whether Matplotlib can be imported (:func:`plot_curves` needs it: the ``plot`` extra)."""
    try:
        return importlib.util.find_spec("matplotlib") is not None
    except (ImportError, ValueError, AttributeError):  # blocked in sys.modules, or no spec
        return False


def check_out(
    out: str | os.PathLike[str],
    results: Sequence[str],
    *,
    overwrite: bool = False,
    resume: bool = False,
) -> None:
    """Refuse an output folder ``out`` an eval run must not write into; writes nothing.

    ``out`` must be a folder or not exist yet. When it holds one of ``results`` (file names:
    an earlier run's results), the run is refused unless ``overwrite`` allows replacing them,
    or ``resume`` finishes the interrupted run whose ``partial.jsonl`` is there.

    Raises:
        InvalidInputError: naming the folder and what it holds (exit status 2 in the CLI).
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise InvalidInputError(f"--out {out}: is a file, not a folder; name a folder")
    held = [name for name in results if (out / name).exists()]
    if not held or overwrite:
        return
    if resume and (out / "partial.jsonl").exists():
        return
    if "partial.jsonl" in held and not resume:
        raise InvalidInputError(
            f"--out {out}: holds an interrupted run's partial.jsonl; pass --resume to finish "
            "it, or --overwrite to start again"
        )
    raise InvalidInputError(
        f"--out {out}: holds an earlier run's {', '.join(held)}"
        f"{' and nothing to --resume' if resume else ''}; pass --overwrite to replace "
        f"{'them' if len(held) > 1 else 'it'}, or choose another --out"
    )


@contextlib.contextmanager
def hold_out(out: str | os.PathLike[str]) -> Iterator[Path]:
    """Hold ``out``'s lock for the ``with`` block: one eval run per output folder at a time.

    The lock is ``out/.lock`` (:data:`LOCK_NAME`), an ``flock`` the kernel releases when its
    holder dies (a killed run never leaves the folder locked); the file stays after a run. The
    folder is made if needed; when the block fails, what this call made (the lock file, the
    folder) is removed again, so a refused run leaves nothing.

    Raises:
        InvalidInputError: another run holds the lock (exit status 2 in the CLI).
        OSError: the folder or its lock file cannot be made.
    """
    out = Path(out)
    path = out / LOCK_NAME
    made_dir = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    made_lock = not path.exists()
    lock = filelock.FileLock(
        path, timeout=0, thread_local=False, fallback_to_soft=False, preserve_lock_file=True
    )
    try:
        lock.acquire()
    except filelock.Timeout:
        raise InvalidInputError(
            f"--out {out}: another kvedit eval run is writing there (it holds {path}); wait for "
            "it to end, or choose another --out"
        ) from None
    ok = False
    try:
        yield out
        ok = True
    finally:
        if not ok and made_lock:
            path.unlink(missing_ok=True)
        lock.release()
        if not ok and made_dir:
            with contextlib.suppress(OSError):
                out.rmdir()  # only when empty
