"""``none``: the captured cache as is (the baseline every edit is compared to)."""

from __future__ import annotations

from kvedit.evals.methods.context import ExampleContext
from kvedit.evals.methods.registry import Method, register_method
from kvedit.states.state import KVState

__all__ = ["UNEDITED_ANSWER", "NoEdit"]

UNEDITED_ANSWER = "unedited_answer"
"""The ``ctx.notes`` key of ``none``'s :class:`~kvedit.states.decoding.Answer`: ``auto`` and
``reread`` on the same example read it as focus's unedited answer instead of decoding it again
(the same greedy tokens; their ``seconds`` then leave that decode out)."""


@register_method("none")
class NoEdit(Method):
    """The captured cache as is."""

    def answer_state(self, ctx: ExampleContext) -> KVState:
        return ctx.state

    def predict(self, ctx: ExampleContext) -> str:
        answer = self.answer_state(ctx).answer(ctx.continuation, ctx.max_new_tokens)
        ctx.notes[UNEDITED_ANSWER] = answer
        return answer.text
