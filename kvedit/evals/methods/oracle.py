"""``oracle``: edit the gold document, told which one it is.

An oracle of the choice, not of the edit: it edits the gold document by a fixed rule (by
default ``emphasize``, +2 nats on every layer), no sizing, no guard, so it is no upper bound on
a method that chooses for itself: ``auto`` sizes its bias per layer, guards its answer, and can
score above it (NQ-10 in ``reports/litm/README.md``).
"""

from __future__ import annotations

from kvedit.evals.methods.context import ExampleContext
from kvedit.evals.methods.edits import EditParams, apply_edit, edited_state
from kvedit.evals.methods.registry import Method, register_method
from kvedit.states.state import KVState

__all__ = ["Oracle"]


@register_method("oracle")
class Oracle(Method):
    """Edit the gold document, told which one it is: an oracle of the choice, not of the edit
    (a fixed edit, no sizing, no guard; module docstring), so no upper bound on ``auto``.

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
