"""One ranking of cache entries across layers (and KV heads): what to keep under one budget.

KVzip (arXiv:2505.23416) and kvpress's ``KVzipPress`` rank every (layer, KV head, entry)
score together: a layer or a head that reads the text broadly keeps many entries, one that
reads a few keeps a few, and the budget holds over the whole cache. :func:`rank_keep` does that
ranking for a budget counted in any unit: each layer's entries cost what one of its entries
takes (``cost``: 1 to count entries, its bytes to count bytes), and the best-scored entries are
kept, best first, until the budget is spent.

Two granularities:

* head-uniform (``per_head=False``): a unit is an entry of a layer on every KV head at once (its
  score its largest over the heads: an entry some head needs is kept). A layer then holds the
  same tokens on every head, as every dense cache does (and vLLM's paged cache needs).
* per head (``per_head=True``): a unit is one KV head's entry; the result says what each head
  keeps.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..errors import InvalidInputError

__all__ = ["rank_keep"]


def rank_keep(
    scores: Mapping[int, torch.Tensor],
    must: Mapping[int, torch.Tensor],
    budget: float,
    cost: Mapping[int, float | torch.Tensor],
    *,
    per_head: bool = False,
    held: Mapping[int, torch.Tensor] | None = None,
) -> dict[int, torch.Tensor]:
    """What each layer keeps: the entries of ``must``, then the best-scored others of all the
    layers together while their cost fits ``budget``.

    Args:
        scores: ``{layer: [kv_heads, n]}`` float, higher kept first (``n`` the layer's entries).
        must: ``{layer: [n]}`` bool (or ``[kv_heads, n]`` with ``per_head``), kept whatever
            their scores (their cost counts).
        budget: what the kept entries may cost in all.
        cost: ``{layer: c}``, what one head-uniform entry of the layer costs (all its KV heads),
            or ``{layer: [n]}`` what each of its entries costs; a per-head entry costs
            ``c / kv_heads``.
        per_head: rank each KV head's entries on their own (module docstring).
        held: ``{layer: [kv_heads, n]}`` bool, the slots that hold an entry (a headwise layer's
            padding does not; never kept nor paid for). None: every slot.

    Returns:
        ``{layer: [n]}`` bool (head-uniform) or ``{layer: [kv_heads, n]}`` bool (``per_head``).

    Raises:
        InvalidInputError: the entries of ``must`` alone cost more than ``budget``, or the
            inputs' shapes disagree.
    """
    order = list(scores)
    if set(order) != set(must) or set(order) != set(cost):
        raise InvalidInputError("scores, must and cost must name the same layers")
    units, unit_cost, musts, shapes = [], [], [], {}
    for i in order:
        s = scores[i].float().cpu()
        heads, n = s.shape if s.ndim == 2 else (0, 0)
        m = must[i].cpu()
        if s.ndim != 2 or m.shape not in ((n,), (heads, n)) or (m.ndim == 2 and not per_head):
            raise InvalidInputError(
                f"layer {i}: scores {tuple(s.shape)} and must {tuple(m.shape)} disagree"
            )
        if per_head:
            m = m if m.ndim == 2 else m[None].expand(heads, n)
            h = held[i].cpu() if held is not None else torch.ones(heads, n, dtype=torch.bool)
            units.append(s.masked_fill(~h, float("nan")).flatten())
            musts.append((m & h).flatten())
            unit_cost.append((_costs(cost[i], n) / heads)[None].expand(heads, n).flatten())
        else:
            units.append(s.amax(dim=0))
            musts.append(m)
            unit_cost.append(_costs(cost[i], n))
        shapes[i] = (heads, n)
    flat = torch.cat(units) if units else torch.zeros(0)
    need = torch.cat(musts) if musts else torch.zeros(0, dtype=torch.bool)
    price = torch.cat(unit_cost) if unit_cost else torch.zeros(0, dtype=torch.float64)
    spent = float(price[need].sum())
    if spent > budget + 1e-9:
        raise InvalidInputError(
            f"the protected entries alone cost {spent:g}, more than the budget {budget:g}"
        )
    kept = need.clone()
    free = (~need & ~torch.isnan(flat)).nonzero().flatten()
    if len(free):
        ranked = free[torch.argsort(flat[free], descending=True, stable=True)]
        fits = torch.cumsum(price[ranked], 0) <= budget - spent + 1e-9
        kept[ranked[fits]] = True
    out, start = {}, 0
    for i in order:
        heads, n = shapes[i]
        size = heads * n if per_head else n
        part = kept[start : start + size]
        out[i] = part.reshape(heads, n) if per_head else part
        start += size
    return out


def _costs(cost: float | torch.Tensor, n: int) -> torch.Tensor:
    """``[n]`` float64: one cost for every entry, or each entry's own."""
    if isinstance(cost, torch.Tensor):
        if cost.shape != (n,):
            raise InvalidInputError(f"costs of shape {tuple(cost.shape)} for {n} entries")
        return cost.to(torch.float64).cpu()
    return torch.full((n,), float(cost), dtype=torch.float64)
