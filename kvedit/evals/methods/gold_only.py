"""``gold_only``: only the gold document (Liu et al.'s oracle-context baseline)."""

from __future__ import annotations

from kvedit.evals.methods.context import ExampleContext
from kvedit.evals.methods.registry import Method, register_method

__all__ = ["GoldOnly"]


@register_method("gold_only")
class GoldOnly(Method):
    """Only the gold document (Liu et al.'s oracle-context baseline)."""

    uses_capture = False

    def predict(self, ctx: ExampleContext) -> str:
        return ctx.generate_prompt(ctx.example.gold_only())
