"""``benchmarks.tuning.focus_recheck``: an eval run's ``auto`` answered again only where the rule for
the passage holding all of a question's words may change an abstention; the rest is the run's."""

from __future__ import annotations

import json

import pytest

from benchmarks.tuning import focus_recheck
from kvedit.evals.litm import evaluate

DOORS = [
    "The code for the red oak door is 1111.",
    "The code for the red pine door is 2222.",
    "The code for the blue oak door is 3333.",
    "The code for the blue pine door is 4444.",
]


def _data(path) -> str:
    rows = []
    for i, door in enumerate(["red oak", "red pine", "blue oak", "blue pine"]):
        gold = next(k for k, d in enumerate(DOORS) if f" {door} " in d)
        rows.append(
            {
                "id": f"doors-{i}",
                "instruction": "Read the records and answer the question.",
                "documents": DOORS,
                "separator": "\n",
                "question": f"What is the code for the {door} door?",
                "answers": [DOORS[gold].split()[-1].rstrip(".")],
                "gold_index": gold,
            }
        )
    rows.append({**rows[0], "id": "one-word", "question": "Which door is red and green?"})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _auto(path) -> dict:
    res = json.loads((path / "results.json").read_text())
    return {r["id"]: r for r in res["examples"] if r["method"] != "none"}


def test_a_run_without_the_rule_rechecked_gives_the_run_with_it(tmp_path):
    data = _data(tmp_path / "doors.jsonl")
    fresh = tmp_path / "fresh"
    args = dict(data=data, max_new_tokens=4, progress=False, prompt="chat")
    evaluate("tiny-llama", ["none", "auto:threshold=1e9"], fresh, **args)
    # threshold 1e9: nothing stands out, so every edit is the rule's; the same run as a focus
    # without the rule made it: every auto record an abstention answered unedited
    res = json.loads((fresh / "results.json").read_text())
    none = {r["id"]: r for r in res["examples"] if r["method"] == "none"}
    chosen = {i: r.get("chosen") for i, r in _auto(fresh).items()}
    assert chosen["one-word"] == [] and any(chosen.values())  # the tiny model edits one at least
    for r in res["examples"]:
        if r["method"] != "none":
            r.update(prediction=none[r["id"]]["prediction"], correct=none[r["id"]]["correct"])
            r.update(chosen=[])
            r.pop("kept", None), r.pop("support", None)
    before = tmp_path / "before"
    before.mkdir()
    (before / "results.json").write_text(json.dumps(res))
    out = tmp_path / "rechecked"
    argv = [str(before), "--data", data, "--out", str(out), "--verify", "1"]
    argv += ["--spec", "auto:threshold=1e9"]
    assert focus_recheck.main(argv) == 0
    again = json.loads((out / "results.json").read_text())["extra"]["recheck"]
    assert again["answered_again"] == [f"doors-{i}" for i in range(4)]  # not "one-word"
    assert again["verified"] == 1 and again["verify_mismatched"] == []  # "one-word", redone
    got, want = _auto(out), _auto(fresh)
    assert {i: focus_recheck.answer_of(r) for i, r in got.items()} == {
        i: focus_recheck.answer_of(r) for i, r in want.items()
    }
    assert sorted(again["chosen_now"]) == sorted(i for i, c in chosen.items() if c)


def test_a_run_of_other_examples_or_parameters_is_refused_in_one_line(tmp_path):
    data = _data(tmp_path / "doors.jsonl")
    run = tmp_path / "run"
    evaluate("tiny-llama", ["none", "auto"], run, data=data, max_new_tokens=2, progress=False)
    with pytest.raises(SystemExit, match="not none and auto on the examples"):
        focus_recheck.main([str(run), "--task", "records", "--trials", "1", "--dry-run"])
    with pytest.raises(SystemExit, match="records are not none and auto:threshold=3"):
        focus_recheck.main([str(run), "--data", data, "--dry-run", "--spec", "auto:threshold=3"])
    res = json.loads((run / "results.json").read_text())
    res["extra"]["params"]["auto"]["threshold"] = 3.0  # made by another auto
    (run / "results.json").write_text(json.dumps(res))
    with pytest.raises(SystemExit, match="the run's auto had other parameters than today's"):
        focus_recheck.main([str(run), "--data", data, "--dry-run"])
    params = res["extra"].pop("params")
    (run / "results.json").write_text(json.dumps(res))
    with pytest.raises(SystemExit, match="the run recorded no parameters for auto"):
        focus_recheck.main([str(run), "--data", data, "--dry-run"])
    params["auto"]["threshold"] = 2.5
    res["extra"]["params"] = params
    (run / "results.json").write_text(json.dumps(res))
    assert focus_recheck.main([str(run), "--data", data, "--dry-run"]) == 0


def test_an_answer_the_code_no_longer_gives_fails_the_verification(tmp_path):
    data = _data(tmp_path / "doors.jsonl")
    run = tmp_path / "run"
    evaluate("tiny-llama", ["none", "auto"], run, data=data, max_new_tokens=2, progress=False)
    res = json.loads((run / "results.json").read_text())
    for r in res["examples"]:
        if r["id"] == "one-word" and r["method"] == "auto":  # no sole holder: verified only
            r["prediction"] += " (made by other code)"
    (run / "results.json").write_text(json.dumps(res))
    out = tmp_path / "out"
    assert focus_recheck.main([str(run), "--data", data, "--out", str(out), "--verify", "1"]) == 1
    again = json.loads((out / "results.json").read_text())["extra"]["recheck"]
    assert again["verify_mismatched"] == ["one-word"]
