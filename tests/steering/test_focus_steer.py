"""``kvedit.steer(focus=True)``, ``capture_tokens`` and ``runtime.detached``: focus on the
``model.generate`` path answers exactly as :func:`kvedit.focus` does on the same cut."""

from __future__ import annotations

import pytest
import torch

import kvedit
from kvedit.errors import InvalidInputError, NestedSteeringError
from kvedit.focusing.readout import attention_share
from kvedit.runtime import active_plan, detached
from kvedit.states.capturing import capture_tokens

CONTEXT = "Read the records.\n\nAnn's number is 11.\nBo's number is 22.\nCy's number is 33."
QUESTION = "What is Bo's number?"


def _prompt(tok):
    return kvedit.templated_prompt(tok, CONTEXT + "\n\nQuestion: " + QUESTION)


def test_capture_tokens_equals_capture(llama):
    model, tok = llama
    text = _prompt(tok)
    by_text = kvedit.capture(model, tok, text)
    by_ids = capture_tokens(model, tok, tok(text)["input_ids"])
    assert torch.equal(by_ids.token_ids, by_text.token_ids)
    assert torch.equal(by_ids.last_logits, by_text.last_logits)
    for a, b in zip(by_ids.layers, by_text.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    span = "Bo's number is 22."
    assert torch.equal(by_ids.token_indices(span), by_text.token_indices(span))


def test_detached_lets_kvedit_run_inside_a_steer_block(llama):
    model, tok = llama
    plain = kvedit.capture(model, tok, CONTEXT)
    with kvedit.steer(model, tok, emphasize="Bo") as s:
        with pytest.raises(NestedSteeringError):
            attention_share(plain, "Bo?", "Bo")
        steered = kvedit.capture(model, tok, CONTEXT)  # a capture inside the block is steered
        assert not torch.equal(steered.last_logits, plain.last_logits)
        with detached(model):
            assert active_plan(model) is None
            attention_share(plain, "Bo?", "Bo")  # its own plan, no error
            again = kvedit.capture(model, tok, CONTEXT)
        assert torch.equal(again.last_logits, plain.last_logits)
        assert active_plan(model) is s.plan


@pytest.mark.parametrize("max_strength", [5.0, 50.0])
def test_wrapper_answers_like_focus_on_the_same_cut(llama, max_strength):
    model, tok = llama
    prompt = _prompt(tok)
    s = kvedit.steer(model, tok, focus=True, question=QUESTION, threshold=None)
    out = s.generate(prompt, max_new_tokens=8)
    found = s.plan.found
    assert found is not None and len(found.strengths) == len(found.state.layers)
    # the same cut by hand: the prompt's tokens up to the question's line (less the blank
    # line before it), then kvedit.focus on the user turn
    ids = tok(prompt)["input_ids"]
    cut = prompt.rindex("\n\nQuestion: " + QUESTION)
    offsets = tok(prompt, return_offsets_mapping=True)["offset_mapping"]
    n = sum(1 for _, b in offsets if b <= cut)
    state = capture_tokens(model, tok, ids[:n])
    region = (state.text.index(CONTEXT), len(state.text))  # the user turn, not the template
    again = kvedit.focus(state, tok.decode(ids[n:]), query=QUESTION, region=region, threshold=None)
    texts = [state.text[a:b] for a, b in found.passages]
    assert texts == ["Read the records.", *CONTEXT.split("\n\n")[1].split("\n")]
    assert again.chosen == found.chosen and again.strengths == found.strengths
    assert again.kept == found.kept
    assert out == again.generate(8)


def test_wrapper_with_the_guard_off_equals_the_edit(llama):
    """Without a guard verdict to lean on, the steered decode equals the edited cache."""
    model, tok = llama
    prompt = _prompt(tok)
    s = kvedit.steer(model, tok, focus=True, question=QUESTION, threshold=None)
    out = s.generate(prompt, max_new_tokens=6)
    found = s.plan.found
    spans = [found.passages[i] for i in found.chosen]
    edited = kvedit.ops.emphasize(
        capture_tokens(model, tok, found.state.token_ids), spans, found.strengths
    )
    expected = (edited if found.kept else found.state).generate(found.question, 6)
    assert out == expected


def test_context_manager_around_model_generate(llama):
    model, tok = llama
    prompt = _prompt(tok)
    s = kvedit.steer(model, tok, focus=True, question=QUESTION, threshold=None)
    wrapped = s.generate(prompt, max_new_tokens=6)
    enc = tok(prompt, return_tensors="pt")
    with kvedit.steer(model, tok, focus=True, question=QUESTION, threshold=None) as t:
        out = model.generate(**enc, max_new_tokens=6, do_sample=False)
    assert t.plan.found.chosen == s.plan.found.chosen
    assert tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True) == wrapped


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(question=None), "needs question"),
        (dict(question=QUESTION, emphasize="Bo"), "drop emphasize"),
        (dict(question=QUESTION, layers=[0]), "drop layers"),
        (dict(question=QUESTION, scope="all"), "scope 'decode'"),
        (dict(question=QUESTION, top_k=0), "top_k"),
        (dict(question=""), "question"),
    ],
)
def test_bad_focus_arguments(llama, kwargs, match):
    model, tok = llama
    with pytest.raises(InvalidInputError, match=match):
        kvedit.steer(model, tok, focus=True, **kwargs)


def test_question_must_be_in_the_prompt_and_one_prompt_at_a_time(llama):
    model, tok = llama
    s = kvedit.steer(model, tok, focus=True, question="Who is Zed?")
    with pytest.raises(InvalidInputError, match="not in the prompt"):
        s.generate(_prompt(tok))
    with pytest.raises(InvalidInputError, match="no context before"):
        kvedit.steer(model, tok, focus=True, question="Read").generate("Read the records.")
    enc = tok([_prompt(tok)] * 2, return_tensors="pt")
    steering = kvedit.steer(model, tok, focus=True, question=QUESTION)
    with pytest.raises(InvalidInputError, match="one prompt at a time"), steering:
        model.generate(**enc, max_new_tokens=2, do_sample=False)


def test_a_guard_that_drops_the_edit_leaves_the_prompt_unsteered(llama):
    from kvedit.focusing.guard import AgreementGuard

    model, tok = llama
    prompt = _prompt(tok)
    enc = tok(prompt, return_tensors="pt")
    plain = model.generate(**enc, max_new_tokens=6, do_sample=False)
    unsteered = tok.decode(plain[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    # passages that do not name Bo: on this random model, emphasizing one changes the answer
    others = ["Ann's number is 11.", "Cy's number is 33."]
    keep = kvedit.steer(model, tok, focus=True, question=QUESTION, threshold=None, passages=others)
    assert keep.generate(prompt, max_new_tokens=6) != unsteered  # the edit changes the answer
    drop = kvedit.steer(
        model,
        tok,
        focus=True,
        question=QUESTION,
        guard=AgreementGuard(1e9, max_new_tokens=6),
        threshold=None,
        passages=others,
    )
    assert drop.generate(prompt, max_new_tokens=6) == unsteered
    assert not drop.plan.found.kept and drop.plan.found.verdict.reason == "original"
    with pytest.raises(kvedit.errors.InvalidTypeError, match="guard"):
        kvedit.steer(model, tok, focus=True, question=QUESTION, guard="strict")
