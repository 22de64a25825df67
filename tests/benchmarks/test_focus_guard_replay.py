"""``benchmarks/focus_guard_replay.py`` and ``benchmarks/focus_harm_check.py``: the support
guard replayed on recorded answers, and the do-no-harm rules compared on tuning answers."""

from __future__ import annotations

import json

import pytest
from helpers import load_benchmark

from kvedit.evals.schema import Example

EX = Example(
    id="e0", instruction="", documents=("Ann's code is 11.", "Bob's code is 22."),
    separator="\n", question="What is Bob's code?", answers=("22",), gold_index=1,
)  # fmt: skip


def _rec(method, prediction, correct, ex=EX, **kw):
    return {"id": ex.id, "method": method, "gold_index": ex.gold_index,
            "prediction": prediction, "correct": correct, **kw}  # fmt: skip


def test_replay_answers_unedited_only_where_the_answer_comes_from_the_chosen_passage(
    monkeypatch,
):
    m = load_benchmark("focus_guard_replay", monkeypatch)
    other = Example(**{**EX.__dict__, "id": "e1"})
    third = Example(**{**EX.__dict__, "id": "e2"})
    results = {
        "examples": [
            _rec("none", "Bob's code is 22.", True),  # supported by passage 1: unedited
            _rec("auto", "The answer is", False, chosen=[1], example=EX.digest()),
            _rec("none", "Bob's code is 33.", False, ex=other),  # not supported: the edit
            _rec("auto", "22", True, ex=other, chosen=[1]),
            _rec("none", "22", True, ex=third),  # no choice: auto answered unedited
            _rec("auto", "22", True, ex=third, chosen=[]),
        ]
    }
    examples = {e.id: e for e in (EX, other, third)}
    out = {r["id"]: r for r in m.replay(results, examples, 0.75)}
    assert (out["e0"]["prediction"], out["e0"]["kept"], out["e0"]["support"]) == (
        "Bob's code is 22.", False, 1.0)  # fmt: skip
    assert (out["e1"]["prediction"], out["e1"]["kept"], out["e1"]["support"]) == ("22", True, 0)
    assert out["e2"]["kept"] and out["e2"]["support"] is None
    row = m.summary(list(out.values()))["1"]
    assert (row["none"], row["auto"], row["guarded"]) == (2 / 3, 2 / 3, 1.0)
    assert row["auto_won_lost"] == (1, 1) and row["guarded_won_lost"] == (1, 0)
    # a record of another example (its digest differs) is refused
    results["examples"][1]["example"] = "another"
    with pytest.raises(SystemExit, match="another example"):
        m.replay(results, examples, 0.75)


def test_check_counts_the_answers_a_real_run_gave_otherwise(monkeypatch, tmp_path):
    m = load_benchmark("focus_guard_replay", monkeypatch)
    replayed = [{"id": "e0", "prediction": "22"}, {"id": "e1", "prediction": "33"}]
    real = tmp_path / "real.json"
    real.write_text(json.dumps({"examples": [_rec("auto", "22", True), _rec("none", "x", 0)]}))
    assert m.check(replayed, str(real)) == 0
    real.write_text(json.dumps({"examples": [_rec("auto", "23", False)]}))
    assert m.check(replayed, str(real)) == 1


def test_harm_check_rules_answer_from_the_variant_they_name(monkeypatch):
    m = load_benchmark("focus_harm_check", monkeypatch)
    base = {"id": "e0", "gold_index": 1, "chosen": [1], "none": "Bob's code is 22.",
            "none_ok": True, "edit_ok": False, "nolead_ok": True, "leads": [True, True, False]}  # fmt: skip
    assert m.RULES["auto"](base, EX) is False
    assert m.RULES["nolead"](base, EX) is True
    assert m.RULES["skip-lead"](base, EX) is True  # leads on 2 of 3 layers: no edit
    assert m.RULES["support>=0.75"](base, EX) is True  # the answer is in passage 1
    unsupported = {**base, "none": "Bob's code is 33.", "none_ok": False, "edit_ok": True}
    assert m.RULES["support>=0.75"](unsupported, EX) is True  # the edit answers
    assert m.RULES["support>=0.75"]({**unsupported, "edit_ok": False}, EX) is False
    abstained = {**base, "chosen": []}
    assert all(rule(abstained, EX) is True for rule in m.RULES.values())  # unedited answers
    text = m.table([base, {**base, "gold_index": 0}], {"e0": EX})
    assert "support>=0.75" in text and "(examples per position: 0: 1 1: 1)" in text


def test_out_writes_a_run_that_the_no_harm_table_reads(monkeypatch, tmp_path):
    from kvedit.evals.jsonl import write_jsonl

    m = load_benchmark("focus_guard_replay", monkeypatch)
    table = load_benchmark("focus_no_harm", monkeypatch)
    data = write_jsonl([EX], tmp_path / "data.jsonl")
    results = {
        "model": "m",
        "task": "custom",
        "examples": [
            _rec("none", "Bob's code is 22.", True),
            _rec("auto", "The answer is", False, chosen=[1]),
            _rec("gold_only", "22", True),
        ],
        "extra": {"seed": 0},
    }
    src = tmp_path / "run.json"
    src.write_text(json.dumps(results))
    assert m.main([str(src), "--data", str(data), "--out", str(tmp_path / "replay")]) == 0
    written = json.loads((tmp_path / "replay" / "results.json").read_text())
    auto = [r for r in written["examples"] if r["method"] == "auto"]
    assert len(auto) == 1 and auto[0]["replayed"] and auto[0]["correct"]  # unedited answer
    assert written["extra"]["replayed_from"] == str(src) and written["extra"]["seed"] == 0
    row = table.positions(written)[0]
    assert (row.none, row.auto, row.lost) == (1.0, 1.0, 0)


LOCKERS = Example(
    id="l0", instruction="", separator="\n", question="Which code does Bob have?",
    documents=("Locker assignment: Ann was given code 11.",
               "Locker assignment: Bob was given code 22."),
    answers=("22",), gold_index=1,
)  # fmt: skip


def test_replay_of_a_guarded_source_refuses_what_it_cannot_know(monkeypatch):
    m = load_benchmark("focus_guard_replay", monkeypatch)
    # session 13's rule kept this unedited answer (all its words are in passage 1); today's
    # leaves out the words passage 0 shares too, so the edit would answer: never decoded
    unedited = "Locker assignment given"
    results = {
        "examples": [
            _rec("none", unedited, False, ex=LOCKERS),
            _rec("auto", unedited, False, ex=LOCKERS, chosen=[1]),
        ]
    }
    examples = {"l0": LOCKERS}
    assert m.replay(results, examples, 0.5)[0]["kept"]  # an unguarded source: the edit's
    with pytest.raises(SystemExit, match="needs the edited answer"):
        m.replay(results, examples, 0.5, source_guard=0.75)
    results["examples"][1]["prediction"] = "22"  # not what the old guard kept
    with pytest.raises(SystemExit, match="kept no unedited answer"):
        m.replay(results, examples, 0.5, source_guard=0.75)
    # where both rules keep the unedited answer, the guarded source replays
    both = {"examples": [_rec("none", "Bob's code is 22.", True),
                         _rec("auto", "Bob's code is 22.", True, chosen=[1])]}  # fmt: skip
    (out,) = m.replay(both, {"e0": EX}, 0.5, source_guard=0.75)
    assert not out["kept"] and out["prediction"] == "Bob's code is 22."


def test_harm_check_telling_rules_leave_out_shared_words(monkeypatch):
    m = load_benchmark("focus_harm_check", monkeypatch)
    rec = {"id": "l0", "gold_index": 1, "chosen": [1], "none": "Locker assignment: 12637",
           "none_ok": False, "edit_ok": True, "nolead_ok": True, "leads": [True]}  # fmt: skip
    # "locker" and "assignment" are in the other passage: only the invented code tells
    assert m.RULES["telling>=0.5"](rec, LOCKERS) is True  # the edit answers
    assert m.rules(1.0)["telling>=0.5"](rec, LOCKERS) is False  # nothing left out: unedited
    assert m.RULES["support>=0.5"](rec, LOCKERS) is False  # the rule before
    assert "telling>=0.5" in m.table([rec], {"l0": LOCKERS}, shared=1.0)
