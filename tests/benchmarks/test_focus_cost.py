"""``benchmarks/focus_cost.py``: times focus next to ``none``, an abstention included."""

from __future__ import annotations

import dataclasses
import json
import sys

from helpers import load_benchmark


def test_focus_cost_times_an_abstention_as_no_edit(tmp_path, monkeypatch):
    cost = load_benchmark("focus_cost", monkeypatch)
    real, edits = cost.choose, []

    def abstaining(*args, **kwargs):  # focus found nothing that stands out
        return dataclasses.replace(real(*args, **kwargs), chosen=[], reason="test")

    real_emphasize = cost.ops.emphasize
    monkeypatch.setattr(cost, "choose", abstaining)
    monkeypatch.setattr(
        cost.ops, "emphasize", lambda *a, **kw: edits.append(1) or real_emphasize(*a, **kw)
    )
    out = tmp_path / "cost.json"
    argv = ["focus_cost", "--task", "records", "--model", "tiny-llama", "--examples", "2"]
    monkeypatch.setattr(sys, "argv", [*argv, "--max-new-tokens", "2", "--out", str(out)])
    cost.main()
    payload = json.loads(out.read_text())
    assert payload["summary"]["abstained"] == 2 and not edits
    assert all(r["abstained"] and r["auto"] > 0 for r in payload["examples"])
