"""``reread``: like ``auto``, but the chosen documents are re-read at the end of the cache."""

from __future__ import annotations

from dataclasses import dataclass

from kvedit.evals.methods.auto import AutoParams
from kvedit.evals.methods.context import ExampleContext
from kvedit.evals.methods.focus import focused_answer, focused_state
from kvedit.evals.methods.registry import Method, register_method
from kvedit.state import KVState

__all__ = ["Reread", "RereadParams"]


@dataclass(frozen=True)
class RereadParams(AutoParams):
    """:class:`~kvedit.evals.methods.auto.AutoParams` with ``edit="reread"``."""

    edit: str = "reread"


@register_method("reread")
class Reread(Method):
    """Like ``auto``, but the chosen documents are re-read at the end of the cache."""

    Params = RereadParams
    needs_documents = True

    def answer_state(self, ctx: ExampleContext) -> KVState:
        state, found = focused_state(ctx, self.params)
        if state is None:
            return super().answer_state(ctx)
        ctx.notes["auto_choice"] = found.chosen
        return state

    def predict(self, ctx: ExampleContext) -> str:
        answer, found = focused_answer(ctx, self.params)
        ctx.notes["auto_choice"] = found.chosen
        return answer
