"""What a memory holds, per message and per layer: each message's entries **kept** (exact),
**quantized** (held in low bits) or **forgotten** (dropped by a forgetting round).

Computed from the layers alone (no model): each message's tokens (a
:class:`~kvedit.memory.records.Turn`'s ``start`` and ``end``), each counted layer's entries
(``token_index`` for a layer holding the same tokens on every KV head, ``head_index`` for one
whose heads hold their own, averaged over the heads) and, for a quantized layer, its first
``n_packed`` slots held in low bits. The counted layers are the global-attention ones (every
layer when every layer slides: :attr:`kvedit.KVState.counted_layers`): a sliding-window layer
keeps its last tokens by itself and is not counted.

The app's Memory tab draws these rows as HTML (``apps/highlight/memory_view.py``);
``kvedit memory show FILE --plot PNG`` draws them as a PNG
(:mod:`kvedit.memory.holdings_plot`) from a memory file read without the model
(:mod:`kvedit.memory.holdings_file`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .records import Turn

__all__ = ["COLORS", "LayerHeld", "MessageHeld", "held_by_message", "held_spread"]

COLORS = {"kept": "#16a34a", "quantized": "#2563eb", "forgotten": "#e5e7eb"}
"""The chart's colours (the app's Memory tab and ``kvedit memory show --plot``): kept green,
quantized blue, forgotten light grey."""


@dataclass(frozen=True)
class LayerHeld:
    """One message's entries in one layer (per KV head, on average over a layer's heads)."""

    layer: int
    kept: float
    quantized: float
    forgotten: float

    @property
    def held(self) -> float:
        """The entries held, exact or in low bits."""
        return self.kept + self.quantized

    @property
    def state(self) -> str:
        """``kept``, ``quantized``, ``forgotten`` (nothing held) or ``partial``."""
        if self.held <= 0 < self.forgotten:
            return "forgotten"
        if self.forgotten > 0:
            return "partial"
        return "quantized" if self.quantized > 0 else "kept"


@dataclass(frozen=True)
class MessageHeld:
    """What the memory holds of one message: its tokens and each counted layer's entries."""

    index: int
    role: str
    content: str
    n_tokens: int
    layers: tuple[LayerHeld, ...]

    @property
    def held_share(self) -> float:
        """The share of the message's entries still held (kept or quantized), all layers."""
        total = sum(x.held + x.forgotten for x in self.layers)
        return 1.0 if total <= 0 else sum(x.held for x in self.layers) / total

    @property
    def state(self) -> str:
        """``forgotten`` when no layer holds any of it, ``kept`` / ``quantized`` when every
        layer holds all of it, else ``partial``."""
        states = {x.state for x in self.layers}
        if states == {"forgotten"}:
            return "forgotten"
        if states <= {"kept", "quantized"}:
            return "quantized" if "quantized" in states else "kept"
        return "partial"


def _layer_counts(layer, bounds: torch.Tensor, n_messages: int) -> tuple[torch.Tensor, ...]:
    """``(exact, quantized)`` entries per message held by ``layer`` (per KV head, averaged);
    ``bounds``: each message's end token, in order."""
    head_index = getattr(layer, "head_index", None)
    if head_index is not None:  # each KV head its own entries: padding is -1
        tokens, heads = head_index[head_index >= 0], max(head_index.shape[0], 1)
        packed = torch.zeros(0, dtype=torch.long)
    else:
        n_packed = int(getattr(layer, "n_packed", 0) or 0)
        tokens, heads = layer.token_index.reshape(-1), 1
        packed, tokens = tokens[:n_packed], tokens[n_packed:]

    def per_message(index: torch.Tensor) -> torch.Tensor:
        index = index[index >= 0].cpu()
        which = torch.searchsorted(bounds, index, right=True)
        return torch.bincount(which, minlength=n_messages + 1)[:n_messages].double() / heads

    return per_message(tokens), per_message(packed)


def held_by_message(
    turns: Sequence[Turn], layers: Sequence, counted: Sequence[int], n_tokens: int
) -> list[MessageHeld]:
    """Per message (``turns``, in order) and per counted layer (``counted``: indices into
    ``layers``, the memory's cache layers; ``n_tokens``: the tokens its transcript holds), the
    entries kept, quantized and forgotten now."""
    if not turns:
        return []
    bounds = torch.tensor([t.end for t in turns], dtype=torch.long)
    sizes = [max(0, min(t.end, n_tokens) - t.start) for t in turns]
    counts = {i: _layer_counts(layers[i], bounds, len(turns)) for i in counted}
    out = []
    for m, t in enumerate(turns):
        row = []
        for i in counted:
            exact, packed = (float(c[m]) for c in counts[i])
            row.append(LayerHeld(i, exact, packed, max(0.0, sizes[m] - exact - packed)))
        out.append(MessageHeld(t.index, t.role, t.content, t.n_tokens, tuple(row)))
    return out


def held_spread(values: Sequence[float]) -> str:
    """``least / median / most`` of ``values`` (entries), as whole numbers."""
    v = sorted(values)
    return f"{v[0]:,.0f} / {v[len(v) // 2]:,.0f} / {v[-1]:,.0f}" if v else "none"
