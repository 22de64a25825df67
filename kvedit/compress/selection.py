"""``select``: keep, per KV head of every global layer, the entries a scorer ranks best, and
``snapkv``, its SnapKV preset.

``select(state, scorer, keep)`` asks the scorer (:mod:`kvedit.compress.scorers`) for
``[batch, kv_heads, n]`` scores of every global layer, gives each layer a budget of
``max(1, round(keep * n))`` entries per KV head (split among the heads by ``scorer.budgets``:
the same for every head, or by score mass with :class:`~kvedit.compress.AdaKV`), keeps each
head's best entries and stores the layer as a masked union (:mod:`kvedit.compress.masking`).
Then the last token is recomputed over the kept entries, as after every edit.

Which entries a head keeps, in order of precedence:

1. *Protected* entries, always, even past the budget: the tokens of ``protect`` (spans of the
   state's text), the tokens that carry a positive stored bias on any layer (emphasized or
   focus-chosen passages; unless ``protect_bias=False``), and the last token (which
   :func:`~kvedit.states.passes.recompute_last` needs).
2. Entries the scorer scored ``+inf`` (e.g. SnapKV's recent window), the latest first.
3. The best finite scores.

Entries a head had already dropped (a :data:`~kvedit.compress.DROPPED` bias, from an earlier
selection) stay dropped. Sliding-window layers (Gemma-3) are kept whole: they hold at most their
window already.

:func:`snapkv` is ``select`` with the :class:`~kvedit.compress.SnapKV` scorer (Li et al., 2024:
the attention an observation window, or a query such as the question, gives each entry,
max-pooled over neighbouring entries) and ``protect_bias=False``: entries with a positive stored
bias are ranked like any other (call ``select`` to protect them, or spans, or to share the budget
among heads with ``AdaKV``).

Storage. Heads keep *different* entries while a layer's ``token_index`` and ``positions`` are
shared by its heads, so a layer keeps, physically, the union of the entries any head keeps, and
masks each head's dropped entries with a :data:`~kvedit.compress.DROPPED` bias (``-1e30``,
``[batch, kv_heads or heads, n]``): attention is exactly per-head selection, and every other op
and the storage format keep working. The memory really saved is ``1 - union / n`` (plus the
bias, 4 bytes per entry and bias head), less than the nominal ``1 - keep`` when heads disagree;
compare ``state.nbytes`` before and after.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import checks
from ..cache import LayerKV, refuse_headwise
from ..errors import EmptySelectionError, InvalidInputError, InvalidTypeError
from ..provenance import Step, token_ranges
from ..spans import Spans
from ..states.passes import recompute_last
from ..states.state import KVState
from .masking import live_entries, masked_union
from .scorers.base import Scorer, make_scorer
from .scorers.snapkv import SnapKV

__all__ = ["keep_mask", "protected_tokens", "select", "snapkv"]


@torch.no_grad()
def select(
    state: KVState,
    scorer: Scorer | str,
    keep: float,
    *,
    protect: Spans | None = None,
    protect_bias: bool = True,
    layers: Sequence[int] | None = None,
) -> KVState:
    """A new state keeping, per KV head of every chosen global layer, ``keep`` of its entries.

    Args:
        state: the state to compress (not modified); scorers that read attention need its model.
        scorer: a :class:`~kvedit.compress.Scorer`, or a registered scorer name (its defaults).
        keep: the fraction of each layer's entries a head keeps on average, in ``(0, 1]``;
            ``1`` returns ``state`` itself.
        protect: spans of ``state.text`` (substrings, regexes, ``(start, end)`` ranges) whose
            tokens no head drops.
        protect_bias: also protect every token with a positive stored bias on some layer.
        layers: layer indices to compress (None: all); sliding-window layers stay whole.

    Returns:
        A state holding, per layer, the union of the entries any head keeps, with a
        :data:`~kvedit.compress.DROPPED` bias on those a head dropped. Compare ``nbytes``
        before and after for the memory saved (see :mod:`kvedit.compress.masking`). Its
        history records a ``select`` step (the scorer, ``keep``, the protected tokens).

    Raises:
        InvalidInputError: ``keep`` out of range, an unknown scorer name, scores of the wrong
            shape or with NaN; EmptySelectionError: ``protect`` selects no token;
            SpanNotFoundError: a span of ``protect`` is not in the text.
    """
    out = _select(state, scorer, keep, protect, protect_bias, layers)
    if out is state:
        return state
    scorer = make_scorer(scorer) if isinstance(scorer, str) else scorer
    protected = None if protect is None else token_ranges(state.token_indices(protect))
    params = {
        "scorer": repr(scorer),
        "keep": float(keep),
        "protect": protected,
        "protect_bias": protect_bias,
        "layers": None if layers is None else sorted(checks.layers(layers, len(state.layers))),
    }
    return out.with_step(Step("compression", "select", params, exact=False))


def _select(
    state: KVState,
    scorer: Scorer | str,
    keep: float,
    protect: Spans | None,
    protect_bias: bool,
    layers: Sequence[int] | None,
) -> KVState:
    """:func:`select` without its step (``state`` itself when nothing is dropped)."""
    scorer = make_scorer(scorer) if isinstance(scorer, str) else scorer
    if not isinstance(scorer, Scorer):
        raise InvalidTypeError(f"scorer must be a Scorer or a scorer name, not {scorer!r}")
    keep = checks.real("keep", keep)
    if not 0.0 < keep <= 1.0:
        raise InvalidInputError(f"keep must be a fraction in (0, 1], not {keep!r}")
    if not isinstance(protect_bias, bool):
        raise InvalidTypeError(f"protect_bias must be a bool, not {protect_bias!r}")
    chosen = checks.layers(layers, len(state.layers))
    refuse_headwise(state.layers, "select")
    tokens = protected_tokens(state, protect, protect_bias)
    if keep == 1.0:
        return state
    targets = [i for i in state.global_layers if chosen is None or i in chosen]
    if not targets:
        return state
    packed = [i for i in targets if state.layers[i].packed]
    if packed:
        # A per-head selection of packed entries would hold them dense: larger than the input.
        raise InvalidInputError(
            f"select cannot keep layer {packed[0]} packed ({type(state.layers[packed[0]]).__name__}"
            "): select the dense state first, then quantize or merge it "
            "(quantize(select(state, ...), bits))"
        )
    scores = scorer.score(state, targets)
    new_layers = list(state.layers)
    for i in targets:
        layer = state.layers[i]
        must = torch.isin(layer.token_index, tokens.to(layer.token_index.device))
        if protect_bias and layer.bias is not None:
            must |= (layer.bias > 0).any(dim=1).any(dim=0).to(must.device)
        kept = keep_mask(layer, _checked(scores, i, layer, scorer), keep, must, scorer)
        new_layers[i] = masked_union(layer, kept)
    return recompute_last(state.replace(layers=new_layers))


def snapkv(
    state: KVState,
    keep: float = 0.5,
    query: str | None = None,
    window: int = 32,
    kernel: int = 5,
) -> KVState:
    """A new state keeping, per KV head of every global layer, ``keep`` of the entries SnapKV
    scores best: ``select(state, SnapKV(query, window, kernel), keep, protect_bias=False)``.

    Args:
        state: the state to compress (not modified); needs its model.
        keep: fraction of each layer's entries each KV head keeps, in ``(0, 1]``.
        query: text whose attention scores the entries (e.g. the question), or None to use
            the state's last ``window`` tokens.
        window: observation window (when ``query`` is None); the last ``window`` tokens are
            always kept.
        kernel: odd width of the max-pool over neighbouring entries' scores.

    Returns:
        A state holding, per layer, the union of the entries any head keeps, with a ``-1e30``
        bias (masked) on the entries a head dropped (see the module doc for the memory this
        saves), whose history records a ``snapkv`` step; ``state`` itself when ``keep`` is 1
        or the state is no longer than ``window`` (every token is in the window: nothing to
        drop).
    """
    if not isinstance(keep, (int, float)) or isinstance(keep, bool) or not 0.0 < keep <= 1.0:
        raise InvalidInputError(f"keep must be a fraction in (0, 1], not {keep!r}")
    scorer = SnapKV(query=query, window=window, kernel=kernel)
    state.require_model()
    if keep == 1.0 or len(state) <= window:
        return state
    out = _select(state, scorer, keep, None, False, None)
    if out is state:
        return state
    params = {"keep": float(keep), "query": query, "window": window, "kernel": kernel}
    return out.with_step(Step("compression", "snapkv", params, exact=False))


def protected_tokens(
    state: KVState, protect: Spans | None = None, protect_bias: bool = True
) -> torch.Tensor:
    """Sorted token indices ``LongTensor[k]`` no head may drop: the tokens of ``protect``, the
    text tokens with a positive stored bias on some layer (with ``protect_bias``), the last
    token and the last input's token (what :func:`~kvedit.states.passes.recompute_last` reruns)."""
    parts = [torch.tensor([len(state) - 1, state.last_input.token_index], dtype=torch.long)]
    if protect is not None:
        spans = state.token_indices(protect)
        if spans.numel() == 0:
            raise EmptySelectionError(f"protect {protect!r} selects no token of the state")
        parts.append(spans.cpu())
    if protect_bias:
        for layer in state.layers:
            if layer.bias is not None:
                positive = (layer.bias > 0).any(dim=1).any(dim=0).cpu()
                index = layer.token_index.cpu()[positive]
                parts.append(index[index >= 0])
    return torch.unique(torch.cat(parts))


def keep_mask(
    layer: LayerKV, scores: torch.Tensor, keep: float, must: torch.Tensor, scorer: Scorer
) -> torch.Tensor:
    """``[batch, kv_heads, n]`` bool: the entries each KV head of ``layer`` keeps.

    Args:
        layer: the layer (its stored bias says which entries a head already dropped).
        scores: ``[batch, kv_heads, n]`` from the scorer.
        keep: the fraction kept; the layer's budget is ``max(1, round(keep * n))`` per head,
            split among heads by ``scorer.budgets``.
        must: ``[n]`` bool, the protected entries (kept by every head, even past its budget).
        scorer: whose ``budgets`` split the layer's budget.
    """
    b, kv_heads, n = scores.shape
    budget = max(1, round(keep * n))
    live = live_entries(layer, kv_heads).to(scores.device)
    must = must.to(scores.device)[None, None].expand(b, kv_heads, n) & live
    ranked = scores.float().clone()
    priority = torch.isposinf(ranked) & ~must & live
    ranked.masked_fill_(must, float("inf"))
    ranked.masked_fill_(~live, float("-inf"))
    budgets = scorer.budgets(ranked, budget)
    if budgets.shape != (b, kv_heads):
        raise InvalidInputError(
            f"scorer {scorer.name!r} gave budgets of shape {tuple(budgets.shape)}, "
            f"not {(b, kv_heads)}"
        )
    n_must = must.sum(dim=-1)
    budgets = torch.maximum(budgets.to(scores.device).clamp(0, n), n_must)
    # more +inf entries than a head's room: only its latest ones rank first
    room = (budgets - n_must)[..., None]
    from_end = priority.flip(-1).cumsum(-1).flip(-1)
    ranked.masked_fill_(priority & (from_end > room), float("-inf"))
    most = int(budgets.max())
    top = ranked.topk(most, dim=-1).indices  # [b, kv_heads, most], best first
    wanted = torch.arange(most, device=scores.device) < budgets[..., None]
    kept = torch.zeros(b, kv_heads, n, dtype=torch.bool, device=scores.device)
    kept.scatter_(-1, top, wanted)
    return kept & live


def _checked(scores: dict[int, torch.Tensor], i: int, layer: LayerKV, scorer: Scorer):
    """Layer ``i``'s scores, checked to be ``[batch, kv_heads, n]`` without NaN."""
    s = scores.get(i)
    shape = (*layer.kv_shape[:2], len(layer))
    if not isinstance(s, torch.Tensor) or tuple(s.shape) != shape:
        got = tuple(s.shape) if isinstance(s, torch.Tensor) else type(s).__name__
        raise InvalidInputError(
            f"scorer {scorer.name!r} gave layer {i} scores {got}, not [batch, kv_heads, n] {shape}"
        )
    if torch.isnan(s).any():
        raise InvalidInputError(f"scorer {scorer.name!r} gave NaN scores on layer {i}")
    return s
