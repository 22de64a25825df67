"""``benchmarks.focus_scale``'s wordings: the tuned one unchanged, the held-out ones well posed
(each gold pair unique, its telling words shared), every generator deterministic."""

from __future__ import annotations

import hashlib
import json
from collections import Counter

import pytest

from benchmarks import focus_scale
from benchmarks import focus_wordings as scale
from benchmarks.focus_abstain import UNRELATED
from kvedit.errors import InvalidInputError

SIZES = (20, 50, 100, 300)
SECRET_DIGEST = "ac72004baf9325f3392aec4047cf6f037ce6a5223c9508561bb24d2dd7623335"


def test_the_tuned_wording_is_the_one_the_kept_report_ran():
    # reports/focus/scale was made from these contexts; a changed generator would orphan it
    digest = hashlib.sha256()
    for n in SIZES:
        for seed in (100, 119):
            digest.update(json.dumps(scale.context_of(n, seed)).encode())
    assert digest.hexdigest() == SECRET_DIGEST
    _, records, questions, answers = scale.context_of(20, 100)
    assert questions[0] == f"What is {records[0].split(chr(39))[0]}'s secret number?"
    assert records[0].endswith(f" is {answers[0]}.")


@pytest.mark.parametrize("wording", scale.WORDINGS)
def test_contexts_are_deterministic_per_seed(wording):
    assert scale.context_of(50, 7, wording) == scale.context_of(50, 7, wording)
    assert scale.context_of(50, 7, wording) != scale.context_of(50, 8, wording)
    text, records, questions, answers = scale.context_of(50, 7, wording)
    assert len(records) == len(questions) == len(answers) == 50
    assert text == scale.INSTRUCTION + "\n\n" + "\n".join(records)


@pytest.mark.parametrize("n", SIZES)
def test_only_the_gold_door_holds_both_words_and_each_is_shared(n):
    for seed in range(100, 105):
        _, records, questions, answers = scale.context_of(n, seed, "doors")
        doors = [
            q.removeprefix("What is the access code for the ").removesuffix(" door?")
            for q in questions
        ]
        assert len(set(doors)) == n and len(set(answers)) == n
        colour = Counter(d.split()[0] for d in doors)
        material = Counter(d.split()[1] for d in doors)
        for i, door in enumerate(doors):
            a, b = door.split()
            assert a in scale.COLOURS and b in scale.MATERIALS
            both = [r for r in records if f" {a} " in r and f" {b} " in r]
            assert both == [records[i]] == [f"The access code for the {door} door is {answers[i]}."]
            assert colour[a] >= 4 and material[b] >= 4  # shared by several lines
        if n == 300:  # the full 30 x 10 grid: each colour on 10 lines, each material on 30
            assert set(colour.values()) == {10} and set(material.values()) == {30}


def _asked(questions: list[str], head: str, between: str, tail: str) -> list[list[str]]:
    """The two things each question names: what lies between ``head`` and ``between``, and
    between ``between`` and ``tail``."""
    return [q.removeprefix(head).removesuffix(tail).split(between) for q in questions]


@pytest.mark.parametrize("n", SIZES)
def test_each_person_and_year_pair_is_unique_the_year_shared_by_more_lines(n):
    for seed in range(100, 105):
        _, records, questions, answers = scale.context_of(n, seed, "moves")
        pairs = _asked(questions, "Where did ", " move in ", "?")
        assert len({tuple(p) for p in pairs}) == n  # every question has one answer
        name = Counter(p[0] for p in pairs)
        year = Counter(p[1] for p in pairs)
        for (who, when), record, city in zip(pairs, records, answers, strict=True):
            assert record == f"In {when} {who} moved to {city}."
            assert 3 <= name[who] <= scale.MOVES_PER_PERSON
            assert year[when] >= 5 and year[when] > name[who]
            same_person = [r for r in records if f" {who} " in r]
            assert len({r.split(" moved to ")[1] for r in same_person}) == len(same_person)


@pytest.mark.parametrize("n", SIZES)
def test_the_tuning_wordings_have_the_held_out_ones_shapes(n):
    for seed in range(1, 4):
        _, records, questions, answers = scale.context_of(n, seed, "lessons")
        pairs = _asked(questions, "How much does the ", " teacher in ", " charge?")
        assert len({tuple(p) for p in pairs}) == n
        instrument, town = Counter(p[0] for p in pairs), Counter(p[1] for p in pairs)
        for (a, t), record, price in zip(pairs, records, answers, strict=True):
            assert record == f"The {a} teacher in {t} charges {price} dollars an hour."
            assert instrument[a] >= 2 and town[t] >= 2  # each word shared, only the gold both
        _, records, questions, answers = scale.context_of(n, seed, "visits")
        pairs = _asked(questions, "Which country did ", " visit in ", "?")
        assert len({tuple(p) for p in pairs}) == n
        name, month = Counter(p[0] for p in pairs), Counter(p[1] for p in pairs)
        for (who, when), record, country in zip(pairs, records, answers, strict=True):
            assert record == f"In {when} {who} visited {country}."
            assert 3 <= name[who] <= scale.MOVES_PER_PERSON
        assert sum(month.values()) / len(month) >= 4  # each month on about 5 lines (or more)


def test_every_size_is_checked_against_the_answer_the_wording_expects():
    assert scale.answer_of("secret", "The number is 4821, not 12.") == "4821"
    assert scale.answer_of("doors", "Code: 1712") == "1712"
    assert scale.answer_of("moves", "She moved to Porto, then Lyon.") == "Porto"
    assert scale.answer_of("moves", "Portos and Lyonnais") is None
    assert scale.answer_of("moves", "In 2011 she moved to Oslo") == "Oslo"
    assert scale.answer_of("visits", "He visited Chile in May, then Peru.") == "Chile"
    assert scale.answer_of("lessons", "It costs 120 dollars.") == "120"


def test_unrelated_per_size_asks_each_question_once_per_size():
    asked = [q for i in range(20) for q in focus_scale.spread_unrelated(48, 20, i)]
    assert sorted(asked) == sorted(UNRELATED)
    assert {len(focus_scale.spread_unrelated(48, 20, i)) for i in range(20)} == {2, 3}


def test_sizes_beyond_a_wording_are_refused():
    with pytest.raises(InvalidInputError, match="doors: 1 to 300 records, not 301"):
        scale.context_of(301, 0, "doors")
    with pytest.raises(InvalidInputError, match="wording must be one of"):
        scale.context_of(20, 0, "lockers")


def test_a_held_out_wording_runs_end_to_end_on_a_tiny_model(tmp_path):
    out = tmp_path / "run"
    argv = ["--model", "tiny-llama", "--wording", "moves", "--sizes", "8", "--n", "1"]
    argv += ["--unrelated-per-size", "1", "--max-new-tokens", "2", "--out", str(out)]
    assert focus_scale.main(argv) == 0
    rows = [json.loads(x) for x in (out / "rows.jsonl").read_text().splitlines()]
    assert [r["position"] for r in rows] == ["first", "middle", "last", "unrelated"]
    assert all(r["wording"] == "moves" and "rival_z" in r for r in rows)
    _, _, questions, answers = scale.context_of(8, 100, "moves")
    assert rows[0]["question"] == questions[0] and rows[0]["answer"] == answers[0]
    assert all("gold_z" in r for r in rows[:3])
    assert "the moves wording" in (out / "results.md").read_text()
    assert all(r["by_words"] == (r["edited"] and r["gold_z"] < 2.5) for r in rows[:3])
    with pytest.raises(InvalidInputError, match="another wording"):
        focus_scale.main([*argv[:3], "doors", *argv[4:], "--resume"])


def test_a_recheck_answers_again_only_what_the_rule_may_change(tmp_path):
    out = tmp_path / "run"
    argv = ["--model", "tiny-llama", "--wording", "lessons", "--sizes", "8,9", "--n", "1"]
    argv += ["--unrelated-per-size", "1", "--max-new-tokens", "2"]
    assert focus_scale.main([*argv, "--out", str(out)]) == 0
    rows = [json.loads(x) for x in (out / "rows.jsonl").read_text().splitlines()]
    # as a focus without the rule made them: its edits were abstentions, answered unedited
    before = [
        {**r, "edited": False, "by_words": False, "chosen": [], "auto": r["none"]}
        if r["by_words"]
        else r
        for r in rows
    ]
    (tmp_path / "before").mkdir()
    (tmp_path / "before" / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in before))
    asked = focus_scale.sole_questions(before)
    assert any(r["by_words"] for r in rows) and any(not r["edited"] for r in before)
    # at 8 and 9 lessons each instrument and town is on 2-3 lines: every relevant question
    # focus did not edit asks for a conjunction, and is answered again
    relevant = {(r["n"], r["seed"], r["question"]) for r in rows if r["position"] != "unrelated"}
    assert {
        (r["n"], r["seed"], r["question"]) for r in before if not r["edited"]
    } & relevant <= asked
    again = tmp_path / "again"
    focus_scale.main([*argv, "--recheck", str(tmp_path / "before"), "--out", str(again)])
    assert [json.loads(x) for x in (again / "rows.jsonl").read_text().splitlines()] == rows
    assert f"{len(asked)} questions answered again" in (again / "results.md").read_text()


def _row(position, edited, gold_score, rival_score, none_ok=False, auto_ok=False):
    return dict(
        n=20, seed=100, position=position, edited=edited, none_ok=none_ok, auto_ok=auto_ok,
        oracle_ok=True, gold_score=gold_score, gold_z=1.0, rival=3, rival_score=rival_score,
        rival_z=2.0,
    )  # fmt: skip


def test_abstentions_blame_the_scores_or_the_rule():
    rows = [
        _row("first", False, 0.05, 0.08),  # outscored: the scores
        _row("first", False, 0.01, 0.08),
        _row("first", False, 0.09, 0.04),  # highest, z too low: the rule
        _row("first", True, 0.09, 0.04, auto_ok=True),  # edited and won
        _row("last", True, 0.02, 0.04, none_ok=True),  # edited and lost
        {"n": 20, "seed": 100, "position": "unrelated", "edited": False},
    ]
    table = focus_scale.abstentions(rows)
    assert "| 20/first | 4 | 0.50 | 3 | 2 / 1 | 1 / 0 |" in table
    assert "| 20/last | 1 | 0.00 | 0 | 0 / 0 | 0 / 1 |" in table
    assert "| 20/first | 100 | 0.050 (1.00) | #3: 0.080 (2.00) | scores | no | yes |" in table
    assert "| 20/first | 100 | 0.090 (1.00) | #3: 0.040 (2.00) | rule | no | yes |" in table
