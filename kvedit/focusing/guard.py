"""Do-no-harm guards: keep a cache edit only where it is not expected to hurt the answer.

An edit that moves attention onto the right passage fixes an answer lost in the middle; the
same edit on the wrong passage (the neighbour of the right one, say) breaks an answer the model
already had. A guard looks at the model's answers with and without the edit, never at a gold
label, and says which state to answer from: a :class:`Verdict`, of the guard's own subclass
(:class:`SupportVerdict`, :class:`AgreementVerdict`) when it has more to tell.

:class:`SupportGuard` (the default of :func:`kvedit.focus`:
:data:`kvedit.focusing.choice.DEFAULT_GUARD`) reads the unedited answer: when at least half of
its telling words are in the passages the edit would raise (:func:`answer_support`: words
the prompt does not say outside its passages and most other passages do not hold), the model
is already reading them.
The edit can add no evidence there, only disturb the answer (on NQ it made the model copy the
passage's opening sentence), so the unedited state answers. It costs the unedited answer (one
question pass and its decode steps) before the edited one.

:class:`AgreementGuard` decodes greedily from both states in lockstep. While they agree,
nothing needs deciding. At the first answer token where they differ, each of the two candidate
tokens is scored by its log-probability under *both* states (a product of the two experts): the
edited state's token wins only if the unedited model does not find it much less likely than the
edited model finds the unedited token. A wrong neighbour's number is very unlikely to a model
that was reading the right record, so that edit is dropped; a right number the model had lost in
the middle keeps some probability without the edit, so that edit is kept. Both distributions at
that step are computed anyway, so the rule costs one extra question pass (the unedited answer)
and one decode step per agreeing token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from .. import checks
from ..errors import InvalidTypeError
from ..states.decoding import Answer, Decoder
from ..states.state import KVState
from .words import COMMON_SHARE, common_words, words

__all__ = [
    "COMMON_SHARE",
    "SUPPORT_THRESHOLD",
    "AgreementGuard",
    "AgreementVerdict",
    "Guard",
    "SupportGuard",
    "SupportVerdict",
    "Verdict",
    "answer_support",
    "check_guard",
    "check_verdict",
    "content_words",
    "evidence_and_others",
]


@dataclass(frozen=True)
class Verdict:
    """What a guard decided: the fields every guard's verdict has (a guard of one's own may
    return this class itself; :class:`SupportVerdict` and :class:`AgreementVerdict` add what
    their guard read).

    Attributes:
        kept: whether the edited state should answer.
        reason: the guard's word for why (its subclass lists them).
        answer: the greedy answer of the chosen state (up to the guard's ``max_new_tokens``).
    """

    kept: bool
    reason: str
    answer: Answer


@dataclass(frozen=True)
class AgreementVerdict(Verdict):
    """What :class:`AgreementGuard` decided.

    Attributes:
        reason: ``"agree"`` (same greedy answer), ``"edit"`` or ``"original"`` (the token that
            won where they first differ).
        step: the answer token where the two first differ (``None`` when they agree).
        margin: at ``step``, the joint log-probability of the edited state's token minus that
            of the original's (``0.0`` when they agree).
    """

    step: int | None = None
    margin: float = 0.0


@dataclass(frozen=True)
class SupportVerdict(Verdict):
    """What :class:`SupportGuard` decided.

    Attributes:
        reason: ``"supported"`` (the unedited answer comes from the edited passages: it
            answers) or ``"unsupported"`` (the edited state answers).
        support: the share of the unedited answer's telling words (:func:`answer_support`)
            found in the edited passages.
    """

    support: float


class Guard(Protocol):
    """Decides whether ``edited`` (an edit of ``original``) should answer ``continuation``.

    ``evidence`` holds the texts of the passages the edit raises, ``others`` those of the
    context's other passages, ``query`` the asking part of ``continuation`` (without the
    chat template), and ``outside`` the prompt's text outside its passages (instruction,
    headers, chat template); a guard may ignore all four."""

    def decide(
        self,
        original: KVState,
        edited: KVState,
        continuation: str,
        *,
        evidence: Sequence[str] = (),
        others: Sequence[str] = (),
        query: str | None = None,
        outside: str = "",
    ) -> Verdict: ...


DECIDE_KEYWORDS = ("evidence", "others", "query", "outside")
"""The keywords kvedit passes to a guard's ``decide`` (after ``original, edited,
continuation``)."""


def check_guard(guard: object) -> Guard | None:
    """``guard`` itself when it is ``None`` or has a ``decide`` that takes what kvedit passes
    (the :class:`Guard` protocol: ``original, edited, continuation`` and the keywords
    :data:`DECIDE_KEYWORDS`, or ``**kwargs``); anything else (a class instead of an instance,
    say) is refused with :class:`~kvedit.errors.InvalidTypeError` before any work is done."""
    if guard is None:
        return None
    if isinstance(guard, type):
        raise InvalidTypeError(
            f"guard must be a guard object, not the class {guard.__name__}: pass an instance, "
            f"{guard.__name__}()"
        )
    decide = getattr(guard, "decide", None)
    if not callable(decide):
        raise InvalidTypeError(
            "guard must have a decide(original, edited, continuation, *, evidence, others, "
            f"query, outside) method (kvedit.focusing.guard.Guard), or be None, not {guard!r}"
        )
    refusal = checks.call_refusal(decide, 3, DECIDE_KEYWORDS)
    if refusal is not None:
        raise InvalidTypeError(
            f"guard {type(guard).__name__}.decide cannot be called as kvedit calls it, "
            "decide(original, edited, continuation, evidence=..., others=..., query=..., "
            f"outside=...): {refusal} (accept the keywords, or **kwargs)"
        )
    return guard  # type: ignore[return-value]


def check_verdict(guard: object, verdict: object) -> Verdict:
    """``verdict`` when it is a :class:`Verdict`; otherwise :class:`InvalidTypeError` naming
    ``guard`` and what its ``decide`` returned."""
    if not isinstance(verdict, Verdict):
        raise InvalidTypeError(
            f"guard {type(guard).__name__}.decide returned {checks.describe(verdict)}, not a "
            "kvedit.focusing.guard.Verdict (Verdict(kept, reason, answer))"
        )
    return verdict


@dataclass(frozen=True)
class AgreementGuard:
    """Keep the edit unless, where the answers first differ, the unedited state's token is
    more likely under both states together (see the module docstring).

    Attributes:
        margin: the joint log-probability (nats) by which the edited token must win; 0 keeps
            the edit whenever both states together find its token the more likely one
            (tuning: reports/focus/README.md).
        max_new_tokens: the longest answer decoded (the lockstep stops at the first
            difference; the chosen state then decodes on to this length or EOS).
    """

    margin: float = 0.0
    max_new_tokens: int = 32

    def __post_init__(self) -> None:
        object.__setattr__(self, "margin", checks.real("margin", self.margin))
        object.__setattr__(
            self, "max_new_tokens", checks.count("max_new_tokens", self.max_new_tokens, minimum=1)
        )

    @torch.no_grad()
    def decide(
        self,
        original: KVState,
        edited: KVState,
        continuation: str,
        *,
        evidence: Sequence[str] = (),
        others: Sequence[str] = (),
        query: str | None = None,
        outside: str = "",
    ) -> AgreementVerdict:
        """The verdict for ``edited`` (``evidence``, ``others``, ``query`` and ``outside`` are
        not used)."""
        base, edit = original.decoder(continuation), edited.decoder(continuation)
        tokens: list[int] = []
        base_lps: list[float] = []  # each state's log-probs of the shared tokens
        edit_lps: list[float] = []
        for step in range(self.max_new_tokens):
            # the tokens as KVState.answer picks them (argmax of the raw logits)
            a, b = int(base.next_logits.argmax()), int(edit.next_logits.argmax())
            lp_base = base.next_logits.float().log_softmax(-1)
            lp_edit = edit.next_logits.float().log_softmax(-1)
            if a != b:
                margin = float(lp_base[b] + lp_edit[b] - lp_base[a] - lp_edit[a])
                kept = margin > self.margin
                if kept:
                    answer = _finish(edit, tokens, edit_lps, b, lp_edit, step, self.max_new_tokens)
                else:
                    answer = _finish(base, tokens, base_lps, a, lp_base, step, self.max_new_tokens)
                return AgreementVerdict(kept, "edit" if kept else "original", answer, step, margin)
            if a in edit.eos_ids:
                return AgreementVerdict(True, "agree", _answer(edit, tokens, edit_lps, True))
            tokens.append(a)
            base_lps.append(float(lp_base[a]))
            edit_lps.append(float(lp_edit[a]))
            if step < self.max_new_tokens - 1:
                base.push(a)
                edit.push(a)
        return AgreementVerdict(True, "agree", _answer(edit, tokens, edit_lps, False))


STOP_WORDS = frozenset(
    [
        "a",
        "an",
        "and",
        "are",
        "as",
        "at",
        "be",
        "by",
        "for",
        "from",
        "in",
        "is",
        "it",
        "its",
        "of",
        "on",
        "that",
        "the",
        "this",
        "to",
        "was",
        "were",
        "with",
    ]
)
"""English function words, which :func:`content_words` leaves out: they say nothing about where
an answer came from. The words of a prompt's own frame (its instruction, headers, template) are
left out by :func:`answer_support` from the prompt itself, never from a list."""


def content_words(text: str) -> list[str]:
    """The words of ``text`` (:func:`kvedit.focusing.words.words`) longer than one character,
    with :data:`STOP_WORDS` left out."""
    return [w for w in words(text) if len(w) > 1 and w not in STOP_WORDS]


def evidence_and_others(texts: Sequence[str], chosen: Sequence[int]) -> tuple[list[str], list[str]]:
    """``texts`` (every passage's text) split into the ``chosen`` ones, in ``chosen``'s order
    (a guard's ``evidence``), and the rest, in passage order (its ``others``)."""
    picked = set(chosen)
    return [texts[i] for i in chosen], [t for i, t in enumerate(texts) if i not in picked]


def answer_support(
    answer: str,
    evidence: Sequence[str],
    question: str,
    others: Sequence[str] = (),
    shared: float = COMMON_SHARE,
    outside: str = "",
) -> float:
    """The share of ``answer``'s telling words that occur in ``evidence`` (the texts of the
    passages an edit raises); 0 when the answer has no telling word.

    The telling words are its :func:`content_words` that are neither the prompt's own words
    (those of ``question`` and of ``outside``, the prompt's text outside its passages: an
    instruction's "answer", a header's "document") nor common among ``others`` (the context's
    other passages: :func:`kvedit.focusing.words.common_words`, held by more than ``shared``
    of them, default :data:`~kvedit.focusing.words.COMMON_SHARE`; 1 leaves none out). A word
    the answer invents, found in no passage, counts against it."""
    asked = set(words(question)) | set(words(outside)) | common_words(others, shared)
    telling = [w for w in content_words(answer) if w not in asked]
    if not telling:
        return 0.0
    present = {w for text in evidence for w in words(text)}
    return sum(w in present for w in telling) / len(telling)


SUPPORT_THRESHOLD = 0.5
"""The support (share of the unedited answer's telling words found in the chosen passage) at
which :class:`SupportGuard` answers unedited: when most of the answer already comes from that
passage, the edit can only disturb it (tuning: reports/focus/README.md)."""


@dataclass(frozen=True)
class SupportGuard:
    """Keep the edit unless the unedited answer already comes from the edited passages.

    The unedited state answers first (greedy). When at least ``threshold`` of that answer's
    telling words (:func:`answer_support`: words the prompt does not say outside its passages
    and most other passages do not hold) occur in the passages the edit raises, the unedited
    state answers; otherwise the edited one does. An answer with no such word (an empty
    answer, or one that only repeats the question) keeps the edit.

    Attributes:
        threshold: the support (a share in ``[0, 1]``) at which the unedited answer stands
            (:data:`SUPPORT_THRESHOLD`).
        max_new_tokens: the longest answer decoded, unedited and edited.
        shared: a word found in more than this share of the other passages is left out of
            the support (:data:`COMMON_SHARE`; 1 leaves none out).
        read: the part of an answer the caller reads (``None``: all of it). A base model
            asked in a plain prompt runs on past its answer into the next question; the
            eval reads only its first line (:func:`kvedit.prompts.plain_answer`), and
            so must the guard.
    """

    threshold: float = SUPPORT_THRESHOLD
    max_new_tokens: int = 32
    read: Callable[[str], str] | None = None
    shared: float = COMMON_SHARE

    def __post_init__(self) -> None:
        object.__setattr__(self, "threshold", checks.share("threshold", self.threshold))
        object.__setattr__(
            self, "max_new_tokens", checks.count("max_new_tokens", self.max_new_tokens, minimum=1)
        )
        object.__setattr__(self, "shared", checks.share("shared", self.shared))
        if self.read is not None:
            refusal = checks.call_refusal(self.read, 1) if callable(self.read) else "not callable"
            if refusal is not None:
                raise InvalidTypeError(
                    "read must be a function (answer text) -> the part read, or None, not "
                    f"{checks.describe(self.read)}: {refusal}"
                )

    @torch.no_grad()
    def decide(
        self,
        original: KVState,
        edited: KVState,
        continuation: str,
        *,
        evidence: Sequence[str] = (),
        others: Sequence[str] = (),
        query: str | None = None,
        outside: str = "",
    ) -> SupportVerdict:
        """The verdict for ``edited``: the unedited answer's support in ``evidence``, with
        the prompt's own words (those of ``continuation``, ``query`` and ``outside``) and
        those most of ``others`` share left out."""
        unedited = original.answer(continuation, self.max_new_tokens)
        text = unedited.text if self.read is None else self.read(unedited.text)
        if not isinstance(text, str):
            raise InvalidTypeError(
                f"SupportGuard's read {getattr(self.read, '__name__', self.read)!r} returned "
                f"{checks.describe(text)}, not the str of the answer it reads"
            )
        asked = continuation if query is None else f"{query}\n{continuation}"
        share = answer_support(text, evidence, asked, others, self.shared, outside)
        if share >= self.threshold:
            return SupportVerdict(False, "supported", unedited, share)
        answer = edited.answer(continuation, self.max_new_tokens)
        return SupportVerdict(True, "unsupported", answer, share)


def _finish(
    dec: Decoder,
    tokens: list[int],
    logprobs: list[float],
    token: int,
    lp: torch.Tensor,
    step: int,
    max_new_tokens: int,
) -> Answer:
    """Greedy decoding of ``dec`` on from ``token`` (chosen at ``step``) to the length limit."""
    tokens, logprobs = list(tokens), list(logprobs)
    while True:
        if token in dec.eos_ids:
            return _answer(dec, tokens, logprobs, finished=True)
        tokens.append(token)
        logprobs.append(float(lp[token]))
        step += 1
        if step >= max_new_tokens:
            return _answer(dec, tokens, logprobs, finished=False)
        logits = dec.push(token)
        lp = logits.float().log_softmax(-1)
        token = int(logits.argmax())


def _answer(dec: Decoder, tokens: list[int], logprobs: list[float], finished: bool) -> Answer:
    return Answer(
        dec.tokenizer.decode(tokens, skip_special_tokens=True), tokens, logprobs, finished
    )
