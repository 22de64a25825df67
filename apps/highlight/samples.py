"""The app's samples: lost-in-the-middle prompts of 20 records, the gold one in the middle,
and a few short one-click examples (:data:`EXAMPLES`)."""

from __future__ import annotations

from dataclasses import dataclass

from kvedit.evals.tasks import Example, records_examples

__all__ = [
    "EXAMPLES",
    "SAMPLE_POSITION",
    "SAMPLE_RECORDS",
    "SAMPLE_TRIALS",
    "ShortExample",
    "sample_examples",
    "sample_fields",
]


@dataclass(frozen=True)
class ShortExample:
    """A one-click example: what it fills in (the span boxes hold one span per line)."""

    name: str
    context: str
    emphasize: str
    suppress: str
    question: str
    note: str


EXAMPLES: tuple[ShortExample, ...] = (
    ShortExample(
        name="Opening hours",
        context=(
            "The museum opens at 9 am on weekdays.\nThe cafe opens at 7 am.\n"
            "The library opens at 11 am on Sundays."
        ),
        emphasize="The library opens at 11 am on Sundays.",
        suppress="",
        question="When does the library open on Sundays?",
        note="Emphasize the line that answers; **Auto-highlight** picks the same line.",
    ),
    ShortExample(
        name="Suppress a distractor",
        context=(
            "Mia's flight leaves at 6:40 from gate B12.\nTom's train leaves at 9:15 from "
            "platform 4.\nLea's bus leaves at noon from stop 7."
        ),
        emphasize="",
        suppress="Mia's flight leaves at 6:40 from gate B12.",
        question="When does Tom's train leave?",
        note="Suppress the first line and see the attention move away from it.",
    ),
    ShortExample(
        name="Secret numbers",
        context=(
            "Alice's secret number is 4821. Bob's secret number is 7310. "
            "Carol's secret number is 5902. Dave's secret number is 1234."
        ),
        emphasize="Carol's secret number is 5902.",
        suppress="Alice's secret number is 4821.",
        question="What is Carol's secret number?",
        note="Emphasize the sentence that answers and suppress another one.",
    ),
)
"""Short one-click examples (each span is in its context; the first is docs/app.md's
``/focus`` example, which Auto-highlight picks on SmolLM2)."""

# 20 records with the asked-about one in the middle, where small models lose it.
SAMPLE_RECORDS = 20
SAMPLE_POSITION = 10
SAMPLE_TRIALS = 50


def sample_examples() -> list[Example]:
    """Lost-in-the-middle samples: 20 records, the asked-about record in the middle."""
    return records_examples(
        n_records=SAMPLE_RECORDS, positions=(SAMPLE_POSITION,), trials=SAMPLE_TRIALS, seed=0
    )


def sample_fields(example: Example) -> tuple[str, str, str]:
    """``(context, question, hint markdown)`` of a sample."""
    context = example.user_message()[: example.documents_end()]
    gold = example.gold_document or ""
    hint = (
        f"**Sample** `{example.id}`: {len(example.documents)} records; the question asks about "
        f"record {example.gold_index + 1}, in the middle, where small models often lose it. "
        f"Gold record (the hint): `{gold}` It is in the Emphasize box; press **Run** and "
        f"compare the answers (expected: {example.answers[0]})."
    )
    return context, example.question, hint
