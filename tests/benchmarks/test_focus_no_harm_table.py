"""``benchmarks.focus_no_harm``: the counts and verdicts of #28's no-harm table."""

from __future__ import annotations

import json

from benchmarks import focus_no_harm as table


def results(rows: list[tuple[int, bool, bool, list[int]]], gold_only: list[bool] | None = None):
    """A results.json payload: one example per row (gold index, none right, auto right, chosen)."""
    examples = []
    for k, (gold, none, auto, chosen) in enumerate(rows):
        base = {"id": f"e{k}", "gold_index": gold}
        examples.append({**base, "method": "none", "correct": none})
        examples.append({**base, "method": "auto", "correct": auto, "chosen": chosen})
        if gold_only is not None:
            examples.append({**base, "method": "gold_only", "correct": gold_only[k]})
    return {"examples": examples}


def test_the_table_counts_lost_and_won_questions_and_judges_each_position(tmp_path):
    rows = [(0, False, True, [0]), (0, True, True, [0]), (0, True, False, [1])]  # 1 lost, 1 won
    rows += [(9, True, False, [9]), (9, True, False, []), (9, False, False, [9])]  # 2 lost
    positions = {p.gold_index: p for p in table.positions(results(rows))}
    assert (positions[0].lost, positions[0].won, positions[0].n) == (1, 1, 3)
    assert positions[0].hit == 2 / 3 and positions[9].hit == 2 / 3  # an abstention is a miss
    assert positions[0].harmless and not positions[9].harmless  # at most one lost below 100
    # from 100 examples at a position, the margin rule: auto >= none - 0.02
    many = [(4, True, True, [4])] * 97 + [(4, True, False, [4])] * 2 + [(4, False, True, [4])]
    ids = [(g, n, a, c) for g, n, a, c in many]
    (p,) = table.positions(results(ids))
    assert p.n == 100 and p.lost == 2 and p.harmless  # .98 against .99: within .02
    (p,) = table.positions(results(ids[:-1] + [(4, True, False, [4])]))
    assert p.lost == 3 and not p.harmless  # .97 against 1.00
    path = tmp_path / "run" / "results.json"
    path.parent.mkdir()
    path.write_text(json.dumps(results(rows, gold_only=[True] * 6)))
    text = table.table([path])
    assert "| run | 9 | 3 | 0.667 | 0.000 | 2 | 0 | 0.67 | **no** |" in text
    assert "| run | 0.667 | 0.333 | 1.000 | **no** |" in text  # auto far below gold_only


def test_a_missing_or_broken_results_file_is_one_line_naming_it(tmp_path):
    import pytest

    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    for path in (tmp_path / "missing.json", broken):
        with pytest.raises(SystemExit, match=path.name):
            table.table([path])
    listed = tmp_path / "list.json"
    listed.write_text("[]")
    with pytest.raises(SystemExit, match="JSON object"):
        table.table([listed])
