"""``kvedit.focus(edit=...)``: the one focus path also applies other edits of the chosen passages
(what the eval's ``reread``/``duplicate`` methods use), guarded like the emphasis."""

from __future__ import annotations

import functools

import pytest
import torch

import kvedit
from kvedit.errors import InvalidTypeError

CONTEXT = (
    "Ann Lee's secret number is 4821.\n\nBo Park's secret number is 7315.\n\n"
    "Cy Diaz's secret number is 2096."
)
QUESTION = "\n\nQuestion: What is Bo Park's secret number?"


@pytest.fixture(scope="module")
def state(llama):
    model, tok = llama
    return kvedit.capture(model, tok, CONTEXT)


def chosen_spans(found):
    return [found.passages[i] for i in found.chosen]


@pytest.mark.parametrize(
    "op",
    [kvedit.ops.reread, functools.partial(kvedit.ops.duplicate, copies=2)],
    ids=["reread", "duplicate"],
)
def test_focus_applies_the_given_edit_to_its_choice(state, op):
    found = kvedit.focus(state, QUESTION, threshold=None, edit=op)  # threshold None: it chooses
    assert found.chosen, "focus chose nothing to edit"
    by_hand = op(state, chosen_spans(found))
    assert found.state.digest == by_hand.digest  # the same steps, the same parameters
    assert torch.equal(found.state.last_logits, by_hand.last_logits)
    assert found.state.history.steps[-1].name == by_hand.history.steps[-1].name != "emphasize"


def test_the_edit_is_not_called_when_focus_abstains(state):
    calls = []

    def edit(s, spans):
        calls.append(spans)
        return s

    found = kvedit.focus(state, QUESTION, threshold=1e9, edit=edit)  # nothing can stand out
    assert found.chosen == [] and calls == [] and found.state is state


def test_the_default_is_the_sized_emphasis(state):
    found = kvedit.focus(state, QUESTION, threshold=None)
    by_hand = kvedit.ops.emphasize(state, chosen_spans(found), found.strengths)
    assert found.state.digest == by_hand.digest


def test_a_bad_edit_is_refused(state):
    with pytest.raises(InvalidTypeError, match="edit must be a function"):
        kvedit.focus(state, QUESTION, edit="reread")
    with pytest.raises(InvalidTypeError, match="returned str"):
        kvedit.focus(state, QUESTION, threshold=None, edit=lambda s, spans: "edited")
