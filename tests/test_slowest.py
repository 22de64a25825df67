"""``make test`` keeps its 25 slowest tests under runs/ (tests/slowest.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import slowest


def test_the_slowest_are_summed_over_phases_and_sorted():
    seconds: dict[str, float] = {}
    for node, duration in [("a", 0.5), ("b", 2.0), ("a", 1.75), ("c", 0.1)]:
        slowest.add(seconds, SimpleNamespace(nodeid=node, duration=duration))
    assert slowest.slowest(seconds, 2) == [("a", 2.25), ("b", 2.0)]
    lines = slowest.text(seconds, 2).splitlines()
    assert lines[0] == "# the 2 slowest of 3 tests, seconds (setup + call + teardown)"
    assert lines[2:] == ["    2.25  a", "    2.00  b"]


def test_only_a_whole_run_writes_unless_asked(monkeypatch, tmp_path):
    monkeypatch.delenv("KVEDIT_SLOWEST_OUT", raising=False)
    whole = SimpleNamespace(args_source=pytest.Config.ArgsSource.TESTPATHS)
    some = SimpleNamespace(args_source=pytest.Config.ArgsSource.ARGS)
    assert slowest.target(whole) == slowest.FILE
    assert slowest.FILE.parent.name == "runs" and slowest.COUNT == 25
    assert slowest.target(some) is None
    out = tmp_path / "slow.txt"
    monkeypatch.setenv("KVEDIT_SLOWEST_OUT", str(out))
    assert slowest.write(some, {"t": 1.0}) == out
    assert out.read_text().splitlines()[-1] == "    1.00  t"
