"""``closedbook``: no documents at all (Liu et al.'s closed-book baseline)."""

from __future__ import annotations

from kvedit.evals.methods.context import ExampleContext
from kvedit.evals.methods.registry import Method, register_method

__all__ = ["ClosedBook"]


@register_method("closedbook")
class ClosedBook(Method):
    """No documents at all (Liu et al.'s closed-book baseline)."""

    uses_capture = False

    def predict(self, ctx: ExampleContext) -> str:
        return ctx.generate_prompt(ctx.example.closed_book())
