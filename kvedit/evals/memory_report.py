"""The summary, table and plot of the memory suite (:mod:`kvedit.evals.memory`): accuracy by
method x budget x bucket."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvedit.errors import InvalidInputError
from kvedit.evals.metrics import bootstrap_ci
from kvedit.evals.report import accuracy_axes, save_accuracy_plot
from kvedit.evals.tasks.memory_schema import BUCKETS

__all__ = [
    "check_memory_record",
    "format_memory_table",
    "plot_memory",
    "reread_summary",
    "summarize_memory",
]

_NUMBERS = ("correct", "seconds", "rounds", "forget_seconds")
"""The numbers every record holds for the summary (``budget`` and ``max_entries`` apart)."""


def check_memory_record(record: dict, where: str) -> dict:
    """``record`` if it holds what :func:`summarize_memory` and ``--resume`` read: ``example``,
    ``digest`` (text), ``budget`` (in (0, 1]), ``bucket`` (one of :data:`BUCKETS`, or None for
    a conversation file's question without evidence), the
    numbers ``correct``, ``seconds``, ``rounds`` and ``forget_seconds``, ``max_entries`` (a
    count or None); ``id`` and ``method`` are checked by
    :func:`kvedit.evals.jsonl.check_record`.

    Raises:
        InvalidInputError: naming ``where`` (the file and line), the key and what it holds.
    """

    def bad(key: str, wanted: str) -> InvalidInputError:
        held = f"{record[key]!r}" if key in record else "nothing"
        return InvalidInputError(f"{where}: a memory record's {key!r} must be {wanted}, not {held}")

    def number(value: object) -> bool:
        return (
            isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        )

    for key in ("example", "digest"):
        if not isinstance(record.get(key), str):
            raise bad(key, "text")
    if not number(record.get("budget")) or not 0 < record["budget"] <= 1:
        raise bad("budget", "a number in (0, 1]")
    if record.get("bucket") not in BUCKETS and record.get("bucket", "") is not None:
        raise bad("bucket", f"one of {', '.join(BUCKETS)} or null (a question without evidence)")
    for key in _NUMBERS:
        if not (
            number(record.get(key)) or (key == "correct" and isinstance(record.get(key), bool))
        ):
            raise bad(key, "a number")
    entries = record.get("max_entries")
    if entries is not None and (not isinstance(entries, int) or isinstance(entries, bool)):
        raise bad("max_entries", "a whole number or null")
    return record


def summarize_memory(records: Sequence[dict]) -> dict[str, dict[str, dict[str, Any]]]:
    """``{method: {budget: {"mean", "ci95", "n", "by_bucket", "seconds", "rounds",
    "forget_seconds", "max_entries", "own_entries_fraction", "own_bytes_fraction"}}}``:
    accuracy over the questions, and by bucket (the buckets measured); ``seconds`` the mean per
    answer, ``rounds`` and ``forget_seconds`` the mean per conversation (kept rounds),
    ``max_entries`` the mean budget in entries (None at 1.0); the two fractions the mean over
    the questions of what the memory held of the model's own windowed cache
    (:mod:`kvedit.memory.footprint`; None where no record says, as in files written before
    them). Budgets are keys as text (``"0.5"``), in descending order.

    Raises:
        InvalidInputError: a ``(method, budget, id)`` given twice.
    """
    groups: dict[str, dict[float, list[dict]]] = {}
    seen = set()
    for r in records:
        key = (r["method"], float(r["budget"]), r["id"])
        if key in seen:
            raise InvalidInputError(
                f"duplicate record for method {key[0]!r}, budget {key[1]}, id {key[2]!r}"
            )
        seen.add(key)
        groups.setdefault(r["method"], {}).setdefault(float(r["budget"]), []).append(r)
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for method, by_budget in groups.items():
        out[method] = {}
        for budget in sorted(by_budget, reverse=True):
            rs = by_budget[budget]
            values = [float(r["correct"]) for r in rs]
            low, high = bootstrap_ci(values, n_resamples=1000, seed=0)
            per_conv = {r["example"]: r for r in rs}  # the last question's record of each
            entries = [r["max_entries"] for r in rs if r.get("max_entries") is not None]
            out[method][f"{budget:g}"] = {
                "mean": math.fsum(values) / len(values),
                "ci95": [low, high],
                "n": len(values),
                "by_bucket": {
                    b: math.fsum(float(r["correct"]) for r in rs if r["bucket"] == b)
                    / sum(r["bucket"] == b for r in rs)
                    for b in BUCKETS
                    if any(r["bucket"] == b for r in rs)
                },
                "seconds": math.fsum(r["seconds"] for r in rs) / len(rs),
                "rounds": math.fsum(r["rounds"] for r in per_conv.values()) / len(per_conv),
                "forget_seconds": math.fsum(r["forget_seconds"] for r in per_conv.values())
                / len(per_conv),
                "max_entries": math.fsum(entries) / len(entries) if entries else None,
                "own_entries_fraction": _mean_of(rs, "own_entries_fraction"),
                "own_bytes_fraction": _mean_of(rs, "own_bytes_fraction"),
            }
    return out


def _mean_of(records: Sequence[dict], key: str) -> float | None:
    """The mean of ``key`` over the records that hold a number there (None where none does)."""
    values = [float(r[key]) for r in records if isinstance(r.get(key), (int, float))]
    return math.fsum(values) / len(values) if values else None


def _fraction(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def format_memory_table(summary: dict[str, dict[str, dict[str, Any]]]) -> str:
    """The summary as a plain-text table: a row per method and budget, the accuracy by bucket,
    the mean with its 95% CI, ``n``, seconds per answer, forgetting rounds per conversation,
    and the fractions of the model's own entries and bytes the memory held (``own entries``,
    ``own bytes``: ``-`` where the records do not say; last, so that the columns before keep
    their places)."""
    header = [
        "method",
        "budget",
        *BUCKETS,
        "mean",
        "95% CI",
        "n",
        "s/answer",
        "rounds",
        "own entries",
        "own bytes",
    ]
    rows = [header]
    for method, by_budget in summary.items():
        for budget, s in by_budget.items():
            low, high = s["ci95"]
            rows.append(
                [
                    method,
                    budget,
                    *(f"{s['by_bucket'][b]:.3f}" if b in s["by_bucket"] else "-" for b in BUCKETS),
                    f"{s['mean']:.3f}",
                    f"[{low:.3f}, {high:.3f}]",
                    str(s["n"]),
                    f"{s['seconds']:.3f}",
                    f"{s['rounds']:.1f}",
                    _fraction(s.get("own_entries_fraction")),
                    _fraction(s.get("own_bytes_fraction")),
                ]
            )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        rest = (c.rjust(w) for c, w in zip(cells[1:], widths[1:]))
        return "  ".join([cells[0].ljust(widths[0]), *rest]).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), rule, *(line(r) for r in rows[1:])])


def plot_memory(summary: dict, path: str | Path, title: str | None = None) -> Path:
    """Accuracy against budget, one line per method (``reuse`` as a dashed level), saved as a
    PNG atomically.

    Raises:
        KVEditError: Matplotlib is not installed.
    """
    fig, ax = accuracy_axes(width=7.0)
    budgets = sorted({float(b) for s in summary.values() for b in s})
    for method, by_budget in summary.items():
        points = sorted((float(b), s["mean"]) for b, s in by_budget.items())
        if len(points) == 1 and method == "reuse":
            ax.plot(budgets, [points[0][1]] * len(budgets), "--", color="gray", label=method)
        else:
            ax.plot([b for b, _ in points], [a for _, a in points], marker="o", label=method)
    ax.set_xscale("log")
    ax.set_xticks(budgets)
    ax.set_xticklabels([f"{b:g}" for b in budgets])
    ax.set_xlabel("Budget (fraction of the conversation's global-layer entries)")
    return save_accuracy_plot(fig, ax, path, title)


def reread_summary(turns: list[dict]) -> dict | None:
    """Re-reading the transcript each turn, timed (None when ``reuse`` did not run)."""
    if not turns:
        return None
    return {
        "turns": len(turns),
        "seconds_per_turn": round(math.fsum(t["seconds"] for t in turns) / len(turns), 4),
        "reuse_seconds_per_turn": round(
            math.fsum(t["reuse_seconds"] for t in turns) / len(turns), 4
        ),
        "same_answers": sum(t["same_answer"] for t in turns),
    }
