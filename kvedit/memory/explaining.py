"""What a :class:`kvedit.Memory` holds and did, in words: :meth:`Memory.explain`'s lines and
:meth:`Memory.focus_said`, from the memory's records (turns, forgetting rounds, the last focus).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from ..cache import is_headwise
from ..focusing.choice import Focus
from ..states.state import KVState
from .budget import Budget
from .forgetting import Round, global_entries, layer_entries
from .protection import system_texts
from .records import Turn
from .rendering import Message, Rendering

__all__ = ["explain_text", "focus_said", "held_line", "per_layer", "preview"]


def preview(text: str, width: int = 48) -> str:
    """``text`` on one line, cut to ``width`` characters (with an ellipsis), quoted."""
    one = " ".join(text.split())
    return repr(one if len(one) <= width else one[: width - 1] + "…")


def explain_text(
    header: str,
    turns: Sequence[Turn],
    rounds: Sequence[Round],
    budget: Budget | None,
    messages: Sequence[Message],
    rendering: Rendering,
    state: KVState,
    said: str | None,
) -> str:
    """Per message: role, tokens, computed / kept / loaded, bytes (after ``header``), and where
    a template writes a system message's text in another message's tokens (Gemma-3's folds it
    into the first user turn), that message; the forgetting rounds by policy (a memory loaded
    with another policy forgot by both) against the ``budget`` it has now; and ``said``, what
    focus did last (:func:`focus_said`)."""
    lines = [header]
    texts = system_texts(messages, rendering)
    for t in turns:
        how = {"computed": f"computed {t.computed}", "loaded": "loaded from file"}.get(
            t.source, f"decoded, kept {t.kept}, computed {t.computed}"
        )
        if t.recomputed:
            how += f", {t.recomputed} recomputed ({t.note})"
        start = texts.get(t.index, (t.start,))[0]
        if not t.start <= start < t.end:
            holder = next((u.index for u in turns if u.start <= start < u.end), None)
            how += f"; its text is in message {holder}'s tokens (the template puts it there)"
        lines.append(
            f"{t.index:4d} {t.role:9s} {t.n_tokens:6d} tok  {how}; "
            f"{t.nbytes / 1024:.0f} KiB  {preview(t.content)}"
        )
    if rounds:
        spent = sum(r.seconds for r in rounds)
        by_policy = Counter(r.policy for r in rounds)  # in the order they first forgot
        policies = ", ".join(f"{n} by {name}" for name, n in by_policy.items())
        now = "no budget now" if budget is None else f"budget {budget.describe()}"
        lines.append(
            f"forgetting ({now}): {len(rounds)} rounds ({policies}), {spent:.2f} s, "
            f"{spent / max(len(messages), 1):.3f} s per message; holds "
            f"{global_entries(state)} entries of {len(state)} tokens"
        )
    if budget is not None or rounds:
        lines.append(held_line(state))
    if said is not None:
        lines.append(f"last focus: {said}")
    return "\n".join(lines)


def per_layer(state: KVState) -> list[dict]:
    """Per layer, what the cache holds now: ``entries`` (per KV head, on average: a headwise
    layer's heads hold their own), ``bytes`` (allocated, padding included) and ``window``."""
    return [
        {
            "layer": i,
            "entries": round(layer_entries(state, i), 2),
            "bytes": layer.nbytes,
            "window": layer.window,
        }
        for i, layer in enumerate(state.layers)
    ]


def held_line(state: KVState) -> str:
    """One line: what the global layers hold now (entries per layer: least, median, most) and
    the bytes the whole cache allocates."""
    counted = sorted(layer_entries(state, i) for i in state.counted_layers)
    if not counted:
        return f"holds {state.nbytes / 2**20:.2f} MiB"
    mid = counted[len(counted) // 2]
    heads = (
        " (each KV head its own)"
        if any(is_headwise(state.layers[i]) for i in state.counted_layers)
        else ""
    )
    return (
        f"holds per global layer {counted[0]:.0f} / {mid:.0f} / {counted[-1]:.0f} entries "
        f"(least / median / most){heads}, {state.nbytes / 2**20:.2f} MiB in all"
    )


def focus_said(
    found: Focus | None,
    contents: Sequence[tuple[int, int] | None],
    messages: Sequence[Message],
) -> str | None:
    """What focus did (``found``, over messages whose contents span ``contents``, character
    ranges of the memory's text), in words: the messages it emphasized, the guard's verdict
    where it dropped the edit, or why it abstained; None when ``found`` is None."""
    if found is None:
        return None
    if found.chosen and found.kept:
        said = ", ".join(_message_at(found.passages[i], contents, messages) for i in found.chosen)
        why = " (the only one holding all of the question's words)" if found.by_words else ""
        return f"emphasized {said}{why}"
    if found.chosen:
        return f"edit dropped by the guard ({found.verdict})"
    return f"abstained ({found.reason})"


def _message_at(
    span: tuple[int, int], contents: Sequence[tuple[int, int] | None], messages: Sequence[Message]
) -> str:
    for i, r in enumerate(contents):
        if r is not None and r[0] <= span[0] < r[1]:
            return f"message {i} ({messages[i].role}: {preview(messages[i].content)})"
    return f"characters {span[0]}..{span[1]}"
