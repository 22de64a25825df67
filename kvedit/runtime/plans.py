"""Bias plans: what a steered forward adds to the attention logits, scoped per model and per
context (:mod:`contextvars`), so a forward in another thread or outside the block is never
steered.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import PreTrainedModel

__all__ = ["Active", "BiasPlan", "active_entry", "active_plan", "config_key", "detached", "scoped"]


class BiasPlan(Protocol):
    """Where the additive key bias of one model comes from, for one context.

    Two optional members the seam reads when present: ``observe(layer_idx, probs)``, called
    with each layer's attention probabilities ``[batch, heads, q, k]``; and
    ``output_from_probs = True``, for an observing plan whose pass only scores (its outputs
    feed nothing but the rest of that scoring): the attention output is then taken from those
    probabilities (fast, equal up to rounding, not bit-identical to an unobserved pass, which
    every other plan's pass is).
    """

    def key_bias(self, layer_idx: int, k_len: int, total_len: int) -> torch.Tensor | None:
        """Bias for the ``k_len`` keys of layer ``layer_idx``: ``[batch, kv_heads|heads, k_len]``.

        ``total_len`` is the absolute length of the sequence including the current queries, so
        key entry ``j`` holds absolute token ``total_len - k_len + j`` (sliding-window caches hold
        only the most recent tokens). Returns None for no bias on this layer.
        """

    def unbiased_queries(self, q_len: int, total_len: int) -> int:
        """How many leading queries of this call attend without the bias (0: all are biased)."""


@dataclass(frozen=True)
class Active:
    """A plan active for one model in one context (``owner``: who activated it)."""

    plan: BiasPlan
    owner: object | None
    model: weakref.ref


# Never mutated in place: activate() sets a new dict, so the shared default stays empty.
NO_PLANS: dict[int, Active] = {}
PLANS: contextvars.ContextVar[dict[int, Active]] = contextvars.ContextVar("kvedit_plans")


def config_key(model_or_module) -> int:
    """The key plans and prepared models are kept under: the id of the text config."""
    cfg = model_or_module.config
    if hasattr(cfg, "get_text_config"):
        cfg = cfg.get_text_config()
    return id(cfg)


def active_entry(key: int) -> Active | None:
    """The active plan entry for a config key in the current context, if any."""
    return PLANS.get(NO_PLANS).get(key)


def active_plan(model: PreTrainedModel) -> BiasPlan | None:
    """The plan active for ``model`` in the current context, if any."""
    entry = active_entry(config_key(model))
    return None if entry is None or entry.model() is not model else entry.plan


@contextlib.contextmanager
def detached(model: PreTrainedModel) -> Iterator[None]:
    """Inside the block, ``model`` has no active plan in the current context: kvedit's own
    runs of it (a capture, a readout) may activate theirs. For work a plan does before the
    forward it steers (``steer(focus=True)`` reads the prompt's cache first); the outer plan
    is active again when the block ends."""
    key = config_key(model)
    plans = PLANS.get(NO_PLANS)
    token = PLANS.set({k: v for k, v in plans.items() if k != key})
    try:
        yield
    finally:
        PLANS.reset(token)


@contextlib.contextmanager
def scoped(model: PreTrainedModel, plan: BiasPlan, owner: object | None = None) -> Iterator[None]:
    """``plan`` active for ``model`` in the current context inside the block, replacing any
    other; no checks (:func:`kvedit.runtime.activate` is the checked entry point)."""
    token = PLANS.set(
        {**PLANS.get(NO_PLANS), config_key(model): Active(plan, owner, weakref.ref(model))}
    )
    try:
        yield
    finally:
        PLANS.reset(token)
