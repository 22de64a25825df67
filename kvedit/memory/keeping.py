"""How the entries a :class:`kvedit.Memory`'s forgetting rounds keep may differ across KV heads
and layers: ``Memory(keep=)`` (:data:`KEEPS`), and the older keywords ``per_head=`` and
``per_layer=`` it replaces (:func:`keep_of`; a file that kept them still reads)."""

from __future__ import annotations

from .. import checks
from ..compress.scorers import Scorer
from ..errors import InvalidInputError
from ..states.state import KVState

__all__ = ["KEEPS", "checked_keep", "keep_of"]

KEEPS = ("auto", "head", "layer", "token")
"""What ``Memory(keep=)`` takes: how the entries a round keeps may differ. ``"head"``: each KV
head keeps its own (an arrival policy only); ``"layer"``: each global layer keeps its own, the
same on every head; ``"token"``: every global layer and head keeps the same tokens (what a
stock serving kernel, one slot per token for all layers, holds exactly); ``"auto"``: ``"head"``
where the policy scores arrivals, the model's global layers have more than one KV head,
``quantize`` is off and the budget counts entries, else ``"layer"``."""


def keep_of(keep: str | None, per_head: bool | None, per_layer: bool | None) -> str:
    """The ``keep`` (:data:`KEEPS`) of ``Memory``'s keywords: ``keep=``, or the older
    ``per_head=`` and ``per_layer=`` (``per_head=True``: ``"head"``; ``per_head=False``:
    ``"layer"``; ``per_layer=False``: ``"token"``; none: ``"auto"``), checked.

    Raises:
        InvalidInputError: a ``keep`` not in :data:`KEEPS`, ``keep=`` with either older keyword,
            or ``per_head=True`` with ``per_layer=False``.
    """
    if per_head is not None:
        per_head = checks.flag("per_head", per_head)
    if per_layer is not None:
        per_layer = checks.flag("per_layer", per_layer)
    if keep is not None:
        if keep not in KEEPS:
            raise InvalidInputError(f"keep must be one of {list(KEEPS)}, not {keep!r}")
        if per_head is not None or per_layer is not None:
            raise InvalidInputError("give keep= or per_head=/per_layer=, not both")
        return keep
    if per_layer is False and per_head:
        raise InvalidInputError(
            "per_layer=False keeps the same tokens on every layer and every KV head: give "
            "per_head=False with it"
        )
    if per_layer is False:
        return "token"
    return "auto" if per_head is None else ("head" if per_head else "layer")


def checked_keep(keep: str, state: KVState, forget: str, scorer: Scorer, quantize) -> str:
    """``keep="head"`` refused where it cannot be: a model whose layers all slide, a policy
    that scores at each round, ``quantize``."""
    if keep != "head":
        return keep
    if not state.global_layers:
        raise InvalidInputError(
            "keep='head' (per_head=True) needs global-attention layers; every layer of this "
            "model slides, and a sliding-window layer holds the same entries on every KV head"
        )
    if not scorer.arrival:
        raise InvalidInputError(
            f"keep='head' (per_head=True) needs a policy that scores entries when they arrive "
            f"(kvzip, learned); {forget!r} scores at each round"
        )
    if quantize is not None:
        raise InvalidInputError(
            "quantize= holds the older messages packed, the same entries on every KV head: "
            "give keep='layer' (per_head=False) with it"
        )
    return keep
