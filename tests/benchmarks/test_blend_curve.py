"""``benchmarks.blend_curve``: accuracy and time to first token of kvedit.blend's rules across
recompute fractions, on a tiny model; resuming an interrupted run, merging runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import kvedit
from benchmarks import blend_curve as curve
from kvedit.errors import InvalidInputError


def test_blend_curve_runs_on_a_tiny_model(tmp_path):
    args = ["--model", "tiny-llama", "--limit", "2", "--n-docs", "2", "--fractions", "0,1"]
    args += ["--rules", "default,leading=2:rescale=0.5", "--max-new-tokens", "2"]
    assert curve.main([*args, "--out", str(tmp_path)]) == 0
    assert (tmp_path / "blend_curve.png").read_bytes()[:4] == b"\x89PNG"
    payload = json.loads((tmp_path / "blend_curve.json").read_text())
    points = {(r["rule"], r["recompute"]) for r in payload["rows"]}
    assert points == {(None, 1.0)} | {
        (rule, f) for rule in ("default", "leading=2:rescale=0.5") for f in (0.0, 1.0)
    }
    assert all(r["n"] == 2 for r in payload["rows"])
    for r in payload["records"]:
        assert r["rule"] != "leading=2:rescale=0.5" or r["rules"] == ["leading", "rescale"]
    full = {r["id"]: r["prediction"] for r in payload["records"] if r["rule"] is None}
    for r in payload["records"]:
        if r["rule"] is not None and r["recompute"] == 1.0:  # exact: the prefill's answer
            assert r["prediction"] == full[r["id"]]
    assert "| full prefill |" in (tmp_path / "blend_curve.md").read_text()


def test_blend_curve_passes_previous_to_every_blend(tmp_path, monkeypatch):
    real, seen = kvedit.blend, []

    def recording(*a, **kw):
        seen.append(kw.get("previous"))
        return real(*a, **kw)

    monkeypatch.setattr(kvedit, "blend", recording)
    args = ["--model", "tiny-llama", "--limit", "1", "--n-docs", "3", "--fractions", "0.5"]
    args += ["--rules", "default", "--max-new-tokens", "2", "--previous", "Notes. "]
    assert curve.main([*args, "--out", str(tmp_path)]) == 0
    assert seen and set(seen) == {"Notes. "}
    payload = json.loads((tmp_path / "blend_curve.json").read_text())
    assert payload["settings"]["previous"] == "Notes. "


def test_blend_curve_resumes_an_interrupted_run(tmp_path, monkeypatch):
    args = ["--model", "tiny-llama", "--n-docs", "2", "--fractions", "0", "--rules", "default"]
    args += ["--max-new-tokens", "2", "--limit", "2", "--out", str(tmp_path)]
    real, calls = curve.run_example, []

    def interrupted(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(curve, "run_example", interrupted)
    with pytest.raises(KeyboardInterrupt):
        curve.main(args)
    partial = tmp_path / "partial.jsonl"
    kept = [json.loads(line) for line in partial.read_text().splitlines()]
    assert len(kept) == 2 and {r["rule"] for r in kept} == {None, "default"}  # example 1 only
    partial.write_text("".join(json.dumps({**r, "prediction": "KEPT"}) + "\n" for r in kept))
    with pytest.raises(InvalidInputError, match="came from another run: seed 0"):
        curve.main([*args, "--seed", "1", "--resume"])
    settings = tmp_path / "partial.settings.json"
    saved = settings.read_text()
    settings.write_text(json.dumps({**json.loads(saved), "source": "0" * 64}))
    with pytest.raises(InvalidInputError, match="came from another run: source"):
        curve.main([*args, "--resume"])  # kvedit's code changed since
    settings.write_text(saved)
    monkeypatch.setattr(curve, "run_example", real)
    keep = partial.read_text()  # the same id over other distractors (another --limit) is refused
    partial.write_text("".join(json.dumps({**r, "example": "0" * 16}) + "\n" for r in kept))
    with pytest.raises(InvalidInputError, match="another example than this run's"):
        curve.main([*args, "--resume"])
    settings.write_text(saved)
    partial.write_text(keep)
    assert curve.main([*args, "--resume"]) == 0
    records = json.loads((tmp_path / "blend_curve.json").read_text())["records"]
    assert [r["prediction"] == "KEPT" for r in records] == [True, True, False, False]
    assert not partial.exists() and not (tmp_path / "partial.settings.json").exists()
    with pytest.raises(InvalidInputError, match="holds no partial"):
        curve.main([*args, "--resume"])


def test_blend_curve_merges_runs_split_by_position_and_pairs_them(tmp_path, monkeypatch):
    args = ["--model", "tiny-llama", "--n-docs", "2", "--fractions", "0", "--rules", "default"]
    args += ["--max-new-tokens", "2"]
    for name, positions in (("a", "0"), ("b", "1")):
        out = tmp_path / name
        assert curve.main([*args, "--limit", "2", "--positions", positions, "--out", str(out)]) == 0
    a, b = str(tmp_path / "a" / "blend_curve.json"), str(tmp_path / "b" / "blend_curve.json")
    assert curve.main(["--merge", a, b, "--out", str(tmp_path / "m")]) == 0
    payload = json.loads((tmp_path / "m" / "blend_curve.json").read_text())
    assert len({r["id"] for r in payload["records"]}) == 4
    assert payload["settings"]["source"] and payload["settings"]["merged"] == [a, b]
    by_position = {r["position"]: r for r in payload["paired"]}
    assert set(by_position) == {0, 1} and all(r["n"] == 2 for r in by_position.values())
    full = {r["id"]: r["correct"] for r in payload["records"] if r["rule"] is None}
    lost = sum(full[r["id"]] > r["correct"] for r in payload["records"] if r["rule"])
    assert sum(r["lost"] for r in payload["paired"]) == lost
    assert "| default | 0 | 1 | 2 |" in (tmp_path / "m" / "paired.md").read_text()
    with pytest.raises(InvalidInputError, match="repeats 2 examples"):
        curve.main(["--merge", a, a, "--out", str(tmp_path / "m2")])
    other = json.loads(Path(b).read_text())
    other["settings"]["seed"] = 5
    Path(b).write_text(json.dumps(other))
    with pytest.raises(InvalidInputError, match="differs from .*seed 5"):
        curve.main(["--merge", a, b, "--out", str(tmp_path / "m3")])
    with pytest.raises(InvalidInputError, match="not a finished"):
        curve.main(["--merge", str(tmp_path / "nope.json"), "--out", str(tmp_path / "m4")])
