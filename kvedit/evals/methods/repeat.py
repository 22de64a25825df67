"""``repeat``: a text-only baseline that also asks the question before the documents."""

from __future__ import annotations

import dataclasses

from kvedit.evals.methods.context import ExampleContext
from kvedit.evals.methods.registry import Method, register_method

__all__ = ["RepeatQuestion"]


@register_method("repeat")
class RepeatQuestion(Method):
    """Text-only baseline: the question is also asked before the documents."""

    uses_capture = False

    def predict(self, ctx: ExampleContext) -> str:
        ex = ctx.example
        instruction = (
            (ex.instruction + "\n\n" if ex.instruction else "") + "Question: " + ex.question
        )
        return ctx.generate_prompt(dataclasses.replace(ex, instruction=instruction))
