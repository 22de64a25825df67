"""A state's cache in the form a stock attention kernel serves: :func:`to_stock`.

vLLM's kernels (like every serving kernel) take keys and values and nothing else: no per-key
bias, one cache slot per sequence position, and the new tokens' positions right after the last
slot. :func:`to_stock` turns a :class:`~kvedit.KVState` into such a cache:

* **Biases become entries.** A stored bias of ``+b`` nats on an entry becomes ``r`` extra copies
  of it, ``r`` the count whose ``log(r + 1)`` is nearest ``b`` (at most
  :data:`~kvedit.checks.MAX_DUPLICATE_COPIES`): ``r`` copies multiply the entry's attention
  weight by exactly ``r + 1`` (what :func:`kvedit.ops.duplicate` does). A bias of ``-remove_at``
  nats or less (:data:`REMOVE_AT`, 20 by default) removes the entry: a full suppress. Beyond
  :data:`MASKED` nats the weight kvedit gives the entry is exactly 0 in float32, so removal is
  exact; between ``remove_at`` and that, kvedit still gives it ``e**-|b|`` of its weight. A
  negative bias above ``-remove_at`` has no stock-kernel form (nothing lowers one key's weight
  without a bias); it is left out and reported (``how="unrealized"``). Every bias is reported
  next to the one realised (:attr:`StockCache.realizations`).
* **One slot count for every layer.** vLLM gives all layers the same slots. Where layers ask
  for different copy counts of an entry (per-layer strengths, :func:`kvedit.focus`), every
  global layer gets the count nearest the mean positive bias the layers ask for it, and each
  layer's asked vs realised bias is reported. Where KV heads of one layer need different
  counts, or layers differ in their entries, the missing entries are *null* entries (zero key
  and value): they add ``e**0`` to the softmax denominator, which is small next to the
  attention sink on most layers but not nothing, so such a cache is reported approximate
  (:attr:`StockCache.null_entries`).
* **Positions.** vLLM puts the first new token at position ``n_slots``; kvedit's own
  ``generate`` puts it at ``state.next_position``. RoPE is relative, so every cached key is
  rotated by ``n_slots - next_position`` (:mod:`kvedit.rope`) and the new tokens see exactly
  the distances kvedit's ``generate`` sees. A plain state needs no rotation (bit-exact keys).
* **Sliding-window layers** keep their entries (no copies: they would push real tokens out of
  the window), right-aligned to the last slot, so the window over slots is the window over
  entries that kvedit's attention applies. A sliding layer holding fewer than ``window - 1``
  entries in a longer cache is refused: later queries would see slots nothing fills.

Whether such a cache may be served (exact; approximate only when asked, and labelled; never
when nothing of the edit is realised) is one rule, :mod:`~kvedit.integrations.vllm.servable`.

Shapes: keys and values of :class:`StockCache` are ``[n_i, kv_heads, head_dim]`` per layer
(vLLM's ``[tokens, kv_heads, head_dim]``), ``n_i = n_slots`` on global layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ... import checks, rope
from ...cache import LayerKV, refuse_headwise
from ...errors import InvalidInputError, ModelNotAttachedError
from ...provenance import History
from ...states.state import KVState

REMOVE_AT = 20.0
"""Entries whose bias is at or below ``-REMOVE_AT`` nats are removed (a full suppress)."""

MASKED = 104.0
"""Nats beyond which a float32 softmax weight is exactly 0: removal is then exact."""

_TOL = 1e-6


@dataclass(frozen=True)
class BiasRealization:
    """How one stored bias value of one layer was realised on a stock kernel.

    Attributes:
        layer: the decoder layer.
        asked: the stored bias in nats (mean over the query heads of a KV head).
        realized: the bias the stock cache applies: ``log(copies + 1)``, ``-inf`` (removed),
            or ``0.0`` (unrealized).
        how: ``"copies"``, ``"removed"`` or ``"unrealized"``.
        entries: how many cache entries of the layer carry this bias (on any KV head).
        copies: extra copies per entry (``"copies"`` only).
    """

    layer: int
    asked: float
    realized: float
    how: str
    entries: int
    copies: int = 0

    @property
    def exact(self) -> bool:
        """Whether the stock cache gives exactly the attention kvedit's bias gives."""
        if self.how == "removed":
            return self.asked <= -MASKED
        return abs(self.asked - self.realized) <= _TOL


@dataclass(eq=False, frozen=True)
class StockCache:
    """A state's cache as a stock kernel serves it (see the module doc).

    Attributes:
        token_ids: ``[n_slots]`` the prompt token ids to send for the cached part, one per slot
            (a copy's id is its token's; a null or separator slot gets ``placeholder_id``).
        keys, values: per layer ``[n_i, kv_heads, head_dim]``, slot ``n_slots - n_i + j`` for
            row ``j``; keys rotated by ``shift`` positions.
        windows: per layer its sliding window, or None.
        next_position: the state's ``next_position`` (where kvedit puts the first new token).
        shift: positions every key was moved by (``n_slots - next_position``).
        realizations: the biases asked and realised, per layer and value.
        null_entries: per layer, the (slot, KV head) pairs holding a null entry.
        model, model_fingerprint, tokenizer_fingerprint: what made the state.
        digest: the state's :attr:`~kvedit.KVState.digest` (after the approximation step
            :func:`~kvedit.integrations.vllm.servable.realize` labels it with, if any): the
            published file's name and what a request names (empty for a cache built by hand).
        history: the state's :class:`~kvedit.provenance.History` (None for a cache built by
            hand).

    Frozen: setting an attribute raises :class:`dataclasses.FrozenInstanceError`
    (:func:`~kvedit.integrations.vllm.servable.label` returns a relabelled copy). The
    attributes are frozen, not the data: the lists and tensors they hold are not.
    """

    token_ids: list[int]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    windows: list[int | None]
    next_position: int
    shift: int
    realizations: list[BiasRealization] = field(default_factory=list)
    null_entries: list[int] = field(default_factory=list)
    model: str | None = None
    model_fingerprint: str = ""
    tokenizer_fingerprint: str = ""
    digest: str = ""
    history: History | None = None

    @property
    def n_slots(self) -> int:
        return len(self.token_ids)

    @property
    def plain_capture(self) -> bool:
        """Whether the state was a plain capture (:attr:`~kvedit.KVState.is_plain_capture`):
        what a request that names no digest is served from."""
        return self.history is not None and self.history.first_change() is None

    def first_slot(self, layer: int) -> int:
        """The slot of layer ``layer``'s first row (0 on global layers)."""
        return self.n_slots - int(self.keys[layer].shape[0])

    @property
    def exact(self) -> bool:
        """Whether vLLM attends over this cache exactly as kvedit attends over the state (up
        to float rounding of rotated keys): every bias realised exactly, no null entries."""
        return all(r.exact for r in self.realizations) and not any(self.null_entries)

    def report(self) -> str:
        """A few lines: slots, shift, and each distinct bias asked vs realised."""
        lines = [
            f"{self.n_slots} slots (state next_position {self.next_position}, keys moved by "
            f"{self.shift:+d}); {'exact' if self.exact else 'approximate'}"
        ]
        seen: dict[tuple, tuple[list[float], set[int]]] = {}
        for r in self.realizations:  # one line per outcome: the range of biases asked
            asked, layers = seen.setdefault((r.realized, r.how, r.copies), ([], set()))
            asked.append(r.asked)
            layers.add(r.layer)
        for (realized, how, copies), (asked, layers) in seen.items():
            what = f"{copies} copies" if how == "copies" else how
            lo, hi = min(asked), max(asked)
            ask = f"{lo:+.3f}" if lo == hi else f"{lo:+.3f}..{hi:+.3f}"
            lines.append(f"  bias {ask} -> {realized:+.3f} nats ({what}) on {len(layers)} layers")
        if any(self.null_entries):
            lines.append(f"  null entries (slot x KV head) per layer: {self.null_entries}")
        return "\n".join(lines)


def nearest_copies(bias: torch.Tensor) -> torch.Tensor:
    """Per positive bias ``b`` (nats), the copy count ``r`` in ``[0, 64]`` whose ``log(r + 1)``
    is nearest ``b``; 0 where ``b <= 0``. Same shape as ``bias``, int64."""
    b = bias.double().clamp_min(0.0)
    lo = (b.exp() - 1).floor().clamp(0, checks.MAX_DUPLICATE_COPIES)
    hi = (lo + 1).clamp(max=checks.MAX_DUPLICATE_COPIES)
    pick_hi = ((hi + 1).log() - b).abs() < (b - (lo + 1).log()).abs()
    return torch.where(pick_hi, hi, lo).long()


def _kv_head_bias(layer: LayerKV, kv_heads: int) -> torch.Tensor:
    """The layer's bias per KV head ``[kv_heads, n]`` (float64, CPU; zeros when unset); a
    per-query-head bias is averaged over the heads sharing a KV head."""
    n = len(layer)
    if layer.bias is None:
        return torch.zeros(kv_heads, n, dtype=torch.float64)
    b = layer.bias[0].to("cpu", torch.float64)  # [heads or kv_heads or 1, n]
    if b.shape[0] == kv_heads:
        return b
    if b.shape[0] == 1:
        return b.expand(kv_heads, n).clone()
    if b.shape[0] % kv_heads:
        raise InvalidInputError(f"a bias over {b.shape[0]} heads on {kv_heads} KV heads")
    return b.reshape(kv_heads, b.shape[0] // kv_heads, n).mean(dim=1)


def _shared_copies(layers: list[LayerKV]) -> torch.Tensor | None:
    """Per entry, one copy count for every global layer ``[n]``, when the layers would
    otherwise need different slot counts (per-layer strengths) and share one entry layout:
    the count nearest the mean positive bias the layers ask for the entry. None when the
    layers already agree (or differ in layout, which null entries then pad)."""
    if len(layers) < 2:
        return None
    first = layers[0].token_index.cpu()
    if any(not torch.equal(x.token_index.cpu(), first) for x in layers[1:]):
        return None
    asked = torch.stack([_kv_head_bias(x, x.kv_shape[1]).max(dim=0).values for x in layers])
    counts = torch.stack([nearest_copies(a) for a in asked])  # [layers, n]
    if bool((counts == counts[0]).all()):
        return None
    positive = asked.clamp_min(0)
    n_pos = (asked > 0).sum(dim=0).clamp_min(1)
    return nearest_copies(positive.sum(dim=0) / n_pos)


def _realize_global(
    i: int,
    layer: LayerKV,
    remove_at: float,
    out: list[BiasRealization],
    shared: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """One global layer as slots: ``(keys [kv, m, d], values [kv, m, d], token_index [m],
    null pairs)``; appends the layer's realizations to ``out``. ``shared`` ``[n]``: the copy
    count of each entry on every KV head (see :func:`_shared_copies`)."""
    keys, values = layer.keys[0], layer.values[0]  # [kv_heads, n, head_dim]
    kv_heads, n = keys.shape[0], keys.shape[1]
    bias = _kv_head_bias(layer, kv_heads)
    removed = bias <= -remove_at  # [kv_heads, n]
    gone = removed.all(dim=0)
    partly = removed.any(dim=0) & ~gone
    if bool(partly.any()):
        e = int(partly.nonzero()[0, 0])
        raise InvalidInputError(
            f"layer {i}: entry {e} is removed (bias <= -{remove_at}) on some KV heads only; a "
            "stock kernel shares each slot between heads, so per-head removal (snapkv) cannot "
            "be served"
        )
    copies = nearest_copies(bias) if shared is None else shared.expand(kv_heads, n)
    counts = torch.where(gone, 0, 1 + copies.max(dim=0).values)  # slots per entry
    src = torch.repeat_interleave(torch.arange(n), counts)  # [m] entry of each slot
    starts = torch.cumsum(counts, 0) - counts
    copy_no = torch.arange(src.numel()) - starts[src]  # 0: the entry itself
    live = copy_no[None, :] <= copies[:, src]  # [kv_heads, m]; False: a null entry
    dev = keys.device
    mask = live.to(dev)[..., None]
    k = keys[:, src.to(dev)] * mask
    v = values[:, src.to(dev)] * mask
    _record(i, bias, removed, copies, out)
    return k, v, layer.token_index.cpu()[src], int((~live).sum())


def _record(
    i: int,
    bias: torch.Tensor,
    removed: torch.Tensor,
    copies: torch.Tensor,
    out: list[BiasRealization],
) -> None:
    """Append one realization per distinct (bias, outcome) of a layer."""
    nonzero = (bias != 0) | (copies > 0)
    if not bool(nonzero.any()):
        return
    groups: dict[tuple[float, str, int], set[int]] = {}
    heads, entries = nonzero.nonzero(as_tuple=True)
    for h, e in zip(heads.tolist(), entries.tolist(), strict=True):
        b = float(bias[h, e])
        if bool(removed[h, e]):
            key = (b, "removed", 0)
        elif int(copies[h, e]) > 0 or b > 0:
            key = (b, "copies", int(copies[h, e]))
        else:
            key = (b, "unrealized", 0)
        groups.setdefault(key, set()).add(e)
    for (b, how, r), es in groups.items():
        realized = {"removed": -math.inf, "copies": math.log(r + 1), "unrealized": 0.0}[how]
        out.append(BiasRealization(i, b, realized, how, len(es), r))


def to_stock(state: KVState, *, remove_at: float = REMOVE_AT) -> StockCache:
    """``state``'s cache as a stock kernel serves it: biases as copies or removals, one slot
    count for all layers, keys rotated so new tokens sit at the state's ``next_position`` (see
    the module doc). The state is not modified.

    Raises:
        ModelNotAttachedError: keys must be moved (an edit changed the entry count) and the
            state has no model.
        UnsupportedModelError: a layer's keys cannot be moved in position (no RoPE mover).
        InvalidInputError: a per-head removal, a batch other than 1, or a sliding-window layer
            too short for the slots before it.
    """
    remove_at = checks.real("remove_at", remove_at)
    if remove_at <= 0:
        raise InvalidInputError(f"remove_at must be > 0 nats, not {remove_at}")
    if any(layer.kv_shape[0] != 1 for layer in state.layers):
        raise InvalidInputError("to_stock takes a state of batch 1")
    refuse_headwise(state.layers, "a stock kernel (vLLM)")
    rows, nulls, realizations = _realized_rows(state, remove_at)
    global_rows = [r for r, layer in zip(rows, state.layers, strict=True) if layer.window is None]
    n_slots = max(r[0].shape[1] for r in (global_rows or rows))
    placeholder = _placeholder_id(state)

    def ids_of(index: torch.Tensor) -> list[int]:
        tok = state.token_ids
        return [int(tok[t]) if t >= 0 else placeholder for t in index.tolist()]

    token_ids: list[int] | None = None
    keys_out, values_out = [], []
    for i, ((k, v, index), layer) in enumerate(zip(rows, state.layers, strict=True)):
        m = k.shape[1]
        if layer.window is None and m < n_slots:  # null entries first: their slot is moot
            pad = k.new_zeros(k.shape[0], n_slots - m, k.shape[2])
            k, v = torch.cat([pad, k], dim=1), torch.cat([pad, v], dim=1)
            index = torch.cat([torch.full((n_slots - m,), -1), index])
            nulls[i] += pad.shape[0] * pad.shape[1]
        elif layer.window is not None and m != n_slots:
            if min(m, n_slots) < layer.window - 1:
                raise InvalidInputError(
                    f"layer {i} (sliding window {layer.window}) holds {m} entries but the cache "
                    f"has {n_slots} slots: the window would not match the entries kvedit attends"
                )
            if m > n_slots:  # entries no later query sees (removals shortened the cache)
                k, v, index = k[:, m - n_slots :], v[:, m - n_slots :], index[m - n_slots :]
        if token_ids is None and k.shape[1] == n_slots and layer.window is None:
            token_ids = ids_of(index)
        keys_out.append(k)
        values_out.append(v)
    if token_ids is None:  # only sliding-window layers: the longest one names the slots
        longest = max(range(len(rows)), key=lambda j: rows[j][0].shape[1])
        token_ids = ids_of(rows[longest][2])
    shift = n_slots - int(state.next_position)
    if shift:
        keys_out = _moved_keys(state, keys_out, n_slots, shift)
    return StockCache(
        token_ids=token_ids,
        keys=[k.transpose(0, 1).contiguous() for k in keys_out],
        values=[v.transpose(0, 1).contiguous() for v in values_out],
        windows=[layer.window for layer in state.layers],
        next_position=int(state.next_position),
        shift=shift,
        realizations=realizations,
        null_entries=nulls,
        model=getattr(state.model, "name_or_path", None) if state.model is not None else None,
        model_fingerprint=state.model_fingerprint,
        tokenizer_fingerprint=state.tokenizer_fingerprint,
        digest=state.digest,
        history=state.history,
    )


def _realized_rows(state: KVState, remove_at: float):
    """Each layer's ``(keys [kv_heads, m, head_dim], values, token index [m])`` with its bias
    realized (global layers: copies or removals, :func:`_realize_global`; a sliding-window
    layer's bias is recorded as unrealized), the null entries each holds, and the
    realizations."""
    realizations: list[BiasRealization] = []
    rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    nulls: list[int] = []
    shared = _shared_copies([x for x in state.layers if x.window is None])
    for i, layer in enumerate(state.layers):
        if layer.window is None:
            k, v, index, n_null = _realize_global(i, layer, remove_at, realizations, shared)
        else:
            k, v, index, n_null = layer.keys[0], layer.values[0], layer.token_index.cpu(), 0
            bias = _kv_head_bias(layer, k.shape[0])
            for b in sorted({float(x) for x in bias[bias != 0].tolist()}):
                n = int((bias == b).any(dim=0).sum())
                realizations.append(BiasRealization(i, b, 0.0, "unrealized", n))
        rows.append((k, v, index))
        nulls.append(n_null)
    return rows, nulls, realizations


def _moved_keys(
    state: KVState, keys: list[torch.Tensor], n_slots: int, shift: int
) -> list[torch.Tensor]:
    """``keys`` (each ``[kv_heads, n_slots, head_dim]``) moved ``shift`` positions by each
    layer's RoPE mover, so new tokens sit at the state's ``next_position``."""
    if state.model is None:
        raise ModelNotAttachedError(
            f"the edit changed the cache to {n_slots} slots for {state.next_position} "
            "positions; moving the keys needs the state's model (load_state(path, model, tok))"
        )
    movers = rope.movers(state.model)
    out = []
    for i, k in enumerate(keys):
        delta = torch.full((k.shape[1],), shift, dtype=torch.long)
        out.append(movers[i].move(k[None], delta)[0])
    return out


def _placeholder_id(state: KVState) -> int:
    """A real vocabulary id for slots that encode no token of the text (nulls, separators):
    the tokenizer's pad or EOS id, else the state's first token."""
    tok = state.tokenizer
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tok, name, None) if tok is not None else None
        if isinstance(value, int) and value >= 0:
            return value
    return int(state.token_ids[0])
