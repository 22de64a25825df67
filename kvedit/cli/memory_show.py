"""``kvedit memory show FILE [--plot PNG]``: what a saved memory file holds, read without the
model (:func:`kvedit.memory.holdings_file.read_held_file`): the model that made it, its
messages and what each still holds, the entries per global layer, its bytes against its
budget, its forgetting rounds; ``--plot`` draws the app's Memory chart to a PNG
(:func:`kvedit.memory.holdings_plot.plot_held`).

Nothing heavy is imported until the command runs (``kvedit memory show --help`` stays fast)."""

from __future__ import annotations

import importlib.util
from collections import Counter

from .status import UsageError

__all__ = ["add_show_parser", "show_lines"]

SHOW_HELP = "what a saved memory file holds (messages, entries per layer, bytes, forgetting)"


def add_show_parser(tools) -> None:
    """``kvedit memory show``'s parser, under ``kvedit memory``'s subcommands ``tools``."""
    p = tools.add_parser(
        "show",
        help=SHOW_HELP,
        description=(
            "Prints what a memory file (Memory.save's, kvedit chat --memory's) holds, read "
            "without loading the model: the model that made it, the budget it was saved with, "
            "the entries each global-attention layer holds (least / median / most), the bytes, "
            "the forgetting rounds, and per message its tokens and whether it is still held "
            "(kept, quantized, partly or wholly forgotten). The file's seal and fields are "
            "checked; that its messages render to its tokens needs the tokenizer and is "
            "checked when the file is loaded (kvedit chat, Memory.load)."
        ),
    )
    p.add_argument("file", metavar="FILE", help="the memory file")
    p.add_argument(
        "--plot",
        metavar="PNG",
        default=None,
        help="also draw the chart of what is held (per message and per layer: kept, "
        "quantized, forgotten; the app's Memory chart) to this .png file, in an existing "
        "folder (needs matplotlib; default: no chart)",
    )
    p.set_defaults(run=_run_show)


def _check_plot(plot: str | None):
    """The ``--plot`` file, checked before the memory file is read (None: no chart)."""
    if plot is None:
        return None
    from ..errors import InvalidInputError
    from ..memory.holdings_plot import check_png_path

    try:
        out = check_png_path(plot, "--plot")
    except InvalidInputError as e:
        raise UsageError(str(e)) from None
    if importlib.util.find_spec("matplotlib") is None:
        raise UsageError("--plot needs matplotlib: pip install 'kvedit[plot]'")
    return out


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:,.1f} {unit}"
    return f"{nbytes} B"


def _budget_line(keywords: dict, nbytes: int, entries: list[float]) -> str:
    """The budget the file was saved with, and how full the memory is against it."""
    max_bytes, max_tokens = keywords.get("max_bytes"), keywords.get("max_tokens")
    if max_bytes is None and max_tokens is None:
        return "budget: none (nothing is forgotten)"
    if max_bytes is not None:
        size = f"{_size(max_bytes)} ({100 * nbytes / max_bytes:.0f}% used)"
    else:
        mean = sum(entries) / max(len(entries), 1)
        size = f"{max_tokens:,} entries per global layer ({100 * mean / max_tokens:.0f}% used)"
    extras = [f"forget {keywords['forget']}"] if keywords.get("forget") else []
    keep = keywords.get("keep")
    head, layer = keywords.get("per_head"), keywords.get("per_layer")
    if keep is None and (head is not None or layer is not None):  # the older keywords
        from ..memory.keeping import keep_of

        keep = keep_of(None, head, layer)
    for key, value in (
        ("keep", keep),
        *((k, keywords.get(k)) for k in ("recent_tokens", "quantize")),
    ):
        if value is not None:
            extras.append(f"{key} {value}")
    return f"budget: {size}" + (f", {', '.join(extras)}" if extras else "")


def _message_line(row, layers: list[float]) -> str:
    """One message: index, role, tokens, what the global layers hold of it now, its text."""
    if row.state in ("kept", "quantized"):
        said = "kept" if row.state == "kept" else "held, quantized (low bits)"
    elif row.state == "forgotten":
        said = "forgotten"
    else:
        from ..memory.holdings import held_spread

        said = (
            f"partly forgotten: {held_spread(layers)} of {row.n_tokens:,} held "
            f"({100 * row.held_share:.0f}%)"
        )
    from ..memory.explaining import preview

    return (
        f"{row.index:4d} {row.role:9s} {row.n_tokens:6,d} tok  {said}  {preview(row.content, 40)}"
    )


def show_lines(found) -> list[str]:
    """What :func:`_run_show` prints for ``found`` (a
    :class:`~kvedit.memory.holdings_file.HeldFile`)."""
    from ..memory.holdings import held_spread

    entries, rows = found.entries(), found.held()
    sealed = "sealed by this installation" if found.trusted else "not sealed here"
    lines = [
        f"memory file: {found.path} ({sealed})",
        f"model: {found.model or 'not recorded'}",
        f"messages: {len(found.messages)}, {found.n_tokens:,} tokens ({found.prompt} format)",
        f"holds per global layer {held_spread(entries)} entries (least / median / most, per KV "
        f"head) over {len(entries)} global-attention layers; {_size(found.nbytes)} in all",
        _budget_line(found.keywords, found.nbytes, entries),
    ]
    if found.rounds:
        by = Counter(r.policy for r in found.rounds)
        lines.append(
            f"forgetting: {len(found.rounds)} rounds "
            f"({', '.join(f'{n} by {p}' for p, n in by.items())}), "
            f"{sum(r.seconds for r in found.rounds):.2f} s"
        )
    else:
        lines.append("forgetting: no rounds")
    lines.append("held now, per message (entries of its tokens per global layer):")
    lines += [_message_line(r, [x.held for x in r.layers]) for r in rows]
    return lines


def _run_show(args) -> int:
    out = _check_plot(args.plot)  # before the file is read: a refusal does no work
    from ..errors import CorruptCacheError, InvalidInputError
    from ..memory.holdings_file import read_held_file

    try:
        found = read_held_file(args.file)
    except (InvalidInputError, CorruptCacheError) as e:
        raise UsageError(str(e)) from None
    except OSError as e:
        raise UsageError(f"{args.file}: cannot read it: {e.strerror or e}") from None
    if out is not None and not found.messages:
        raise UsageError(f"--plot {out}: {args.file} holds no messages, there is nothing to draw")
    print("\n".join(show_lines(found)))
    if out is not None:
        from ..memory.holdings_plot import plot_held

        name = found.model or "unknown model"
        title = f"{found.path.name}: {name}, {len(found.messages)} messages"
        plot_held(found.held(), out, title)
        print(f"chart written: {out}")
    return 0
