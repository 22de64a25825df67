"""Publish a context (a document, a set of passages), edited, and say what a client sends.

:func:`publish_context` is what ``kvedit publish`` runs: it captures the context the way the
evaluation suite and :func:`kvedit.focus_text` prompt it (the chat template with one
user turn ``context + "\\n\\nQuestion: " + question``, cut before ``"\\n\\nQuestion:"``; or,
for a base model, the plain context), edits it (:func:`kvedit.focus` for a question, then any
``emphasize``/``suppress``/``duplicate`` spans), publishes it (:func:`publish_stock`) and
returns a :class:`PublishedPrompt`: the token ids to send to a server
``kvedit serve`` started (OpenAI completions API, ``"prompt": [ids]``), and the body of such a
request.

A client sends ``published_token_ids`` followed by the token ids of ``continuation`` (the
question in the prompt format); with ``question`` given, ``prompt_token_ids`` is that whole
prompt. Without a question, ``continuation`` is a template with ``{question}`` in it.
What is published follows the rule of :mod:`~kvedit.integrations.vllm.servable`, before
anything is written: an edit realised exactly is published; one realised only approximately
(an ``emphasize`` strength that is not ``log(r + 1)``, :func:`kvedit.focus`'s per-layer
strengths, biases on sliding-window layers) only with ``approximate=True`` (``kvedit publish
--approximate``), labelled in the state's history; one nothing of which a stock kernel realises
(a ``suppress`` by less than :data:`~kvedit.integrations.vllm.REMOVE_AT` nats, an ``emphasize``
below ``log 1.5`` nats) never: the server would answer from the unedited entries.

The request names the published state's digest (``kv_transfer_params``, :attr:`PublishedPrompt.
digest`) and stops where kvedit's own decoding stops (``stop_token_ids``, vLLM's own EOS
handling off); a client checks ``kv_transfer_params["kvedit"]`` in the response: ``digest`` is
the digest it named and ``served == served``; anything else means the server did not answer
from this file (another root, a refused file) and the answer is not the edited cache's.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ... import ops
from ...errors import InvalidInputError
from ...focusing.choice import DEFAULT_GUARD, content_question, focused, text_focused
from ...focusing.guard import Guard
from ...focusing.options import focus_options, query_name
from ...prompts import ANSWER_CUE, PROMPT_FORMATS, QUESTION_MARK, QUESTION_SEPARATOR, chat_prefix
from ...states.capturing import capture
from ...states.decoding import eos_ids
from .publishing import kv_transfer_params, publish_stock

__all__ = ["PublishedPrompt", "publish_context"]

PLACEHOLDER = "{question}"


@dataclass(frozen=True)
class PublishedPrompt:
    """What to send for a published context.

    Attributes:
        model: the served model name the request names.
        file: the published file.
        digest: the published state's digest (an approximation step included): what the
            request names in ``kv_transfer_params`` and the response echoes.
        published_token_ids: the ids the server serves from the file (one per cache slot).
        continuation: the text after them: the question in the prompt format, or with no
            question a template containing ``{question}``.
        prompt_token_ids: ``published_token_ids`` + the continuation's ids (None without a
            question).
        question: the question, or None.
        exact: whether vLLM attends over the file exactly as kvedit attends over the edited
            state (:attr:`~kvedit.integrations.vllm.StockCache.exact`); False only when
            ``approximate=True`` was asked.
        report: the realisation report (slots, shift, each bias asked vs realised).
        chosen: the passages :func:`kvedit.focus` emphasized (text), if it ran.
        served: the prompt tokens the server must report serving from the file
            (``kv_transfer_params["kvedit"]["served"]``): all of ``published_token_ids``.
        stop_token_ids: where kvedit's decoding stops (the model's EOS ids).
    """

    model: str
    file: str
    digest: str
    published_token_ids: list[int]
    continuation: str
    prompt_token_ids: list[int] | None
    question: str | None
    exact: bool
    report: str
    chosen: list[str]
    served: int
    stop_token_ids: list[int]

    def request(self, max_tokens: int = 32) -> dict[str, Any]:
        """The JSON body of a greedy ``POST /v1/completions`` for the whole prompt: it names
        the published state's digest (``kv_transfer_params``), stops at kvedit's EOS ids only
        and asks for the token ids back.

        Raises:
            InvalidInputError: no question was given (the prompt is not complete).
        """
        if self.prompt_token_ids is None:
            raise InvalidInputError(
                "no question was given: send published_token_ids followed by the ids of "
                "the continuation with your question"
            )
        return {
            "model": self.model,
            "prompt": self.prompt_token_ids,
            "max_tokens": int(max_tokens),
            "temperature": 0.0,
            "ignore_eos": True,
            "stop_token_ids": list(self.stop_token_ids),
            "return_token_ids": True,
            "kv_transfer_params": kv_transfer_params(self.digest),
        }

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict (what ``kvedit publish`` prints)."""
        return asdict(self)


def _prefix(tokenizer, context: str, question: str, prompt: str) -> tuple[str, str]:
    if prompt == "chat":
        return chat_prefix(tokenizer, context + QUESTION_SEPARATOR + question, QUESTION_MARK)
    return context, QUESTION_SEPARATOR + question + ANSWER_CUE


def publish_context(
    model,
    tokenizer,
    context: str,
    root: str | os.PathLike,
    *,
    question: str | None = None,
    focus_on: str | None = None,
    emphasize: Sequence[str] = (),
    suppress: Sequence[str] = (),
    duplicate: Sequence[str] = (),
    strength: float = 2.0,
    suppress_strength: float = 1e4,
    copies: int = 3,
    prompt: str = "chat",
    served_model_name: str = "",
    approximate: bool = False,
    guard: Guard | None = DEFAULT_GUARD,
    max_positions: int | None = None,
) -> PublishedPrompt:
    """Capture ``context``, edit it, publish it under ``root``; returns what to send.

    Args:
        context: the text (documents, passages) to publish.
        question: the question a request asks (optional; ``focus_on`` sets it too).
        focus_on: a question: :func:`kvedit.focus` emphasizes the passage it points at.
        emphasize, suppress, duplicate: substrings of ``context`` to edit (each occurrence),
            after any focus; with ``strength`` nats, ``suppress_strength`` nats (at least
            :data:`~kvedit.integrations.vllm.REMOVE_AT`: removal), ``copies`` extra copies.
        prompt: ``"chat"`` (the chat template) or ``"plain"`` (base models).
        served_model_name: the model name requests give (``kvedit serve`` serves the kvedit
            model name).
        approximate: publish an edit vLLM realises only approximately, labelled (see
            :mod:`~kvedit.integrations.vllm.servable`).
        max_positions: the most positions the model attends to (None: its config's), for the
            capture and every edit after it (:attr:`kvedit.KVState.max_positions`).
        guard: with ``focus_on``, the answer guard :func:`kvedit.focus` applies (default
            :data:`kvedit.focusing.choice.DEFAULT_GUARD`: no edit where the unedited answer already
            comes from the chosen passage; then nothing is chosen); ``None``: none.

    Raises:
        InvalidInputError: empty context, a question differing from ``focus_on``, a context
            containing ``"\\n\\nQuestion:"``, an unknown prompt format, or an edit vLLM
            realises only approximately (without ``approximate``) or not at all (nothing is
            published then).
        SpanNotFoundError: a span is not in the context.
        InvalidTypeError: ``guard`` has no ``decide``.
    """
    if not isinstance(context, str) or not context.strip():
        raise InvalidInputError("the context is empty")
    if QUESTION_MARK in context:
        raise InvalidInputError(f"the context must not contain {QUESTION_MARK!r}: it is cut there")
    if prompt not in PROMPT_FORMATS:
        raise InvalidInputError(
            f"unknown prompt format {prompt!r}; choose one of {', '.join(PROMPT_FORMATS)}"
        )
    if focus_on is not None and question is not None and focus_on != question:
        raise InvalidInputError("--focus and --question name different questions")
    options = focus_options(guard=guard)  # the guard, checked once
    question = focus_on if focus_on is not None else question
    prefix, continuation = _prefix(tokenizer, context, question or PLACEHOLDER, prompt)
    chosen: list[str] = []
    if focus_on is not None and prompt == "chat":
        asked_for = content_question("question", focus_on)
        found = text_focused(
            model, tokenizer, context, asked_for, options, max_positions=max_positions
        )
        state = found.state
    elif focus_on is not None:
        # focus_on is a str (_prefix joined it), so query_name can read it
        query = content_question(query_name(continuation, focus_on), focus_on)
        state = capture(model, tokenizer, prefix, max_positions=max_positions)
        found = focused(state, continuation, query, None, options, region=(0, len(context)))
        state = found.state
    else:
        state = capture(model, tokenizer, prefix, max_positions=max_positions)
    if focus_on is not None and found.kept:  # a guard that dropped the edit chose nothing
        chosen = [state.text[a:b] for a, b in (found.passages[i] for i in found.chosen)]
    if emphasize:
        state = ops.emphasize(state, list(emphasize), strength)
    if suppress:
        state = ops.suppress(state, list(suppress), suppress_strength)
    if duplicate:
        state = ops.duplicate(state, list(duplicate), copies)
    # the rule of servable (before anything is written), then the file
    ids, stock, path = publish_stock(state, root, approximate=approximate)
    full = None if question is None else ids + list(state.encode(continuation))
    return PublishedPrompt(
        model=served_model_name,
        file=str(Path(path).resolve()),
        digest=ids.digest,
        published_token_ids=list(ids),
        continuation=continuation,
        prompt_token_ids=full,
        question=question,
        exact=stock.exact,
        report=stock.report(),
        chosen=chosen,
        served=len(ids),
        stop_token_ids=sorted(eos_ids(model, tokenizer)),
    )
