"""Which A token and which A layers each B token and B layer reads.

Tokens are matched by character offsets (:func:`align_tokens`), layers by relative depth
(:func:`depth_matched_layers`); B's special tokens have no counterpart in A
(:func:`special_token_mask`).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

import torch
from transformers import PreTrainedTokenizerBase

__all__ = ["align_tokens", "depth_matched_layers", "special_token_mask"]


def align_tokens(
    offsets_b: torch.Tensor,
    offsets_a: torch.Tensor,
    special_b: Sequence[bool] | None = None,
) -> torch.Tensor:
    """For each B token, the index of the A token whose K/V it takes.

    Args:
        offsets_b: ``[n_b, 2]`` character range ``[start, end)`` of each B token.
        offsets_a: ``[n_a, 2]`` the same for A's tokens of the same text.
        special_b: ``n_b`` flags, True for B tokens that have no counterpart in A.

    Returns:
        ``LongTensor[n_b]``: an index into A's tokens, or ``-1`` for no counterpart.

    B token ``j`` with character range ``[s, e)`` takes the last A token that starts at or
    before character ``e - 1`` (so the A token holding that character, or the nearest one
    before a gap). When several tokens cover exactly the same characters (byte-level pieces of
    one character), the ``r``-th such B token takes the ``r``-th such A token (the last one if
    A has fewer), so identical tokenizations align one to one. Zero-width tokens on either side
    (special tokens) and B tokens flagged in ``special_b`` get ``-1``.
    """
    oa = offsets_a.tolist()
    valid = [i for i, (s, e) in enumerate(oa) if e > s]
    starts = [oa[i][0] for i in valid]
    same_range: dict[tuple[int, int], list[int]] = {}
    for i in valid:
        same_range.setdefault((oa[i][0], oa[i][1]), []).append(i)
    seen: dict[tuple[int, int], int] = {}
    out = []
    for j, (s, e) in enumerate(offsets_b.tolist()):
        if e <= s or not valid or (special_b is not None and special_b[j]):
            out.append(-1)
            continue
        rank = seen.get((s, e), 0)
        seen[(s, e)] = rank + 1
        twins = same_range.get((s, e))
        if twins:
            out.append(twins[min(rank, len(twins) - 1)])
            continue
        k = bisect.bisect_right(starts, e - 1) - 1
        out.append(valid[max(k, 0)])
    return torch.tensor(out, dtype=torch.long)


def depth_matched_layers(n_a: int, n_b: int, width: int) -> list[list[int]]:
    """For each of ``n_b`` layers, the ``width`` layers of ``n_a`` nearest its relative depth.

    ``width`` is clamped to ``[1, n_a]``; the groups are consecutive and never leave
    ``[0, n_a)``.
    """
    width = max(1, min(width, n_a))
    out = []
    for layer in range(n_b):
        center = (layer + 0.5) * n_a / n_b - 0.5
        start = int(math.floor(center - (width - 1) / 2 + 0.5))
        start = min(max(start, 0), n_a - width)
        out.append(list(range(start, start + width)))
    return out


def special_token_mask(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int]) -> list[bool]:
    """Per id in ``ids``, whether it is one of the tokenizer's special tokens (BOS, EOS, chat
    markers, added tokens flagged special)."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    for token_id, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(added, "special", False):
            special.add(int(token_id))
    return [int(i) in special for i in ids]
