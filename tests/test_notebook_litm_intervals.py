"""The lost-in-the-middle notebook says what its run is doing and how sure its curve is (#69):
it prints progress while the methods run, labels ``oracle`` for what it is (told the gold
record, a fixed edit without a guard: no upper bound on ``auto``), and gives each point its 95%
Wilson interval, computed from the per-example results it writes. Run on the tiny random
Llama, as ``tests/test_notebooks.py`` runs it."""

from __future__ import annotations

import json
import math
import re

from test_notebooks import REPO, execute

NOTEBOOK = REPO / "notebooks" / "lost_in_the_middle.ipynb"


def _text(cell) -> str:
    return "".join(out.get("text", "") for out in cell.outputs if out.get("name") == "stdout")


def _wilson(k: float, n: int, z: float = 1.96) -> tuple[float, float]:
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def test_progress_honest_labels_and_intervals(tmp_path, monkeypatch):
    nb = execute(NOTEBOOK, tmp_path, monkeypatch)
    ran = _text(nb.cells[3])
    done = re.findall(r"^(\d+)/(\d+) examples, \d+ s, about \d+ s left$", ran, re.MULTILINE)
    assert done and done[-1][0] == done[-1][1], ran  # the last line: every example answered

    plotted = _text(nb.cells[5])
    assert "upper bound" not in plotted
    assert "oracle (told the gold record; fixed +2 nats, no guard):" in plotted
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    for method in ("none", "auto", "oracle"):
        line = re.search(rf"^{method} \(.*\):\n  (.*)$", plotted, re.MULTILINE)
        assert line, (method, plotted)
        points = re.findall(r"p(\d+) ([\d.]+) \[([\d.]+), ([\d.]+)\]", line.group(1))
        assert len(points) == 5
        for position, acc, low, high in points:
            mine = [
                float(r["correct"])
                for r in results["examples"]
                if r["method"] == method and r["gold_index"] == int(position)
            ]
            want = _wilson(sum(mine), len(mine))
            assert float(acc) == round(sum(mine) / len(mine), 2)
            assert (float(low), float(high)) == (round(want[0], 2), round(want[1], 2))
            assert float(low) < float(high)  # an interval, not a point
    source = "".join(c.source for c in nb.cells)
    assert "an upper bound" not in source and "no upper bound on `auto`" in source
