"""The chart of what a memory holds (:mod:`kvedit.memory.holdings`' rows) as a PNG, the chart
the app's Memory tab draws: a row per message (index, role, text, tokens, share held), a cell
per counted layer filled from the bottom with its kept (green), quantized (blue) and forgotten
(grey) share; a forgotten message's label is struck through.

matplotlib (the ``plot`` extra) is imported when a chart is drawn, with the Agg backend (no
display); the file is written atomically (:func:`kvedit.atomic.atomic_write`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from ..atomic import atomic_write
from ..errors import InvalidInputError
from .holdings import COLORS, MessageHeld

__all__ = ["check_png_path", "plot_held"]

_ROW_INCHES = 0.24
_MAX_INCHES = 120.0  # the tallest figure: more messages share it (and only some are labelled)


def check_png_path(path: str | os.PathLike, flag: str = "--plot") -> Path:
    """``path`` as a PNG to write: a ``.png`` name in an existing folder, not itself a folder.

    Raises:
        InvalidInputError: an empty path, another suffix, a folder, or a parent folder that
            does not exist (or is a file).
    """
    text = os.fspath(path)
    if not text.strip():
        raise InvalidInputError(f"{flag} is empty: name the PNG file to write")
    out = Path(text)
    if out.suffix.lower() != ".png":
        raise InvalidInputError(f"{flag} {out}: the chart is written as a PNG: name a .png file")
    if out.is_dir():
        raise InvalidInputError(f"{flag} {out} is a folder: name the PNG file to write")
    parent = out.absolute().parent
    if not parent.is_dir():
        what = "is a file" if parent.exists() else "does not exist"
        raise InvalidInputError(f"{flag} {out}: its folder {parent} {what}: create it first")
    return out


def _label(row: MessageHeld, width: int = 32) -> str:
    """A row's label: index, role, text (cut), tokens, share held; a forgotten message's text
    struck through."""
    one = "".join(c if c.isprintable() else "\ufffd" for c in " ".join(row.content.split()))
    text = one if len(one) <= width else one[: width - 1] + "…"
    if row.state == "forgotten":
        text = "".join(c + "\u0336" for c in text)  # a combining long stroke: struck through
    return f"{row.index} {row.role}: {text}  {row.n_tokens} tok {100 * row.held_share:.0f}%"


def _cells(rows: Sequence[MessageHeld]) -> tuple[list, ...]:
    """Per cell (message ``y``, layer column ``x``): the kept and quantized shares of the
    cell's height, filled from the bottom."""
    xs, ys, kept, quantized = [], [], [], []
    for y, row in enumerate(rows):
        for x, cell in enumerate(row.layers):
            total = cell.held + cell.forgotten
            xs.append(x)
            ys.append(y)
            kept.append(0.0 if total <= 0 else cell.kept / total)
            quantized.append(0.0 if total <= 0 else cell.quantized / total)
    return xs, ys, kept, quantized


def plot_held(
    rows: Sequence[MessageHeld], path: str | os.PathLike, title: str = "", dpi: int = 100
) -> Path:
    """Draw ``rows`` (:func:`kvedit.memory.holdings.held_by_message`) to the PNG ``path``
    (:func:`check_png_path`), with ``title`` above; returns the path written.

    Raises:
        InvalidInputError: no rows (a memory without messages), or a bad ``path``.
    """
    out = check_png_path(path, "path")
    if not rows or not rows[0].layers:
        raise InvalidInputError("the memory holds no messages: there is nothing to draw")
    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    n_rows, n_layers = len(rows), len(rows[0].layers)
    row_inches = min(_ROW_INCHES, _MAX_INCHES / n_rows)
    fig = Figure(figsize=(4.2 + 0.16 * max(n_layers, 16), 1.6 + row_inches * n_rows), dpi=dpi)
    ax = fig.add_subplot()
    xs, ys, kept, quantized = _cells(rows)
    h = 0.86  # a cell's height and width; rows go downwards: a cell's bottom is y + h / 2
    bottoms = [y + h / 2 for y in ys]
    ax.bar(xs, [-h] * len(xs), bottom=bottoms, width=h, color=COLORS["forgotten"], linewidth=0)
    above_kept = [b - h * k for b, k in zip(bottoms, kept, strict=True)]
    ax.bar(
        xs,
        [-h * q for q in quantized],
        bottom=above_kept,
        width=h,
        color=COLORS["quantized"],
        linewidth=0,
    )
    ax.bar(xs, [-h * k for k in kept], bottom=bottoms, width=h, color=COLORS["kept"], linewidth=0)
    ax.set_xlim(-0.6, n_layers - 0.4)
    ax.set_ylim(n_rows - 0.5, -0.5)
    step = max(1, -(-n_rows // int(_MAX_INCHES / _ROW_INCHES)))
    shown = list(range(0, n_rows, step))
    ax.set_yticks(shown, [_label(rows[y]) for y in shown], fontsize=8)
    for y, tick in zip(shown, ax.get_yticklabels(), strict=True):
        if rows[y].state == "forgotten":
            tick.set_color("#9ca3af")
    layer_ticks = [x for x, cell in enumerate(rows[0].layers) if cell.layer % 5 == 0]
    ax.set_xticks(layer_ticks, [str(rows[0].layers[x].layer) for x in layer_ticks], fontsize=8)
    ax.set_xlabel(f"layer ({n_layers} global-attention layers)")
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    legend = [Patch(color=COLORS[k], label=k) for k in ("kept", "quantized", "forgotten")]
    ax.legend(handles=legend, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=3, frameon=False)
    if title:
        fig.suptitle(title, fontsize=9, x=0.02, ha="left")
    fig.tight_layout()
    atomic_write(out, lambda tmp: fig.savefig(tmp, format="png"))
    return out
