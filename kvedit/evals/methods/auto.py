"""``auto``: emphasize the documents the question's bias-corrected attention points at."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvedit import checks
from kvedit.errors import InvalidInputError
from kvedit.evals.methods.context import ExampleContext
from kvedit.evals.methods.edits import EditParams
from kvedit.evals.methods.focus import example_focus, focused_answer, focused_state
from kvedit.evals.methods.params import check_count, check_fraction, check_real
from kvedit.evals.methods.registry import Method, register_method
from kvedit.focusing.choice import ABSTAIN_THRESHOLD, SCORE_SMOOTHING, SUPPORT_THRESHOLD, Focus
from kvedit.focusing.words import COMMON_SHARE
from kvedit.states.state import KVState

__all__ = ["GUARDS", "Auto", "AutoParams", "auto_hit_rate"]

GUARDS = ("support", "agreement", "none")
"""The answer guards ``auto``'s ``guard`` names (:class:`AutoParams`)."""


# The bias is sized per layer to lift one chosen document's share to `target` (0.2, at most
# `strength` 5 nats), because a fixed strength broke the document next to the question on NQ;
# chosen on tuning seeds (reports/focus/README.md §10).
@dataclass(frozen=True)
class AutoParams(EditParams):
    """The parameters of ``auto`` (and ``reread``): the edit, and how documents are chosen.

    Attributes:
        strength: With ``target``, the most bias (nats) a layer may get; without, the bias.
        top_k: How many documents are chosen (at least 1).
        layers: ``(lo, hi)``, the layers whose attention scores the documents, as fractions
            of the depth (``0 <= lo <= hi <= 1``).
        target: The attention share each layer's bias lifts the chosen documents to, in
            ``(0, 1)``; ``None`` adds ``strength`` everywhere instead. Only ``emphasize``
            uses it.
        guard: The answer guard (:mod:`kvedit.focusing.guard`): ``"support"`` (the default of a cache
            edit, :class:`~kvedit.focusing.guard.SupportGuard`: answer unedited where at least ``support`` of
            the unedited answer's telling words are in the chosen document), ``"agreement"``
            or ``True`` (:class:`~kvedit.focusing.guard.AgreementGuard`: keep the edit only where, at
            the first answer token where the answers differ, the edit's token is the likelier
            under both states; it hurt NQ on the tuning seed), ``"none"`` or ``False`` (no
            guard; the default, and the only one, of ``edit="steer"``).
        support: :class:`~kvedit.focusing.guard.SupportGuard`'s threshold
            (:data:`kvedit.focusing.choice.SUPPORT_THRESHOLD`).
        shared: :class:`~kvedit.focusing.guard.SupportGuard`'s share of the other documents a word
            may be found in and still count as support (:data:`kvedit.focusing.words.COMMON_SHARE`;
            1: none left out, the rule before shared words were left out). Recorded, so runs made before are never
            reused for this rule.
        smoothing: The share added to both sides of each score's log ratio, as a fraction
            of the mean share of a document (:data:`kvedit.focusing.choice.SCORE_SMOOTHING`;
            recorded, so results made with another value are never reused for this one).
        threshold: The robust z-score a document's score must reach to be emphasized
            (:data:`kvedit.focusing.choice.ABSTAIN_THRESHOLD`); when none does, ``auto`` edits nothing
            and answers as ``none``. ``None`` always edits the ``top_k`` best (the former
            behaviour). Recorded like ``smoothing``.
        all_words: When no document stands out, choose the one that alone holds all of the
            question's distinctive words, each shared by other documents, if its score is
            positive (:func:`kvedit.focusing.scoring.sole_holder`). Recorded like ``smoothing``.
    """

    strength: float = 5.0
    top_k: int = 1
    layers: tuple[float, float] = (0.0, 1.0)
    target: float | None = 0.2
    guard: bool | str = "default"
    support: float = SUPPORT_THRESHOLD
    shared: float = COMMON_SHARE
    smoothing: float = SCORE_SMOOTHING
    threshold: float | None = ABSTAIN_THRESHOLD
    all_words: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "all_words", checks.flag("all_words", self.all_words))
        if self.threshold is not None:
            object.__setattr__(self, "threshold", check_real("threshold", self.threshold))
        object.__setattr__(self, "top_k", check_count("top_k", self.top_k, minimum=1))
        smoothing = check_fraction("smoothing", self.smoothing, open_low=True)
        object.__setattr__(self, "smoothing", smoothing)
        default = "none" if self.edit == "steer" else "support"
        guard = {True: "agreement", False: "none", "default": default}.get(self.guard, self.guard)
        if guard not in GUARDS:
            raise InvalidInputError(
                f"guard must be one of {', '.join(GUARDS)} (or True/False), not {self.guard!r}"
            )
        object.__setattr__(self, "guard", guard)
        object.__setattr__(self, "support", check_fraction("support", self.support))
        object.__setattr__(self, "shared", check_fraction("shared", self.shared))
        if guard != "none" and self.edit == "steer":
            raise InvalidInputError(
                f"guard {guard!r} needs a cache edit to compare: with edit='steer' use guard=none"
            )
        layers = self.layers
        if isinstance(layers, str) or not isinstance(layers, Sequence) or len(layers) != 2:
            raise InvalidInputError(f"layers must be a pair (lo, hi), not {layers!r}")
        lo = check_fraction("layers[0]", layers[0])
        hi = check_fraction("layers[1]", layers[1])
        if lo > hi:
            raise InvalidInputError(f"layers must have lo <= hi, not {layers!r}")
        object.__setattr__(self, "layers", (lo, hi))
        if self.target is not None:
            target = check_real("target", self.target)
            if not 0.0 < target < 1.0:
                raise InvalidInputError(f"target share must be in (0, 1), not {target!r}")
            object.__setattr__(self, "target", target)
            if self.strength < 0:
                raise InvalidInputError(
                    f"strength (the most bias a target may add) must be >= 0, not {self.strength}"
                )


@register_method("auto")
class Auto(Method):
    """Emphasize the documents the question's bias-corrected attention points at.

    With ``target`` (default 0.2), each layer's bias is the one that lifts the chosen
    documents' attention share to ``target`` (:func:`kvedit.focusing.choice.adaptive_strengths`, at most
    ``strength``); ``target=None`` adds ``strength`` everywhere instead. Parameters:
    :class:`AutoParams`. Leaves ``ctx.notes["auto_choice"]`` (the chosen documents) and, with
    a target, ``ctx.notes["auto_strengths"]`` (the bias of each layer).
    """

    Params = AutoParams
    needs_documents = True

    def answer_state(self, ctx: ExampleContext) -> KVState:
        state, found = focused_state(ctx, self.params)
        if state is None:
            return super().answer_state(ctx)
        self._note(ctx, found)
        return state

    def predict(self, ctx: ExampleContext) -> str:
        answer, found = focused_answer(ctx, self.params)
        self._note(ctx, found)
        return answer

    def _note(self, ctx: ExampleContext, found: Focus) -> None:
        """Leave the choice (and the guard's verdict, the per-layer strengths) in ``ctx.notes``."""
        p = self.params
        ctx.notes["auto_choice"] = found.chosen
        if found.verdict is not None:
            ctx.notes["auto_verdict"] = found.verdict
        if p.edit == "emphasize" and p.target is not None:
            ctx.notes["auto_strengths"] = torch.tensor(found.strengths)


def auto_hit_rate(contexts: list[ExampleContext], params: AutoParams | None = None) -> float:
    """Fraction of examples whose top-scored document is the gold one (a retrieval check)."""
    p = dataclasses.replace(params or AutoParams(), top_k=1)
    # the best-scored document, whether or not it stands out enough to be edited
    hits = [example_focus(c, p, edit=False).best == c.example.gold_index for c in contexts]
    return sum(hits) / max(1, len(hits))
