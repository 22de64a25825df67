"""``reread``: like ``auto``, but the chosen documents are re-read at the end of the cache."""

from __future__ import annotations

from dataclasses import dataclass

from kvedit.evals.methods.auto import Auto, AutoParams
from kvedit.evals.methods.registry import register_method

__all__ = ["Reread", "RereadParams"]


@dataclass(frozen=True)
class RereadParams(AutoParams):
    """:class:`~kvedit.evals.methods.auto.AutoParams` with ``edit="reread"``."""

    edit: str = "reread"


@register_method("reread")
class Reread(Auto):
    """Like ``auto``, but the chosen documents are re-read at the end of the cache (``auto``
    with :class:`RereadParams`: the same choice, guard and notes)."""

    Params = RereadParams
