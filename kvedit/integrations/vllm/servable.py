"""What vLLM can serve: one rule for :func:`~kvedit.integrations.vllm.publish`,
:func:`~kvedit.integrations.vllm.contexts.publish_context`,
:class:`~kvedit.integrations.vllm.answer.VLLMAnswerer` and ``kvedit eval litm --engine vllm``.

vLLM's kernels take no per-key bias, so a state's biases become copies or removals
(:func:`~kvedit.integrations.vllm.stock.to_stock`). :func:`judge` sorts the outcome:

* **exact**: every bias realised as asked, no null entries. Served.
* **approximate**: something of the edit is realised, but not all of it as asked (a copy count
  off the asked bias, one shared copy count where layers asked different biases, a removal of
  an entry kvedit still gives ``e**-|b|`` of its weight, null entries, or some biases left out:
  on sliding-window layers, or too small for one copy). Served only when asked
  (``approximate=True``, ``--approximate``), and then labelled: the state gets a
  ``Step("approximation", "vllm", ...)`` (:func:`approximation_step`), so its digest, the
  published file's name and every record built from it say so.
* **not realisable**: the state has biases and none of them is realised (a ``suppress``
  above ``-remove_at`` nats, an ``emphasize`` below ``log 1.5`` nats, biases on
  sliding-window layers only): vLLM would serve the unedited cache. Refused even with
  ``approximate=True``; the error says what to ask instead (a removal with a lower
  ``remove_at``, a stronger emphasize).

:func:`check` applies the rule to a :class:`~kvedit.integrations.vllm.stock.StockCache` and
:func:`realize` to a state (before anything is written or sent to vLLM). Pure Python: no vLLM.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ...errors import InvalidInputError
from ...provenance import Step
from ...states.state import KVState
from .stock import REMOVE_AT, BiasRealization, StockCache, to_stock

__all__ = [
    "APPROXIMATE_HINT",
    "Servability",
    "approximation_step",
    "check",
    "judge",
    "label",
    "realize",
]

APPROXIMATE_HINT = "pass approximate=True (kvedit publish / kvedit eval litm: --approximate)"
"""How to ask for an approximate realisation, named in every refusal."""


def _lost(r: BiasRealization) -> bool:
    """A bias asked and not realised at all (left out, or rounded to no copy)."""
    if r.how == "unrealized":
        return r.asked != 0
    return r.how == "copies" and r.copies == 0 and r.asked != 0


def _realized(r: BiasRealization) -> bool:
    return r.how == "removed" or (r.how == "copies" and r.copies > 0)


@dataclass(frozen=True)
class Servability:
    """How a stock cache realises its state's edit (see the module doc).

    Attributes:
        exact: every bias realised as asked and no null entries.
        realisable: something of the edit is realised (False: biases were asked and none is).
        lost: the biases asked and not realised at all.
        approximate: the biases realised with another value than asked.
        null_entries: null (zero) entries padding heads or layers that asked fewer copies.
    """

    exact: bool
    realisable: bool
    lost: tuple[BiasRealization, ...]
    approximate: tuple[BiasRealization, ...]
    null_entries: int

    @property
    def label(self) -> str:
        """``"exact"``, ``"approximate"`` or ``"not realisable"``."""
        if self.exact:
            return "exact"
        return "approximate" if self.realisable else "not realisable"

    def describe(self) -> str:
        """One line: what is not as asked."""
        parts = []
        if self.lost:
            layers = sorted({r.layer for r in self.lost})
            asked = sorted({round(r.asked, 3) for r in self.lost})
            parts.append(f"bias(es) {asked} nats left out on layers {_ranges(layers)}")
        if self.approximate:
            worst = max(self.approximate, key=_error)
            parts.append(
                f"{len(self.approximate)} bias value(s) realised approximately (worst: "
                f"{worst.asked:+.3f} asked, {worst.realized:+.3f} realised on layer {worst.layer})"
            )
        if self.null_entries:
            parts.append(f"{self.null_entries} null entries")
        return "; ".join(parts) or "exact"


def _error(r: BiasRealization) -> float:
    if math.isinf(r.realized):
        return math.inf if r.asked > -1e30 else 0.0
    return abs(r.asked - r.realized)


def _ranges(values: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``"0-2, 5"``."""
    out: list[str] = []
    for v in values:
        if out and int(out[-1].split("-")[-1]) == v - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{v}"
        else:
            out.append(str(v))
    return ", ".join(out)


def judge(stock: StockCache) -> Servability:
    """Sort ``stock``'s realisations (pure: reads ``realizations`` and ``null_entries``)."""
    lost = tuple(r for r in stock.realizations if _lost(r))
    approx = tuple(r for r in stock.realizations if not r.exact and not _lost(r))
    nulls = sum(stock.null_entries)
    asked = any(r.asked != 0 for r in stock.realizations)
    realisable = not asked or any(_realized(r) for r in stock.realizations) or nulls > 0
    exact = not lost and not approx and not nulls
    return Servability(exact, realisable, lost, approx, nulls)


def _advice(verdict: Servability, remove_at: float) -> str:
    """What to ask instead of an edit that cannot be realised at all."""
    tips = []
    negative = [r.asked for r in verdict.lost if r.asked < 0]
    positive = [r.asked for r in verdict.lost if r.asked > 0]
    if negative:
        weakest = max(negative)
        tips.append(
            f"a suppress is realised only as a removal (bias <= -{remove_at:g} nats): suppress "
            f"by at least {remove_at:g} nats (exact from {104} nats), or approximate it by a "
            f"removal with remove_at={-weakest:g} and {APPROXIMATE_HINT}"
        )
    if positive:
        tips.append("an emphasize needs at least log 1.5 nats (one copy; exact at log(r + 1))")
    sliding = [r for r in verdict.lost if r.how == "unrealized" and r.asked > 0]
    if sliding:
        tips.append("sliding-window layers get no copies")
    return "; ".join(tips)


def check(
    stock: StockCache,
    *,
    approximate: bool = False,
    remove_at: float = REMOVE_AT,
    what: str = "the state",
) -> Servability:
    """The rule (see the module doc) for ``stock``: its :class:`Servability`, or an error.

    Raises:
        InvalidInputError: the edit cannot be realised at all (always), or only approximately
            and ``approximate`` is False. The message names the biases and what to ask.
    """
    verdict = judge(stock)
    if not verdict.realisable:
        raise InvalidInputError(
            f"{what} cannot be served by vLLM: {verdict.describe()}, nothing of its edit is "
            f"realised (no per-key bias on vLLM's kernels), so vLLM would answer from the "
            f"unedited cache; {_advice(verdict, remove_at)}. Nothing was written"
        )
    if not verdict.exact and not approximate:
        raise InvalidInputError(
            f"{what} is realised on vLLM only approximately ({verdict.describe()}); to serve the "
            f"approximation, labelled in the state's history, {APPROXIMATE_HINT}. Nothing was "
            "written"
        )
    return verdict


def approximation_step(stock: StockCache, remove_at: float = REMOVE_AT) -> Step:
    """The ``Step("approximation", "vllm", ...)`` that labels a state served approximately:
    how many bias values were realised exactly, approximately or not at all, the worst error
    in nats, the layers that lost a bias, and the null entries."""
    verdict = judge(stock)
    errors = [_error(r) for r in verdict.approximate]
    finite = [e for e in errors if math.isfinite(e)]
    return Step(
        "approximation",
        "vllm",
        {
            "engine": "vllm",
            "remove_at": float(remove_at),
            "exact_biases": sum(r.exact for r in stock.realizations),
            "approximate_biases": len(verdict.approximate),
            "lost_biases": len(verdict.lost),
            "lost_layers": sorted({r.layer for r in verdict.lost}),
            "max_error_nats": round(max(finite), 6) if finite else 0.0,
            "null_entries": verdict.null_entries,
            "slots": stock.n_slots,
        },
        exact=False,
    )


def label(
    state: KVState, stock: StockCache, remove_at: float = REMOVE_AT
) -> tuple[KVState, StockCache]:
    """``(state with :func:`approximation_step` appended, stock named by the labelled state's
    digest and history)``: new objects, ``state`` and ``stock`` are left as they are. A state
    already labelled for this stock is kept."""
    step = approximation_step(stock, remove_at)
    last = state.history.steps[-1] if state.history.steps else None
    if last is not None and last.kind == "approximation" and last.name == step.name:
        labelled = state
    else:
        labelled = state.with_step(step)
    return labelled, dataclasses.replace(stock, digest=labelled.digest, history=labelled.history)


def realize(
    state: KVState,
    *,
    approximate: bool = False,
    remove_at: float = REMOVE_AT,
    what: str = "the state",
) -> tuple[KVState, StockCache]:
    """``state``'s stock cache, by the rule: ``(state, stock)`` when it is exact; when it is
    approximate and ``approximate`` is True, ``(state labelled with an approximation step,
    stock named by the labelled digest)``.

    Raises:
        InvalidInputError: see :func:`check`; also what :func:`to_stock` raises.
    """
    stock = to_stock(state, remove_at=remove_at)
    verdict = check(stock, approximate=approximate, remove_at=remove_at, what=what)
    if verdict.exact:
        return state, stock
    return label(state, stock, remove_at)
