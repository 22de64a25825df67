"""``benchmarks/focus_support_check.py``: when the unedited answer counts as read from the chosen
passage, and the accuracy of answering unedited there."""

from __future__ import annotations

from helpers import load_benchmark

from kvedit.evals.schema import Example


def load(monkeypatch):
    return load_benchmark("focus_support_check", monkeypatch)


def test_support_counts_the_answers_new_words_found_in_the_passage(monkeypatch):
    m = load(monkeypatch)
    question = "What is Zoltan's secret number?"
    passage = "Zoltan's secret number is 3407."
    assert m.support("Zoltan's secret number is 3407.", passage, question) == 1.0
    assert m.support("Zoltan's secret number is 2618.", passage, question) == 0.0
    assert m.support("It is 3407, 2618.", passage, question) == 0.5
    assert m.support("The answer is:", passage, question) == 0.0  # nothing beyond stop words


def test_check_answers_unedited_only_where_supported(monkeypatch):
    m = load(monkeypatch)
    ex = Example(
        id="e0", instruction="", documents=("Ann's code is 11.", "Bob's code is 22."),
        separator="\n", question="What is Bob's code?", answers=("22",), gold_index=1,
    )  # fmt: skip
    records = [
        {"id": "e0", "chosen": [1], "none": "Bob's code is 22.", "none_ok": True, "edit_ok": False},
        {"id": "e0", "chosen": [1], "none": "Bob's code is 11.", "none_ok": False, "edit_ok": True},
        {"id": "e0", "chosen": [], "none": "22", "none_ok": True, "edit_ok": False},
        {"id": "other", "chosen": [0], "none": "x", "none_ok": True, "edit_ok": True},
    ]
    c = m.check(records, {"e0": ex}, 0.75)
    assert (c["n"], c["edit"], c["rule"], c["kept"]) == (3, 2, 3, 1)
    assert c["changed"] == ["e0 (won)"]
