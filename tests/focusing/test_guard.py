"""Answers with log-probabilities, lockstep decoding, and the answer guard (kvedit.focusing.guard)."""

from __future__ import annotations

import pytest
import torch

import kvedit
from kvedit import ops
from kvedit.errors import InvalidInputError, KVEditError
from kvedit.focusing.guard import AgreementGuard, AgreementVerdict, SupportVerdict, Verdict

CONTEXT = "Read the records.\n\nAnn's number is 11.\nBo's number is 22.\nCy's number is 33."
QUESTION = "\n\nQuestion: What is Bo's number?"


def _state(llama):
    model, tok = llama
    return kvedit.capture(model, tok, CONTEXT)


def test_answer_is_generate_with_log_probs(llama):
    state = _state(llama)
    ans = state.answer(QUESTION, 7)
    assert ans.text == state.generate(QUESTION, 7)
    assert len(ans.token_ids) == len(ans.logprobs) <= 7
    torch.testing.assert_close(
        torch.tensor(ans.logprobs), torch.tensor(state.token_logprobs(QUESTION, ans.token_ids))
    )
    assert all(lp <= 0 for lp in ans.logprobs)
    assert ans.confidence() == pytest.approx(sum(ans.logprobs) / len(ans.logprobs))
    assert ans.confidence(1) == pytest.approx(ans.logprobs[0])


def test_finished_tells_eos_from_the_length_limit(llama):
    state = _state(llama)
    cut = state.answer(QUESTION, 3, eos_token_id=[])
    assert not cut.finished and len(cut.token_ids) == 3
    eos = cut.token_ids[1]
    ended = state.answer(QUESTION, 3, eos_token_id=eos)
    assert ended.finished and ended.token_ids == cut.token_ids[: cut.token_ids.index(eos)]


def _guard_case(llama, strength):
    state = _state(llama)
    start = state.text.index("Ann's")
    return state, ops.emphasize(state, [(start, start + 19)], strength)


def test_an_identity_edit_agrees(llama):
    state, edited = _guard_case(llama, 0.0)
    verdict = AgreementGuard(max_new_tokens=6).decide(state, edited, QUESTION)
    assert verdict.kept and verdict.reason == "agree" and verdict.step is None
    assert type(verdict) is AgreementVerdict and isinstance(verdict, Verdict)
    assert not hasattr(verdict, "support") and verdict.margin == 0.0
    assert verdict.answer.text == state.generate(QUESTION, 6)


@pytest.mark.parametrize("strength", [3.0, 8.0, 20.0])
def test_the_verdict_is_the_joint_log_prob_where_the_answers_first_differ(llama, strength):
    state, edited = _guard_case(llama, strength)
    guard = AgreementGuard(max_new_tokens=8)
    verdict = guard.decide(state, edited, QUESTION)
    a = state.answer(QUESTION, 8, eos_token_id=[]).token_ids
    b = edited.answer(QUESTION, 8, eos_token_id=[]).token_ids
    step = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
    assert verdict.step == step
    if step is None:
        return
    common = a[:step]
    # joint log-prob of the edit's token minus the original's, after the common prefix
    margin = (
        state.token_logprobs(QUESTION, [*common, b[step]])[-1]
        + edited.token_logprobs(QUESTION, [*common, b[step]])[-1]
        - state.token_logprobs(QUESTION, [*common, a[step]])[-1]
        - edited.token_logprobs(QUESTION, [*common, a[step]])[-1]
    )
    assert verdict.margin == pytest.approx(margin, abs=1e-4)
    assert verdict.kept == (margin > guard.margin)
    chosen = edited if verdict.kept else state
    assert verdict.answer.text == chosen.generate(QUESTION, 8)


def test_margin_extremes_keep_or_drop_every_differing_edit(llama):
    state, edited = _guard_case(llama, 20.0)
    keep = AgreementGuard(margin=-1e9, max_new_tokens=8).decide(state, edited, QUESTION)
    drop = AgreementGuard(margin=1e9, max_new_tokens=8).decide(state, edited, QUESTION)
    assert keep.reason != "agree", "the strong edit must change the answer for this test"
    assert keep.kept and keep.answer.text == edited.generate(QUESTION, 8)
    assert not drop.kept and drop.answer.text == state.generate(QUESTION, 8)
    # each verdict's log-probs are the chosen state's own, shared prefix included
    for verdict, chosen in ((keep, edited), (drop, state)):
        expected = chosen.token_logprobs(QUESTION, verdict.answer.token_ids)
        torch.testing.assert_close(
            torch.tensor(verdict.answer.logprobs), torch.tensor(expected), atol=1e-4, rtol=0
        )
    with pytest.raises(InvalidInputError):
        AgreementGuard(max_new_tokens=0)


@pytest.mark.parametrize("n", [1, 3, 8, 12])
def test_focus_generate_reuses_the_guards_answer_exactly(llama, n):
    state = _state(llama)
    # threshold=None: a random tiny model has no passage that stands out
    found = kvedit.focus(state, QUESTION, guard=AgreementGuard(max_new_tokens=8), threshold=None)
    assert found.verdict is not None
    assert found.generate(n) == found.state.generate(QUESTION, n)
    assert (found.state is state) == (not found.kept)


def test_token_logprobs_and_capture_tokens_refuse_bad_ids(llama):
    from kvedit.states.capturing import capture_tokens

    model, tok = llama
    state = _state(llama)
    vocab = state.last_logits.shape[-1]
    for bad in ([-1], [vocab], [1.5]):
        with pytest.raises(KVEditError):
            state.token_logprobs(QUESTION, bad)
    ids = torch.tensor([tok(CONTEXT)["input_ids"]])
    assert torch.equal(capture_tokens(model, tok, ids).last_logits, state.last_logits)
    with pytest.raises(InvalidInputError, match="one sequence"):
        capture_tokens(model, tok, ids.repeat(2, 1))


def test_answer_support_counts_the_answers_own_words_found_in_the_evidence():
    from kvedit.focusing.guard import answer_support, content_words

    assert content_words("The answer is: Paris, in 1889!") == ["answer", "paris", "1889"]
    question = "Where was the tower built?"
    # "tower" and "built" are the question's words: only "paris" and "1889" count
    assert answer_support("The tower was built in Paris in 1889.", ["Paris, 1889."], question) == 1
    assert answer_support("Built in Paris in 1890.", ["It rose in Paris in 1889."], question) == 0.5
    assert answer_support("The tower was built.", ["anything"], question) == 0.0  # no own word
    assert answer_support("Paris", [], question) == 0.0
    assert answer_support("Paris", ["Lyon.", "Paris."], question) == 1.0  # any passage


def test_answer_support_leaves_out_the_prompts_own_words_not_a_list_of_them():
    from kvedit.focusing.guard import answer_support

    question = "Who built the tower?"
    answer = "The answer: Eiffel"
    # "answer" is a telling word unless the prompt itself says it outside its passages
    assert answer_support(answer, ["Eiffel built it."], question) == 0.5
    framed = "Answer the question from the documents below.\n"
    assert answer_support(answer, ["Eiffel built it."], question, outside=framed) == 1.0
    # a header word in every passage is common among the others, as before
    docs = [f"Document [{i}] Title: T{i}. Text {i}." for i in range(5)]
    said = "Document [3]: Eiffel"
    assert answer_support(said, ["Eiffel built it."], question, docs) == 1.0
    assert answer_support(said, ["Eiffel built it."], question) == 0.5


def test_answer_support_leaves_out_words_most_other_passages_share():
    from kvedit.focusing.guard import COMMON_SHARE, answer_support

    question = "Which locker code does Yuki have?"
    passage = "Locker assignment: Yuki was given locker code 63800."
    others = [f"Locker assignment: P{i} was given locker code {1000 + i}." for i in range(4)]
    wrong = "Locker assignment: 12637"  # a code from no passage, in the template's words
    assert answer_support(wrong, [passage], question) == 0.5  # "assignment" looks like support
    assert answer_support(wrong, [passage], question, others) == 0.0  # shared: left out
    assert answer_support("Yuki has code 63800.", [passage], question, others) == 0.5  # "has"
    # a word in exactly half the other passages is not shared by most: it still counts
    half = others[:2] + ["Nothing here.", "Nor here."]
    assert COMMON_SHARE == 0.5
    assert answer_support(wrong, [passage], question, half) == 0.5


def test_support_guard_answers_unedited_where_the_answer_comes_from_the_passage(llama):
    from kvedit.focusing.guard import SupportGuard

    state, edited = _guard_case(llama, 8.0)
    unedited = state.answer(QUESTION, 6)
    assert unedited.text.strip() and edited.answer(QUESTION, 6).text != unedited.text
    guard = SupportGuard(max_new_tokens=6)
    # the unedited answer's own words, as the passage the edit raises
    drop = guard.decide(state, edited, QUESTION, evidence=[unedited.text], query="")
    assert not drop.kept and drop.reason == "supported" and drop.support == 1.0
    assert drop.answer == unedited
    keep = guard.decide(state, edited, QUESTION, evidence=["zzz"], query="")
    assert keep.kept and keep.reason == "unsupported" and keep.support == 0.0
    assert keep.answer == edited.answer(QUESTION, 6)
    # each guard's verdict is its own type, with its own fields only
    assert type(drop) is type(keep) is SupportVerdict and isinstance(drop, Verdict)
    assert not hasattr(drop, "step") and not hasattr(drop, "margin")
    # the guard reads the answer as the caller does: here, nothing of it (no support)
    unread = SupportGuard(max_new_tokens=6, read=lambda text: "")
    assert unread.decide(state, edited, QUESTION, evidence=[unedited.text], query="").kept
    with pytest.raises(InvalidInputError, match="threshold"):
        SupportGuard(threshold=1.5)
    with pytest.raises(InvalidInputError, match="shared must be a share"):
        SupportGuard(shared=-0.1)


def test_focus_passes_the_chosen_passages_to_the_guard(llama):
    state = _state(llama)
    seen = []

    class Recorder:
        def decide(
            self, original, edited, continuation, *, evidence=(), others=(), query=None, outside=""
        ):
            seen.append((list(evidence), list(others), query, outside))
            return AgreementGuard(max_new_tokens=4).decide(original, edited, continuation)

    lines = ["Ann's number is 11.", "Bo's number is 22.", "Cy's number is 33."]
    records = [(state.text.index(t), state.text.index(t) + len(t)) for t in lines]
    found = kvedit.focus(
        state, QUESTION, records, guard=Recorder(), threshold=None, query="Bo's number?"
    )
    texts = [state.text[a:b] for a, b in found.passages]
    assert texts == lines
    chosen = [texts[i] for i in found.chosen]
    rest = [t for i, t in enumerate(texts) if i not in found.chosen]
    assert len(rest) == len(texts) - 1 > 0
    assert [s[:3] for s in seen] == [(chosen, rest, "Bo's number?")]
    # the prompt's frame: every character of the state's text outside the passages, in order
    outside = seen[0][3]
    frame = "".join(
        c for i, c in enumerate(state.text) if not any(a <= i < b for a, b in found.passages)
    )
    assert outside.replace("\n", "") == frame.replace("\n", "")
    assert "Read the records." in outside
    assert not any(t in outside for t in texts)
    assert kvedit.focus(state, QUESTION, threshold=None).verdict.support is not None  # default


def test_a_guard_without_decide_is_refused_before_any_work(llama, monkeypatch):
    from kvedit.errors import InvalidTypeError
    from kvedit.focusing import choice as focusing
    from kvedit.focusing.guard import check_guard

    state = _state(llama)
    model, tok = llama
    # focus refuses before it scores anything
    monkeypatch.setattr(focusing, "choose", lambda *a, **k: pytest.fail("scored"))
    with pytest.raises(InvalidTypeError, match="guard must have a decide"):
        kvedit.focus(state, QUESTION, guard="support")
    with pytest.raises(InvalidTypeError, match="guard must have a decide"):
        kvedit.steer(model, tok, focus=True, question="Bo's number?", guard=object())
    monkeypatch.setattr(focusing, "capture", lambda *a, **k: pytest.fail("captured"))
    with pytest.raises(InvalidTypeError, match="guard must have a decide"):
        kvedit.focus_text(model, tok, "Bo's number is 7.", "Bo's number?", guard=print)
    guard = AgreementGuard()
    assert check_guard(guard) is guard and check_guard(None) is None
