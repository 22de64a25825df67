"""``none``: the captured cache as is (the baseline every edit is compared to)."""

from __future__ import annotations

from kvedit.evals.methods.context import ExampleContext
from kvedit.evals.methods.registry import Method, register_method
from kvedit.states.state import KVState

__all__ = ["NoEdit"]


@register_method("none")
class NoEdit(Method):
    """The captured cache as is."""

    def answer_state(self, ctx: ExampleContext) -> KVState:
        return ctx.state

    def predict(self, ctx: ExampleContext) -> str:
        return self.answer_state(ctx).generate(ctx.continuation, ctx.max_new_tokens)
