"""AdaKV: a layer's budget shared among its KV heads by score mass.

Feng et al., 2024, "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for
Efficient LLM Inference" (arXiv:2407.11550). Instead of every head keeping the same number of
entries, the layer keeps its ``kv_heads * budget`` best entries over all heads together (the
top scores of the flattened ``[kv_heads * n]`` scores), so a head whose attention is spread
over many entries gets more of the budget than one that attends to a few. A safeguard keeps
each head at least ``floor * budget`` entries (its best ones), as kvpress's ``AdaKVPress``
(``alpha_safeguard``) does. Scores must be comparable across heads: attention-based scorers
(SnapKV, H2O) are; a scorer that gives every head the same scores (TOVA) gets the uniform split.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .. import checks
from ..errors import InvalidInputError, InvalidTypeError
from ..states.state import KVState
from .scorers.base import Scorer

__all__ = ["AdaKV", "adaptive_budgets"]


def adaptive_budgets(scores: torch.Tensor, budget: int, floor: float = 0.2) -> torch.Tensor:
    """Per-head budgets ``[batch, kv_heads]`` (ints) summing to ``kv_heads * budget`` per row.

    Args:
        scores: ``[batch, kv_heads, n]`` (``+inf``: must keep; ``-inf``: never worth keeping).
        budget: the mean number of entries a head keeps, ``0 <= budget <= n``.
        floor: each head gets at least ``int(floor * budget)`` entries, ``0 <= floor <= 1``.
    """
    b, heads, n = scores.shape
    if not 0 <= budget <= n:
        raise InvalidInputError(f"budget {budget} out of range for {n} entries")
    uniform = torch.full((b, heads), budget, dtype=torch.long, device=scores.device)
    if heads == 1 or budget in (0, n) or torch.equal(scores, scores[:, :1].expand_as(scores)):
        return uniform
    ranked = scores.float().clone()
    safe = int(floor * budget)
    if safe:  # each head's best `safe` entries first (never one it already dropped)
        best = ranked.topk(safe, dim=-1)
        lifted = best.values.masked_fill(best.values > float("-inf"), float("inf"))
        ranked.scatter_(-1, best.indices, lifted)
    top = ranked.reshape(b, heads * n).topk(heads * budget, dim=-1).indices  # [b, heads*budget]
    head_of = top // n
    counts = torch.zeros(b, heads, dtype=torch.long, device=scores.device)
    counts.scatter_add_(-1, head_of, torch.ones_like(head_of))
    return counts


@dataclass(frozen=True)
class AdaKV(Scorer):
    """Any scorer, with per-head budgets shared by score mass (:func:`adaptive_budgets`).

    Attributes:
        scorer: The scorer whose scores rank the entries.
        floor: The fraction of the uniform budget each head keeps at least, in ``[0, 1]``
            (AdaKV's safeguard; 0.2 as in kvpress).
    """

    scorer: Scorer
    floor: float = 0.2

    def __post_init__(self) -> None:
        if not isinstance(self.scorer, Scorer):
            raise InvalidTypeError(f"AdaKV wraps a Scorer, not {type(self.scorer).__name__}")
        floor = checks.real("floor", self.floor)
        if not 0.0 <= floor <= 1.0:
            raise InvalidInputError(f"floor must be in [0, 1], not {self.floor!r}")

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"adakv({self.scorer.name})"

    @property
    def reads_model(self) -> bool:  # type: ignore[override]
        """Whether the wrapped scorer runs the model."""
        return self.scorer.reads_model

    def score(self, state: KVState, layers: Sequence[int]) -> dict[int, torch.Tensor]:
        return self.scorer.score(state, layers)

    def budgets(self, scores: torch.Tensor, budget: int) -> torch.Tensor:
        return adaptive_budgets(scores, budget, self.floor)
