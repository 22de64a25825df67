"""``snapkv``: keep, per KV head, the cache entries an observation window attends to most.

SnapKV (Li et al., 2024) scores every cached entry by the attention an *observation window*
gives it, summed over the window's queries (and over the query heads that share a KV head),
smooths the scores with a 1D max-pool of width ``kernel`` over neighbouring entries (so whole
phrases survive, not isolated tokens), and keeps the top ``keep`` fraction per KV head. The
window is the text of ``query`` when given (say, the question: it is run on top of the state to
read its attention, and not added to the cache), else the state's own last ``window`` tokens
(run again at their positions on top of the rest). The last ``window`` tokens are always kept.

This op is :func:`kvedit.compress.select` with the :class:`kvedit.compress.SnapKV` scorer and
``protect_bias=False`` (entries with a positive stored bias are ranked like any other; call
``select`` to protect them, or spans, or to share the budget among heads with ``AdaKV``).

Storage. SnapKV keeps *different* tokens per KV head, while a layer's entries
(``token_index``, ``positions``) are shared by its heads. kvedit therefore keeps, physically,
the union of the entries any head keeps, and masks each head's dropped entries with a ``-1e30``
bias (a ``[batch, kv_heads, n]`` stored bias): attention is exactly per-head SnapKV, and every
other op and the storage format keep working. The memory it really saves is
``1 - union / n`` (plus the bias, 4 bytes per entry and KV head), less than the nominal
``1 - keep`` when heads disagree; compare ``state.nbytes`` before and after. Sliding-window
layers (Gemma-3) are kept whole: they hold at most ``window`` entries already.
"""

from __future__ import annotations

from ..compress import DROPPED, SnapKV, select
from ..errors import InvalidInputError
from ..state import KVState

__all__ = ["DROPPED", "snapkv"]


def snapkv(
    state: KVState,
    keep: float = 0.5,
    query: str | None = None,
    window: int = 32,
    kernel: int = 5,
) -> KVState:
    """A new state keeping, per KV head of every global layer, ``keep`` of the entries.

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
        bias (masked) on the entries a head dropped (see the module doc for the memory this saves).
    """
    if not isinstance(keep, (int, float)) or isinstance(keep, bool) or not 0.0 < keep <= 1.0:
        raise InvalidInputError(f"keep must be a fraction in (0, 1], not {keep!r}")
    scorer = SnapKV(query=query, window=window, kernel=kernel)
    state.require_model()
    if keep == 1.0 or len(state) <= window:  # every token is in the window: nothing to drop
        return state
    return select(state, scorer, keep, protect_bias=False)
