"""The one attention observer: a state's bias plan that records what the queries attend to.

The attention seam calls a plan's ``observe(layer_idx, probs)`` with each layer's attention
probabilities ``[batch, heads, q, k]`` (``k``: the layer's stored entries, then the ``q``
queries' own). :class:`Observer` keeps, per layer, those probabilities combined over the
queries; :func:`observed_attention` runs tokens on top of some layers with one and returns what
it recorded. Both the read-outs (:func:`kvedit.attention_share`) and the compression scorers
(:mod:`kvedit.compress.observe`) read attention this way. Nothing is added to the cache.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from ..cache import LayerKV
from ..errors import InvalidInputError
from .passes import StateBias, run_model

__all__ = ["REDUCTIONS", "Observer", "observed_attention"]

REDUCTIONS = ("sum", "mean")
"""How an :class:`Observer` combines its queries' attention."""


class Observer(StateBias):
    """The layers' bias plan (:class:`~kvedit.states.passes.StateBias`), recording each layer's
    attention combined over the observing queries.

    Attributes:
        probs: layer index -> float32 ``[batch, heads, k]``, the attention probabilities
            ``[batch, heads, q, k]`` of the queries after the first ``skip_queries``, summed
            (``reduce="sum"``) or averaged (``"mean"``) over them.
        skip_queries: leading queries left out (they still run, and attend).
        reduce: ``"sum"`` or ``"mean"``.
    """

    def __init__(self, layers: Sequence[LayerKV], skip_queries: int = 0, reduce: str = "sum"):
        if reduce not in REDUCTIONS:
            raise InvalidInputError(f"reduce must be one of {REDUCTIONS}, not {reduce!r}")
        if isinstance(skip_queries, bool) or not isinstance(skip_queries, int) or skip_queries < 0:
            raise InvalidInputError(f"skip_queries must be an int >= 0, not {skip_queries!r}")
        super().__init__(layers)
        self.skip_queries = skip_queries
        self.reduce = reduce
        self.probs: dict[int, torch.Tensor] = {}

    def observe(self, layer_idx: int, probs: torch.Tensor) -> None:
        """Record ``probs`` ``[batch, heads, q, k]`` combined over the queries:
        ``[batch, heads, k]``."""
        kept = probs[:, :, self.skip_queries :]
        if self.reduce == "mean":
            self.probs[layer_idx] = kept.float().mean(dim=2)
        else:
            self.probs[layer_idx] = kept.sum(dim=2).float()


@torch.no_grad()
def observed_attention(
    model: PreTrainedModel,
    layers: Sequence[LayerKV],
    ids: Sequence[int],
    positions: torch.Tensor,
    *,
    skip_queries: int = 0,
    reduce: str = "sum",
) -> dict[int, torch.Tensor]:
    """The attention of ``ids`` run at ``positions [q]`` on top of ``layers``, per layer index:
    ``[batch, heads, len(layer) + q]`` float32 (the last ``q`` keys are the queries' own),
    combined over the queries after the first ``skip_queries`` (see :class:`Observer`).
    The layers' stored bias applies; the layers are not changed."""
    observer = Observer(layers, skip_queries, reduce)
    device = layers[0].device
    run_model(
        model,
        layers,
        torch.tensor([list(ids)], device=device),
        positions[None].to(device),
        logits_to_keep=1,
        plan=observer,
    )
    return observer.probs
