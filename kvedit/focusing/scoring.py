"""Scoring passages for :mod:`kvedit.focusing.choice`: how much more attention the question gives a
passage than a content-free copy of the question does (scale-free smoothing), which passages
stand out (a robust z-score against the others; :data:`ABSTAIN_THRESHOLD`), which may be
chosen (those holding the most of the question's distinctive words; the one holding all of them,
when each is shared: :func:`sole_holder`), echoes of the question, why nothing was chosen, and
the per-layer bias that lifts a passage's share to a target; and the checks a question and its
query get once, at focus's entry (:func:`content_question`, :func:`part_of`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch

from .. import checks
from ..errors import InvalidInputError
from ..states.state import KVState
from .passages import Range, template_ranges
from .primed import Continued
from .readout import attention_share, continued_share
from .sizing import strength_for_share
from .words import holders, most, split_words, words

SHARE_EPS = 1e-6
"""Shares are clamped to ``[SHARE_EPS, 1 - SHARE_EPS]`` before sizing a bias (a share of 0
or 1 has no finite bias)."""
SCORE_SMOOTHING = 0.5
"""The smoothing of a passage's log ratio (:func:`passage_scores`), as a fraction of the mean
share a passage gets from the calibration query (so it scales with the number of passages).

Half the mean share keeps a passage in the attention trough next to the first or last one from
beating the right edge passage on the ratio of tiny shares, without swamping the signal when
hundreds of passages each get a tiny share (tuning: reports/focus/README.md)."""
ABSTAIN_THRESHOLD = 2.5
"""The robust z-score a passage's score must reach to be emphasized (:func:`stands_out`): the
passage a question asks about nearly always reaches it, and a question that asks about no
passage nearly never does (tuning: reports/focus/README.md)."""
MIN_SPREAD = 0.02
"""The floor (nats) of the score spread :func:`stands_out` divides by: scores that all agree
(every one 0 when the question has no distinctive word) have no outlier."""
_META_WORDS = frozenset({"question", "questions", "q", "query", "ask", "asked", "asks"})


def _distinctive_holders(question: str, documents: Sequence[str]) -> dict[str, set[int]]:
    """Each distinctive word of ``question`` (see :func:`distinctive_words`) and the indices
    of the documents that hold it."""
    limit = most(len(documents))
    found = holders(words(question), documents)
    return {w: held for w, held in found.items() if 0 < len(held) <= limit}


def distinctive_words(question: str, documents: Sequence[str]) -> set[str]:
    """The question's *distinctive* words (:func:`kvedit.focusing.words.words`): those some of
    ``documents`` hold but not more than :data:`~kvedit.focusing.words.COMMON_SHARE` of them
    (and at most one when there are one or two). Names and entities, not the question's form
    ("what", "is", "number")."""
    return set(_distinctive_holders(question, documents))


def content_free_question(question: str, documents: Sequence[str]) -> str:
    """The question with its :func:`distinctive_words` removed. What is left keeps the
    question's form and position, and serves as a calibration query for positional bias.
    Task-agnostic: it uses only the question and the documents, never the task's wording.
    ``"?"`` when nothing was removed.
    """
    distinctive = distinctive_words(question, documents)
    pieces = split_words(question)
    kept = [w for w in pieces if not (w[0].isalnum() and w.lower() in distinctive)]
    out = re.sub(r"\s+", " ", "".join(kept)).strip()
    return out if out != question.strip() else "?"


def word_coverage(question: str, texts: Sequence[str]) -> torch.Tensor:
    """``[n_passages]``: the fraction of the question's :func:`distinctive_words` (among
    ``texts``) each passage holds; all 0 when the question has none."""
    holders = _distinctive_holders(question, texts)
    if not holders:
        return torch.zeros(len(texts))
    found = [sum(i in held for held in holders.values()) for i in range(len(texts))]
    return torch.tensor(found, dtype=torch.float64) / len(holders)


def _mask(name: str, mask: torch.Tensor, n: int) -> torch.Tensor:
    """``mask`` as a boolean ``[n]`` tensor; an :class:`InvalidInputError` naming ``name``
    for any other shape."""
    if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != (n,):
        shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise InvalidInputError(f"{name} must be a mask of the {n} passages, not {shape}")
    return mask.bool()


def best_covered(question: str, texts: Sequence[str], candidates: torch.Tensor) -> torch.Tensor:
    """The candidates (a boolean mask) that hold the most of the question's
    :func:`distinctive_words` (:func:`word_coverage`): the passages focus may choose. All
    candidates when none holds any. Among 300 records "Emeka Yilmaz" shares a first or last
    name with ~30 others, and the question's attention goes to those about as much as to the
    record with both names; only that one holds both words."""
    candidates = _mask("candidates", candidates, len(texts))
    coverage = word_coverage(question, texts)
    if not bool(candidates.any()):
        return candidates
    top = float(coverage[candidates].max())
    if top <= 0:
        return candidates.clone()
    return candidates & (coverage >= top)


def sole_holder(question: str, texts: Sequence[str], candidates: torch.Tensor) -> int | None:
    """The one candidate (a boolean mask) that holds every one of the question's
    :func:`distinctive_words`, when it has at least two and each is held by another candidate
    too; ``None`` otherwise.

    Such a question asks for a conjunction ("the rust maple door" among rust doors and maple
    doors; "Ana Ruiz in 2011" among her other years and that year's other moves), and attention
    cannot tell the passage holding all its words from those holding some: each word draws the
    question's attention to every passage holding it, so the one with all of them rarely
    stands out (:func:`stands_out`; reports/focus/heldout_wordings.md). The words settle it
    instead. A word only one passage holds is not a conjunction: attention finds that passage.
    """
    mask = _mask("candidates", candidates, len(texts))
    allowed = set(mask.nonzero().flatten().tolist())
    held = [h & allowed for h in _distinctive_holders(question, texts).values()]
    if len(held) < 2:
        return None
    every = set.intersection(*held)
    if len(every) != 1:
        return None
    (sole,) = every
    return sole if all(h - every for h in held) else None


def content_question(name: str, question) -> str:
    """``question`` if it is a ``str`` (:func:`kvedit.checks.text`) with content
    (:func:`with_content`); an :class:`InvalidInputError` otherwise."""
    return with_content(name, checks.text(name, question, allow_empty=False))


def with_content(name: str, question: str) -> str:
    """``question`` (a ``str``) if it has a word character; an :class:`InvalidInputError`
    otherwise (whitespace or punctuation asks nothing)."""
    if not re.search(r"\w", question):
        raise InvalidInputError(
            f"{name} {question!r} has no content (only whitespace or punctuation): nothing to "
            "focus on"
        )
    return question


def part_of(question: str, query: str) -> str:
    """``query``, refused (:class:`InvalidInputError`) unless it is a non-empty part of
    ``question``: the calibration replaces it there."""
    if not query or query not in question:
        raise InvalidInputError(f"query {query!r} is not part of the question {question!r}")
    return query


def echo_passages(question: str, texts: Sequence[str]) -> list[int]:
    """Indices of the passages that only restate ``question``: every word of the passage is a
    word of the question (or a word such as "question"), and it holds at least two of the
    question's words and half of them. Such a passage draws the question's attention by
    repeating it, not by answering it, so :func:`choose` never picks it."""
    asked = set(words(question))
    out = []
    for i, text in enumerate(texts):
        held = set(words(text))
        shared = held & asked
        if held - asked - _META_WORDS or len(shared) < max(2, (len(asked) + 1) // 2):
            continue
        out.append(i)
    return out


def stands_out(
    scores: torch.Tensor,
    candidates: torch.Tensor | None = None,
    threshold: float | None = ABSTAIN_THRESHOLD,
    eligible: torch.Tensor | None = None,
) -> list[int]:
    """The eligible passages whose score stands out among the candidates', best first.

    A passage stands out when its score is positive and its robust z-score against the other
    candidates (:func:`robust_z`: ``(score - median) / max(1.4826 * MAD, MIN_SPREAD)`` of the
    others' scores) reaches ``threshold`` (default :data:`ABSTAIN_THRESHOLD`). The rule reads
    only the distribution of the scores, never how many there are. ``candidates`` is a
    boolean mask (default: all); ``eligible`` (a mask within it, default: the candidates,
    e.g. :func:`best_covered`) the passages that may be returned: the z-score is still taken
    against every candidate. ``threshold`` ``None`` keeps every candidate (no abstention):
    the eligible ones first, then the others, each by score.
    """
    scores = scores.double()
    n = scores.numel()
    mask = (
        torch.ones(n, dtype=torch.bool)
        if candidates is None
        else _mask("candidates", candidates, n)
    )
    allowed = mask if eligible is None else _mask("eligible", eligible, n) & mask
    idx = mask.nonzero().flatten()
    if idx.numel() == 0:
        return []
    order = idx[scores[idx].argsort(descending=True, stable=True)].tolist()
    first = [i for i in order if allowed[i]]
    if threshold is None:
        return first + [i for i in order if not allowed[i]]
    z = robust_z(scores, mask)
    return [i for i in first if scores[i] > 0 and z[i] >= threshold]


def robust_z(scores: torch.Tensor, candidates: torch.Tensor | None = None) -> torch.Tensor:
    """Each passage's robust z-score against the *other* candidates' scores:
    ``(score - median) / max(1.4826 * MAD, MIN_SPREAD)`` of the others (leaving the passage
    itself out, so a clear winner among few passages is not hidden by its own weight in the
    spread; with no other candidate the median is 0)."""
    scores = scores.double()
    mask = torch.ones_like(scores, dtype=torch.bool) if candidates is None else candidates.bool()
    z = torch.zeros_like(scores)
    for i in range(scores.numel()):
        others = mask.clone()
        others[i] = False
        s = scores[others]
        if s.numel() == 0:
            med, spread = 0.0, MIN_SPREAD
        else:
            med = float(s.median())
            spread = max(1.4826 * float((s - med).abs().median()), MIN_SPREAD)
        z[i] = (scores[i] - med) / spread
    return z


def abstain_reason(scores, candidates, eligible, threshold, real, calib) -> str:
    """Why :func:`choose` chose nothing, in words: every passage restates the question, the
    question has no distinctive word, or the best eligible passage's score is not above 0 or
    its robust z is under ``threshold`` (``scores`` ``[passages]``; ``candidates`` and
    ``eligible`` boolean masks; ``real`` and ``calib`` the two queries' shares)."""
    if not bool(candidates.any()):
        return "every passage only restates the question"
    if torch.equal(real, calib):
        return "the question has no distinctive word in the passages (every score 0)"
    z = robust_z(scores, candidates)
    best = stands_out(scores, candidates, None, eligible)[0]
    among = "" if bool(eligible[candidates].all()) else " among the passages with most of its words"
    score, z_best = float(scores[best]), float(z[best])
    if score <= 0:  # stands_out asks for a positive score as well as the robust z
        return (
            f"no passage stands out{among} (best: #{best}, score {score:.3f}: not above 0; "
            f"robust z {z_best:.2f})"
        )
    return (
        f"no passage stands out{among} (best: #{best}, score {score:.3f}, "
        f"robust z {z_best:.2f} < threshold {threshold})"
    )


def adaptive_strengths(shares: torch.Tensor, target: float, max_strength: float) -> torch.Tensor:
    """Per layer, the bias that lifts a span's attention share ``shares[l]`` to ``target``.

    Each bias is :func:`kvedit.focusing.sizing.strength_for_share` of the share (clamped to
    ``[SHARE_EPS, 1 - SHARE_EPS]``), clipped to ``[0, max_strength]``: a span that already gets
    ``target`` (often the one next to the question) is left alone, never suppressed.
    """
    out = []
    for share in shares.double().tolist():
        share = min(max(share, SHARE_EPS), 1.0 - SHARE_EPS)
        out.append(min(max(strength_for_share(share, target), 0.0), max_strength))
    return torch.tensor(out, dtype=torch.float32)


def default_query(state: KVState, question: str) -> str:
    """The asking text of a continuation: up to its first chat-template token, stripped
    (:func:`asking_text` with the state's tokenizer)."""
    return asking_text(question, state.tokenizer)


def asking_text(question: str, tokenizer) -> str:
    """The asking text of a continuation ``question``: up to its first chat-template token
    (``tokenizer``'s special tokens), stripped; ``question`` itself when that leaves nothing."""
    cut = min([a for a, _ in template_ranges(question, tokenizer)] or [len(question)])
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
    the chat template) replaced by its :func:`content_free_question`. When the query has no
    distinctive word (its calibration is ``"?"``) nothing in it points at a passage: ``calib``
    is then ``real`` (every score 0), and the second pass is saved."""
    query = part_of(question, default_query(state, question) if query is None else query)
    real, calib, _ = question_shares(state, question, passages, query=query)
    return real, calib


def question_shares(
    state: KVState, question: str, passages: Sequence[Range], *, query: str
) -> tuple[torch.Tensor, torch.Tensor, Continued]:
    """:func:`passage_shares` of a ``query`` already checked to be part of ``question``
    (:func:`part_of`, at the public entry), and the pass of ``question`` over ``state`` kept
    (:class:`~kvedit.focusing.primed.Continued`: the first pass of the state's answer)."""
    texts = [state.text[a:b] for a, b in passages]
    free = content_free_question(query, texts)
    share, continued = continued_share(state, question, list(passages))
    real = share.per_layer
    if free == "?":  # no distinctive word: the question points at no passage
        return real, real.clone(), continued
    calib_question = question.replace(query, free, 1)
    calib = attention_share(state, calib_question, list(passages)).per_layer
    return real, calib, continued


def passage_scores(
    real: torch.Tensor,
    calib: torch.Tensor,
    layers: Sequence[int] | None = None,
    smoothing: float = SCORE_SMOOTHING,
) -> torch.Tensor:
    """``[n_passages]``: ``log (share(question) + s) - log (share(content-free question) + s)``
    averaged over the ``layers`` (default: all) that hold the passage, with ``s = smoothing``
    (:data:`SCORE_SMOOTHING`) times the mean calibration share of a held passage on those
    layers (scale-free: the same ``smoothing`` serves any number of passages). ``real`` and
    ``calib`` are ``[layers, n_passages]`` shares.

    A layer holds a passage when either query gives it a share above 0: a sliding-window layer
    (Gemma-3 keeps its last 512 tokens) gives the passages before its window 0 from both, which
    says nothing about them. Averaging those zeros in shrank the scores of all but the last
    passages several-fold on Gemma-3, so an early passage the question points at rarely stood
    out (:func:`stands_out`); a passage no layer holds scores 0."""
    if layers is not None:
        real, calib = real[list(layers)], calib[list(layers)]
    real, calib = real.double(), calib.double()
    held = (real > 0) | (calib > 0)
    mean_share = float(calib[held].mean()) if bool(held.any()) else 0.0
    eps = smoothing * max(mean_share, SHARE_EPS)
    ratio = (torch.log(real + eps) - torch.log(calib + eps)) * held
    return (ratio.sum(0) / held.sum(0).clamp(min=1)).float()
