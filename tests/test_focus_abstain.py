"""Focus abstains when no passage stands out, refuses empty questions, scales to hundreds of
passages, ignores passages that only restate the question, and steer(focus=True) chooses among
the same passages as focus_text."""

from __future__ import annotations

import pytest
import torch

import kvedit
from kvedit.errors import InvalidInputError
from kvedit.focusing import echo_passages, passage_scores, stands_out

RECORDS = (
    "Read the records and answer the question.\n\n"
    "Ann Lee's secret number is 4821.\nBo Park's secret number is 7315.\n"
    "Cy Diaz's secret number is 2096.\nDee Wolf's secret number is 5583."
)


@pytest.mark.real
def test_an_unrelated_question_leaves_the_state_unedited(smollm2):
    model, tok = smollm2
    found = kvedit.focus_text(model, tok, RECORDS, "What is the capital of France?")
    assert found.chosen == [] and len(found.scores) == len(found.passages) == 5
    assert set(found.strengths) == {0.0}
    assert "no edit" in found.explain().splitlines()[-1]
    prefix, cont = kvedit.chat_prefix(
        tok, RECORDS + "\n\nQuestion: What is the capital of France?", "\n\nQuestion:"
    )
    plain = kvedit.capture(model, tok, prefix)
    assert torch.equal(found.state.last_logits, plain.last_logits)  # nothing edited
    assert found.generate(8) == plain.generate(cont, 8)


@pytest.mark.real
def test_a_relevant_question_edits_and_an_echo_does_not_win(smollm2):
    """A context line that restates the question draws its attention; it is never chosen,
    and the record that answers is."""
    model, tok = smollm2
    question = "What is Cy Diaz's secret number?"
    context = RECORDS.replace("question.\n\n", "question.\nQuestion: " + question + "\n\n", 1)
    found = kvedit.focus_text(model, tok, context, question)
    texts = [found.state.text[a:b] for a, b in found.passages]
    echo = texts.index("Question: " + question)
    assert found.echoes == [echo]
    assert [texts[i] for i in found.chosen] == ["Cy Diaz's secret number is 2096."]
    assert "2096" in found.generate(12)


@pytest.mark.parametrize("question", ["   ", "\n\t", "?!", ""])
def test_a_question_without_content_is_refused(llama, question):
    model, tok = llama
    with pytest.raises(InvalidInputError, match="question"):
        kvedit.focus_text(model, tok, RECORDS, question)
    with pytest.raises(InvalidInputError, match="question"):
        kvedit.steer(model, tok, focus=True, question=question)
    state = kvedit.capture(model, tok, RECORDS)
    with pytest.raises(InvalidInputError, match="query|question"):
        kvedit.focus(state, "\n\nQuestion: " + question + " ", query=question or " ")


def test_echo_passages_are_restatements_only():
    q = "What is Cy Diaz's secret number?"
    texts = [
        "Question: what is Cy Diaz's secret number?",  # a restatement
        "Cy Diaz's secret number is 2096.",  # the answer: a word beyond the question
        "Cy Diaz",  # a name alone is not a restatement
        "Read the records and answer the question.",
    ]
    assert echo_passages(q, texts) == [0]


def _shares_at_300():
    """Per-layer shares like SmolLM2's on 300 records (mean share ~0.0015): the first and last
    passages hold much of the attention, and the question lifts passage 150 (x2.5) while the
    first passage, in absolute terms, gains more (+25%)."""
    gen = torch.Generator().manual_seed(0)
    layers, n = 6, 300
    calib = 0.0015 * (0.5 + torch.rand(layers, n, generator=gen))
    calib[:, 0], calib[:, -1] = 0.08, 0.05
    real = calib * (1 + 0.1 * (torch.rand(layers, n, generator=gen) - 0.5))
    real[:, 150] = calib[:, 150] * 2.5
    real[:, 0] = calib[:, 0] * 1.25
    return real, calib


def test_300_passages_choose_right_where_the_old_constant_failed():
    real, calib = _shares_at_300()
    old = (torch.log(real + 0.01) - torch.log(calib + 0.01)).mean(0)  # the former scoring
    assert int(old.argmax()) == 0
    scores = passage_scores(real, calib)
    assert int(scores.argmax()) == 150
    assert stands_out(scores)[0] == 150  # and it stands out: an edit is made
    # the same shares at 20 passages (the first 19 and passage 150): still right
    keep = [*range(19), 150]
    assert int(passage_scores(real[:, keep], calib[:, keep]).argmax()) == 19


def test_nothing_stands_out_in_flat_or_zero_scores():
    assert stands_out(torch.zeros(50)) == []
    flat = torch.linspace(-0.05, 0.05, 300)
    assert stands_out(flat) == []
    peaked = flat.clone()
    peaked[7] = 0.5
    assert stands_out(peaked) == [7]
    assert stands_out(peaked, threshold=None)[0] == 7  # None: no abstention
    mask = torch.ones(300, dtype=torch.bool)
    mask[7] = False
    assert stands_out(peaked, mask) == []  # an excluded passage is never chosen


@pytest.mark.real
def test_steer_and_focus_text_agree_under_a_system_line(smollm2):
    """SmolLM2's template opens with a system line ("You are a helpful AI assistant..."):
    it is never a candidate passage; steer(focus=True) and focus_text choose among the same
    passages, choose the same one and answer alike."""
    model, tok = smollm2
    question = "What is Bo Park's secret number?"
    prompt = kvedit.templated_prompt(tok, RECORDS + "\n\nQuestion: " + question)
    assert "You are a helpful AI assistant" in prompt
    s = kvedit.steer(model, tok, focus=True, question=question)
    out = s.generate(prompt, max_new_tokens=14)
    by_steer = s.plan.found
    by_text = kvedit.focus_text(model, tok, RECORDS, question)
    texts = [by_steer.state.text[a:b] for a, b in by_steer.passages]
    assert texts == [by_text.state.text[a:b] for a, b in by_text.passages]
    assert not any("assistant" in t for t in texts)
    assert by_steer.chosen == by_text.chosen == [2]
    assert out == by_text.generate(14)
    assert "7315" in out
