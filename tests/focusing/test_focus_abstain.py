"""Focus abstains when no passage stands out, refuses empty questions, scales to hundreds of
passages, ignores passages that only restate the question, and steer(focus=True) chooses among
the same passages as focus_text."""

from __future__ import annotations

import random

import pytest
import torch

import kvedit
from kvedit.errors import InvalidInputError, InvalidTypeError
from kvedit.focusing.choice import (
    abstain_reason,
    best_covered,
    echo_passages,
    passage_scores,
    stands_out,
)
from kvedit.focusing.scoring import distinctive_words, sole_holder, word_coverage

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


def test_only_the_passages_with_most_of_the_questions_words_may_be_chosen():
    q = "What is Cy Diaz's secret number?"
    texts = [
        "Read the records and answer the question.",
        "Cy Moss's secret number is 1111.",  # a first-name match
        "Cy Diaz's secret number is 2096.",  # both names
        "Bo Diaz's secret number is 3333.",  # a last-name match
        "Ann Lee's secret number is 4444.",
    ]
    assert distinctive_words(q, texts) == {"cy", "diaz"}  # not "what", "secret", "number"
    assert word_coverage(q, texts).tolist() == [0.0, 0.5, 1.0, 0.5, 0.0]
    everyone = torch.ones(5, dtype=torch.bool)
    assert best_covered(q, texts, everyone).nonzero().flatten().tolist() == [2]
    no_names = ["Records follow.", "A is 1.", "B is 2."]
    assert best_covered(q, no_names, torch.ones(3, dtype=torch.bool)).all()  # no gate
    # the partial match scores highest: it is not chosen; the full match is, where it
    # stands out against every candidate (not only the eligible ones)
    scores = torch.tensor([0.0, 0.9, 0.6, 0.1, 0.05] + [0.01 * i for i in range(10)])
    texts += [f"Person {i}'s secret number is {i}." for i in range(10)]
    eligible = best_covered(q, texts, torch.ones(15, dtype=torch.bool))
    assert stands_out(scores) == [1, 2]
    assert stands_out(scores, None, 2.5, eligible) == [2]
    assert stands_out(scores, None, None, eligible)[:2] == [2, 1]  # no threshold: eligible first
    weak = scores.clone()
    weak[2] = 0.08  # the full match does not stand out among all: focus abstains
    assert stands_out(weak, None, 2.5, eligible) == []


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
@pytest.mark.parametrize("asked", [15])
def test_among_shared_names_focus_chooses_the_record_with_both(smollm2, asked):
    """64 records from 8 first and 8 last names: the question's attention goes to records
    that share one of its names about as much as to the one with both (SmolLM2's scores put
    "Fay Lee" over "Fay Kent", "Dee Moss" over "Fay Moss"); focus chooses the one with both."""
    model, tok = smollm2
    first = ["Ann", "Bo", "Cy", "Dee", "Eli", "Fay", "Gus", "Ida"]
    last = ["Lee", "Park", "Diaz", "Wolf", "Moss", "Kent", "Ray", "Hale"]
    names = [f"{f} {x}" for f in first for x in last]
    random.Random(0).shuffle(names)
    records = [f"{n}'s secret number is {1000 + 37 * i}." for i, n in enumerate(names)]
    context = "Read the records and answer the question.\n\n" + "\n".join(records)
    found = kvedit.focus_text(model, tok, context, f"What is {names[asked]}'s secret number?")
    texts = [found.state.text[a:b] for a, b in found.passages]
    gold = texts.index(records[asked])
    scores = torch.tensor(found.scores)
    scores[0] = float("-inf")  # the instruction line
    assert int(scores.argmax()) != gold  # attention alone prefers a shared-name record
    assert found.eligible == [gold] and found.chosen == [gold]


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


def test_the_abstain_reason_names_the_condition_that_failed():
    every = torch.ones(4, dtype=torch.bool)
    real, calib = torch.rand(2, 4), torch.rand(2, 4)
    # the best score stands far out but is not positive: the score is the reason, not the z
    low = abstain_reason(torch.tensor([-0.1, -0.9, -0.9, -0.9]), every, every, 2.5, real, calib)
    assert "best: #0, score -0.100: not above 0; robust z " in low and "< threshold" not in low
    flat = abstain_reason(torch.tensor([0.2, 0.19, 0.18, 0.2]), every, every, 2.5, real, calib)
    assert "best: #0, score 0.200, robust z " in flat and "< threshold 2.5)" in flat


DOORS = [
    "Read the records and answer the question.",
    "The code for the red oak door is 1111.",
    "The code for the red pine door is 2222.",
    "The code for the blue oak door is 3333.",
    "The code for the blue pine door is 4444.",
    "The code for the green elm door is 5555.",
]


def test_the_sole_holder_is_the_one_passage_with_every_shared_word():
    every = torch.ones(len(DOORS), dtype=torch.bool)
    assert sole_holder("What is the code for the blue oak door?", DOORS, every) == 3
    # a word only one passage holds is no conjunction: attention finds that passage itself
    assert sole_holder("What is the code for the green elm door?", DOORS, every) is None
    # one distinctive word, or two passages with all of them, or none: no sole holder
    assert sole_holder("Which door is red?", DOORS, every) is None
    twice = [*DOORS, "The code for the blue oak door was 3334."]
    assert sole_holder("What is the code for the blue oak door?", twice, every.new_ones(7)) is None
    assert sole_holder("What is the code for the red elm door?", DOORS, every) is None
    # a passage that is not a candidate (an echo) holds nothing for the rule
    out = every.clone()
    out[3] = False
    assert sole_holder("What is the code for the blue oak door?", DOORS, out) is None
    with pytest.raises(InvalidInputError, match="candidates must be a mask of the 6 passages"):
        sole_holder("What is the code for the blue oak door?", DOORS, every[:5])


def test_no_passage_stands_out_but_the_sole_holder_is_chosen_when_its_score_is_positive(llama):
    model, tok = llama
    context = "\n".join(DOORS)
    prefix, _ = kvedit.chat_prefix(tok, context + "\n\nQuestion: x", "\n\nQuestion:")
    state = kvedit.capture(model, tok, prefix)
    picked = {}
    for door in ("red oak", "red pine", "blue oak", "blue pine"):
        question = f"What is the code for the {door} door?"
        _, cont = kvedit.chat_prefix(tok, context + "\n\nQuestion: " + question, "\n\nQuestion:")
        # threshold 1e9: no score stands out, so only the rule can choose
        found = kvedit.focus(state, cont, query=question, threshold=1e9, guard=None)
        texts = [state.text[a:b] for a, b in found.passages]
        sole = texts.index(next(d for d in DOORS if f" {door} " in d))
        picked[door] = found.scores[sole] > 0
        if picked[door]:
            assert found.chosen == [sole] and found.by_words and found.state is not state
            assert f"chosen #{sole}: the only passage holding all" in found.explain()
        else:
            assert found.chosen == [] and not found.by_words and found.state is state
        off = kvedit.focus(state, cont, query=question, threshold=1e9, all_words=False)
        assert off.chosen == [] and not off.by_words and off.scores == found.scores
        # without a threshold the top_k best are chosen as before, never "by words"
        every = kvedit.focus(state, cont, query=question, threshold=None, guard=None)
        assert not every.by_words and len(every.chosen) == 1
    assert any(picked.values()) and not all(picked.values())  # both sides of the rule seen
    with pytest.raises(InvalidTypeError, match="all_words must be True or False, not"):
        kvedit.focus(state, cont, query=question, all_words="yes")
