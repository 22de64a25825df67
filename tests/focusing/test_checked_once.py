"""One check per input: the focusing package checks each argument of kvedit.focus, choose and
focus_text once, at the public entry, and hands typed values inward (issue #58).

Counted by wrapping the validators every check goes through (:func:`kvedit.checks.text` for a
text, :func:`kvedit.checks.call_refusal` for a guard's ``decide``), keeping only the calls made
from ``kvedit.focusing``'s modules (``KVState.encode``, which tokenizes the question with its
own check of what it is given, is the state's entry, not focus's).
"""

from __future__ import annotations

import sys

import pytest

import kvedit
from kvedit import checks
from kvedit.errors import InvalidInputError, InvalidTypeError
from kvedit.focusing.guard import SupportGuard

CONTEXT = "Read the records.\n\nAnn's number is 11.\nBo's number is 22.\nCy's number is 33."
QUESTION = "What is Bo's number?"


@pytest.fixture
def counted(monkeypatch):
    """The checks made from kvedit.focusing: ``(validator, name)`` per call, in order."""
    calls: list[tuple[str, str]] = []

    def counting(validator):
        real = getattr(checks, validator)

        def wrapper(*args, **kw):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith("kvedit.focusing"):
                calls.append((validator, args[0] if validator == "text" else "guard"))
            return real(*args, **kw)

        return wrapper

    for validator in ("text", "call_refusal"):
        monkeypatch.setattr(checks, validator, counting(validator))
    return calls


@pytest.fixture
def state(llama):
    model, tok = llama
    prefix, _ = kvedit.chat_prefix(tok, CONTEXT + "\n\nQuestion: x", "\n\nQuestion:")
    return kvedit.capture(model, tok, prefix)


def test_focus_checks_the_question_and_the_guard_once(state, counted):
    kvedit.focus(state, QUESTION, guard=SupportGuard(), threshold=None)
    assert counted == [("call_refusal", "guard"), ("text", "question")]


def test_focus_checks_a_given_query_once(state, counted):
    kvedit.choose(state, "Tell me. " + QUESTION, query=QUESTION)
    assert counted == [("text", "question"), ("text", "query")]


def test_focus_text_checks_the_context_the_question_and_the_guard_once(llama, counted):
    model, tok = llama
    kvedit.focus_text(model, tok, CONTEXT, QUESTION, guard=SupportGuard(), threshold=None)
    assert counted == [("text", "context"), ("text", "question"), ("call_refusal", "guard")]


@pytest.mark.parametrize("prompt", ["chat", "plain"])
def test_publish_checks_the_guard_and_the_question_once(llama, counted, tmp_path, prompt):
    """``kvedit publish --focus``: the guard refused before the capture, and not again."""
    from kvedit.integrations.vllm.contexts import publish_context

    model, tok = llama
    publish_context(
        model,
        tok,
        CONTEXT,
        tmp_path,
        focus_on=QUESTION,
        guard=SupportGuard(),
        prompt=prompt,
        approximate=True,
    )
    name = "question" if prompt == "chat" else "query"
    assert counted == [("call_refusal", "guard"), ("text", name)]


def test_the_refusals_at_the_entry_are_as_before(state, llama):
    """What a caller sees of a bad question or query did not change."""
    with pytest.raises(InvalidTypeError, match="question must be a str, not"):
        kvedit.focus(state, 7)
    with pytest.raises(InvalidInputError, match="question is empty"):
        kvedit.focus(state, "")
    with pytest.raises(InvalidInputError, match="question '\\?!' has no content"):
        kvedit.focus(state, "?!")
    with pytest.raises(InvalidInputError, match="query '\\.\\.' has no content"):
        kvedit.focus(state, QUESTION, query="..")
    with pytest.raises(InvalidInputError, match="is not part of the question"):
        kvedit.focus(state, QUESTION, query="Cy?")
    with pytest.raises(InvalidInputError, match="top_k must be <= 4, not 9"):
        kvedit.choose(state, QUESTION, top_k=9)
    model, tok = llama
    with pytest.raises(InvalidInputError, match="question ' ' has no content"):
        kvedit.focus_text(model, tok, CONTEXT, " ")
