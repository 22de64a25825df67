"""``oracle``: edit the gold document (an upper bound: it knows where the answer is)."""

from __future__ import annotations

from kvedit.evals.methods.context import ExampleContext
from kvedit.evals.methods.edits import EditParams, apply_edit, edited_state
from kvedit.evals.methods.registry import Method, register_method
from kvedit.states.state import KVState

__all__ = ["Oracle"]


@register_method("oracle")
class Oracle(Method):
    """Edit the gold document (an upper bound: it knows the answer's location).

    Parameters: :class:`~kvedit.evals.methods.edits.EditParams`
    (``oracle:edit=scale_keys:factor=1.5``).
    """

    Params = EditParams
    needs_documents = True

    def answer_state(self, ctx: ExampleContext) -> KVState:
        state = edited_state(ctx, [ctx.gold_span()], self.params)
        return super().answer_state(ctx) if state is None else state

    def predict(self, ctx: ExampleContext) -> str:
        return apply_edit(ctx, [ctx.gold_span()], self.params)
