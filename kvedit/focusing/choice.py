"""Automatic focus: emphasize the passages a question points at.

The question is run on top of a captured state twice, as asked and with its distinctive words
removed (:func:`content_free_question`: a calibration query that keeps the question's form and
position). Each passage's score is the log ratio of the attention shares the two give it
(each smoothed by :data:`SCORE_SMOOTHING` times the mean share of a passage, so the same default
serves 5 and 500 passages), averaged over the layers that hold the passage (a sliding-window
layer holds only its last tokens): positional bias (lost in the middle, recency, the sink)
appears in both and cancels, the question's content does not.

Focus edits only when a passage stands out (:func:`stands_out`: its robust z-score among the
candidates' scores reaches :data:`ABSTAIN_THRESHOLD`); otherwise it abstains (no edit). A
question with no distinctive word (none of its words is in some but not most passages) gives
no evidence and every score 0; a passage that only restates the question
(:func:`echo_passages`) is never a candidate. The best passages are then emphasized with a
per-layer bias that lifts their share of the question's attention to ``target``
(:func:`adaptive_strengths`), applied with :func:`kvedit.ops.emphasize` (the last token is
recomputed, so the next token sees the edit). An optional answer guard
(:mod:`kvedit.focusing.guard`, applied by :func:`guarded`) may drop the edit.

This is the evaluation method ``auto`` (``kvedit eval litm --methods auto``) as a library call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from .. import checks, ops
from ..cache import refuse_headwise
from ..errors import InvalidInputError
from ..prompts import QUESTION_MARK, QUESTION_SEPARATOR, chat_prefix
from ..states.capturing import capture
from ..states.decoding import Answer
from ..states.state import KVState
from .edits import checked_edit
from .guard import (
    SUPPORT_THRESHOLD,
    Guard,
    check_verdict,
    evidence_and_others,
)
from .options import DEFAULT_GUARD, FocusOptions, asked, focus_options, query_name
from .passages import Range, outside_passages, split_passages
from .primed import PrimedState
from .result import Focus

__all__ = [
    "ABSTAIN_THRESHOLD",
    "DEFAULT_GUARD",
    "SCORE_SMOOTHING",
    "SHARE_EPS",
    "SUPPORT_THRESHOLD",
    "Focus",
    "adaptive_strengths",
    "best_covered",
    "choose",
    "chosen",
    "content_free_question",
    "content_question",
    "echo_passages",
    "focus",
    "focus_text",
    "focused",
    "guarded",
    "passage_scores",
    "passage_shares",
    "robust_z",
    "stands_out",
    "text_focused",
]

from .scoring import (
    ABSTAIN_THRESHOLD,
    SCORE_SMOOTHING,
    SHARE_EPS,
    abstain_reason,
    adaptive_strengths,
    best_covered,
    content_free_question,
    content_question,
    default_query,
    echo_passages,
    part_of,
    passage_scores,
    passage_shares,
    question_shares,
    robust_z,
    sole_holder,
    stands_out,
    with_content,
)


def _layer_indices(state: KVState, layers) -> list[int] | None:
    chosen = checks.layers(layers, len(state.layers))
    return None if chosen is None else list(chosen)


def choose(
    state: KVState,
    question: str,
    passages=None,
    *,
    top_k: int = 1,
    target: float | None = 0.2,
    max_strength: float = 5.0,
    layers: Sequence[int] | None = None,
    query: str | None = None,
    region: Range | None = None,
    smoothing: float = SCORE_SMOOTHING,
    threshold: float | None = ABSTAIN_THRESHOLD,
    all_words: bool = True,
) -> Focus:
    """Score the passages, choose up to ``top_k`` that stand out and size each layer's bias,
    without editing (see :func:`focus` for the arguments).

    The returned :class:`Focus` holds the input state and the strengths :func:`focus` would
    apply (``chosen`` is empty when no passage stands out). Costs two question-length passes
    over the cache (the question and its calibration; one when the question has no
    distinctive word); the question's is kept (:attr:`Focus.continued`), so an answer from the
    unedited state does not run it again.
    """
    options = focus_options(
        top_k=top_k,
        target=target,
        max_strength=max_strength,
        smoothing=smoothing,
        threshold=threshold,
        all_words=all_words,
        guard=None,
    )
    question, query = asked(question, query)
    return chosen(state, question, query, passages, options, layers=layers, region=region)


def chosen(
    state: KVState,
    question: str,
    query: str | None,
    passages,
    options: FocusOptions,
    *,
    layers: Sequence[int] | None = None,
    region: Range | None = None,
) -> Focus:
    """:func:`choose` of arguments checked at the entry (:mod:`kvedit.focusing.options`:
    :func:`~kvedit.focusing.options.asked`, :func:`~kvedit.focusing.options.focus_options`);
    what needs the state is checked here: the default query, that the query is part of the
    question, the passages, ``top_k`` against their number, the layers."""
    refuse_headwise(state.layers, "focus")
    if query is None:
        query = default_query(state, question)  # a str, from the checked question
        query = with_content(query_name(question, query), query)
    query = part_of(question, query)
    spans = split_passages(state, passages, region)
    top_k, smoothing, threshold = options.top_k, options.smoothing, options.threshold
    if top_k > len(spans):
        raise InvalidInputError(f"top_k must be <= {len(spans)}, not {top_k}")
    layer_idx = _layer_indices(state, layers)
    real, calib, continued = question_shares(state, question, spans, query=query)
    scores = passage_scores(real, calib, layer_idx, smoothing)
    texts = [state.text[a:b] for a, b in spans]
    echoes = echo_passages(query, texts)
    candidates = torch.ones(len(spans), dtype=torch.bool)
    candidates[echoes] = False
    eligible = best_covered(query, texts, candidates)
    ranked = stands_out(scores, candidates, None, eligible)
    chosen = stands_out(scores, candidates, threshold, eligible)[:top_k]
    by_words = False
    if not chosen and options.all_words and threshold is not None:
        sole = sole_holder(query, texts, candidates)
        if sole is not None and float(scores[sole]) > 0:
            chosen, by_words = [sole], True
    reason = "" if chosen else abstain_reason(scores, candidates, eligible, threshold, real, calib)
    target, max_strength = options.target, options.max_strength
    if not chosen:
        strengths = [0.0] * len(state.layers)
    elif target is None:
        strengths = [max_strength] * len(state.layers)
    else:
        strengths = adaptive_strengths(real[:, chosen].sum(-1), target, max_strength).tolist()
    best = ranked[0] if ranked else None
    return Focus(
        state,
        spans,
        scores.tolist(),
        chosen,
        strengths,
        question,
        None,
        reason,
        echoes,
        best,
        eligible.nonzero().flatten().tolist(),
        query,
        continued,
        by_words,
    )


def focus(
    state: KVState,
    question: str,
    passages=None,
    *,
    top_k: int = 1,
    target: float | None = 0.2,
    max_strength: float = 5.0,
    layers: Sequence[int] | None = None,
    query: str | None = None,
    region: Range | None = None,
    smoothing: float = SCORE_SMOOTHING,
    threshold: float | None = ABSTAIN_THRESHOLD,
    all_words: bool = True,
    guard: Guard | None = DEFAULT_GUARD,
    edit: Callable[[KVState, list[Range]], KVState] | None = None,
    unedited: Answer | None = None,
) -> Focus:
    """Emphasize the passages of ``state`` that ``question`` points at, unless that would
    change the answer for the worse.

    Args:
        state: a captured state (not modified).
        question: the continuation that asks (what :meth:`Focus.generate` continues with).
        passages: a list of spans (substrings, regexes, ``(start, end)`` ranges), a splitter
            name (``"paragraphs"``, ``"lines"``, ``"sentences"``), an int (windows of that many
            tokens), or ``None``: paragraphs, multi-line paragraphs cut into lines, long pieces
            into sentences (:func:`kvedit.focusing.passages.split_passages`).
        top_k: the most passages emphasized (1 to the number of passages): the best ones
            among those that stand out (``threshold``).
        target: the share of the question's attention each layer's bias lifts the chosen
            passages to, in ``(0, 1)``; ``None`` adds ``max_strength`` on every layer instead.
        max_strength: the most bias (nats) a layer may get (with ``target``, at least 0).
        layers: the layers whose attention scores the passages (default: all). The bias is
            sized on every layer.
        query: the part of ``question`` whose distinctive words the calibration removes
            (default: ``question`` up to its first chat-template token, stripped).
        region: the character range of ``state.text`` a splitter cuts (default: all).
        smoothing: the share added to both sides of each score's log ratio, as a fraction of
            the mean calibration share of a passage (:data:`SCORE_SMOOTHING`).
        threshold: the robust z-score a passage's score must reach among the candidates'
            scores to be emphasized (:func:`stands_out`, default :data:`ABSTAIN_THRESHOLD`).
            When none does, focus abstains: nothing is edited, :attr:`Focus.chosen` is empty,
            :attr:`Focus.state` is the input state and :meth:`Focus.explain` says why.
            ``None`` always emphasizes the ``top_k`` best.
        all_words: when no passage stands out, choose the one passage that holds all of the
            question's distinctive words, if there are at least two and each is held by other
            passages too (:func:`sole_holder`: a conjunction, which attention cannot tell from
            its parts), and its score is positive (:attr:`Focus.by_words`). ``False``: only
            passages that stand out. Not with ``threshold=None``.
        guard: an answer guard (:mod:`kvedit.focusing.guard`): it reads the answers with and
            without the edit and may drop it (then :attr:`Focus.state` is the input state and
            :attr:`Focus.kept` is ``False``). The default, :data:`DEFAULT_GUARD`
            (:class:`~kvedit.focusing.guard.SupportGuard`), answers unedited where at least half
            of the unedited answer's telling words (neither the question's nor shared by most
            other passages) are in the chosen passage: the model already reads it, and on NQ's
            last position the edit made it copy the passage's opening instead (tuning:
            reports/focus/README.md). ``None``: no guard. Focus's other
            do-no-harm rules are in the choice and the sizing: it abstains when no passage
            stands out (``threshold``), never chooses a passage that only restates the
            question (:func:`echo_passages`), smoothed scores keep the first and last passages
            from losing to their neighbours (:data:`SCORE_SMOOTHING`), and a layer where the
            chosen passage already has ``target`` of the attention gets no bias.
        edit: another edit of the chosen passages instead of the sized emphasis, called as
            ``edit(state, spans)`` with the chosen passages' character ranges, returning the
            edited state (a new state of the same model, tokenizer and token ids; ``state``
            not written in place): ``kvedit.ops.reread``, ``functools.partial(kvedit.ops.duplicate,
            copies=2)``, ... (:attr:`Focus.strengths` still report the sizing, unused then).
            It is called only when focus chooses something, and guarded like the emphasis.
        unedited: the greedy answer of ``state`` to ``question`` (``state.answer(question,
            n)``), when the caller already has it: the guard and :meth:`Focus.generate` read
            it (up to its length) instead of decoding it again. Not checked: an answer of
            another state or question gives that answer.

    Raises:
        InvalidInputError: the question (or ``query``) has no content (only whitespace or
            punctuation), a bad argument, or ``edit`` returned a state of another model,
            tokenizer or tokens.
        InvalidTypeError: ``edit`` is not callable as ``edit(state, spans)``, or returned no
            state; ``guard`` is a class, has no ``decide``, its ``decide`` cannot take what
            focus passes, or it returned no :class:`~kvedit.focusing.guard.Verdict`.
        StateAlteredError: ``edit`` wrote ``state`` in place.

    Returns:
        A :class:`Focus`: the state that answers, the passages, their scores, the chosen ones,
        each layer's bias and the guard's verdict.

    Cost: two question-length passes to score (:func:`choose`; the question's is the first
    pass of the unedited answer, kept in :attr:`Focus.continued`), one recompute of the last
    token to edit, and with the guard the unedited answer's decode steps (none with
    ``unedited``) and, where the edit answers, the edited answer (one question pass and its
    decode steps).
    """
    options = focus_options(
        top_k=top_k,
        target=target,
        max_strength=max_strength,
        smoothing=smoothing,
        threshold=threshold,
        all_words=all_words,
        guard=guard,
        edit=edit,
        unedited=unedited,
    )
    question, query = asked(question, query)
    return focused(state, question, query, passages, options, layers=layers, region=region)


def focused(
    state: KVState,
    question: str,
    query: str | None,
    passages,
    options: FocusOptions,
    *,
    layers: Sequence[int] | None = None,
    region: Range | None = None,
) -> Focus:
    """:func:`focus` of arguments checked at the entry (as :func:`chosen` takes them)."""
    found = chosen(state, question, query, passages, options, layers=layers, region=region)
    if options.unedited is not None:
        continued = dataclasses.replace(found.continued, known=options.unedited)
        found = dataclasses.replace(found, continued=continued)
    if not found.chosen:  # abstained: nothing to edit, nothing to guard
        return found
    spans = [found.passages[i] for i in found.chosen]
    if options.edit is None:
        edited = ops.emphasize(state, spans, found.strengths)  # one recompute of the last token
    else:
        edited = checked_edit(options.edit, state, spans)
    return guarded(found, edited, options.guard)


def guarded(found: Focus, edited: KVState, guard: Guard | None) -> Focus:
    """A copy of ``found`` (from :func:`choose`, holding the state it chose on) that answers
    from ``edited``, an edit of its chosen passages; with ``guard``, only if the guard keeps
    the edit (the verdict is in :attr:`Focus.verdict`). When ``found`` chose nothing (it
    abstained), ``found`` itself is returned (it answers from its own state) and ``edited`` is
    ignored. ``found`` is never changed.

    The guard gets the unedited state primed with :attr:`Focus.continued`
    (:class:`~kvedit.focusing.primed.PrimedState`): its greedy answer to the question starts
    after the scoring pass (the same tokens, one question pass fewer)."""
    if not found.chosen:
        return found
    if guard is None:
        return dataclasses.replace(found, state=edited, continued=None)
    original = found.state
    texts = [original.text[a:b] for a, b in found.passages]
    evidence, others = evidence_and_others(texts, found.chosen)
    c = found.continued
    primed = (
        PrimedState.of(original, c)
        if c is not None and c.matches(original, found.question)
        else original
    )
    verdict = guard.decide(
        primed,
        edited,
        found.question,
        evidence=evidence,
        others=others,
        query=found.query,
        outside=outside_passages(original.text, found.passages),
    )
    verdict = check_verdict(guard, verdict)
    if verdict.kept:
        return dataclasses.replace(found, state=edited, verdict=verdict, continued=None)
    return dataclasses.replace(found, state=original, verdict=verdict)


def focus_text(
    model, tokenizer, context: str, question: str, *, max_positions: int | None = None, **kw
) -> Focus:
    """Capture ``context`` in the chat template and :func:`focus` it for ``question``.

    The user message is ``context + QUESTION_SEPARATOR + question``
    (:data:`kvedit.prompts.QUESTION_SEPARATOR`, the prompt of the evaluation suite); the cache
    holds the templated prompt up to the question (cut at :data:`kvedit.prompts.QUESTION_MARK`),
    passages are cut from the context only, and :meth:`Focus.generate` asks the question.
    ``kw`` goes to :func:`focus` (``passages``, ``top_k``, ``target``, ``max_strength``,
    ``layers``). ``max_positions``: as :func:`kvedit.capture` takes it (the captured state
    keeps it for every later call).
    """
    context = checks.text("context", context, allow_empty=False)
    question = content_question("question", question)
    if QUESTION_MARK in context:
        raise InvalidInputError(
            f"context must not contain {QUESTION_MARK!r}: the prompt is cut there"
        )
    passages, layers = kw.pop("passages", None), kw.pop("layers", None)
    options = focus_options(**kw)  # before the capture
    return text_focused(
        model, tokenizer, context, question, options, passages, layers, max_positions
    )


def text_focused(
    model,
    tokenizer,
    context: str,
    question: str,
    options: FocusOptions,
    passages=None,
    layers: Sequence[int] | None = None,
    max_positions: int | None = None,
) -> Focus:
    """:func:`focus_text` of arguments checked at the entry: ``context`` a ``str`` without
    :data:`~kvedit.prompts.QUESTION_MARK`, ``question`` one with content
    (:func:`content_question`), ``options`` :func:`~kvedit.focusing.options.focus_options`'."""
    prefix, continuation = chat_prefix(
        tokenizer, context + QUESTION_SEPARATOR + question, QUESTION_MARK
    )
    state = capture(model, tokenizer, prefix, max_positions=max_positions)
    start = prefix.rfind(context.strip())
    region = (start, start + len(context.strip())) if start >= 0 else None
    # the continuation is the templated question: a non-empty str; the question was checked
    return focused(state, continuation, question, passages, options, layers=layers, region=region)
