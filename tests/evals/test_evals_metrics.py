"""Tests of kvedit.evals.metrics: answer normalization, the two metrics, bootstrap CIs."""

from __future__ import annotations

from decimal import Decimal

import numpy as np
import pytest

from kvedit.evals.metrics import (
    METRICS,
    best_subspan_em,
    bootstrap_ci,
    extract_numbers,
    first_number_match,
    normalize_answer,
)
from kvedit.evals.schema import Example, score


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The  Eiffel Tower!", "eiffel tower"),
        ("an apple, a pear & the plum.", "apple pear plum"),
        ("Theatre annex", "theatre annex"),  # articles only as whole words
        ("  Wilhelm\tConrad\nRöntgen ", "wilhelm conrad röntgen"),
        ("U.S.A.", "usa"),
        ("", ""),
    ],
)
def test_normalize_answer(text: str, expected: str) -> None:
    assert normalize_answer(text) == expected


@pytest.mark.parametrize(
    ("prediction", "answers", "expected"),
    [
        ("It was Wilhelm Conrad Röntgen, in 1901.", ["Wilhelm Conrad Röntgen"], 1.0),
        ("wilhelm conrad röntgen", ["Wilhelm Conrad Röntgen"], 1.0),
        ("The answer: the Beatles!", ["Beatles"], 1.0),
        ("Paris", ["the city of Paris"], 0.0),  # the gold must lie inside the prediction
        ("Lyon", ["Paris", "Lyon"], 1.0),  # any gold answer counts
        ("Marseille", ["Paris", "Lyon"], 0.0),
        ("in 1901", ["1"], 1.0),  # plain substring match, as in Liu et al.
        ("no idea", ["*"], 0.0),  # a gold answer that normalizes to "" never matches
        ("", ["Paris"], 0.0),
    ],
)
def test_best_subspan_em(prediction: str, answers: list[str], expected: float) -> None:
    assert best_subspan_em(prediction, answers) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4821", ["4821"]),
        ("Alice's secret number is 4,821.", ["4821"]),
        ("1,234,567 and 3.50", ["1234567", "3.5"]),
        ("1,2,3", ["1", "2", "3"]),
        ("4821,1234", ["4821", "1234"]),
        ("1,2345", ["1", "2345"]),
        ("-5 or +6", ["5", "6"]),
        ("no digits", []),
    ],
)
def test_extract_numbers(text: str, expected: list[str]) -> None:
    assert extract_numbers(text) == [Decimal(x) for x in expected]


@pytest.mark.parametrize(
    ("prediction", "expected"),
    [
        ("4821", 1.0),
        (" 4821\n", 1.0),
        ("Alice's secret number is 4821.", 1.0),  # echoing the record is fine
        ("4,821", 1.0),
        ("4821.0", 1.0),
        ("4821 (that is, 4821)", 1.0),  # repeating the same number is fine
        ("4821 or 1234", 0.0),  # a list of several numbers gets no credit...
        ("4821, 1234, 5678", 0.0),
        ("1234, not 4821", 0.0),  # ...nor does a wrong first number
        ("48210", 0.0),
        ("482", 0.0),
        ("I don't know.", 0.0),
        ("", 0.0),
    ],
)
def test_first_number_match(prediction: str, expected: float) -> None:
    assert first_number_match(prediction, ["4821"]) == expected


def test_first_number_match_gold_formats_and_errors() -> None:
    assert first_number_match("1234", ["1,234"]) == 1.0
    assert first_number_match("12", ["7", "12"]) == 1.0
    with pytest.raises(ValueError, match="numeric gold"):
        first_number_match("4821", ["four thousand"])


def test_score_uses_the_example_metric() -> None:
    assert set(METRICS) == {"subspan_em", "first_number"}
    common = dict(id="e", instruction="", documents=("d",), separator="\n", question="q?")
    numeric = Example(**common, answers=("12",), gold_index=0, metric="first_number")
    textual = Example(**common, answers=("12",), gold_index=0)
    assert score(numeric, "12 or 123") == 0.0
    assert score(textual, "12 or 123") == 1.0


def test_bootstrap_ci_contains_the_mean_and_is_deterministic() -> None:
    values = np.random.default_rng(1).integers(0, 2, size=400).astype(float)
    low, high = bootstrap_ci(values)
    assert isinstance(low, float) and isinstance(high, float)
    assert low < values.mean() < high
    # A 95% interval of a proportion near 0.5 from 400 samples is about +-0.049.
    assert 0.07 < high - low < 0.13
    assert bootstrap_ci(values) == (low, high)
    assert bootstrap_ci(list(values), seed=0) == (low, high)
    assert bootstrap_ci(values, seed=1) != (low, high)
    narrower = bootstrap_ci(values, alpha=0.5)
    assert low < narrower[0] < narrower[1] < high


def test_bootstrap_ci_edge_cases() -> None:
    # Constant data: every resample has the same mean, so the interval is that point.
    assert bootstrap_ci([1.0] * 10) == (1.0, 1.0)
    assert bootstrap_ci([0.25]) == (0.25, 0.25)
    # One resample: the interval is the mean of that resample, low == high; over seeds it is
    # each of the possible means of a resample of [0, 1] (so it really resamples, by seed).
    single = [bootstrap_ci([0, 1], n_resamples=1, seed=seed) for seed in range(40)]
    assert all(low == high for low, high in single)
    assert {low for low, _ in single} == {0.0, 0.5, 1.0}
    # alpha close to 1: the interval shrinks to the median resample mean, the sample mean here.
    low, high = bootstrap_ci([0, 1] * 50, alpha=0.999)
    assert low == high == 0.5
    problems = [
        ({"values": []}, "at least one value"),
        ({"values": [1], "n_resamples": 0}, "n_resamples"),
        ({"values": [1], "alpha": 1}, "alpha"),
        ({"values": [1], "alpha": 0}, "alpha"),
    ]
    for bad, problem in problems:
        with pytest.raises(ValueError, match=problem):
            bootstrap_ci(**bad)
