"""kvedit.focus: passages, scoring, the adaptive edit, explain, and bad inputs."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

import kvedit
from kvedit import ops
from kvedit.errors import EmptySelectionError, InvalidInputError, InvalidTypeError
from kvedit.evals.tasks import records_examples
from kvedit.focusing.choice import (
    adaptive_strengths,
    content_free_question,
    guarded,
    passage_scores,
    passage_shares,
)
from kvedit.focusing.guard import AgreementGuard, Verdict
from kvedit.focusing.passages import split_passages
from kvedit.focusing.readout import attention_share
from kvedit.testing import TINY_SLIDING_WINDOW

CONTEXT = "Read the records.\n\nAnn's number is 11.\nBo's number is 22.\nCy's number is 33."


def _state(llama, text=CONTEXT):
    model, tok = llama
    prefix, _ = kvedit.chat_prefix(tok, text + "\n\nQuestion: x", "\n\nQuestion:")
    return kvedit.capture(model, tok, prefix)


def _texts(state, ranges):
    return [state.text[a:b] for a, b in ranges]


def test_default_split_gives_the_instruction_and_one_passage_per_record(llama):
    state = _state(llama)
    texts = _texts(state, split_passages(state))
    # the template's "<|im_start|>user" line is never a passage
    assert texts == [
        "Read the records.",
        "Ann's number is 11.",
        "Bo's number is 22.",
        "Cy's number is 33.",
    ]


def test_named_splitters_and_windows(llama):
    state = _state(llama, "One. Two!\nThree\n\n  \n\nFour? Five.")
    assert _texts(state, split_passages(state, "paragraphs")) == ["One. Two!\nThree", "Four? Five."]
    assert _texts(state, split_passages(state, "lines")) == ["One. Two!", "Three", "Four? Five."]
    assert _texts(state, split_passages(state, "sentences")) == [
        "One.",
        "Two!",
        "Three",
        "Four?",
        "Five.",
    ]
    windows = split_passages(state, 3)
    tokens = [int(state.token_indices([r]).numel()) for r in windows]
    assert all(n <= 3 for n in tokens) and max(tokens) == 3
    joined = "".join(_texts(state, windows)).replace(" ", "").replace("\n", "")
    assert joined == "One.Two!ThreeFour?Five."  # the windows cover the text, template left out


def test_long_pieces_are_cut_into_sentences(llama):
    long = " ".join(f"Sentence number {i} is here." for i in range(60))
    state = _state(llama, "Intro.\n\n" + long)
    assert state.token_indices(long).numel() > 200
    texts = _texts(state, split_passages(state))
    assert texts[0] == "Intro." and texts[1] == "Sentence number 0 is here." and len(texts) == 61


def test_a_list_of_spans(llama):
    state = _state(llama)
    start = state.text.index("Bo's")
    got = split_passages(state, ["Ann's number is 11.", (start, start + 18), re.compile(r"Cy\S*")])
    assert _texts(state, got) == ["Ann's number is 11.", "Bo's number is 22.", "Cy's"]


def test_focus_equals_the_ops_applied_by_hand(llama):
    """focus chooses the best-scored passage among those holding the question's distinctive
    words (scores computed here from the attention shares) and its state is ops.emphasize applied by hand to that passage, layer by layer, with the
    adaptive bias sized from that passage's shares."""
    state = _state(llama)
    question = "\n\nQuestion: What is Bo's number?<|im_end|>\n<|im_start|>assistant\n"
    kw = dict(target=0.6, max_strength=50.0, threshold=None)
    found = kvedit.focus(state, question, guard=None, **kw)
    assert found.kept and found.verdict is None
    assert len(found.scores) == len(found.passages) == 4 and found.echoes == []
    # the scores, and so the choice, computed here
    real, calib = passage_shares(state, question, found.passages, query="What is Bo's number?")
    scores = passage_scores(real, calib)
    assert found.scores == scores.tolist()
    texts = [state.text[a:b] for a, b in found.passages]
    assert found.eligible == [texts.index("Bo's number is 22.")]  # the one naming Bo
    eligible = torch.zeros(len(texts), dtype=torch.bool)
    eligible[found.eligible] = True
    best = int(scores.masked_fill(~eligible, float("-inf")).argmax())
    assert best != int(scores.argmax())  # this random model's attention points elsewhere
    assert found.chosen == [best] and found.best == best
    assert kvedit.choose(state, question, **kw).chosen == [best]  # choose picks the same
    # the strengths are the adaptive bias from the chosen passage's shares
    expected = adaptive_strengths(real[:, best], 0.6, 50.0).tolist()
    assert found.strengths == expected
    assert len(expected) == len(state.layers) and any(b > 0 for b in expected)
    by_hand = state
    for layer, b in enumerate(expected):
        if b > 0:
            by_hand = ops.emphasize(by_hand, [found.passages[best]], b, layers=[layer])
    assert torch.equal(found.state.last_logits, by_hand.last_logits)
    assert not torch.equal(found.state.last_logits, state.last_logits)
    assert found.generate(3) == by_hand.generate(question, 3)


def test_calibration_removes_the_questions_distinctive_words(llama):
    state = _state(llama)
    question = "\n\nQuestion: What is Bo's number?<|im_end|>\n"
    ranges = split_passages(state)
    free = content_free_question("Question: What is Bo's number?", _texts(state, ranges))
    assert free == "Question: What is 's number?"
    real, calib = passage_shares(state, question, ranges)
    expected = attention_share(state, question.replace("Bo", "", 1), ranges).per_layer
    torch.testing.assert_close(calib, expected)
    torch.testing.assert_close(real, attention_share(state, question, ranges).per_layer)


def test_scores_cancel_positional_bias():
    calib = torch.tensor([0.5, 0.1, 0.1, 0.1]).expand(4, 4).clone()
    real = calib.clone()
    real[:, 0] *= 1.1  # the positional favourite stays the most attended passage
    real[2:, 3] *= 2.0  # the question lifts passage 3 in the upper layers
    real[:2, 1] *= 2.0  # ... and passage 1 in the lower ones
    assert int(passage_scores(real, calib, [2, 3]).argmax()) == 3
    assert int(passage_scores(real, calib, [0, 1]).argmax()) == 1


def test_a_passage_is_scored_only_on_the_layers_that_hold_it():
    # [6 layers, 3 passages]; passage 0 lies before the sliding windows of layers 0-4: both
    # queries give it 0 there, and only the global layer 5 says anything about it.
    calib = torch.full((6, 3), 0.2)
    calib[:5, 0] = 0.0
    real = calib.clone()
    real[5, 0] = 0.6  # the question triples passage 0's share on the layer that holds it
    real[:, 2] = 0.3  # ... and lifts passage 2 by half on every layer
    scores = passage_scores(real, calib, smoothing=0.5)
    eps = 0.5 * float(calib[calib > 0].mean())
    expected0 = torch.log(torch.tensor(0.6 + eps)) - torch.log(torch.tensor(0.2 + eps))
    expected2 = torch.log(torch.tensor(0.3 + eps)) - torch.log(torch.tensor(0.2 + eps))
    torch.testing.assert_close(scores[0], expected0.float())
    torch.testing.assert_close(scores[2], expected2.float())
    assert int(scores.argmax()) == 0  # averaging the five zeros in would make it 2
    # a passage that no layer holds says nothing: 0
    calib[:, 1] = 0.0
    real[:, 1] = 0.0
    assert float(passage_scores(real, calib)[1]) == 0.0


def test_sliding_window_layers_do_not_dilute_an_early_passage(gemma3):
    model, tok = gemma3
    lines = [f"Person{i}'s secret number is {1000 + 7 * i}." for i in range(12)]
    state = _state(gemma3, "\n".join(lines))
    assert len(state) > TINY_SLIDING_WINDOW + 10
    question = "\n\nQuestion: What is Person0's secret number?"
    ranges = [(state.text.index(line), state.text.index(line) + len(line)) for line in lines]
    real, calib = passage_shares(state, question, ranges)
    sliding = [i for i, layer in enumerate(state.layers) if layer.window is not None]
    assert sliding and float(real[sliding, 0].abs().max()) == 0.0  # out of every window
    glob = [i for i, layer in enumerate(state.layers) if layer.window is None]
    eps = 0.5 * float(calib[(real > 0) | (calib > 0)].double().mean())
    on_global = torch.log(real[glob, 0].double() + eps) - torch.log(calib[glob, 0].double() + eps)
    torch.testing.assert_close(passage_scores(real, calib)[0], on_global.mean().float())


def test_fixed_strength_without_a_target(llama):
    state = _state(llama)
    found = kvedit.focus(
        state, "\n\nQuestion: Bo?", target=None, max_strength=3.0, guard=None, threshold=None
    )
    assert found.strengths == [3.0] * len(state.layers)
    by_hand = ops.emphasize(state, [found.passages[found.chosen[0]]], 3.0)
    assert torch.equal(found.state.last_logits, by_hand.last_logits)


def test_explain_is_a_readable_table(llama):
    state = _state(
        llama, "Intro.\n\n" + "A very long record that goes on and on and on and on.\nShort."
    )
    question = "\n\nQuestion: Short?"
    found = kvedit.focus(state, question, top_k=2, threshold=None, guard=None)
    text = found.explain()
    lines = text.splitlines()
    assert len(lines) == 1 + len(found.passages) and "score" in lines[0]
    assert "A very long record that goes on and o..." in text  # 40 characters at most
    for i, line in enumerate(lines[1:]):
        assert line.split()[0] == str(i) and f"{found.scores[i]:.3f}" in line
        assert line.rstrip().endswith("*") == (i in found.chosen)
    # with a guard, one more line says what the guard decided, and the state follows it. A
    # fixed strength of 10 changes the first answer token; a margin below any joint
    # log-probability difference keeps that edit, one above drops it
    kw = dict(top_k=2, target=None, max_strength=10.0, threshold=None)
    edited = kvedit.focus(state, question, guard=None, **kw).state
    assert edited.answer(question, 1).token_ids != state.answer(question, 1).token_ids
    for guard, kept in [(AgreementGuard(margin=-1e9), True), (AgreementGuard(margin=1e9), False)]:
        guarded = kvedit.focus(state, question, guard=guard, **kw)
        v = guarded.verdict
        assert guarded.kept == v.kept == kept
        assert (v.reason, v.step) == ("edit" if kept else "original", 0)
        said = "the edit's answer won" if kept else "the unedited answer won"
        where = f"at answer token 0, margin {v.margin:.2f}"
        table = guarded.explain().splitlines()
        assert table[:-1] == lines  # the same table, then the verdict
        assert table[-1] == f"edit {'kept' if kept else 'dropped'}: {said} {where}"
        answers = edited if kept else state
        assert (guarded.state is state) != kept  # dropped: the input state answers
        assert torch.equal(guarded.state.last_logits, answers.last_logits)
        assert guarded.generate(8) == answers.generate(question, 8)
    # an edit that leaves the answer as it was is kept, and explain says so
    agreed = kvedit.focus(state, question, top_k=2, guard=AgreementGuard(), threshold=None)
    assert agreed.verdict.reason == "agree" and agreed.kept
    assert agreed.explain().splitlines()[-1] == "edit kept: same answer with and without it"
    # the default guard (SupportGuard) says how much of the unedited answer the passage holds
    default = kvedit.focus(state, question, top_k=2, threshold=None)
    assert isinstance(default.verdict.support, float)
    said = (
        f"{default.verdict.support:.0%} of the unedited answer's telling words are in the passage"
    )
    verdict = "kept" if default.kept else "dropped"
    assert default.explain().splitlines()[-1] == f"edit {verdict}: {said}"
    assert torch.equal(agreed.state.last_logits, found.state.last_logits)


def test_focus_is_frozen_and_guarded_returns_a_new_one(llama):
    state = _state(llama)
    question = "\n\nQuestion: What is Bo's number?"
    found = kvedit.choose(state, question, threshold=None)
    assert found.chosen and found.verdict is None and found.state is state
    for name, value in [("state", state), ("verdict", None), ("chosen", [])]:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(found, name, value)
    edited = ops.emphasize(state, [found.passages[found.chosen[0]]], found.strengths)
    unguarded = guarded(found, edited, None)
    assert unguarded is not found and unguarded.state is edited and unguarded.kept

    class Refuse:  # a guard of one's own, returning the common Verdict
        def decide(
            self, original, edited, continuation, *, evidence=(), others=(), query=None, outside=""
        ):
            return Verdict(False, "refused here", original.answer(continuation, 3))

    dropped = guarded(found, edited, Refuse())
    assert dropped.state is state and not dropped.kept and dropped.verdict.reason == "refused here"
    assert dropped.explain().splitlines()[-1] == "edit dropped: refused here"
    assert dropped.generate(3) == state.generate(question, 3)
    # found itself is as choose returned it
    assert found.state is state and found.verdict is None
    assert dataclasses.replace(dropped, verdict=None, state=state) == found
    abstained = dataclasses.replace(found, chosen=[])
    assert guarded(abstained, edited, Refuse()) is abstained


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(passages="words"), InvalidInputError, "unknown splitter"),
        (dict(passages=0), InvalidInputError, "passages"),
        (dict(passages=1.5), InvalidTypeError, "spans must be"),
        (dict(top_k=0), InvalidInputError, "top_k"),
        (dict(top_k=5), InvalidInputError, "top_k"),
        (dict(target=1.0), InvalidInputError, "target share"),
        (dict(target=0.0), InvalidInputError, "target share"),
        (dict(max_strength=-1.0), InvalidInputError, "max_strength"),
        (dict(layers=[99]), InvalidInputError, "out of range"),
        (dict(query="absent"), InvalidInputError, "query"),
    ],
)
def test_bad_inputs_raise_named_errors(llama, kwargs, error, match):
    state = _state(llama)
    with pytest.raises(error, match=match):
        kvedit.focus(state, "\n\nQuestion: Bo?", **kwargs)


def test_empty_inputs(llama):
    state = _state(llama)
    with pytest.raises(InvalidInputError, match="question"):
        kvedit.focus(state, "")
    blank = _state(llama, "   ")
    with pytest.raises(EmptySelectionError):
        kvedit.focus(blank, "\n\nQuestion: Bo?")
    model, tok = llama
    with pytest.raises(InvalidInputError, match="must not contain"):
        kvedit.focus_text(model, tok, "a\n\nQuestion: b", "c")


@pytest.mark.real
def test_focus_text_chooses_the_gold_record(smollm2):
    """The records task through focus_text: the passage chosen is the gold record (after the
    instruction), and the prompt is the evaluation suite's."""
    model, tok = smollm2
    for ex in records_examples(n_records=8, positions=(1, 6), trials=1, seed=0):
        context = ex.instruction + "\n\n" + ex.separator.join(ex.documents)
        assert context + "\n\nQuestion: " + ex.question == ex.user_message()
        found = kvedit.focus_text(model, tok, context, ex.question)
        texts = _texts(found.state, found.passages)
        assert texts == [ex.instruction, *ex.documents]
        assert found.chosen == [ex.gold_index + 1], found.explain()
        assert ex.answers[0] in found.generate(12)


@pytest.mark.real
def test_the_first_record_does_not_lose_to_a_neighbour(smollm2):
    """Do no harm at an edge (records seed 1, a tuning example): the model already answers
    the first record right. Unsmoothed scores (1e-6) chose record 2, from tiny shares in the
    attention trough, and emphasizing it broke the answer; the smoothed scores choose the
    first record, and the edit keeps the right answer."""
    from kvedit.evals.methods import ExampleContext
    from kvedit.focusing.choice import passage_scores

    model, tok = smollm2
    ex = records_examples(positions=(0,), trials=4, seed=1)[3]
    assert ex.id == "records-s1-t3-p0" and ex.answers == ("5181",)
    ctx = ExampleContext(model, tok, ex)
    assert "5181" in ctx.state.generate(ctx.continuation, 16)  # right without any edit
    real, calib = passage_shares(ctx.state, ctx.continuation, ctx.doc_spans, query=ex.question)
    unsmoothed = int(passage_scores(real, calib, smoothing=1e-6).argmax())
    assert unsmoothed == 2
    found = kvedit.focus(ctx.state, ctx.continuation, ctx.doc_spans, query=ex.question)
    assert found.chosen == [0]
    assert "5181" in found.generate(16)
    harmed = ops.emphasize(ctx.state, [ctx.doc_spans[unsmoothed]], found.strengths)
    assert "5181" not in harmed.generate(ctx.continuation, 16)  # the edit that would hurt
