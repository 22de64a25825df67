"""The ``"records"`` task: synthetic key-value retrieval.

``n`` records "<name>'s secret number is <number>." and a question about the record at the
gold position (:func:`records_examples`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from kvedit.errors import InvalidInputError
from kvedit.evals.prompts import RECORDS_INSTRUCTION
from kvedit.evals.schema import Example
from kvedit.evals.tasks.registry import check_positions, register_task

__all__ = ["NAMES", "RECORDS_INSTRUCTION", "records_examples"]

# 80 distinct first names from many languages; none is a prefix of another.
NAMES: tuple[str, ...] = (
    "Alice", "Bruno", "Carmen", "Dmitri", "Elena", "Farid", "Grace", "Hiroshi",
    "Ingrid", "Jamal", "Keiko", "Lorenzo", "Maya", "Nikhil", "Olga", "Pablo",
    "Quentin", "Rosa", "Samir", "Tessa", "Umar", "Valeria", "Wei", "Ximena",
    "Yusuf", "Zara", "Amir", "Beatriz", "Chen", "Dalia", "Emeka", "Fiona",
    "Gustavo", "Hana", "Ivan", "Julia", "Kwame", "Leila", "Mateo", "Nadia",
    "Oscar", "Priya", "Rafael", "Sofia", "Tomas", "Ursula", "Victor", "Wanda",
    "Yara", "Zoltan", "Abigail", "Boris", "Chloe", "Diego", "Esther", "Felix",
    "Greta", "Hugo", "Irene", "Jonas", "Kofi", "Lucia", "Marcus", "Nora",
    "Omar", "Paula", "Ruben", "Sakura", "Theo", "Ulrich", "Vera", "Walter",
    "Xavier", "Yvonne", "Zeynep", "Anika", "Bashir", "Clara", "Dorian", "Elif",
)  # fmt: skip


@register_task("records", n_docs="n_records")
def records_examples(
    n_records: int = 20,
    positions: Sequence[int] = (0, 5, 10, 15, 19),
    trials: int = 30,
    seed: int = 0,
) -> list[Example]:
    """Synthetic retrieval: find one person's secret number among ``n_records`` records.

    Trial ``t`` draws ``n_records`` distinct names (from :data:`NAMES`), distinct four-digit
    numbers (1000 to 9999) and the person asked about. Every position uses the same records
    in the same order, except that the asked-about record moves to the gold position, so
    positions are compared on equal footing. Records are ``"<name>'s secret number is
    <number>."`` separated by newlines; the question is ``"What is <name>'s secret
    number?"``; the metric is ``"first_number"``.

    Returns ``len(positions) * trials`` examples, grouped by position then trial, with ids
    ``records-s{seed}-t{trial}-p{position}``. Deterministic in its arguments.

    Raises:
        ValueError: ``n_records`` is not in ``[1, len(NAMES)]``, ``trials < 0``, or a
            position is out of range or repeated.
    """
    if not 1 <= n_records <= len(NAMES):
        raise InvalidInputError(f"n_records must be in [1, {len(NAMES)}], got {n_records}")
    if trials < 0:
        raise InvalidInputError(f"trials must be >= 0, got {trials}")
    positions = check_positions(positions, n_records)
    rng = random.Random(seed)
    drawn = []  # per trial: (the other records, in order; the asked-about name and number)
    for _ in range(trials):
        names = rng.sample(NAMES, n_records)
        numbers = rng.sample(range(1000, 10000), n_records)
        target = rng.randrange(n_records)
        records = [f"{name}'s secret number is {number}." for name, number in zip(names, numbers)]
        gold = records.pop(target)
        drawn.append((records, gold, names[target], str(numbers[target])))
    examples = []
    for position in positions:
        for trial, (others, gold, name, number) in enumerate(drawn):
            examples.append(
                Example(
                    id=f"records-s{seed}-t{trial}-p{position}",
                    instruction=RECORDS_INSTRUCTION,
                    documents=(*others[:position], gold, *others[position:]),
                    separator="\n",
                    question=f"What is {name}'s secret number?",
                    answers=(number,),
                    gold_index=position,
                    metric="first_number",
                )
            )
    return examples
