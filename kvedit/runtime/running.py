"""Running a prepared model: :func:`activate` (a plan, checked against nesting) and
:func:`forward`, the one way kvedit runs a model (ids, explicit positions, a cache, a plan).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from transformers import PreTrainedModel

from .. import errors
from ..compat import cache_kwarg
from .gate import prepare
from .plans import NO_PLANS, PLANS, BiasPlan, config_key, scoped

__all__ = ["activate", "forward"]


@contextlib.contextmanager
def activate(
    model: PreTrainedModel, plan: BiasPlan, owner: object | None = None
) -> Iterator[BiasPlan]:
    """Make ``plan`` the active plan of ``model`` in the current context, inside the block.

    The model is prepared first (:func:`prepare`). Activating a plan while another one is
    active for the same model raises :class:`~kvedit.errors.NestedSteeringError`, unless both
    name the same ``owner`` (a steering handle re-entering itself): then the inner plan
    replaces the outer one until the inner block ends.
    """
    prepare(model)
    key = config_key(model)
    plans = PLANS.get(NO_PLANS)
    current = plans.get(key)
    mine = current is not None and current.model() is model
    if mine and (owner is None or current.owner is not owner):
        raise errors.NestedSteeringError(
            f"nested steering: {type(model).__name__} already has an active kvedit plan in this "
            "context (a steer block or a state's own run); leave it first, or combine the "
            "spans in one call"
        )
    with scoped(model, plan, owner):
        yield plan


def forward(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    cache,
    *,
    plan: BiasPlan | None = None,
    logits_to_keep: int = 0,
    attention_mask=None,
) -> torch.Tensor:
    """The one way kvedit runs a model: ``input_ids [batch, n]`` at explicit
    ``position_ids [batch, n]`` on top of ``cache`` (a transformers cache, updated in place),
    with ``plan`` active when given (else whatever plan the context has). Returns the logits
    ``[batch, n | logits_to_keep, vocab]``. The model is prepared first.
    """
    prepare(model)
    kwargs = {cache_kwarg(model): cache}
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.no_grad())
        if plan is not None:
            stack.enter_context(activate(model, plan))
        return model(
            input_ids=input_ids,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=logits_to_keep,
            **kwargs,
        ).logits
