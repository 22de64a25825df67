"""Do-no-harm guards: keep a cache edit only where it is not expected to hurt the answer.

An edit that moves attention onto the right passage fixes an answer lost in the middle; the
same edit on the wrong passage (the neighbour of the right one, say) breaks an answer the model
already had. A guard looks at the model's answers with and without the edit, never at a gold
label, and says which state to answer from.

:class:`AgreementGuard` (the default of :func:`kvedit.focus`) decodes greedily from both
states in lockstep. While they agree, nothing needs deciding. At the first answer token where
they differ, each of the two candidate tokens is scored by its log-probability under *both*
states (a product of the two experts): the edited state's token wins only if the unedited model
does not find it much less likely than the edited model finds the unedited token. A wrong
neighbour's number is very unlikely to a model that was reading the right record, so that edit
is dropped; a right number the model had lost in the middle keeps some probability without the
edit, so that edit is kept. Both distributions at that step are computed anyway, so the rule
costs one extra question pass (the unedited answer) and one decode step per agreeing token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from . import checks
from .decoding import Answer, Decoder
from .state import KVState

__all__ = ["AgreementGuard", "Guard", "Verdict"]


@dataclass(frozen=True)
class Verdict:
    """What a guard decided.

    Attributes:
        kept: whether the edited state should answer.
        reason: ``"agree"`` (same greedy answer), ``"edit"`` or ``"original"`` (the token that
            won where they first differ).
        step: the answer token where the two first differ (``None`` when they agree).
        margin: at ``step``, the joint log-probability of the edited state's token minus that
            of the original's (``0.0`` when they agree).
        answer: the greedy answer of the chosen state (up to the guard's ``max_new_tokens``).
    """

    kept: bool
    reason: str
    step: int | None
    margin: float
    answer: Answer


class Guard(Protocol):
    """Decides whether ``edited`` (an edit of ``original``) should answer ``continuation``."""

    def decide(self, original: KVState, edited: KVState, continuation: str) -> Verdict: ...


@dataclass(frozen=True)
class AgreementGuard:
    """Keep the edit unless, where the answers first differ, the unedited state's token is
    more likely under both states together (see the module docstring).

    Attributes:
        margin: the joint log-probability (nats) by which the edited token must win; 0 keeps
            the edit on any win. Chosen on tuning seeds (see ``reports/``).
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
    def decide(self, original: KVState, edited: KVState, continuation: str) -> Verdict:
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
                return Verdict(kept, "edit" if kept else "original", step, margin, answer)
            if a in edit.eos_ids:
                return Verdict(True, "agree", None, 0.0, _answer(edit, tokens, edit_lps, True))
            tokens.append(a)
            base_lps.append(float(lp_base[a]))
            edit_lps.append(float(lp_edit[a]))
            if step < self.max_new_tokens - 1:
                base.push(a)
                edit.push(a)
        return Verdict(True, "agree", None, 0.0, _answer(edit, tokens, edit_lps, False))


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
