"""The lost-in-the-middle plot labels ``oracle`` for what it is (#65): told the gold passage, it
edits it by a fixed rule (+2 nats on every layer by default), no sizing, no guard, so it is an
oracle of the choice, not of the edit, and no upper bound (``auto`` scores above it on NQ-10,
``reports/litm/README.md``). It was labelled "(upper bound)"."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvedit.evals import report
from kvedit.evals.methods.edits import EditParams
from kvedit.evals.report import ORACLE_STRENGTH, oracle_label, plot_curves, summarize

METHODS = ("none", "auto", "oracle", "oracle:edit=steer", "oracle:strength=3.0")


def _records() -> list[dict]:
    return [
        {"id": f"{m}-{p}", "method": m, "gold_index": p, "prediction": "x", "correct": p == 0}
        for m in METHODS
        for p in (0, 4, 9)
    ]


def _labels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The plot's legend, by method: each label as :func:`plot_curves` draws it."""
    pytest.importorskip("matplotlib")
    seen = {}
    save = report.save_accuracy_plot

    def keep(fig, ax, path, title):
        seen.update(zip(METHODS, ax.get_legend_handles_labels()[1], strict=True))
        return save(fig, ax, path, title)

    monkeypatch.setattr(report, "save_accuracy_plot", keep)
    plot_curves(summarize(_records()), tmp_path / "curves.png")
    return seen


def test_the_plot_calls_no_oracle_an_upper_bound(tmp_path, monkeypatch):
    labels = _labels(tmp_path, monkeypatch)
    assert labels["none"] == "none" and labels["auto"] == "auto"
    assert labels["oracle"] == (
        "oracle (gold passage, fixed +2 nats: an oracle of the choice, not of the edit)"
    )
    for method in METHODS[2:]:
        assert "upper bound" not in labels[method]
        assert labels[method].startswith(f"{method} (gold passage, fixed ")
        assert labels[method].endswith(": an oracle of the choice, not of the edit)")


def test_the_label_names_the_default_strength_the_oracle_adds():
    """``+2 nats`` is :class:`EditParams`' default strength; another edit is a fixed edit."""
    assert EditParams().strength == ORACLE_STRENGTH
    assert "fixed edit" in oracle_label("oracle:edit=duplicate:copies=7")


def test_no_doc_of_the_oracle_method_says_upper_bound():
    root = Path(__file__).resolve().parents[2]
    docs = {
        "kvedit/evals/methods/oracle.py": "an oracle of the choice, not of the edit",
        "kvedit/evals/report.py": "an oracle of the choice, not of the edit",
        "docs/evals.md": "An oracle of the choice, not of the edit",
    }
    for name, said in docs.items():
        text = (root / name).read_text(encoding="utf-8")
        assert said in text, name
        lines = [line for line in text.splitlines() if "upper bound" in line]
        assert all("no upper bound" in line or "not" in line for line in lines), (name, lines)
