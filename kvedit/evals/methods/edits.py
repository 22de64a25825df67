"""The edits ``oracle``, ``auto`` and ``reread`` apply to the documents they choose.

:class:`EditParams` are the parameters every such method takes (``edit`` and the edit's own
settings); :func:`apply_edit` answers with some documents edited that way.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvedit import checks, ops
from kvedit.evals.methods.context import ExampleContext
from kvedit.evals.methods.params import check_choice, check_count, check_real
from kvedit.states.state import KVState
from kvedit.steering.session import steer

__all__ = ["EDITS", "EditParams", "apply_edit", "edited_state"]

EDITS = ("emphasize", "steer", "scale_keys", "duplicate", "reread")
"""The edits :func:`apply_edit` knows."""


@dataclass(frozen=True)
class EditParams:
    """How to edit the chosen documents.

    Attributes:
        edit: One of :data:`EDITS`.
        strength: Bias in nats of ``emphasize`` and ``steer``.
        factor: Key scale of ``scale_keys``.
        copies: Extra copies of ``duplicate`` (at most ``MAX_DUPLICATE_COPIES``).
        separator: Text ``reread`` puts before the re-read documents.
    """

    edit: str = "emphasize"
    strength: float = 2.0
    factor: float = 1.5
    copies: int = 7
    separator: str = "\n"

    def __post_init__(self) -> None:
        check_choice("edit", self.edit, EDITS)
        object.__setattr__(
            self, "strength", check_real("strength", self.strength, cap=checks.MAX_STRENGTH)
        )
        object.__setattr__(
            self, "factor", check_real("factor", self.factor, cap=checks.MAX_SCALE_FACTOR)
        )
        object.__setattr__(
            self,
            "copies",
            check_count("copies", self.copies, maximum=checks.MAX_DUPLICATE_COPIES),
        )
        checks.text("separator", self.separator)

    @property
    def edits_cache(self) -> bool:
        """Whether the edit is a cache edit (a state answers); not for ``steer``."""
        return self.edit != "steer"


def edited_state(
    ctx: ExampleContext,
    spans: list[tuple[int, int]],
    params: EditParams,
    state: KVState | None = None,
):
    """``state`` (default: the captured state) with ``spans`` edited as ``params.edit`` says
    (``None`` for ``steer``, which edits no cache: it steers a fresh run of the prompt)."""
    edit = params.edit
    state = ctx.state if state is None else state
    if edit == "emphasize":
        return ops.emphasize(state, spans, params.strength)
    if edit == "steer":
        return None
    if edit == "scale_keys":
        return ops.scale_keys(state, spans, params.factor)
    if edit == "duplicate":
        return ops.duplicate(state, spans, params.copies)
    # "reread"; EditParams refuses anything outside EDITS
    return ops.reread(state, spans, separator=params.separator)


def apply_edit(ctx: ExampleContext, spans: list[tuple[int, int]], params: EditParams) -> str:
    """Answer with ``spans`` (character ranges of the prefix) edited as ``params.edit`` says."""
    state = edited_state(ctx, spans, params)
    if state is None:
        return steer(
            ctx.model, ctx.tokenizer, emphasize=spans, strength=params.strength, scope="all"
        ).generate(ctx.prompt, max_new_tokens=ctx.max_new_tokens)
    return state.generate(ctx.continuation, ctx.max_new_tokens)
