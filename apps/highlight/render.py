"""Rendering a highlight result: the attention-coloured context, its legend, the status line.

The context is drawn token by token, each token's background as strong as its share of the
question's attention; emphasized spans are underlined in green, suppressed ones dashed in red.
All text from the request is HTML-escaped. The status line is Markdown. Auto-highlight's
passage scores are drawn as a list of bars (:func:`render_scores`), picked passages in green.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .parse import PromptSplit, Range

if TYPE_CHECKING:
    import torch

    from kvedit.states.state import KVState

__all__ = [
    "GroupShare",
    "Piece",
    "context_pieces",
    "legend",
    "render_attention",
    "render_difference",
    "render_focus_status",
    "render_scores",
    "render_status",
    "render_views",
]

# Colours of the attention view.
_HEAT_RGB = "234, 88, 12"  # orange
_EMPHASIZE_COLOR = "#16a34a"  # green underline
_SUPPRESS_COLOR = "#dc2626"  # red dashed underline
_OTHER_BAR_COLOR = "#9ca3af"  # grey: a passage not picked
_GAIN_RGB = "22, 163, 74"  # green: more attention after the edit
_LOSS_RGB = "37, 99, 235"  # blue: less attention after the edit


@dataclass(frozen=True)
class Piece:
    """A token (or tokens sharing characters) of the context.

    Attributes:
        start: where it starts in the context (characters).
        end: where it ends in the context (excluded).
        share: the share of the question's attention on it.
    """

    start: int
    end: int
    share: float


@dataclass(frozen=True)
class GroupShare:
    """The question's attention on a group of spans, before and after the edit.

    Attributes:
        name: ``"emphasized"`` or ``"suppressed"``.
        n_tokens: tokens in the group.
        before: share on the group in the captured cache.
        after: share on the group in the edited cache.
    """

    name: str
    n_tokens: int
    before: float
    after: float


def context_pieces(state: KVState, split: PromptSplit, token_share: torch.Tensor) -> list[Piece]:
    """The context's tokens as character ranges of the context, with their attention share.

    Tokens are clipped to the context; tokens sharing characters (a character split over
    byte-level tokens) are merged and their shares added.
    """
    lo, hi = split.context_start, len(split.prefix)
    pieces: list[Piece] = []
    for (a, b), share in zip(state.offsets.tolist(), token_share.tolist(), strict=True):
        a, b = max(a, lo), min(b, hi)
        if b <= a:
            continue
        if pieces and a < pieces[-1].end + lo:
            last = pieces.pop()
            pieces.append(Piece(last.start, max(last.end, b - lo), last.share + share))
        else:
            pieces.append(Piece(a - lo, b - lo, share))
    return pieces


def _marks(start: int, end: int, emphasize: Sequence[Range], suppress: Sequence[Range]) -> str:
    if any(a < end and start < b for a, b in emphasize):
        return f"border-bottom:3px solid {_EMPHASIZE_COLOR};"
    if any(a < end and start < b for a, b in suppress):
        return f"border-bottom:3px dashed {_SUPPRESS_COLOR};"
    return ""


def render_attention(
    title: str,
    context: str,
    pieces: Sequence[Piece],
    scale: float,
    emphasize: Sequence[Range],
    suppress: Sequence[Range],
) -> str:
    """HTML of the context with each token's background as strong as its attention share.

    ``scale`` is the share drawn at full strength (the same for "before" and "after", so the two
    views compare); intensity grows with the square root of the share so small shares show.
    """
    out: list[str] = []
    cursor = 0
    for piece in pieces:
        if piece.start > cursor:
            out.append(html.escape(context[cursor : piece.start]))
        alpha = 0.9 * math.sqrt(max(piece.share, 0.0) / scale) if scale > 0 else 0.0
        style = f"background:rgba({_HEAT_RGB},{alpha:.3f});" + _marks(
            piece.start, piece.end, emphasize, suppress
        )
        text = html.escape(context[piece.start : piece.end])
        out.append(f'<span style="{style}" title="{100 * piece.share:.2f}%">{text}</span>')
        cursor = piece.end
    out.append(html.escape(context[cursor:]))
    return (
        '<div class="kvedit-attention" style="padding:2px 4px">'
        f'<div style="font-weight:600;margin-bottom:4px">'
        f"{html.escape(title)}</div>"
        '<div style="white-space:pre-wrap;font-family:ui-monospace,SFMono-Regular,Menlo,monospace;'
        "font-size:13px;line-height:1.8;max-height:420px;overflow-y:auto;padding:8px;"
        'border:1px solid #d1d5db;border-radius:8px">' + "".join(out) + "</div></div>"
    )


def legend(scale: float) -> str:
    """The text under the attention views (plain text; ``scale`` as in :func:`render_attention`)."""
    return (
        f"Darker = more of the question's attention (mean over layers, heads and question "
        f"tokens; full colour = {100 * scale:.1f}% on one token, same scale before and after). "
        f"Green underline: emphasized; red dashed: suppressed. Hover a token for its share."
    )


def render_views(
    context: str,
    before: Sequence[Piece],
    after: Sequence[Piece],
    emphasize: Sequence[Range],
    suppress: Sequence[Range],
) -> tuple[str, str]:
    """``(before_html, after_html)``: both views on one colour scale, the legend under "after"."""
    scale = max([p.share for p in [*before, *after]] + [1e-9])
    note = (
        f'<div style="font-size:12px;opacity:.8;margin-top:4px">{html.escape(legend(scale))}</div>'
    )
    return (
        render_attention("Before: the captured cache", context, before, scale, emphasize, suppress),
        render_attention("After: the edited cache", context, after, scale, emphasize, suppress)
        + note,
    )


def render_difference(
    context: str,
    before: Sequence[Piece],
    after: Sequence[Piece],
    emphasize: Sequence[Range],
    suppress: Sequence[Range],
) -> str:
    """HTML of the context coloured by the change of each token's share (after minus before):
    green where the edit gave a token more of the question's attention, blue where less, full
    colour at the largest change in either direction (square-root intensity, as the views).

    ``before`` and ``after`` are the same tokens (an edit keeps the context's tokens).

    Raises:
        ValueError: the two lists are not the same tokens.
    """
    if [(p.start, p.end) for p in before] != [(p.start, p.end) for p in after]:
        raise ValueError("the attention views before and after cover different tokens")
    deltas = [Piece(a.start, a.end, a.share - b.share) for b, a in zip(before, after, strict=True)]
    scale = max([abs(p.share) for p in deltas] + [1e-9])
    out: list[str] = []
    cursor = 0
    for piece in deltas:
        if piece.start > cursor:
            out.append(html.escape(context[cursor : piece.start]))
        rgb = _GAIN_RGB if piece.share >= 0 else _LOSS_RGB
        alpha = 0.9 * math.sqrt(abs(piece.share) / scale)
        style = f"background:rgba({rgb},{alpha:.3f});" + _marks(
            piece.start, piece.end, emphasize, suppress
        )
        text = html.escape(context[piece.start : piece.end])
        title = f"{100 * piece.share:+.2f} points"
        out.append(f'<span style="{style}" title="{title}">{text}</span>')
        cursor = piece.end
    out.append(html.escape(context[cursor:]))
    note = (
        "Green: more of the question's attention after the edit; blue: less (full colour = "
        f"{100 * scale:.2f} percentage points on one token). Hover a token for its change."
    )
    return (
        '<div class="kvedit-difference" style="padding:2px 4px">'
        '<div style="font-weight:600;margin-bottom:4px">Difference: after minus before</div>'
        '<div style="white-space:pre-wrap;font-family:ui-monospace,SFMono-Regular,Menlo,monospace;'
        "font-size:13px;line-height:1.8;max-height:420px;overflow-y:auto;padding:8px;"
        'border:1px solid #d1d5db;border-radius:8px">' + "".join(out) + "</div>"
        f'<div style="font-size:12px;opacity:.8;margin-top:4px">{html.escape(note)}</div></div>'
    )


def render_status(
    model_name: str, seconds: float, n_tokens: int, strength: float, groups: Sequence[GroupShare]
) -> str:
    """The Markdown status of a finished request: time, model, size, and the attention shares."""
    lines = [
        f"{g.name} spans ({g.n_tokens} token{'s' * (g.n_tokens != 1)}): "
        f"{100 * g.before:.1f}% → **{100 * g.after:.1f}%**"
        for g in groups
    ]
    return (
        f"**Done** in {seconds:.1f} s on `{model_name}` ({n_tokens:,} context tokens, "
        f"strength {strength:g} nats). Share of the question's attention, before → after: "
        + "; ".join(lines)
        + "."
    )


def _short(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def render_scores(passages: Sequence[dict], width: int = 60) -> str:
    """HTML of Auto-highlight's passage scores: one row per passage, in context order.

    ``passages`` are dicts with ``passage``, ``score`` and ``chosen`` (as in
    :class:`.steer.FocusResult`). A row shows the passage's first ``width`` characters, its
    score and a bar as long as the score (from the lowest score, empty, to the highest, full);
    picked passages are green, bold and marked ✓ (the row's class is ``chosen``).
    """
    scores = [float(p["score"]) for p in passages]
    lo, hi = min(scores, default=0.0), max(scores, default=0.0)
    rows = []
    for i, p in enumerate(passages):
        score = float(p["score"])
        fill = 100.0 if hi <= lo else 100.0 * (score - lo) / (hi - lo)
        chosen = bool(p["chosen"])
        color = _EMPHASIZE_COLOR if chosen else _OTHER_BAR_COLOR
        weight = "font-weight:600;" if chosen else ""
        rows.append(
            f'<li class="kvedit-passage{" chosen" * chosen}" style="display:grid;'
            "grid-template-columns:1.5em minmax(0,1fr) 110px 4.5em;gap:6px;align-items:center;"
            f'{weight}" title="{html.escape(p["passage"])}">'
            f'<span style="color:{_EMPHASIZE_COLOR}">{"✓" if chosen else ""}</span>'
            '<span style="overflow:hidden;text-overflow:ellipsis;white-space:nowrap">'
            f"{i + 1}. {html.escape(_short(p['passage'], width))}</span>"
            '<span style="background:#f3f4f6;border-radius:3px;height:10px">'
            f'<span style="display:block;height:10px;border-radius:3px;width:{fill:.1f}%;'
            f'background:{color}"></span></span>'
            f'<span class="score" style="text-align:right;font-variant-numeric:tabular-nums">'
            f"{score:+.3f}</span></li>"
        )
    return (
        '<div class="kvedit-scores" style="padding:2px 4px">'
        '<div style="font-weight:600;margin-bottom:4px">Passage scores</div>'
        '<ol style="list-style:none;margin:0;padding:8px;font-size:13px;line-height:1.7;'
        'max-height:420px;overflow-y:auto;border:1px solid #d1d5db;border-radius:8px">'
        + "".join(rows)
        + "</ol>"
        '<div style="font-size:12px;opacity:.8;margin-top:4px">Score: log of the attention '
        "share the question gives a passage over the share a content-free version of the "
        "question gives it, averaged over layers (position bias cancels). Green ✓: picked, "
        "now in the Emphasize box.</div></div>"
    )


def render_focus_status(
    model_name: str,
    seconds: float,
    n_tokens: int,
    n_passages: int,
    picked: int,
    asked: int,
    reason: str = "",
) -> str:
    """The Markdown status of an Auto-highlight: what was picked (``picked`` passages of
    ``n_passages``, ``asked`` for), and that Run steers; when nothing was picked, that no
    passage stands out, why (``reason``, :attr:`kvedit.Focus.reason`), and that the Emphasize
    box is left empty."""
    noun = "passage" if n_passages == 1 else "passages"
    head = (
        f"**Auto-highlight** in {seconds:.1f} s on `{model_name}` ({n_tokens:,} context tokens): "
    )
    if picked == 0:
        return (
            head + f"found no passage that stands out among the {n_passages} {noun}, so the "
            f"Emphasize box is left empty. Nothing picked: {reason or 'no passage stands out'}."
        )
    if picked >= asked:
        fewer = ""
    elif picked == n_passages:
        fewer = f" (asked for {asked}; the context has only {n_passages})"
    else:
        fewer = f" (asked for {asked}; only {picked} stand{'s' if picked == 1 else ''} out)"
    return (
        head + f"picked {picked} of {n_passages} {noun}{fewer}, now in the Emphasize box. "
        "Press **Run** to steer."
    )
