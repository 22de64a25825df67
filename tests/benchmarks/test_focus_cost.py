"""``benchmarks.focus_cost``: times focus next to ``none``, an abstention included."""

from __future__ import annotations

import dataclasses
import json

from benchmarks import focus_cost as cost


def test_focus_cost_times_an_abstention_as_no_edit(tmp_path, monkeypatch):
    real, edits = cost.choose, []

    def abstaining(*args, **kwargs):  # focus found nothing that stands out
        return dataclasses.replace(real(*args, **kwargs), chosen=[], reason="test")

    real_emphasize = cost.ops.emphasize
    monkeypatch.setattr(cost, "choose", abstaining)
    monkeypatch.setattr(
        cost.ops, "emphasize", lambda *a, **kw: edits.append(1) or real_emphasize(*a, **kw)
    )
    out = tmp_path / "cost.json"
    argv = ["--task", "records", "--model", "tiny-llama", "--examples", "2"]
    assert cost.main([*argv, "--max-new-tokens", "2", "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert payload["summary"]["abstained_examples"] == 2 and not edits
    assert payload["summary"]["identical"]
    for r in payload["examples"]:
        assert r["path"] == "abstained" and r["identical"]
        assert all(r[way] > 0 and r[f"{way}_edit"] < r[way] for way in cost.WAYS)
