"""Tests of kvedit.evals.report: summaries, results.json, the table and the plot."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvedit.evals import report
from kvedit.evals.report import format_table, plot_curves, summarize, write_results


def record(method: str, position: int, correct: bool | float, i: int) -> dict:
    return {
        "id": f"ex-{position}-{i}",
        "method": method,
        "gold_index": position,
        "prediction": "4821" if correct else "1234",
        "correct": correct,
    }


@pytest.fixture
def records() -> list[dict]:
    # "edited" is seen first; positions are given out of numeric order on purpose.
    outcomes = {
        "edited": {10: [1, 1, 1, 0], 2: [1, 1, 1, 1], 0: [1, 1, 0, 0]},
        "baseline": {0: [1, 1, 1, 1], 10: [1, 0, 0, 0], 2: [1, 0, 1, 0]},
        "oracle": {0: [1, 1, 1, 0], 2: [1, 1, 1, 0], 10: [1, 1, 1, 0]},
    }
    return [
        record(method, position, bool(value), i)
        for method, by_position in outcomes.items()
        for position, values in by_position.items()
        for i, value in enumerate(values)
    ]


def test_summarize_keys_and_values(records: list[dict], monkeypatch) -> None:
    summary = summarize(records)
    assert list(summary) == ["edited", "baseline", "oracle"]
    for stats in summary.values():
        assert set(stats) == {"mean", "worst", "by_position", "n", "ci95"}
        assert list(stats["by_position"]) == ["0", "2", "10"]
        assert stats["n"] == 12
    edited = summary["edited"]
    assert edited["by_position"] == {"0": 0.5, "2": 1.0, "10": 0.75}
    assert edited["mean"] == pytest.approx(9 / 12)
    assert edited["worst"] == 0.5
    assert summary["baseline"]["worst"] == 0.25
    for stats in summary.values():  # a real bootstrap interval around each mean
        low, high = stats["ci95"]
        assert 0.0 <= low < stats["mean"] < high <= 1.0
    assert summarize(records) == summary  # deterministic

    # ci95 is the bootstrap of each method's own values, 1,000 resamples, seed 0
    calls = []

    def fake_ci(values, n_resamples=1000, seed=0, alpha=0.05):
        calls.append((sorted(values), n_resamples, seed, alpha))
        return (0.125, 0.875)

    monkeypatch.setattr(report, "bootstrap_ci", fake_ci)
    again = summarize(records)
    assert [stats["ci95"] for stats in again.values()] == [[0.125, 0.875]] * 3
    edited_values = sorted(float(r["correct"]) for r in records if r["method"] == "edited")
    assert calls[0] == (edited_values, 1000, 0, 0.05)
    assert [len(c[0]) for c in calls] == [12, 12, 12]


def test_summarize_accepts_fractional_scores_and_numpy_values() -> None:
    rows = [record("m", 0, 0.5, 0), record("m", 0, np.float64(1.0), 1)]
    rows += [record("m", 1, np.bool_(True), 2), record("m", 1, np.bool_(False), 3)]
    assert summarize(rows)["m"]["by_position"] == {"0": 0.75, "1": 0.5}
    assert summarize([]) == {}


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"correct": KeyError}, "missing key"),
        ({"correct": "yes"}, "'correct'"),
        ({"correct": 2}, "'correct'"),
        ({"id": "ex-0-0"}, "duplicate"),
    ],
)
def test_summarize_rejects_bad_records(change: dict, problem: str) -> None:
    rows = [record("m", 0, True, 0), record("m", 0, True, 1)]
    for key, value in change.items():
        if value is KeyError:
            del rows[1][key]
        else:
            rows[1][key] = value
    with pytest.raises(ValueError, match=rf"record 1: .*{problem}"):
        summarize(rows)


def test_write_results(tmp_path: Path, records: list[dict]) -> None:
    path = write_results(tmp_path / "run" / "a", "SmolLM2-135M", "records", records)
    assert path == tmp_path / "run" / "a" / "results.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    assert list(data) == ["model", "task", "methods", "examples"]
    assert data["model"] == "SmolLM2-135M" and data["task"] == "records"
    assert data["methods"] == summarize(records)
    assert data["examples"] == records
    assert [p.name for p in path.parent.iterdir()] == ["results.json"]

    extra = {"seed": 0, "path": tmp_path, "n": np.int64(3)}
    again = write_results(path.parent, "m", "t", iter(records[:2]), extra=extra)
    data = json.loads(again.read_text(encoding="utf-8"))
    assert list(data) == ["model", "task", "methods", "examples", "extra"]
    assert data["extra"] == {"seed": 0, "path": str(tmp_path), "n": 3}
    assert len(data["examples"]) == 2


def test_format_table(records: list[dict]) -> None:
    summary = summarize(records)
    summary["closed_book"] = summarize([record("closed_book", 0, False, 0)])["closed_book"]
    table = format_table(summary)
    lines = table.splitlines()
    assert len(lines) == 2 + 4
    assert lines[0].split() == ["method", "p0", "p2", "p10", "mean", "worst", "95%", "CI", "n"]
    assert set(lines[1]) <= {"-", " "}
    edited = lines[2].split()
    assert edited[:6] == ["edited", "0.500", "1.000", "0.750", "0.750", "0.500"]
    assert edited[-1] == "12"
    low, high = summary["edited"]["ci95"]
    assert f"[{low:.3f}, {high:.3f}]" in lines[2]
    assert lines[5].split()[:4] == ["closed_book", "0.000", "-", "-"]
    assert len({len(line) for line in lines}) == 1  # columns line up


def test_plot_curves_writes_a_png(tmp_path: Path, records: list[dict]) -> None:
    summary = summarize(records + [record("closed_book", 0, False, 0)])
    path = plot_curves(summary, tmp_path / "plots" / "curves.png", title="records")
    assert path == tmp_path / "plots" / "curves.png"
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 5000
    assert [p.name for p in path.parent.iterdir()] == ["curves.png"]
    with pytest.raises(ValueError):
        plot_curves({}, tmp_path / "empty.png")


def test_plot_curves_without_matplotlib_names_the_plot_extra(
    tmp_path: Path, records: list[dict], monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    from kvedit.errors import KVEditError

    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)  # import matplotlib... -> ImportError
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(KVEditError, match=r"pip install 'kvedit\[plot\]'"):
        plot_curves(summarize(records), tmp_path / "curves.png")
    assert not list(tmp_path.iterdir())


def test_summary_reports_seconds_and_the_hit_rate_of_chosen_documents():
    records = [
        {
            "id": "a",
            "method": "auto",
            "prediction": "",
            "gold_index": 0,
            "correct": True,
            "seconds": 1.0,
            "chosen": [0],
        },
        {
            "id": "b",
            "method": "auto",
            "prediction": "",
            "gold_index": 0,
            "correct": False,
            "seconds": 3.0,
            "chosen": [2],
        },
        {
            "id": "c",
            "method": "auto",
            "prediction": "",
            "gold_index": 4,
            "correct": True,
            "seconds": 2.0,
            "chosen": [1, 4],
        },
        {
            "id": "a",
            "method": "none",
            "prediction": "",
            "gold_index": 0,
            "correct": True,
            "seconds": 0.5,
        },
    ]
    summary = summarize(records)
    assert summary["auto"]["seconds"] == 2.0 and summary["none"]["seconds"] == 0.5
    assert summary["auto"]["hit_by_position"] == {"0": 0.5, "4": 1.0}
    assert summary["auto"]["hit_rate"] == 2 / 3
    assert "hit_rate" not in summary["none"]
