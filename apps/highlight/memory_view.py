"""What a :class:`kvedit.Memory` holds, per message and per layer, and its chart.

The rows (each message's entries kept, quantized and forgotten in each counted layer) are
:mod:`kvedit.memory.holdings`' (computed from the memory's public attributes: ``mem.turns``,
``mem.state``); ``kvedit memory show FILE --plot`` draws the same rows to a PNG. This module
draws them as the Memory tab's HTML table. An entry of a message's token is **kept** (exact),
**quantized** (held in low bits) or **forgotten** (dropped by a forgetting round); the counted
layers are the global-attention ones (every layer when every layer slides): a sliding-window
layer keeps its last tokens by itself and is not drawn.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvedit.memory import holdings
from kvedit.memory.holdings import COLORS, LayerHeld, MessageHeld

if TYPE_CHECKING:
    from kvedit.memory.conversation import Memory

__all__ = ["LayerHeld", "MessageHeld", "held_by_message", "render_held"]

_KEPT, _QUANTIZED, _FORGOTTEN = COLORS["kept"], COLORS["quantized"], COLORS["forgotten"]


def held_by_message(mem: Memory) -> list[MessageHeld]:
    """Per message (``mem.turns``) and per counted layer, the entries kept, quantized and
    forgotten now (:func:`kvedit.memory.holdings.held_by_message`)."""
    state = mem.state
    return holdings.held_by_message(mem.turns, state.layers, state.counted_layers, len(state))


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
