"""``snapkv``: the captured documents compressed with :func:`kvedit.compress.snapkv`.

``snapkv:keep=0.5`` scores the cache by the question (the continuation text: question and chat
template, the tokens that come next); ``observe=window`` scores it by the documents' last
``window`` tokens instead. ``select:scorer=snapkv`` (:mod:`.select`) is the same selection through
the scorer protocol, with AdaKV budgets (``adaptive=True``) and protected documents on top.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvedit.compress import snapkv
from kvedit.errors import InvalidInputError
from kvedit.evals.methods.context import ExampleContext
from kvedit.evals.methods.params import check_choice, check_count, check_fraction
from kvedit.evals.methods.registry import Method, register_method

__all__ = ["OBSERVE", "SnapKV", "SnapKVParams"]

OBSERVE = ("question", "window")
"""What may score the cache: the question, or the documents' last ``window`` tokens."""


@dataclass(frozen=True)
class SnapKVParams:
    """The parameters of ``snapkv``.

    Attributes:
        keep: The fraction of the cache kept, in ``(0, 1]``.
        window: The observation window (tokens) of ``observe="window"``.
        kernel: Width of the pooling of the scores (a positive odd int).
        observe: ``"question"`` or ``"window"``, what scores the cache.
    """

    keep: float = 0.5
    window: int = 32
    kernel: int = 5
    observe: str = "question"

    def __post_init__(self) -> None:
        keep = check_fraction("keep", self.keep, open_low=True)
        object.__setattr__(self, "keep", keep)
        object.__setattr__(self, "window", check_count("window", self.window, minimum=1))
        kernel = check_count("kernel", self.kernel, minimum=1)
        if kernel % 2 == 0:
            raise InvalidInputError(f"kernel must be a positive odd int, not {kernel}")
        object.__setattr__(self, "kernel", kernel)
        check_choice("observe", self.observe, OBSERVE)


@register_method("snapkv")
class SnapKV(Method):
    """The documents' cache compressed by SnapKV, scored by the question."""

    Params = SnapKVParams

    def predict(self, ctx: ExampleContext) -> str:
        p = self.params
        state = snapkv(
            ctx.state,
            keep=float(p.keep),
            query=ctx.continuation if p.observe == "question" else None,
            window=p.window,
            kernel=p.kernel,
        )
        ctx.compressed(state)
        return state.generate(ctx.continuation, ctx.max_new_tokens)
