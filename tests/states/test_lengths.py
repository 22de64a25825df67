"""Every entry point that adds tokens to a state checks, before any work, that the state's next
position plus the new tokens (plus the tokens to decode) fits the model's positions, and says
the numbers."""

from __future__ import annotations

import pytest
from conftest import RECORDS

import kvedit
from kvedit import checks, ops
from kvedit.errors import InvalidInputError


@pytest.fixture()
def near_full(llama, monkeypatch):
    """A state with 6 positions left before the model's limit."""
    model, tok = llama
    state = kvedit.capture(model, tok, RECORDS)
    monkeypatch.setattr(checks, "MAX_POSITIONS", state.next_position + 6)
    return state


LONG = " and then some more words follow here" * 3


@pytest.mark.parametrize(
    "use",
    [
        lambda s: s.extend(LONG),
        lambda s: s.logits(LONG),
        lambda s: s.generate(" Who?", 200),
        lambda s: s.generate("", 7),
        lambda s: s.answer(LONG, 1),
        lambda s: kvedit.attention_share(s, LONG, ["Bob"]),
        lambda s: s.extend("x" * 2_000_000),
    ],
    ids=["extend", "logits", "generate", "generate-no-prompt", "answer", "share", "2MB"],
)
def test_past_the_positions_is_refused_with_the_numbers(near_full, use):
    limit = near_full.next_position + 6
    with pytest.raises(InvalidInputError, match=f"at most {limit} positions.*next position"):
        use(near_full)


def test_within_the_positions_still_runs(near_full):
    assert isinstance(near_full.generate(" Who", 3), str)
    assert len(near_full.extend(" Bob.")) > len(near_full)


def test_the_limit_counts_positions_not_cache_entries(llama, monkeypatch):
    """``duplicate`` adds entries at old positions; ``reread`` advances the positions."""
    model, tok = llama
    state = kvedit.capture(model, tok, RECORDS)
    doubled = ops.duplicate(state, "Bob", 4)
    assert doubled.cache_length > doubled.next_position
    monkeypatch.setattr(checks, "MAX_POSITIONS", state.next_position + 4)
    assert isinstance(doubled.generate("", 3), str)  # the copies take no position
    reread = ops.reread(state, "Bob")
    with pytest.raises(InvalidInputError, match="next position"):
        reread.generate(" Who is Bob?", 3)


def test_a_long_focus_question_is_refused_before_scoring(near_full):
    with pytest.raises(InvalidInputError, match="positions"):
        kvedit.focus(near_full, "Which secret number does Bob hold in this long list?" * 3)
