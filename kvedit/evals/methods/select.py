"""``select``: the captured documents compressed with :func:`kvedit.compress.select`.

``select:scorer=knorm:keep=0.5`` keeps, per KV head, half of each global layer's entries ranked
by a registered scorer (``snapkv``, ``knorm``, ``tova``, ``h2o``: :mod:`kvedit.compress.scorers`);
``adaptive=True`` (or ``1``) shares each layer's budget among its heads by score mass (AdaKV,
each head keeping at least ``floor`` of its share). ``observe``, ``window`` and ``kernel`` go to
the scorers that take them (SnapKV observes the question, the continuation text, or the
documents' last ``window`` tokens; H2O keeps its last ``window`` tokens). ``protect=focus``
never drops the document :func:`kvedit.focusing.choice.choose` picks for the question (its defaults,
the ``auto`` method's choice); ``protect=gold`` the gold document (an oracle upper bound).
``bits=8`` (or 4, 2) quantizes the selected cache: selection and quantization combined.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kvedit.cache.packed import BITS
from kvedit.compress import SCORERS, AdaKV, Scorer, make_scorer, quantize, select
from kvedit.errors import InvalidInputError
from kvedit.evals.methods.context import ExampleContext
from kvedit.evals.methods.params import (
    check_choice,
    check_count,
    check_fraction,
    check_int_choice,
)
from kvedit.evals.methods.registry import Method, register_method
from kvedit.focusing.choice import choose

__all__ = ["OBSERVE", "PROTECT", "Select", "SelectParams", "build_scorer"]

OBSERVE = ("question", "window")
"""What an observing scorer (SnapKV) reads: the question, or the documents' last tokens."""

PROTECT = ("none", "focus", "gold")
"""What no head may drop: nothing, the focus-chosen document, or the gold document."""


@dataclass(frozen=True)
class SelectParams:
    """The parameters of ``select``.

    Attributes:
        scorer: A registered scorer name (:data:`kvedit.compress.SCORERS`).
        keep: The fraction of each global layer's entries a head keeps on average, ``(0, 1]``.
        adaptive: Share each layer's budget among its heads by score mass (AdaKV); ``True``
            or ``False`` (``1``/``0`` in a spec).
        floor: With ``adaptive``, the fraction of the uniform budget every head keeps, ``[0, 1]``.
        observe: ``"question"`` or ``"window"``: what an observing scorer reads.
        window: The recent tokens always kept (SnapKV, H2O); SnapKV's observation window.
        kernel: SnapKV's pooling width (a positive odd int).
        protect: ``"none"``, ``"focus"`` or ``"gold"``: which document no head drops.
        bits: ``0`` (none), or ``2``/``4``/``8``: quantize the selected cache
            (:func:`kvedit.compress.quantize` after the selection: select, then quantize).
    """

    scorer: str = "snapkv"
    keep: float = 0.5
    adaptive: bool | int = False
    floor: float = 0.2
    observe: str = "question"
    window: int = 32
    kernel: int = 5
    protect: str = "none"
    bits: int = 0

    def __post_init__(self) -> None:
        check_choice("scorer", self.scorer, tuple(sorted(SCORERS)))
        object.__setattr__(self, "keep", check_fraction("keep", self.keep, open_low=True))
        if self.adaptive not in (True, False) or type(self.adaptive) not in (bool, int):
            raise InvalidInputError(f"adaptive must be True/False or 1/0, not {self.adaptive!r}")
        object.__setattr__(self, "adaptive", bool(self.adaptive))
        object.__setattr__(self, "floor", check_fraction("floor", self.floor))
        check_choice("observe", self.observe, OBSERVE)
        object.__setattr__(self, "window", check_count("window", self.window))
        object.__setattr__(self, "kernel", check_count("kernel", self.kernel, minimum=1))
        check_choice("protect", self.protect, PROTECT)
        object.__setattr__(self, "bits", check_int_choice("bits", self.bits, (0, *BITS)))
        build_scorer(self, "")  # refuse what the scorer refuses (an even kernel...) now


def build_scorer(params: SelectParams, continuation: str) -> Scorer:
    """The scorer ``params`` name, given the parameters it takes (``query`` is
    ``continuation`` when ``observe="question"``), wrapped in AdaKV when ``adaptive``."""
    offered: dict[str, Any] = {
        "query": continuation if params.observe == "question" else None,
        "window": params.window,
        "kernel": params.kernel,
    }
    taken = {f.name for f in dataclasses.fields(SCORERS[params.scorer]) if f.init}
    scorer = make_scorer(params.scorer, **{k: v for k, v in offered.items() if k in taken})
    return AdaKV(scorer, params.floor) if params.adaptive else scorer


@register_method("select")
class Select(Method):
    """The documents' cache compressed by a scorer's per-head selection."""

    Params = SelectParams

    def __init__(self, params: Any = None, /, **values: Any) -> None:
        super().__init__(params, **values)
        self.needs_documents = self.params.protect != "none"

    def predict(self, ctx: ExampleContext) -> str:
        p = self.params
        state = select(
            ctx.state,
            build_scorer(p, ctx.continuation),
            float(p.keep),
            protect=self.protected(ctx),
        )
        if p.bits:
            state = quantize(state, bits=p.bits)
        ctx.compressed(state)
        return state.generate(ctx.continuation, ctx.max_new_tokens)

    def protected(self, ctx: ExampleContext) -> list[tuple[int, int]] | None:
        """The character spans of ``ctx.prefix`` no head may drop (None: nothing).

        ``protect=focus`` protects the passages :func:`kvedit.focusing.choice.choose` picks, and
        nothing when it abstains."""
        if self.params.protect == "gold":
            return [ctx.gold_span()]
        if self.params.protect == "focus":
            found = ctx.memo(
                "select_focus",
                lambda: choose(
                    ctx.state, ctx.continuation, ctx.doc_spans, query=ctx.example.question
                ),
            )
            # Focus abstains when no passage stands out: then nothing is protected.
            return [found.passages[i] for i in found.chosen] or None
        return None
