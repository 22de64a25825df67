"""Scoring of model answers for the lost-in-the-middle evaluation suite.

Two metrics, looked up by name in :data:`METRICS` (an :class:`~kvedit.evals.schema.Example`
names its metric, and :func:`kvedit.evals.schema.score` applies it):

``"subspan_em"`` (:func:`best_subspan_em`)
    The metric of Liu et al. (2024) for NQ: correct when a normalized gold answer occurs
    anywhere in the normalized prediction.
``"first_number"`` (:func:`first_number_match`)
    For answers that are a number (the synthetic records task): the number the prediction
    states must be the gold number, and it must be the only number it states.

:func:`bootstrap_ci` gives the percentile-bootstrap confidence interval of a mean accuracy.
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable, Iterable, Sequence
from decimal import Decimal

import numpy as np

from kvedit.registry import Registry

__all__ = [
    "METRICS",
    "best_subspan_em",
    "bootstrap_ci",
    "extract_numbers",
    "first_number_match",
    "normalize_answer",
]

_PUNCTUATION = str.maketrans("", "", string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")

# A number is a run of ASCII digits, optionally with comma thousands separators (only when
# every group after the first has exactly three digits: "1,234" and "12,345,678", but "1,2"
# is two numbers) and optionally a decimal part ("3.5"; a full stop not followed by a digit
# ends a sentence, not a number). A leading sign is not part of the number.
_NUMBER = re.compile(r"(?<![0-9])(?:[0-9]{1,3}(?:,[0-9]{3})+(?![0-9])|[0-9]+)(?:\.[0-9]+)?")


def normalize_answer(s: str) -> str:
    """Normalize ``s`` the SQuAD way, as Liu et al. do.

    Lowercase, delete ASCII punctuation, remove the articles "a", "an" and "the" (as whole
    words), and collapse runs of whitespace to one space (stripping both ends).
    """
    s = s.lower().translate(_PUNCTUATION)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def best_subspan_em(prediction: str, answers: Sequence[str]) -> float:
    """1.0 when a normalized gold answer is a substring of the normalized prediction, else 0.0.

    This is the "best subspan exact match" of Liu et al. (2024). The match is a plain
    substring test, not word-bounded (their definition): gold "1" matches "1901". One
    deviation: a gold answer that normalizes to the empty string (such as "*") is ignored
    rather than matching every prediction.
    """
    normalized_prediction = normalize_answer(prediction)
    for answer in answers:
        normalized = normalize_answer(answer)
        if normalized and normalized in normalized_prediction:
            return 1.0
    return 0.0


def extract_numbers(text: str) -> list[Decimal]:
    """Every number in ``text``, in order of appearance, as exact decimals.

    Thousands separators are dropped ("1,234" is 1234), a decimal part is kept ("3.50" equals
    3.5), signs are ignored ("-5" is 5), and only ASCII digits count.
    """
    return [Decimal(match.group().replace(",", "")) for match in _NUMBER.finditer(text)]


def first_number_match(prediction: str, answers: Sequence[str]) -> float:
    """1.0 when the prediction states the gold number and no other number, else 0.0.

    The rule, precisely: let ``numbers`` be :func:`extract_numbers` of the prediction. Credit
    is given when ``numbers`` is non-empty, its first element equals the number of some gold
    answer, and every other element equals the first. So an echo of the record ("Alice's
    secret number is 4821.") and a repetition ("4821, i.e. 4821") are correct, while a list of
    several numbers ("4821 or 1234") gets no credit, even when the gold one comes first.
    Formatting does not matter: "4,821" and "4821.0" both equal 4821.

    Raises:
        ValueError: no gold answer contains a number.
    """
    gold = {numbers[0] for numbers in map(extract_numbers, answers) if numbers}
    if not gold:
        raise ValueError(f"first_number needs numeric gold answers, got {list(answers)!r}")
    numbers = extract_numbers(prediction)
    if not numbers or numbers[0] not in gold:
        return 0.0
    return 1.0 if all(number == numbers[0] for number in numbers) else 0.0


METRICS: Registry[Callable[[str, Sequence[str]], float]] = Registry("metric")
"""Metric name -> ``metric(prediction, answers) -> float`` (1.0 correct, 0.0 wrong; a
:class:`kvedit.registry.Registry`)."""
METRICS.register("subspan_em", best_subspan_em)
METRICS.register("first_number", first_number_match)


def bootstrap_ci(
    values: Iterable[float],
    n_resamples: int = 1000,
    seed: int = 0,
    alpha: float = 0.05,
) -> tuple[float, float]:
    """Percentile-bootstrap ``1 - alpha`` confidence interval of the mean of ``values``.

    Draws ``n_resamples`` resamples (with replacement, of the same size) from a NumPy
    generator seeded with ``seed``, so the interval is the same on every call.

    Raises:
        ValueError: ``values`` is empty, ``n_resamples < 1``, or ``alpha`` is not in (0, 1).
    """
    data = np.asarray(list(values), dtype=np.float64)
    if data.size == 0:
        raise ValueError("bootstrap_ci needs at least one value")
    if n_resamples < 1:
        raise ValueError(f"n_resamples must be >= 1, got {n_resamples}")
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    rng = np.random.default_rng(seed)
    # Resample in chunks so that memory stays small for large evaluations.
    chunk = max(1, 1_000_000 // data.size)
    means = np.empty(n_resamples)
    for start in range(0, n_resamples, chunk):
        stop = min(start + chunk, n_resamples)
        indices = rng.integers(0, data.size, size=(stop - start, data.size))
        means[start:stop] = data[indices].mean(axis=1)
    low, high = np.quantile(means, [alpha / 2, 1 - alpha / 2])
    return float(low), float(high)
