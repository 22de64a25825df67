"""``benchmarks.compare_predictions``: two runs of ``smoke_predictions.sh`` answered alike, or
not (a prediction changed or missing, or no run to compare at all)."""

from __future__ import annotations

import json

from benchmarks import compare_predictions


def write_run(folder, predictions: dict[tuple[str, str], str]) -> None:
    examples = [{"method": m, "id": i, "prediction": p} for (m, i), p in predictions.items()]
    (folder / "records-transformers").mkdir(parents=True)
    (folder / "records-transformers" / "results.json").write_text(
        json.dumps({"examples": examples})
    )


def test_identical_runs_pass_and_a_changed_or_missing_prediction_fails(tmp_path, capsys):
    run = {("none", "a"): "4821", ("none", "b"): "7310", ("auto", "a"): "4821"}
    write_run(tmp_path / "old", run)
    write_run(tmp_path / "same", run)
    write_run(tmp_path / "changed", {**run, ("auto", "a"): "5902"})
    write_run(tmp_path / "fewer", {k: v for k, v in run.items() if k != ("none", "b")})
    old = str(tmp_path / "old")
    assert compare_predictions.main([old, str(tmp_path / "same")]) == 0
    assert "all identical" in capsys.readouterr().out
    assert compare_predictions.main([old, str(tmp_path / "changed")]) == 1
    out = capsys.readouterr().out
    assert "auto         0/1 identical" in out and "1 predictions differ" in out
    assert compare_predictions.main([old, str(tmp_path / "fewer")]) == 1
    assert compare_predictions.main([old, str(tmp_path / "nothing")]) == 1  # no run there
    assert compare_predictions.main([str(tmp_path / "nothing"), old]) == 1
