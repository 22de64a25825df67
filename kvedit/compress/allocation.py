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

A floor (``floor``): one ranking alone can starve a layer whose scores run low (a live chat
under a budget left most of SmolLM2's layers holding little more than the last answer, and
the chat repeated one answer). With ``floor=f``, a fraction ``f`` of the budget is shared out
first, each layer keeping its own best entries up to an equal part of it (what it must keep
counts towards its part), and the ranking across layers spends the rest.
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
    floor: float = 0.0,
    cap: int | None = None,
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
        floor: the fraction of ``budget`` (0 to 1) shared equally among the layers before the
            ranking across layers (module docstring); 0: one ranking alone.
        cap: the most entries one layer keeps (one KV head, with ``per_head``), ``must``'s
            included: the ranking passes over an entry whose layer (head) holds ``cap``
            already. None: no cap.

    Returns:
        ``{layer: [n]}`` bool (head-uniform) or ``{layer: [kv_heads, n]}`` bool (``per_head``).

    Raises:
        InvalidInputError: the entries of ``must`` alone cost more than ``budget``, the
            inputs' shapes disagree, or ``floor`` is not in [0, 1].
    """
    if not 0.0 <= floor <= 1.0:
        raise InvalidInputError(f"floor must be in [0, 1], not {floor!r}")
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
    sizes = [heads * n if per_head else n for heads, n in (shapes[i] for i in order)]
    capped = None if cap is None else (_groups(shapes, order, per_head), cap)
    if floor > 0 and order:
        part = floor * budget / len(order)
        spent += _floor(flat, price, kept, sizes, part, budget - spent, capped)
    free = (~kept & ~torch.isnan(flat)).nonzero().flatten()
    if len(free):
        ranked = free[torch.argsort(flat[free], descending=True, stable=True)]
        if capped is not None:
            ranked = ranked[_under_cap(ranked, kept, *capped)]
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


def _groups(shapes: dict, order: list, per_head: bool) -> torch.Tensor:
    """``[units]`` the group each unit counts toward under a cap: its layer, or with
    ``per_head`` its (layer, KV head)."""
    ids, start = [], 0
    for i in order:
        heads, n = shapes[i]
        if per_head:
            ids.append(start + torch.arange(heads)[:, None].expand(heads, n).flatten())
            start += heads
        else:
            ids.append(torch.full((n,), start))
            start += 1
    return torch.cat(ids) if ids else torch.zeros(0, dtype=torch.long)


def _under_cap(ranked: torch.Tensor, kept: torch.Tensor, group: torch.Tensor, cap: int):
    """``[len(ranked)]`` bool: the ranked units their group can still take, in rank order,
    after what ``kept`` holds of it (at most ``cap`` in all)."""
    g = group[ranked]
    counts = torch.bincount(group[kept], minlength=int(group.max()) + 1 if len(group) else 0)
    order = torch.argsort(g, stable=True)  # rank order within each group
    sorted_g = g[order]
    first = torch.searchsorted(sorted_g, sorted_g)  # each group's first index
    within = torch.empty_like(order)
    within[order] = torch.arange(len(order)) - first
    return within < (cap - counts[g]).clamp_min(0)


def _floor(
    flat: torch.Tensor,
    price: torch.Tensor,
    kept: torch.Tensor,
    sizes: list[int],
    part: float,
    left: float,
    capped: tuple[torch.Tensor, int] | None = None,
) -> float:
    """Keep (in ``kept``, in place) each layer's best free units while the layer's kept units
    cost at most ``part`` and all it adds at most ``left`` (what the budget has left after the
    protected units: one layer's protected units may already exceed its part, so the parts
    alone do not bound the sum), and with ``capped`` (each unit's group, the cap) no group past
    the cap; ``sizes``: each layer's units in ``flat``, in order. Returns what the units it
    added cost."""
    added, start = 0.0, 0
    for size in sizes:
        sl = slice(start, start + size)
        start += size
        room = min(part - float(price[sl][kept[sl]].sum()), left - added)
        free = (~kept[sl] & ~torch.isnan(flat[sl])).nonzero().flatten()
        if room <= 0 or not len(free):
            continue
        ranked = free[torch.argsort(flat[sl][free], descending=True, stable=True)]
        if capped is not None:
            ranked = ranked[_under_cap(ranked + sl.start, kept, *capped)]
        fits = torch.cumsum(price[sl][ranked], 0) <= room + 1e-9
        kept[sl][ranked[fits]] = True
        added += float(price[sl][ranked[fits]].sum())
    return added


def _costs(cost: float | torch.Tensor, n: int) -> torch.Tensor:
    """``[n]`` float64: one cost for every entry, or each entry's own."""
    if isinstance(cost, torch.Tensor):
        if cost.shape != (n,):
            raise InvalidInputError(f"costs of shape {tuple(cost.shape)} for {n} entries")
        return cost.to(torch.float64).cpu()
    return torch.full((n,), float(cost), dtype=torch.float64)
