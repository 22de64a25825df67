"""``benchmarks.memory_table``: a stopped run keeps only whole conversations; each method is
compared with ``reuse`` on the same questions, by #28's rule."""

from __future__ import annotations

import json

import pytest

from benchmarks.memory_table import latest, run_records, versus_reuse


def _record(example, method, budget, q, bucket, correct):
    return {
        "id": f"{example}-q{q}",
        "example": example,
        "method": method,
        "budget": budget,
        "bucket": bucket,
        "correct": correct,
    }


def test_a_stopped_run_keeps_whole_conversations_only(tmp_path):
    rows = [
        _record("a", "reuse", 1.0, 0, "early", 1.0),
        _record("a", "window", 0.25, 0, "early", 0.0),
        _record("b", "reuse", 1.0, 0, "early", 1.0),  # b stopped before window ran
    ]
    lines = [json.dumps(r) for r in rows] + ['{"id": "b-q1", "cut']
    (tmp_path / "partial.jsonl").write_text("\n".join(lines))
    assert [r["example"] for r in run_records(tmp_path)] == ["a", "a"]


def test_a_folder_without_a_run_or_a_broken_record_is_one_line(tmp_path):
    with pytest.raises(SystemExit, match="no results.json or partial.jsonl"):
        run_records(tmp_path)
    good = json.dumps(_record("a", "reuse", 1.0, 0, "early", 1.0))
    (tmp_path / "partial.jsonl").write_text("\n".join([good, "{not json", good]) + "\n")
    with pytest.raises(SystemExit, match=r"partial.jsonl:2: bad JSON"):
        run_records(tmp_path)


def test_versus_reuse_counts_losses_per_bucket_with_the_rule():
    rows = []
    for q in range(10):
        rows.append(_record("a", "reuse", 1.0, q, "early", 1.0))
        rows.append(_record("a", "window", 0.25, q, "early", 1.0 if q else 0.0))
        rows.append(_record("a", "knorm", 0.25, q, "early", 1.0 if q > 1 else 0.0))
    table = "\n".join(versus_reuse(rows))
    assert "| window | 0.25 | 0.90 | 1 (10) |" in table and "kept" in table
    assert "| knorm | 0.25 | 0.80 | 2 (10) |" in table and "broken" in table


def test_a_later_run_replaces_a_methods_records_of_every_earlier_run():
    old = [
        _record("a", "reuse", 1.0, 0, "early", 1.0),
        _record("a", "tova", 0.25, 0, "early", 0.0),
        _record("b", "tova", 0.25, 0, "early", 0.0),  # not in the later run: dropped too
    ]
    new = [_record("a", "tova", 0.25, 0, "early", 1.0)]
    rows, replaced = latest([old, new])
    assert replaced == 2 and sorted((r["id"], r["method"], r["correct"]) for r in rows) == [
        ("a-q0", "reuse", 1.0),
        ("a-q0", "tova", 1.0),
    ]
    other = [{**new[0], "digest": "another"}]
    with pytest.raises(SystemExit, match="another conversation"):
        latest([old, other])
    # a run of other conversations (another seed) pools whole
    seed2 = [_record("c", "tova", 0.25, 0, "early", 1.0)]
    rows, replaced = latest([old, seed2])
    assert replaced == 0 and len(rows) == 4


def test_main_writes_the_pooled_table_and_plot(tmp_path, capsys):
    from benchmarks.memory_table import main

    for k, correct in enumerate((1.0, 0.0)):
        run = tmp_path / f"run{k}"
        run.mkdir()
        rows = [
            _record(f"c{k}", "reuse", 1.0, 0, "early", 1.0),
            _record(f"c{k}", "window", 0.25, 0, "early", correct),
        ]
        extra = {"digest": f"d{k}", "seconds": 1.0, "rounds": 0, "forget_seconds": 0.0}
        rows = [{**r, **extra} for r in rows]
        (run / "results.json").write_text(json.dumps({"examples": rows}))
    plot = tmp_path / "pooled.png"
    assert main([str(tmp_path / "run0"), str(tmp_path / "run1"), "--plot", str(plot)]) == 0
    assert plot.read_bytes()[:4] == b"\x89PNG"
    assert "2 conversations: c0, c1" in capsys.readouterr().out


def test_a_budget_in_the_spec_names_the_method_at_that_budget(tmp_path):
    """``window:budget=0.1`` at 0.1 pools with ``window`` at 0.1 from another run; a spec whose
    other parts differ stays its own method."""
    one, two = tmp_path / "one", tmp_path / "two"
    for folder, method in ((one, "window:budget=0.1"), (two, "window:quantize=4:budget=0.1")):
        folder.mkdir()
        records = [_record("e0", method, 0.1, 0, "early", 1.0)]
        (folder / "results.json").write_text(json.dumps({"examples": records}))
    assert [r["method"] for r in run_records(one)] == ["window"]
    assert [r["method"] for r in run_records(two)] == ["window:quantize=4"]
    (one / "results.json").unlink()
    (one / "partial.jsonl").write_text(
        json.dumps(_record("e0", "tova:budget=0.5", 0.25, 0, "early", 1.0)) + "\n"
    )
    assert [r["method"] for r in run_records(one)] == ["tova:budget=0.5"]  # not its budget


def test_mean_bytes_pairs_each_method_and_budget_with_its_accuracy(tmp_path):
    from benchmarks.memory_table import mean_bytes, plot_bytes

    rows = [
        {**_record("c", "learned", 0.1, q, "early", float(q < 2)), "nbytes": 2**20 * (q + 1)}
        for q in range(4)
    ]
    rows.append({**_record("c", "reuse", 1.0, 0, "early", 1.0), "nbytes": 2**22})
    got = mean_bytes(rows)
    assert got[("learned", 0.1)] == (2.5, 0.5) and got[("reuse", 1.0)] == (4.0, 1.0)
    pytest.importorskip("matplotlib")
    assert plot_bytes(rows, tmp_path / "b.png").read_bytes()[:4] == b"\x89PNG"


def test_methods_keeps_the_named_methods_and_reuse_and_refuses_an_unknown_name():
    from benchmarks.memory_table import only_methods

    rows = [
        _record("c", "reuse", 1.0, 0, "early", 1.0),
        _record("c", "learned", 0.1, 0, "early", 1.0),
        _record("c", "learned:quantize=4", 0.1, 0, "early", 0.0),
    ]
    got = only_methods(rows, ["learned:quantize=4"])
    assert [r["method"] for r in got] == ["reuse", "learned:quantize=4"]
    with pytest.raises(SystemExit, match="no records of \\['window'\\]"):
        only_methods(rows, ["window"])
