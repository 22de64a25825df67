"""Checks of a :class:`kvedit.Memory`'s budget keywords that take more than a line:
``reposition`` (:func:`checked_reposition`) and ``layer_floor`` (:func:`checked_layer_floor`),
for :func:`~kvedit.memory.budget.budget_from` and a memory file's budget."""

from __future__ import annotations

from .. import checks
from ..errors import InvalidInputError, InvalidTypeError
from .repositioning import REPOSITIONS

__all__ = ["checked_layer_floor", "checked_reposition"]


def checked_layer_floor(value, name: str = "layer_floor") -> float:
    """``layer_floor`` as a float in [0, 1): the fraction of a budget shared equally among the
    global layers before the one ranking across them spends the rest
    (:func:`kvedit.compress.allocation.rank_keep`'s ``floor``); ``name`` names it in the error.

    Raises:
        InvalidTypeError: not a number (a bool, a str, None).
        InvalidInputError: NaN, infinite, below 0, or 1 or more (the whole budget shared
            equally is a policy's equal share, not a floor).
    """
    try:
        number = checks.real(name, value)
    except InvalidTypeError:
        number, error = None, InvalidTypeError
    except InvalidInputError:
        number, error = None, InvalidInputError
    else:
        error = InvalidInputError
    if number is None or not 0.0 <= number < 1.0:
        raise error(
            f"{name} must be a number in [0, 1) (the fraction of the budget each global layer "
            f"is sure of a part of; 0: one ranking alone), not {checks.describe(value)}"
        )
    return number


def checked_reposition(reposition: str | None, quantize: int | None) -> str | None:
    """``reposition`` checked: one of :data:`REPOSITIONS` (None: the default), and not
    ``"always"`` with ``quantize`` (packed keys cannot be moved without repacking)."""
    if reposition is None:
        return None
    if not isinstance(reposition, str) or reposition not in REPOSITIONS:
        raise InvalidInputError(
            f"reposition must be one of {list(REPOSITIONS)}, not {checks.describe(reposition)}"
        )
    if reposition == "always" and quantize is not None:
        raise InvalidInputError(
            "reposition='always' with quantize=: the packed older messages' keys cannot be "
            "moved without unpacking and packing them again; use reposition='at_limit' (the "
            "memory then stops at the model's positions) or no quantize="
        )
    return reposition
