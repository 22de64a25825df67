"""kvedit.prompts: the question convention, and a prompt cut after the context."""

from __future__ import annotations

import pytest

from kvedit.errors import SpanNotFoundError
from kvedit.evals.methods import split_prompt
from kvedit.evals.tasks import records_examples
from kvedit.prompts import QUESTION_LABEL, QUESTION_MARK, QUESTION_SEPARATOR, split_user_message


def test_the_question_convention_is_one_set_of_strings():
    assert QUESTION_SEPARATOR == "\n\nQuestion: " == "\n\n" + QUESTION_LABEL
    assert QUESTION_MARK == "\n\nQuestion:" and QUESTION_SEPARATOR.startswith(QUESTION_MARK)
    ex = records_examples(n_records=3, positions=(1,), trials=1, seed=0)[0]
    context = ex.user_message()[: ex.documents_end()]
    assert ex.user_message() == context + QUESTION_SEPARATOR + ex.question


def test_split_user_message_cuts_inside_the_message_where_the_prompt_holds_it():
    full = "<s>user\nctx one" + QUESTION_SEPARATOR + "q?</s>"
    user = "ctx one" + QUESTION_SEPARATOR + "q?"
    prefix, continuation, start = split_user_message(full, user, len("ctx one"))
    assert (prefix, continuation, start) == ("<s>user\nctx one", QUESTION_SEPARATOR + "q?</s>", 8)
    with pytest.raises(SpanNotFoundError, match="does not hold the user message"):
        split_user_message(full.upper(), user, 3)


def test_the_evals_split_is_the_cut_of_the_user_message():
    class Plain:  # a base model's tokenizer: no chat template, no BOS text
        chat_template = None
        bos_token = None

    ex = records_examples(n_records=3, positions=(1,), trials=1, seed=0)[0]
    prefix, continuation, spans = split_prompt(Plain(), ex, "plain")
    cut = split_user_message(ex.user_message() + "\nAnswer:", ex.user_message(), ex.documents_end())
    assert (prefix, continuation) == cut[:2] and continuation.startswith(QUESTION_MARK)
    assert [prefix[a:b] for a, b in spans] == list(ex.documents)
