"""Automatic focus: emphasize the passages a question points at.

The question is run on top of a captured state twice, as asked and with its distinctive words
removed (:func:`content_free_question`: a calibration query that keeps the question's form and
position). Each passage's score is the log ratio of the attention shares the two give it
(each smoothed by :data:`SCORE_SMOOTHING`), averaged over layers: positional bias (lost in the middle, recency, the sink) appears in both
and cancels, the question's content does not. The best passages are then emphasized with a
per-layer bias that lifts their share of the question's attention to ``target``
(:func:`adaptive_strengths`), applied with :func:`kvedit.ops.emphasize` (the last token is
recomputed, so the next token sees the edit). An optional answer guard (:mod:`kvedit.guard`,
applied by :func:`guarded`) may drop the edit.

This is the evaluation method ``auto`` (``kvedit eval litm --methods auto``) as a library call.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from . import checks, ops
from .errors import InvalidInputError
from .guard import AgreementGuard, Guard, Verdict
from .passages import Range, split_passages, template_ranges
from .readout import attention_share
from .state import KVState, capture, chat_prefix
from .strengths import strength_for_share

__all__ = [
    "DEFAULT_GUARD",
    "SCORE_SMOOTHING",
    "SHARE_EPS",
    "Focus",
    "adaptive_strengths",
    "choose",
    "content_free_question",
    "focus",
    "focus_text",
    "guarded",
    "passage_scores",
    "passage_shares",
]

SHARE_EPS = 1e-6
"""Shares are clamped to ``[SHARE_EPS, 1 - SHARE_EPS]`` before sizing a bias (a share of 0
or 1 has no finite bias)."""
SCORE_SMOOTHING = 0.01
"""The share added to both sides of a passage's log ratio (:func:`passage_scores`).

Without it (1e-6), a passage in the attention trough next to the first or last one gets a large
ratio from tiny shares and beats the right edge passage: on the tuning seeds the top-1 hit rate
at the first and last positions was 0.70 and 0.40 (lockers seed 3), 0.80 and 0.90 (records
seed 1). With 0.01 (also tried: 1e-3, 0.03, 0.1, the difference of shares, and a fraction of
the mean share) every position was 1.00 on both (``benchmarks/focus_scoring.py``)."""
QUESTION_MARK = "\n\nQuestion:"
"""Where :func:`focus_text` cuts the prompt: the context is captured, the question asked after."""


def content_free_question(question: str, documents: Sequence[str]) -> str:
    """The question with its *distinctive* words removed: words that occur in some documents
    but not most of them (names, entities). What is left keeps the question's form and
    position, and serves as a calibration query for positional bias. Task-agnostic: it uses
    only the question and the documents, never the task's wording. ``"?"`` when nothing was
    removed.
    """
    words = re.findall(r"\w+|\W+", question)
    lowered = [d.lower() for d in documents]
    n = max(1, len(documents))
    kept = []
    for w in words:
        if w.strip() and w[0].isalnum():
            df = sum(1 for d in lowered if re.search(r"\b" + re.escape(w.lower()) + r"\b", d))
            if 0 < df <= max(1, n // 2):
                continue
        kept.append(w)
    out = "".join(kept)
    out = re.sub(r"\s+", " ", out).strip()
    return out if out != question.strip() else "?"


def adaptive_strengths(shares: torch.Tensor, target: float, max_strength: float) -> torch.Tensor:
    """Per layer, the bias that lifts a span's attention share ``shares[l]`` to ``target``.

    Each bias is :func:`kvedit.steer.strength_for_share` of the share (clamped to
    ``[SHARE_EPS, 1 - SHARE_EPS]``), clipped to ``[0, max_strength]``: a span that already gets
    ``target`` (often the one next to the question) is left alone, never suppressed.
    """
    out = []
    for share in shares.double().tolist():
        share = min(max(share, SHARE_EPS), 1.0 - SHARE_EPS)
        out.append(min(max(strength_for_share(share, target), 0.0), max_strength))
    return torch.tensor(out, dtype=torch.float32)


def _default_query(state: KVState, question: str) -> str:
    """The asking text of a continuation: up to its first chat-template token, stripped."""
    cut = min([a for a, _ in template_ranges(question, state.tokenizer)] or [len(question)])
    return question[:cut].strip() or question


def passage_shares(
    state: KVState,
    question: str,
    passages: Sequence[Range],
    *,
    query: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(real, calib)``: ``[layers, n_passages]`` attention shares of each passage, from
    ``question`` and from ``question`` with ``query`` (a part of it; default: the text up to
    the chat template) replaced by its :func:`content_free_question`."""
    if query is None:
        query = _default_query(state, question)
    if not query or query not in question:
        raise InvalidInputError(f"query {query!r} is not part of the question {question!r}")
    texts = [state.text[a:b] for a, b in passages]
    calib_question = question.replace(query, content_free_question(query, texts), 1)
    real = attention_share(state, question, list(passages)).per_layer
    calib = attention_share(state, calib_question, list(passages)).per_layer
    return real, calib


def passage_scores(
    real: torch.Tensor,
    calib: torch.Tensor,
    layers: Sequence[int] | None = None,
    smoothing: float = SCORE_SMOOTHING,
) -> torch.Tensor:
    """``[n_passages]``: ``log (share(question) + s) - log (share(content-free question) + s)``
    with ``s = smoothing`` (:data:`SCORE_SMOOTHING`), averaged over ``layers`` (default: all).
    ``real`` and ``calib`` are ``[layers, n_passages]`` shares."""
    lift = torch.log(real + smoothing) - torch.log(calib + smoothing)  # [L, n]
    if layers is not None:
        lift = lift[list(layers)]
    return lift.mean(0)


DEFAULT_GUARD = AgreementGuard()
"""The answer guard ``focus(..., guard=DEFAULT_GUARD)`` applies (off by default: see
:func:`focus`)."""


@dataclass
class Focus:
    """What :func:`focus` did.

    Attributes:
        state: the state that answers: the edited one, or the input state itself when
            nothing was edited (:func:`choose`) or the guard dropped the edit.
        passages: ``(start, end)`` character ranges of the passages in ``state.text``.
        scores: one relevance score per passage (higher: the question points at it more).
        chosen: indices into ``passages`` of the emphasized passages, best first.
        strengths: the bias (nats) each layer's chosen passages got (or would get).
        question: the continuation :meth:`generate` asks.
        verdict: the guard's decision (``None`` without a guard).
    """

    state: KVState
    passages: list[Range]
    scores: list[float]
    chosen: list[int]
    strengths: list[float]
    question: str
    verdict: Verdict | None = None

    @property
    def kept(self) -> bool:
        """Whether the edit stands (``True`` when no guard was asked)."""
        return self.verdict is None or self.verdict.kept

    def explain(self, width: int = 40) -> str:
        """A table: passage index, its first ``width`` characters, score, ``*`` if chosen."""
        lines = [f"{'#':>3}  {'passage':<{width}}  {'score':>7}  chosen"]
        for i, ((a, b), score) in enumerate(zip(self.passages, self.scores, strict=True)):
            text = " ".join(self.state.text[a:b].split())
            if len(text) > width:
                text = text[: width - 3] + "..."
            mark = "*" if i in self.chosen else ""
            lines.append(f"{i:>3}  {text:<{width}}  {score:>7.3f}  {mark}")
        v = self.verdict
        if v is not None:
            said = {"agree": "same answer with and without it", "edit": "the edit's answer won"}
            said["original"] = "the unedited answer won"
            where = "" if v.step is None else f" at answer token {v.step}, margin {v.margin:.2f}"
            lines.append(f"edit {'kept' if v.kept else 'dropped'}: {said[v.reason]}{where}")
        return "\n".join(lines)

    def generate(self, max_new_tokens: int = 32, **kw) -> str:
        """Continue :attr:`state` with :attr:`question` (see :meth:`KVState.generate`).

        A greedy call no longer than the guard's answer reuses that answer (the same tokens).
        """
        max_new_tokens = checks.count("max_new_tokens", max_new_tokens)
        known = None if self.verdict is None or kw else self.verdict.answer
        if known is not None and (max_new_tokens <= len(known.token_ids) or known.finished):
            ids = known.token_ids[:max_new_tokens]
            return self.state.tokenizer.decode(ids, skip_special_tokens=True)
        return self.state.generate(self.question, max_new_tokens, **kw)


def _layer_indices(state: KVState, layers) -> list[int] | None:
    chosen = checks.layers(layers, len(state.layers))
    return None if chosen is None else list(chosen)


def _check_sizing(target: float | None, max_strength: float) -> tuple[float | None, float]:
    if target is not None:
        target = checks.real("target", target)
        if not 0.0 < target < 1.0:
            raise InvalidInputError(f"target share must be in (0, 1), not {target!r}")
    max_strength = checks.strength("max_strength", max_strength)
    if target is not None and max_strength < 0:
        raise InvalidInputError(f"max_strength must be >= 0 with a target, not {max_strength}")
    return target, max_strength


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
) -> Focus:
    """Score the passages, choose the ``top_k`` best and size each layer's bias, without
    editing (see :func:`focus` for the arguments).

    The returned :class:`Focus` holds the input state and the strengths :func:`focus` would
    apply. Costs two question-length passes over the cache (the question and its calibration).
    """
    target, max_strength = _check_sizing(target, max_strength)
    smoothing = checks.real("smoothing", smoothing)
    if not 0.0 < smoothing <= 1.0:
        raise InvalidInputError(f"smoothing must be in (0, 1], not {smoothing!r}")
    question = checks.text("question", question, allow_empty=False)
    spans = split_passages(state, passages, region)
    top_k = checks.count("top_k", top_k, minimum=1, maximum=len(spans))
    layer_idx = _layer_indices(state, layers)
    real, calib = passage_shares(state, question, spans, query=query)
    scores = passage_scores(real, calib, layer_idx, smoothing)
    chosen = scores.topk(top_k).indices.tolist()
    if target is None:
        strengths = [max_strength] * len(state.layers)
    else:
        strengths = adaptive_strengths(real[:, chosen].sum(-1), target, max_strength).tolist()
    return Focus(state, spans, scores.tolist(), chosen, strengths, question)


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
    guard: Guard | None = None,
) -> Focus:
    """Emphasize the passages of ``state`` that ``question`` points at, unless that would
    change the answer for the worse.

    Args:
        state: a captured state (not modified).
        question: the continuation that asks (what :meth:`Focus.generate` continues with).
        passages: a list of spans (substrings, regexes, ``(start, end)`` ranges), a splitter
            name (``"paragraphs"``, ``"lines"``, ``"sentences"``), an int (windows of that many
            tokens), or ``None``: paragraphs, multi-line paragraphs cut into lines, long pieces
            into sentences (:func:`kvedit.passages.split_passages`).
        top_k: how many passages are emphasized (1 to the number of passages).
        target: the share of the question's attention each layer's bias lifts the chosen
            passages to, in ``(0, 1)``; ``None`` adds ``max_strength`` on every layer instead.
        max_strength: the most bias (nats) a layer may get (with ``target``, at least 0).
        layers: the layers whose attention scores the passages (default: all). The bias is
            sized on every layer.
        query: the part of ``question`` whose distinctive words the calibration removes
            (default: ``question`` up to its first chat-template token, stripped).
        region: the character range of ``state.text`` a splitter cuts (default: all).
        smoothing: the share added to both sides of each score's log ratio
            (:data:`SCORE_SMOOTHING`).
        guard: an answer guard (:mod:`kvedit.guard`, e.g. :data:`DEFAULT_GUARD`): it compares
            the answers with and without the edit and may drop it (then :attr:`Focus.state`
            is the input state and :attr:`Focus.kept` is ``False``). Off by default: on the
            tuning seeds every answer-confidence rule tried dropped more good edits than bad
            ones on NQ (see ``reports/``). Focus's do-no-harm rules are in the scoring and
            the sizing instead: smoothed scores keep the first and last passages from losing
            to their neighbours (:data:`SCORE_SMOOTHING`), and a layer where the chosen
            passage already has ``target`` of the attention gets no bias.

    Returns:
        A :class:`Focus`: the state that answers, the passages, their scores, the chosen ones,
        each layer's bias and the guard's verdict.

    Cost: two question-length passes to score (:func:`choose`), one recompute of the last
    token to edit, and with the guard one more question pass (the unedited answer) plus one
    decode step per answer token on which the two agree.
    """
    found = choose(
        state,
        question,
        passages,
        top_k=top_k,
        target=target,
        max_strength=max_strength,
        layers=layers,
        query=query,
        region=region,
        smoothing=smoothing,
    )
    spans = [found.passages[i] for i in found.chosen]
    edited = ops.emphasize(state, spans, found.strengths)  # one recompute of the last token
    return guarded(found, edited, guard)


def guarded(found: Focus, edited: KVState, guard: Guard | None) -> Focus:
    """``found`` (from :func:`choose`, holding the state it chose on) set to answer from
    ``edited``, an edit of its chosen passages; with ``guard``, only if the guard keeps the
    edit (the verdict is kept in :attr:`Focus.verdict`). Returns ``found``."""
    original = found.state
    found.state = edited
    if guard is not None:
        found.verdict = guard.decide(original, edited, found.question)
        found.state = edited if found.verdict.kept else original
    return found


def focus_text(model, tokenizer, context: str, question: str, **kw) -> Focus:
    """Capture ``context`` in the chat template and :func:`focus` it for ``question``.

    The user message is ``context + "\\n\\nQuestion: " + question`` (the prompt of the
    evaluation suite); the cache holds the templated prompt up to the question, passages are
    cut from the context only, and :meth:`Focus.generate` asks the question. ``kw`` goes to
    :func:`focus` (``passages``, ``top_k``, ``target``, ``max_strength``, ``layers``).
    """
    context = checks.text("context", context, allow_empty=False)
    question = checks.text("question", question, allow_empty=False)
    if QUESTION_MARK in context:
        raise InvalidInputError(
            f"context must not contain {QUESTION_MARK!r}: the prompt is cut there"
        )
    prefix, continuation = chat_prefix(
        tokenizer, context + QUESTION_MARK + " " + question, QUESTION_MARK
    )
    state = capture(model, tokenizer, prefix)
    start = prefix.rfind(context.strip())
    region = (start, start + len(context.strip())) if start >= 0 else None
    return focus(state, continuation, query=question, region=region, **kw)
