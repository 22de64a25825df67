"""What a :class:`kvedit.Memory` holds, per message and per layer, and its chart.

Computed in the app from the memory's public attributes: each message's tokens
(``mem.turns``: ``start``, ``end``), each counted layer's entries (``mem.state.layers[i]``:
``token_index`` for a layer holding the same tokens on every KV head, ``head_index`` for one
whose heads hold their own, averaged over the heads) and, for a quantized layer, its first
``n_packed`` slots held in low bits. An entry of a message's token is **kept** (exact),
**quantized** (held in low bits) or **forgotten** (dropped by a forgetting round). The counted
layers are the global-attention ones (every layer when every layer slides): a sliding-window
layer keeps its last tokens by itself and is not drawn.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvedit.memory.conversation import Memory

__all__ = ["LayerHeld", "MessageHeld", "held_by_message", "render_held"]

_KEPT = "#16a34a"  # green
_QUANTIZED = "#2563eb"  # blue
_FORGOTTEN = "#e5e7eb"  # light grey


@dataclass(frozen=True)
class LayerHeld:
    """One message's entries in one layer (per KV head, on average over a layer's heads)."""

    layer: int
    kept: float
    quantized: float
    forgotten: float

    @property
    def state(self) -> str:
        """``kept``, ``quantized``, ``forgotten`` (nothing held) or ``partial``."""
        held = self.kept + self.quantized
        if held <= 0 < self.forgotten:
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
        total = sum(x.kept + x.quantized + x.forgotten for x in self.layers)
        return 1.0 if total <= 0 else sum(x.kept + x.quantized for x in self.layers) / total

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


def held_by_message(mem: Memory) -> list[MessageHeld]:
    """Per message (``mem.turns``) and per counted layer, the entries kept, quantized and
    forgotten now."""
    state, turns = mem.state, mem.turns
    if not turns:
        return []
    n_state = len(state)
    bounds = torch.tensor([t.end for t in turns], dtype=torch.long)
    sizes = [max(0, min(t.end, n_state) - t.start) for t in turns]
    layers = state.counted_layers
    counts = {i: _layer_counts(state.layers[i], bounds, len(turns)) for i in layers}
    out = []
    for m, t in enumerate(turns):
        row = []
        for i in layers:
            exact, packed = (float(c[m]) for c in counts[i])
            row.append(LayerHeld(i, exact, packed, max(0.0, sizes[m] - exact - packed)))
        out.append(MessageHeld(t.index, t.role, t.content, t.n_tokens, tuple(row)))
    return out


def _cell(x: LayerHeld) -> str:
    total = x.kept + x.quantized + x.forgotten
    if total <= 0:
        return '<td class="cell empty"></td>'
    k, q = 100 * x.kept / total, 100 * (x.kept + x.quantized) / total
    fill = (
        f"linear-gradient(to top,{_KEPT} 0 {k:.1f}%,{_QUANTIZED} {k:.1f}% {q:.1f}%,"
        f"{_FORGOTTEN} {q:.1f}% 100%)"
    )
    title = (
        f"layer {x.layer}: {x.kept:.0f} kept, {x.quantized:.0f} quantized, "
        f"{x.forgotten:.0f} forgotten"
    )
    return f'<td class="cell {x.state}" title="{title}" style="background:{fill}"></td>'


def _preview(text: str, width: int = 36) -> str:
    one = " ".join(text.split())
    return one if len(one) <= width else one[: width - 1] + "…"


def render_held(rows: Sequence[MessageHeld], summary: str = "") -> str:
    """The chart: a row per message (index, role, text, tokens, share held), a cell per counted
    layer filled from the bottom with its kept (green), quantized (blue) and forgotten (grey)
    share; a row's class is its :attr:`MessageHeld.state`. ``summary``: a line above it."""
    if not rows:
        return '<div class="kvedit-memory empty">No messages yet: type one below.</div>'
    n_layers = len(rows[0].layers)
    head = "".join(
        f'<th class="layer">{x.layer if x.layer % 5 == 0 else ""}</th>' for x in rows[0].layers
    )
    body = []
    for r in rows:
        label = (
            f'<td class="label" title="{html.escape(r.content)}">{r.index} '
            f"<b>{html.escape(r.role)}</b> {html.escape(_preview(r.content))}</td>"
            f'<td class="num">{r.n_tokens}</td>'
            f'<td class="num share">{100 * r.held_share:.0f}%</td>'
        )
        cells = "".join(_cell(x) for x in r.layers)
        body.append(f'<tr class="message {r.state}" data-index="{r.index}">{label}{cells}</tr>')
    legend = (
        f'<span style="color:{_KEPT}">■</span> kept &nbsp; '
        f'<span style="color:{_QUANTIZED}">■</span> quantized &nbsp; '
        f'<span style="color:#9ca3af">■</span> forgotten &nbsp; (a cell: one message in one '
        f"layer, filled from the bottom by its share of the message's tokens; {n_layers} "
        "global-attention layers; a forgotten message's row is struck through)"
    )
    return (
        "<style>.kvedit-memory table{border-collapse:collapse;font-size:12px}"
        ".kvedit-memory td.cell{width:9px!important;min-width:9px;max-width:9px;height:14px;"
        "padding:0!important;border:1px solid #fff!important}"
        ".kvedit-memory td,.kvedit-memory th{padding:1px 4px!important}"
        ".kvedit-memory td.label{max-width:260px;overflow:hidden;white-space:nowrap;"
        "text-overflow:ellipsis;padding-right:6px}"
        ".kvedit-memory td.num{text-align:right;padding-right:6px;"
        "font-variant-numeric:tabular-nums}"
        ".kvedit-memory tr.forgotten td.label{text-decoration:line-through;opacity:.6}"
        ".kvedit-memory th.layer{font-weight:400;font-size:10px;padding:0!important}</style>"
        '<div class="kvedit-memory" style="padding:2px 4px">'
        f'<div class="summary" style="margin-bottom:4px">{html.escape(summary)}</div>'
        '<div style="overflow-x:auto"><table><thead><tr><th>message</th><th>tok</th>'
        f"<th>held</th>{head}</tr></thead><tbody>{''.join(body)}</tbody></table></div>"
        f'<div style="font-size:12px;opacity:.8;margin-top:4px">{legend}</div></div>'
    )
