"""A context longer than the model attends to is refused before the model runs (and before
tokenizing, where its characters alone cannot fit); ``max_positions=`` overrides the limit."""

from __future__ import annotations

import pytest

from kvedit import checks
from kvedit.errors import InvalidInputError
from kvedit.states.capturing import capture, capture_tokens

LONG = "Alice's secret number is 4821. " * 10


def test_capture_refuses_a_context_longer_than_the_model_attends_to(short_llama):
    model, tok = short_llama
    n = len(tok(LONG)["input_ids"])
    with pytest.raises(InvalidInputError, match=f"is {n} tokens long .* at most 16 positions"):
        capture(model, tok, LONG)
    with pytest.raises(InvalidInputError, match="pass max_positions= or give the CLI"):
        capture(model, tok, LONG)  # capture takes the keyword, so its message offers it


def test_capture_tokens_refuses_too_many_ids(short_llama):
    model, tok = short_llama
    with pytest.raises(InvalidInputError, match="is 17 tokens long .* at most 16"):
        capture_tokens(model, tok, [5] * 17)


def test_a_huge_context_is_refused_before_tokenizing(short_llama):
    model, _ = short_llama

    class NoTokenizer:
        def __call__(self, *args, **kwargs):
            raise AssertionError("tokenized a text that cannot fit")

    text = "x" * (16 * checks.MAX_CHARS_PER_TOKEN + 1)
    with pytest.raises(InvalidInputError, match=f"{len(text)} characters long.* 16 tokens"):
        capture(model, NoTokenizer(), text)


def test_the_limit_can_be_overridden(short_llama):
    model, tok = short_llama
    state = capture(model, tok, LONG, max_positions=4096)
    assert len(state) > 16
    assert not hasattr(checks, "MAX_POSITIONS")  # a keyword, no module-wide setting


def test_room_for_the_question_and_answer_is_kept(short_llama):
    model, _ = short_llama
    checks.context_fits(model, n_tokens=10, reserve=6)
    with pytest.raises(InvalidInputError, match="16 positions, 7 of them kept .* leaving 9"):
        checks.context_fits(model, n_tokens=10, reserve=7)
    with pytest.raises(InvalidInputError, match="no room"):
        checks.context_fits(model, n_tokens=1, reserve=16)
