"""Scores of the memory suite on conversations from files (:mod:`kvedit.evals.conversation_files`):
exact match and token F1 (normalised as SQuAD does, :func:`kvedit.evals.metrics.normalize_answer`,
the best over the gold answers), by category and by the age of the evidence (the rendering's
tokens after the oldest evidence turn, binned by :data:`AGE_BINS`), and their tables."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

from kvedit.evals.metrics import normalize_answer

__all__ = [
    "AGE_BINS",
    "NO_CATEGORY",
    "NO_EVIDENCE",
    "add_file_scores",
    "age_bin",
    "exact_match",
    "format_file_tables",
    "message_ends",
    "token_f1",
]

AGE_BINS = ((256, "<256"), (1024, "256-1K"), (4096, "1K-4K"), (16384, "4K-16K"), (None, "16K+"))
"""``(below, label)``: an age in tokens falls in the first bin it is below."""
NO_EVIDENCE = "no evidence"
"""The age bin of a question without evidence turns."""
NO_CATEGORY = "(none)"
"""The category of a question that gives none."""


def exact_match(prediction: str, answers: Sequence[str]) -> float:
    """1.0 when the normalised prediction equals a normalised gold answer (SQuAD's EM)."""
    said = normalize_answer(prediction)
    return float(any(said == normalize_answer(a) for a in answers))


def token_f1(prediction: str, answers: Sequence[str]) -> float:
    """SQuAD's token F1 of the normalised prediction against each gold answer, the best one (an
    empty side scores 1.0 only when both are empty)."""
    said = normalize_answer(prediction).split()
    best = 0.0
    for answer in answers:
        gold = normalize_answer(answer).split()
        if not said or not gold:
            best = max(best, float(said == gold))
            continue
        common = sum((Counter(said) & Counter(gold)).values())
        if common:
            precision, recall = common / len(said), common / len(gold)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best


def age_bin(tokens: int | None) -> str:
    """The :data:`AGE_BINS` label of an age in tokens (:data:`NO_EVIDENCE` for None)."""
    if tokens is None:
        return NO_EVIDENCE
    return next(label for below, label in AGE_BINS if below is None or tokens < below)


def message_ends(renderer, messages: Sequence[tuple[str, str]]) -> list[int]:
    """``[0, end of message 0, end of message 1, ...]``: the tokens of the rendering of the
    messages up to each one (the rendering a memory holds, forgetting nothing)."""
    from kvedit.memory.rendering import Message

    ends, rendering, held = [0], None, []
    for role, content in messages:
        held.append(Message(role, content))
        rendering = renderer.render(held, after=rendering)
        ends.append(len(rendering.ids))
    return ends


def _scores(records: Sequence[dict]) -> dict[str, Any]:
    n = len(records)
    return {
        "n": n,
        "em": math.fsum(r["em"] for r in records) / n,
        "f1": math.fsum(r["f1"] for r in records) / n,
    }


def _order(labels: set[str], first: Sequence[str]) -> list[str]:
    return [b for b in first if b in labels] + sorted(labels - set(first))


def add_file_scores(summary: dict, records: Sequence[dict]) -> dict:
    """``summary`` (:func:`kvedit.evals.memory_report.summarize_memory`) with, for each method
    and budget, ``em`` and ``f1`` (means), ``by_category`` and ``by_age`` (``{label: {"n",
    "em", "f1"}}``, the ages by :data:`AGE_BINS`, youngest first)."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in records:
        groups.setdefault((r["method"], f"{float(r['budget']):g}"), []).append(r)
    ages = [label for _, label in AGE_BINS] + [NO_EVIDENCE]
    for (method, budget), rs in groups.items():
        cats: dict[str, list[dict]] = {}
        by_age: dict[str, list[dict]] = {}
        for r in rs:
            cats.setdefault(r.get("category") or NO_CATEGORY, []).append(r)
            by_age.setdefault(age_bin(r.get("age_tokens")), []).append(r)
        summary[method][budget].update(
            {
                **{k: v for k, v in _scores(rs).items() if k != "n"},
                "by_category": {c: _scores(cats[c]) for c in sorted(cats)},
                "by_age": {a: _scores(by_age[a]) for a in _order(set(by_age), ages)},
            }
        )
    return summary


def _table(summary: dict, key: str, title: str) -> str:
    labels: list[str] = []
    for by_budget in summary.values():
        for s in by_budget.values():
            labels += [lab for lab in s.get(key, {}) if lab not in labels]
    header = ["method", "budget", "EM", "F1", *(f"{lab} F1 (n)" for lab in labels)]
    rows = [header]
    for method, by_budget in summary.items():
        for budget, s in by_budget.items():
            cells = [method, budget, f"{s['em']:.3f}", f"{s['f1']:.3f}"]
            for lab in labels:
                got = s[key].get(lab)
                cells.append("-" if got is None else f"{got['f1']:.3f} ({got['n']})")
            rows.append(cells)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        rest = (c.rjust(w) for c, w in zip(cells[1:], widths[1:]))
        return "  ".join([cells[0].ljust(widths[0]), *rest]).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([title, line(header), rule, *(line(r) for r in rows[1:])])


def format_file_tables(summary: dict) -> str:
    """Two plain-text tables of :func:`add_file_scores`' summary: EM, F1 and the F1 by
    category, then by the age of the evidence in tokens."""
    return "\n\n".join(
        [
            _table(summary, "by_category", "by category (token F1, questions):"),
            _table(summary, "by_age", "by age of the evidence in tokens (token F1, questions):"),
        ]
    )
