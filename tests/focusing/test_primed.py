"""Focus's scoring pass reused as the unedited answer's first pass (kvedit.focusing.primed)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import kvedit
from kvedit import ops
from kvedit.focusing.choice import guarded
from kvedit.focusing.guard import AgreementGuard, SupportGuard
from kvedit.focusing.primed import PrimedState, cut_answer
from kvedit.focusing.readout import continued_share
from kvedit.states.state import KVState

CONTEXT = (
    "Read the records.\n\nAnn's number is 11.\n\nBo's number is 22.\n\nCy's number is 33.\n\n"
    "Di's number is 44."
)
QUESTION = "\n\nQuestion: What is Bo's number?"


def _state(model):
    m, tok = model
    return kvedit.capture(m, tok, CONTEXT)


@pytest.mark.parametrize("model", ["llama", "gemma3"])
def test_the_continued_state_is_the_extended_state(model, request):
    state = _state(request.getfixturevalue(model))
    _, continued = continued_share(state, QUESTION, ["Bo's number is 22."])
    after, extended = continued.state(), state.extend(QUESTION)
    assert after.text == extended.text and after.next_position == extended.next_position
    assert torch.equal(after.token_ids, extended.token_ids)
    assert torch.equal(after.offsets, extended.offsets)
    assert torch.equal(after.last_logits, extended.last_logits)
    for a, b in zip(after.layers, extended.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        assert torch.equal(a.positions, b.positions)
        assert torch.equal(a.token_index, b.token_index)


@pytest.mark.parametrize("model", ["llama", "gemma3"])
def test_a_primed_state_answers_as_the_state_does(model, request):
    state = _state(request.getfixturevalue(model))
    _, continued = continued_share(state, QUESTION, ["Bo's number is 22."])
    primed = PrimedState.of(state, continued)
    for n in (1, 5, 12):
        assert primed.answer(QUESTION, n) == state.answer(QUESTION, n)
    # another continuation, or sampling, is the plain state's call
    assert primed.answer(" Ann", 4) == state.answer(" Ann", 4)
    base, fresh = primed.decoder(QUESTION), state.decoder(QUESTION)
    assert torch.equal(base.next_logits.float(), fresh.next_logits.float())
    token = int(fresh.next_logits.argmax())
    assert torch.equal(base.push(token), fresh.push(token))
    # a state derived from it is plain: it holds no primed answer
    derived = primed.replace(text=primed.text)
    assert type(derived) is KVState


def test_a_primed_state_skips_the_question_pass(llama, monkeypatch):
    state = _state(llama)
    _, continued = continued_share(state, QUESTION, ["Bo's number is 22."])
    primed = PrimedState.of(state, continued)
    runs = []
    real_run = KVState.run
    monkeypatch.setattr(
        KVState, "run", lambda self, *a, **k: runs.append(1) or real_run(self, *a, **k)
    )
    primed.answer(QUESTION, 4)
    assert runs == []
    state.answer(QUESTION, 4)
    assert runs == [1]


def test_a_known_answer_is_read_not_decoded(llama):
    state = _state(llama)
    _, continued = continued_share(state, QUESTION, ["Bo's number is 22."])
    full = state.answer(QUESTION, 6, eos_token_id=[])
    known = dataclasses.replace(continued, known=full)
    assert known.answer(6) is full
    assert known.answer(3) == state.answer(QUESTION, 3, eos_token_id=[])
    # cut shorter than asked: the rest is decoded
    assert known.answer(9) == state.answer(QUESTION, 9)
    tok = llama[1]
    assert cut_answer(full, 7, tok) is None
    ended = dataclasses.replace(full, finished=True)
    assert cut_answer(ended, 20, tok) is ended


@pytest.mark.parametrize(
    "guard", [SupportGuard(max_new_tokens=6), AgreementGuard(max_new_tokens=6)]
)
@pytest.mark.parametrize("strength", [0.0, 8.0])
def test_focus_decides_and_answers_as_with_a_plain_state(llama, guard, strength):
    state = _state(llama)
    found = kvedit.choose(state, QUESTION, threshold=None)
    assert found.continued is not None and found.continued.matches(state, QUESTION)
    edited = ops.emphasize(state, [found.passages[i] for i in found.chosen], strength)
    got = guarded(found, edited, guard)
    plain = guarded(dataclasses.replace(found, continued=None), edited, guard)
    assert got.verdict == plain.verdict and got.state is plain.state
    assert got.generate(10) == plain.generate(10)
    assert (got.continued is None) == got.verdict.kept


def test_an_abstention_answers_from_the_scoring_pass(llama, monkeypatch):
    state = _state(llama)
    found = kvedit.focus(state, QUESTION, threshold=1e9)
    assert not found.chosen and found.continued is not None
    runs = []
    real_run = KVState.run
    monkeypatch.setattr(
        KVState, "run", lambda self, *a, **k: runs.append(1) or real_run(self, *a, **k)
    )
    assert found.generate(8) == state.generate(QUESTION, 8)
    assert runs == [1]  # the plain call's pass only


def test_focus_reads_a_given_unedited_answer(llama):
    state = _state(llama)
    wrong = state.answer(" Ann", 5)  # a caller's word is not checked: it is read as given
    found = kvedit.focus(state, QUESTION, threshold=1e9, unedited=wrong)
    assert found.generate(5) == wrong.text
    with pytest.raises(kvedit.errors.InvalidTypeError, match="unedited must be"):
        kvedit.focus(state, QUESTION, unedited="22")
