"""``repeat``: a text-only baseline that also asks the question before the documents."""

from __future__ import annotations

import dataclasses

from kvedit.evals.methods.context import ExampleContext
from kvedit.evals.methods.registry import Method, register_method
from kvedit.prompts import QUESTION_LABEL, QUESTION_SEPARATOR

__all__ = ["RepeatQuestion"]


@register_method("repeat")
class RepeatQuestion(Method):
    """Text-only baseline: the question is also asked before the documents."""

    uses_capture = False

    def predict(self, ctx: ExampleContext) -> str:
        ex = ctx.example
        asked = ex.instruction + QUESTION_SEPARATOR if ex.instruction else QUESTION_LABEL
        instruction = asked + ex.question
        return ctx.generate_prompt(dataclasses.replace(ex, instruction=instruction))
