"""Forward passes over a state's cache: run tokens on top of stored layers, append their entries,
and recompute a state's last input after an edit.

:func:`run_model` feeds stored layers to the model through :func:`~kvedit.cache.adapter.dynamic_cache`
with explicit positions and the stored bias (:class:`StateBias`); :func:`appended_layers` turns
its output into layers with the new entries; :func:`recompute_last` is how every op makes its
edit reach the first continuation token (it reruns the state's last input, wherever it sits).
A state is typed :class:`~kvedit.states.view.StateView` here (:mod:`kvedit.states.state`
imports this module); :func:`recompute_last` returns the type it is given.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
from transformers import PreTrainedModel

from ..cache import LayerKV
from ..cache.adapter import CacheEntries, dynamic_cache
from ..errors import StateAlteredError
from ..runtime import forward
from .view import StateView

S = TypeVar("S", bound=StateView)

__all__ = ["StateBias", "appended_layers", "last_input_entries", "recompute_last", "run_model"]


class StateBias:
    """BiasPlan for continuing from a state: stored bias on cached entries, zeros on new ones."""

    def __init__(self, layers: Sequence[LayerKV]):
        self._bias = [layer.bias for layer in layers]

    def key_bias(self, layer_idx: int, k_len: int, total_len: int) -> torch.Tensor | None:
        b = self._bias[layer_idx]
        if b is None:
            return None
        if k_len < b.shape[-1]:
            raise StateAlteredError("cache shorter than the stored bias: the state was altered")
        return torch.nn.functional.pad(b, (0, k_len - b.shape[-1]))

    def unbiased_queries(self, q_len: int, total_len: int) -> int:
        return 0


def run_model(
    model: PreTrainedModel,
    layers: Sequence[LayerKV],
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    logits_to_keep: int = 0,
    plan=None,
) -> tuple[torch.Tensor, CacheEntries]:
    """Run ``input_ids [1, n]`` at ``position_ids [1, n]`` on top of ``layers``.

    Returns ``(logits [1, n|keep, vocab], entries)``: ``entries[i]`` is layer ``i``'s
    ``(keys, values)``, the stored entries followed by the ``n`` new ones
    (``[batch, kv_heads, len + n, dim]``; a packed layer is expanded on access), and
    ``entries.new_entries(i)`` only the new ones (:class:`CacheEntries`).
    The stored bias applies to every new query (or ``plan``, a BiasPlan, decides); ``layers``
    is left untouched.
    """
    cache = dynamic_cache(layers)
    plan = StateBias(layers) if plan is None else plan
    logits = forward(
        model, input_ids, position_ids, cache, plan=plan, logits_to_keep=logits_to_keep
    )
    return logits, CacheEntries(cache, len(layers), input_ids.shape[-1])


def appended_layers(layers, full_kv, ids, first_position, first_index=-1) -> list[LayerKV]:
    """Layers extended to ``full_kv`` (stored + new entries, from :func:`run_model`).

    ``first_index < 0`` marks the new entries as not being tokens of the state's text.
    """
    n = len(ids)
    positions = torch.arange(first_position, first_position + n)
    index = torch.arange(first_index, first_index + n) if first_index >= 0 else torch.full((n,), -1)
    if len(layers) != len(full_kv):
        raise ValueError(f"{len(full_kv)} layers of entries for {len(layers)} layers")
    out = []
    for i, layer in enumerate(layers):
        if layer.packed:  # the new entries only: the packed part is never expanded
            k, v = full_kv.new_entries(i)
            out.append(layer.append(k, v, index, positions))
        else:
            k, v = full_kv[i]
            out.append(layer.extended(k, v, index, positions))
    return out


def last_input_entries(state: StateView, layer: LayerKV) -> torch.Tensor:
    """``BoolTensor[len(layer)]``: the layer's entries of the state's last input (its token
    index at its position; a token's other readings, such as a re-read copy or the original of
    one, are other entries)."""
    last = state.last_input
    return (layer.token_index == last.token_index) & (layer.positions == last.position)


@torch.no_grad()
def recompute_last(
    state: S, edit: Callable[[int, LayerKV, torch.Tensor], LayerKV] | None = None
) -> S:
    """``state`` with its last input run again over the (edited) rest of the cache.

    The last input (``state.last_input``) is the entry ``last_logits`` follow: the last text
    token after a capture or an extension, the last re-read token after a re-read. It is run
    at its own position over every other entry of the cache (all of them at earlier positions,
    or copies at its own), every entry of it (one per layer, more where it was duplicated) is
    replaced by its fresh K/V, keeping each entry's bias, and ``last_logits`` become the fresh
    prediction, so an edit reaches the first continuation token. Other entries of the same
    token (the text token a re-read copy was read from) are left as they are.
    ``edit(i, layer, entries)``, when given, is applied to layer ``i``'s fresh entries of the
    last input afterwards (an op whose span covers it). Key or value edits an *earlier* op made
    to the last input's own entries are recomputed away; biases are kept. Needs the state's
    model; a state with no tokens is returned as is.

    Raises:
        StateAlteredError: a layer no longer holds the last input.
    """
    if len(state) == 0:
        return state
    model, _ = state.checked_model()
    t, pos = state.last_input
    if not 0 <= t < len(state):
        raise StateAlteredError(
            f"the last input, token {t}, is not a token of this {len(state)}-token state"
        )
    bases, counts, biases = [], [], []
    for i, layer in enumerate(state.layers):
        mine = last_input_entries(state, layer)
        if not bool(mine.any()):
            raise StateAlteredError(
                f"layer {i} no longer holds the last input (token {t} at position {pos}); "
                "cannot recompute it"
            )
        keep = (~mine).nonzero().flatten()
        bases.append(layer.select(keep))
        counts.append(int(mine.sum()))
        entries = mine.nonzero().flatten().to(layer.keys.device)
        biases.append(None if layer.bias is None else layer.bias[..., entries])
    device = state.device
    logits, full_kv = run_model(
        model,
        bases,
        torch.tensor([[int(state.token_ids[t])]], device=device),
        torch.tensor([[pos]], device=device),
        logits_to_keep=1,
    )
    layers = []
    for i, (base, count, bias) in enumerate(zip(bases, counts, biases, strict=True)):
        fresh_k, fresh_v = full_kv.new_entries(i)
        layer = base.append(
            fresh_k.repeat(1, 1, count, 1),
            fresh_v.repeat(1, 1, count, 1),
            torch.full((count,), t, dtype=torch.long),
            torch.full((count,), pos, dtype=torch.long),
            bias,
        )
        if edit is not None:
            entries = last_input_entries(state, layer).nonzero().flatten()
            layer = edit(i, layer, entries.to(layer.keys.device))
        layers.append(layer)
    return state.replace(layers=layers, last_logits=logits[0, -1].float())
