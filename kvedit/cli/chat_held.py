"""What a ``kvedit chat``'s memory holds now, in the chat's words: the turn line's account
(entries per global layer held, the transcript's tokens, bytes against the budget),
``/explain``'s per-message lines (how much of each message is still held), and whether an
answer was cut at ``--max-new-tokens``.

Read from :class:`kvedit.Memory`'s public fields (``state``, ``turns``, ``budget``,
``nbytes``, ``last_answer``); heavy modules are imported inside the functions (``kvedit chat --help`` stays
fast)."""

from __future__ import annotations

__all__ = ["answer_cut", "held_now", "held_summary", "size"]


def size(nbytes: int) -> str:
    """``nbytes`` in B, KiB, MiB or GiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:,.1f} {unit}"
    return f"{nbytes} B"


def held_summary(memory) -> str:
    """What ``memory`` holds now: its transcript's tokens, the entries each global layer
    holds (least / median / most over those layers, per KV head on average) and its bytes,
    against a byte budget as a percentage."""
    from ..memory.forgetting import layer_entries
    from ..memory.holdings import held_spread

    state = memory.state
    entries = [layer_entries(state, i) for i in state.counted_layers]
    line = (
        f"memory {len(state):,} tok, holds {held_spread(entries)} entries per global layer "
        f"(least / median / most), {size(memory.nbytes)}"
    )
    budget = memory.budget
    if budget is not None and budget.max_bytes is not None:
        line += f" of {size(budget.max_bytes)} ({100 * memory.nbytes / budget.max_bytes:.0f}%)"
    return line


def held_now(memory) -> str:
    """Per message: its tokens and the entries of them each global layer holds now (least /
    median / most over those layers): ``all held``, ``forgotten`` (no layer holds any) or
    the spread."""
    from ..memory.holdings import held_by_message, held_spread

    state = memory.state
    lines = [
        "held now, per message: entries of its tokens each global layer holds "
        "(least / median / most)"
    ]
    rows = held_by_message(memory.turns, state.layers, state.counted_layers, len(state))
    for t, row in zip(memory.turns, rows, strict=True):
        held = [x.held for x in row.layers]
        if t.n_tokens and min(held) >= t.n_tokens:
            said = "all held"
        elif max(held, default=0) == 0:
            said = "forgotten"
        else:
            said = f"{held_spread(held)} of {t.n_tokens:,} ({100 * sum(held) / len(held) / t.n_tokens:.0f}%)"
        lines.append(f"{t.index:4d} {t.role:9s} {t.n_tokens:6,d} tok  {said}")
    return "\n".join(lines)


def answer_cut(memory) -> int | None:
    """The tokens the last answer took when it was cut at ``--max-new-tokens``, else None
    (it ended at EOS or a stop string): ``Memory.last_answer`` says why it
    ended."""
    said = memory.last_answer
    return said.n_tokens if said is not None and said.ended == "length" else None
