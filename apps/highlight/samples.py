"""The app's samples: lost-in-the-middle prompts of 20 records, the gold one in the middle."""

from __future__ import annotations

from kvedit.evals.tasks import Example, records_examples

__all__ = ["SAMPLE_POSITION", "SAMPLE_RECORDS", "SAMPLE_TRIALS", "sample_examples", "sample_fields"]

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
