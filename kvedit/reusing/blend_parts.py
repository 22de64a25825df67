"""Step 1 of :func:`~kvedit.reusing.blending.blend`: the parts' tokens and cached states.

Part 0 is tokenized with the tokenizer's default special tokens, every later part (and the
neutral ``previous`` passage) without them: :func:`encode_parts`, which also checks that the
blend fits the model before any model work. :func:`part_states` then fetches each part's cache
from the store, or computes and stores it (part 0 captured; a later part behind the prefix, and
behind ``previous`` after part 1, with ``context="prefix"``, or alone), and cuts a later part
cached behind the prefix out of that capture. The module doc of
:mod:`kvedit.reusing.blending` says why.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from .. import checks
from ..errors import InvalidInputError
from ..states.capturing import capture, capture_passage, encode, extend_ids, passage_after
from ..states.state import KVState
from ..store import KVStore
from .prefix import require_plain


@dataclass
class PartReport:
    """One part of a blend: its store key, token count and where its cache came from
    (``"memory"``, ``"disk"``, or ``"computed"`` when it was prefilled and stored)."""

    key: str
    n_tokens: int
    source: str


@dataclass(frozen=True)
class PreviousPassage:
    """The neutral passage later parts are cached behind: its text, ids and offsets
    (``text`` None, no ids and no offsets when there is none)."""

    text: str | None
    ids: list[int]
    offsets: torch.Tensor | None


def encode_parts(
    model: PreTrainedModel,
    tokenizer,
    parts: Sequence[str],
    previous: str | None,
    *,
    max_positions: int | None = None,
) -> tuple[list[tuple[list[int], torch.Tensor]], PreviousPassage]:
    """Every part's ``(ids, offsets)`` (part 0 with special tokens) and the ``previous`` passage.

    The blend, and each later part behind the prefix (and ``previous``), must fit the model
    (``max_positions``, else its config's maximum): checked on the characters before
    tokenizing, then on the tokens, before any model work.
    """
    limit = {"max_positions": max_positions}
    checks.context_fits(model, n_chars=sum(map(len, parts)), what="blend", **limit)
    if previous:
        checks.context_fits(model, n_chars=len(previous), what="blend's previous passage", **limit)
    previous_ids, previous_offsets = (
        encode(tokenizer, previous, special_tokens=False) if previous else ([], None)
    )
    if previous is not None and not previous_ids:
        raise InvalidInputError("blend: previous tokenizes to nothing")
    encoded = [encode(tokenizer, text, special_tokens=i == 0) for i, text in enumerate(parts)]
    for i, (ids, _) in enumerate(encoded):
        if not ids:
            raise InvalidInputError(f"blend: part {i} tokenizes to nothing")
    checks.context_fits(model, n_tokens=sum(len(ids) for ids, _ in encoded), what="blend", **limit)
    if previous:
        longest = max((len(ids) for ids, _ in encoded[2:]), default=0)
        n_behind = len(encoded[0][0]) + len(previous_ids) + longest
        checks.context_fits(
            model,
            n_tokens=n_behind,
            what="prefix, previous passage and longest later part",
            **limit,
        )
    return encoded, PreviousPassage(previous, previous_ids, previous_offsets)


def part_states(
    model: PreTrainedModel,
    tokenizer,
    parts: Sequence[str],
    encoded: Sequence[tuple[list[int], torch.Tensor]],
    previous: PreviousPassage,
    store: KVStore,
    context: str,
    *,
    max_positions: int | None = None,
) -> tuple[list[KVState], list[PartReport]]:
    """Each part's state as it is placed in the blend, and its report, in order.

    A part is fetched from ``store`` or computed and stored (part 0 captured; a later part run
    behind the prefix, and behind ``previous`` after part 1, or captured alone); a later part
    cached behind the prefix is then cut out of that capture. Every part's state carries
    ``max_positions`` (:attr:`KVState.max_positions`), a fetched one included.
    """
    states, reports = [], []
    prefix_ids: list[int] = []
    prefix: KVState | None = None
    behind_previous: KVState | None = None  # the prefix's state extended by ``previous``
    for i, (text, (ids, offsets)) in enumerate(zip(parts, encoded, strict=True)):
        behind = context == "prefix" and i > 0
        lead = previous.ids if behind and i > 1 else []  # part 1 reads right after the prefix
        key = store.key_for(model, tokenizer, prefix_ids + lead + ids if behind else ids)
        state, source = store.fetch(key, model, tokenizer)
        if state is not None:
            require_plain(state, store, f"blend part {i}")
            state = state.replace(max_positions=max_positions)
        if state is None:
            if i == 0:
                state = capture(model, tokenizer, text, max_positions=max_positions)
            elif behind:
                if lead and behind_previous is None:
                    behind_previous = extend_ids(
                        prefix,
                        lead,
                        previous.offsets + len(prefix.text),
                        prefix.text + previous.text,
                    )
                base = behind_previous if lead else prefix
                state = extend_ids(base, ids, offsets + len(base.text), base.text + text)
            else:
                state = capture_passage(model, tokenizer, text, max_positions=max_positions)
            # a plain capture (or a plain capture extended): storable; the limit is this
            # call's setting, not the entry's
            store.put(state.replace(max_positions=None))
            source = "computed"
        if i == 0:
            prefix, prefix_ids = state, ids
        elif behind:
            text_start = len(prefix.text) + (len(previous.text) if lead else 0)
            state = passage_after(state, len(prefix_ids) + len(lead), text_start)
        states.append(state)
        reports.append(PartReport(key, len(ids), source))
    return states, reports
