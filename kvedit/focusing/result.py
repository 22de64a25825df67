"""What :func:`kvedit.focus` and :func:`kvedit.choose` return: :class:`Focus`, the state that
answers, the passages, their scores, the chosen ones, each layer's bias and the guard's verdict,
with :meth:`Focus.explain` (the choice in words) and :meth:`Focus.generate` (the answer, from the
guard's or the scoring pass where they hold it). The choice itself is
:mod:`kvedit.focusing.choice`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import checks
from ..states.state import KVState
from .guard import AgreementVerdict, SupportVerdict, Verdict
from .passages import Range
from .primed import Continued

__all__ = ["Focus"]


@dataclass(frozen=True)
class Focus:
    """What :func:`~kvedit.focusing.choice.focus` did (frozen: setting an attribute raises;
    :func:`~kvedit.focusing.choice.guarded` returns a new one).

    Attributes:
        state: the state that answers: the edited one, or the input state itself when
            nothing was edited (:func:`~kvedit.focusing.choice.choose`) or the guard dropped
            the edit.
        passages: ``(start, end)`` character ranges of the passages in ``state.text``.
        scores: one relevance score per passage (higher: the question points at it more).
        chosen: indices into ``passages`` of the emphasized passages, best first; empty when
            focus abstained (no passage stands out:
            :func:`~kvedit.focusing.scoring.stands_out`, and none alone holds all of the
            question's shared distinctive words: :func:`~kvedit.focusing.scoring.sole_holder`),
            and then nothing was edited.
        strengths: the bias (nats) each layer's chosen passages got (or would get); all 0
            when nothing is chosen.
        question: the continuation :meth:`generate` asks.
        verdict: the guard's decision (``None`` without a guard): a
            :class:`~kvedit.focusing.guard.Verdict`, of the guard's own subclass for the
            library's guards (:class:`~kvedit.focusing.guard.SupportVerdict`, ...).
        reason: why nothing was chosen (``""`` when something was).
        echoes: indices of the passages that only restate the question (never chosen).
        best: the best-scored eligible passage, chosen or not (``None`` without candidates).
        eligible: the passages focus may choose: the candidates (not echoes) that hold the
            most of the question's distinctive words
            (:func:`~kvedit.focusing.scoring.best_covered`; all candidates when none holds any).
        query: the asking part of :attr:`question` (its words are left out of a guard's
            reading of the answer; ``None``: the whole question).
        by_words: the passage was chosen because it alone holds all of the question's
            distinctive words, each of which other passages hold too
            (:func:`~kvedit.focusing.scoring.sole_holder`), with a positive score that does not
            stand out.
        continued: the scoring pass of :attr:`question` over the unedited state
            (:class:`~kvedit.focusing.primed.Continued`), while that state answers (``None``
            once an edit answers): the guard's unedited answer and :meth:`generate` start
            from it instead of running the question again. It holds the question's K/V only.
    """

    state: KVState
    passages: list[Range]
    scores: list[float]
    chosen: list[int]
    strengths: list[float]
    question: str
    verdict: Verdict | None = None
    reason: str = ""
    echoes: list[int] = field(default_factory=list)
    best: int | None = None
    eligible: list[int] = field(default_factory=list)
    query: str | None = None
    continued: Continued | None = field(default=None, repr=False, compare=False)
    by_words: bool = False

    @property
    def kept(self) -> bool:
        """Whether the edit stands (``True`` when no guard was asked)."""
        return self.verdict is None or self.verdict.kept

    def explain(self, width: int = 40) -> str:
        """A table: passage index, its first ``width`` characters, score, ``*`` if chosen
        (``echo`` if it only restates the question); then, when nothing was chosen, why."""
        lines = [f"{'#':>3}  {'passage':<{width}}  {'score':>7}  chosen"]
        for i, ((a, b), score) in enumerate(zip(self.passages, self.scores, strict=True)):
            text = " ".join(self.state.text[a:b].split())
            if len(text) > width:
                text = text[: width - 3] + "..."
            mark = "*" if i in self.chosen else ("echo" if i in self.echoes else "")
            lines.append(f"{i:>3}  {text:<{width}}  {score:>7.3f}  {mark}")
        if not self.chosen:
            lines.append(f"no edit: {self.reason or 'no passage chosen'}")
        elif self.by_words:
            lines.append(
                f"chosen #{self.chosen[0]}: the only passage holding all of the question's "
                "distinctive words (its score does not stand out)"
            )
        v = self.verdict
        if v is not None:
            lines.append(f"edit {'kept' if v.kept else 'dropped'}: {_verdict_said(v)}")
        return "\n".join(lines)

    def generate(self, max_new_tokens: int = 32, **kw) -> str:
        """Continue :attr:`state` with :attr:`question` (see :meth:`kvedit.KVState.generate`).

        A greedy call no longer than the guard's answer reuses that answer (the same tokens);
        a greedy call from the unedited state starts after the scoring pass of the question
        (:attr:`continued`).
        """
        max_new_tokens = checks.count("max_new_tokens", max_new_tokens)
        known = None if self.verdict is None or kw else self.verdict.answer
        if known is not None and (max_new_tokens <= len(known.token_ids) or known.finished):
            ids = known.token_ids[:max_new_tokens]
            return self.state.tokenizer.decode(ids, skip_special_tokens=True)
        c = self.continued
        if c is not None and not kw and c.matches(self.state, self.question):
            return c.answer(max_new_tokens).text
        return self.state.generate(self.question, max_new_tokens, **kw)


_AGREEMENT_SAID = {
    "agree": "same answer with and without it",
    "edit": "the edit's answer won",
    "original": "the unedited answer won",
}


def _verdict_said(v: Verdict) -> str:
    """Why the guard decided as it did, for :meth:`Focus.explain` (a reason no known guard
    gives is shown as is)."""
    if isinstance(v, SupportVerdict):
        return f"{v.support:.0%} of the unedited answer's telling words are in the passage"
    said = _AGREEMENT_SAID.get(v.reason, v.reason)
    if isinstance(v, AgreementVerdict) and v.step is not None:
        said += f" at answer token {v.step}, margin {v.margin:.2f}"
    return said
