"""Forgetting: which entries a :class:`kvedit.Memory` drops when a message (or a kept answer)
takes it past its budget (:mod:`kvedit.memory.budget`), without knowing the next question.

**A round** (:func:`forget`) keeps every protected entry (the first :data:`SINK_TOKENS` tokens,
the system message, the ``protect`` spans, the last ``recent_tokens`` tokens: the budget's
:meth:`~kvedit.memory.budget.Budget.protected_tokens`) and the best-scored others
(:func:`kvedit.compress.allocation.rank_keep`), and cuts the layers to them.

**Policies** are the compression scorers by name (:data:`kvedit.compress.SCORERS`: any
registered scorer is a policy); what a round does with one follows from what it says of itself
(:class:`kvedit.compress.Scorer`):

* an ``arrival`` scorer (``learned``, ``kvzip``) scores each message's entries once, when the
  message arrives, and the memory keeps the scores (:mod:`kvedit.memory.held`): a round only
  ranks them, nothing is re-read; any other scorer scores everything the memory holds at each
  round (``reconstruct`` re-reads it);
* a ``shared`` scorer's scores compare across layers: one ranking of every global layer's
  entries shares the budget (a layer that reads the text broadly keeps more, KVzip's rule;
  ``Memory(layer_floor=f)`` shares a fraction ``f`` of it equally first, so that no layer
  starves);
  any other keeps the same count on every global layer;
* ``whole_words``: an entry's score is the best of its word's (:func:`kvedit.spans.word_index`);
* ``per_head`` (arrival scorers; the default under an entry budget where the model has more
  than one KV head and nothing needs the same entries on every head): one ranking of (layer, KV
  head, entry), each head keeping its own entries (:class:`kvedit.cache.HeadwiseLayerKV`; the
  bytes are freed); otherwise an entry's score is its largest over the KV heads (an entry some
  head needs is kept) and a layer keeps the same entries on every head (what vLLM's paged cache
  serves).

Each round is a ``forget`` history step (not exact: a memory that forgot is no longer a plain
capture) and a :class:`Round`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import torch

from ..cache import LayerKV, is_headwise, keep_per_head
from ..compress.allocation import rank_keep
from ..compress.scorers import SCORERS, Scorer, make_scorer
from ..errors import InvalidInputError, UnsupportedModelError
from ..provenance import Step
from ..spans import word_index
from ..states.state import KVState

__all__ = [
    "DEFAULT_POLICY",
    "FALLBACK_POLICY",
    "SINK_TOKENS",
    "Round",
    "check_policy",
    "default_policy",
    "entry_bytes",
    "entry_costs",
    "forget",
    "global_entries",
    "layer_entries",
    "policies",
    "protected_slots",
]

SINK_TOKENS = 4
"""The first tokens every round keeps: attention sinks (StreamingLLM, arXiv:2309.17453) that
every later query attends to; dropping them degrades all that follows."""

DEFAULT_POLICY = "learned"
"""``Memory(forget=)``'s default where a fit exists for the model: the policy that kept the most
on the tuning seeds at a quarter and a tenth of the entries, at a fraction of a message's cost
(reports/memory/forgetting.md)."""

FALLBACK_POLICY = "kvzip"
"""The default for a model no learned scorer is fit for: the arrival policy that needs no fit
(it re-reads each message once, about the message's own cost)."""


def default_policy(state: KVState) -> str:
    """:data:`DEFAULT_POLICY` when a fit exists for ``state``'s model, else
    :data:`FALLBACK_POLICY`."""
    return DEFAULT_POLICY if make_scorer(DEFAULT_POLICY).refuses(state) is None else FALLBACK_POLICY


def policies() -> tuple[str, ...]:
    """Every policy's name: the registered scorers (:data:`kvedit.compress.SCORERS`)."""
    return tuple(sorted(SCORERS))


@dataclass(frozen=True)
class Round:
    """One forgetting round: at which message, the policy, the global-layer entries before and
    after (:func:`global_entries`: on average over those layers), and its cost in seconds
    (scoring and dropping)."""

    at_message: int
    policy: str
    before: int
    after: int
    seconds: float

    def to_json(self) -> dict:
        """The round as a memory file's ``rounds`` hold it (JSON-ready: its fields by name)."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping) -> Round:
        """The round :meth:`to_json` wrote (not checked: a file's rounds are checked first,
        :mod:`kvedit.memory.attached`)."""
        return cls(
            data["at_message"],
            data["policy"],
            data["before"],
            data["after"],
            float(data["seconds"]),
        )


def layer_entries(state: KVState, i: int) -> float:
    """The entries layer ``i`` of ``state`` holds per KV head (on average over its heads)."""
    layer = state.layers[i]
    return layer.head_entries() / max(layer.kv_shape[1], 1)


def global_entries(state: KVState) -> int:
    """The entries a global-attention layer of ``state`` holds on average, rounded up (every
    layer when the model has none; a layer held per head: its heads' entries on average)."""
    sizes = [layer_entries(state, i) for i in state.counted_layers]
    return -int(-sum(sizes) // len(sizes))


def check_policy(policy: str, state: KVState) -> Scorer:
    """The scorer of ``policy``, refused before any work when it does not exist or cannot serve
    the model (:meth:`kvedit.compress.Scorer.refuses`)."""
    if not isinstance(policy, str) or policy not in SCORERS:
        raise InvalidInputError(f"forget must be one of {list(policies())}, not {policy!r}")
    scorer = make_scorer(policy)
    why = scorer.refuses(state)
    if why is not None:
        raise UnsupportedModelError(f"forget={policy!r}: {why}")
    return scorer


def entry_bytes(layer) -> int:
    """Bytes one more entry (every KV head) takes on ``layer``: keys and values in its dtype,
    its bias when it holds one."""
    b, heads, _, d = layer.kv_shape
    dv = layer.value_shape[3]
    exact = layer.packed_keys.residual if layer.packed else layer.keys  # new entries: exact
    bias = 0 if layer.bias is None else 4 * layer.bias.shape[1]
    # a headwise layer's slots: a token and a position per head
    slots = 2 * heads * layer.head_index.element_size() if is_headwise(layer) else 0
    return b * heads * (d + dv) * exact.element_size() + b * bias + slots


def forget(
    state: KVState,
    scores: dict[int, torch.Tensor] | None,
    protected: torch.Tensor,
    policy: str,
    room: float,
    at_message: int = 0,
    *,
    per_head: bool = False,
    per_layer: bool = True,
    in_bytes: bool = False,
    packed: tuple[int, int] | None = None,
    cap: int | None = None,
    floor: float = 0.0,
) -> tuple[KVState, dict[int, torch.Tensor] | None, Round]:
    """``state`` with its global layers cut to ``room``: entries per layer on average, or
    bytes (``in_bytes``), by ``policy`` (a registered scorer's name), each KV head keeping its
    own entries with ``per_head``; without ``per_layer`` every global layer keeps the same
    tokens (:func:`kept_tokens`). ``packed``: ``(bits, first exact token)``, for a memory that
    holds its older messages packed: in bytes, an entry of a token before that is priced as it
    will be held, packed in ``bits`` bits. ``cap``: the most entries one layer (one KV head,
    ``per_head``) keeps (:func:`~kvedit.compress.allocation.rank_keep`; None: no cap).
    ``floor`` (``Memory(layer_floor=)``, in [0, 1)): for a ``shared`` policy, the fraction of
    the room shared out first, each global layer keeping its own best entries up to an equal
    part of it (its protected entries count towards it; with ``per_head`` a layer's heads
    share its part by their scores), the one ranking across layers spending the rest: no
    layer starves. It changes nothing where no ranking crosses layers: a policy that is not
    ``shared`` (each layer keeps its equal share already) and ``per_layer=False`` (every
    global layer keeps the same tokens). The floor's parts are not held to ``cap``.

    Args:
        state: the memory's state (not modified).
        scores: ``{layer: [kv_heads, n]}`` the memory keeps for an arrival policy (None:
            scored now).
        protected: ``BoolTensor[len(state)]``, the tokens no round drops.

    Raises:
        InvalidInputError: the protected entries alone exceed ``room``.
    """
    t0 = time.perf_counter()
    before = global_entries(state)
    chosen = list(state.counted_layers)
    scorer = make_scorer(policy)
    ranked = scores if scores is not None else _scored_now(scorer, state, chosen)
    if scorer.whole_words:
        ranked = _word_max(ranked, state)
    must = {i: protected_slots(state.layers[i], protected) for i in chosen}
    held = {i: _slots(state.layers[i])[0] >= 0 for i in chosen}
    cost = {i: entry_costs(state.layers[i], in_bytes, packed) for i in chosen}
    total = room if in_bytes else room * len(chosen)
    if per_layer:
        kept = _kept(ranked, must, held, cost, total, scorer.shared, per_head, cap, floor)
    else:
        kept = kept_tokens(state, ranked, must, held, cost, total)
    layers = list(state.layers)
    new_scores = None if scores is None else {}
    for i in chosen:
        layers[i], s = _cut(state.layers[i], kept[i], None if scores is None else scores[i])
        if new_scores is not None:
            new_scores[i] = s
    params = {"policy": policy, "room": float(room), "before": int(before), "per_head": per_head}
    if not per_layer:
        params["per_layer"] = False
    if floor:
        params["floor"] = float(floor)
    out = state.replace(layers=layers).with_step(Step("compression", "forget", params, exact=False))
    done = Round(at_message, policy, before, global_entries(out), time.perf_counter() - t0)
    return out, new_scores, done


def entry_costs(layer, in_bytes: bool, packed: tuple[int, int] | None = None):
    """What keeping each entry of ``layer`` costs: 1 (an entry), its bytes, or, for a memory
    packing its older messages (``packed``: bits, first exact token), each entry's bytes as it
    will be held."""
    if not in_bytes:
        return 1.0
    full = float(entry_bytes(layer))
    if packed is None:
        return full
    from .quantizing import packed_entry_bytes

    bits, exact_from = packed
    old = (layer.token_index >= 0) & (layer.token_index < exact_from)
    cheap = packed_entry_bytes(layer, bits)
    return torch.where(old.cpu(), torch.tensor(cheap), torch.tensor(full)).double()


def _scored_now(scorer: Scorer, state: KVState, layers: Sequence[int]) -> dict[int, torch.Tensor]:
    """``{layer: [kv_heads, n]}``: the scores of a policy that scores at each round (a shared
    one's per head, for its largest over them; another's averaged over its heads)."""
    got = scorer.score(state, list(layers))
    if scorer.shared:
        return {i: got[i][0].float().cpu() for i in layers}
    return {i: got[i][0].float().mean(dim=0, keepdim=True).cpu() for i in layers}


def _word_max(scores: dict[int, torch.Tensor], state: KVState) -> dict[int, torch.Tensor]:
    """Each entry's score the largest of the entries of its word on its head (entries without
    a token, a word each)."""
    words = word_index(state.text, state.offsets)
    out = {}
    for i, s in scores.items():
        index = _slots(state.layers[i])[0][: s.shape[0]]
        n = index.shape[1]
        other = -1 - torch.arange(n)[None].expand_as(index)
        w = torch.where(index >= 0, words[index.clamp_min(0)], other)
        w = torch.unique(w, return_inverse=True)[1]  # [heads, n], word ids shared by the heads
        best = torch.full((s.shape[0], int(w.max()) + 1), float("-inf"))
        best = best.scatter_reduce(1, w.expand_as(s), s.float(), "amax")
        out[i] = best.gather(1, w.expand_as(s))
    return out


def _slots(layer) -> tuple[torch.Tensor, torch.Tensor]:
    """``(index, positions)`` ``[kv_heads, n]``: the token each head's slot holds (``-1``: a
    headwise layer's padding) and its position."""
    if is_headwise(layer):
        return layer.head_index.cpu(), layer.head_positions.cpu()
    heads = layer.kv_shape[1]
    return layer.token_index.cpu()[None].expand(heads, -1), layer.positions.cpu()[None].expand(
        heads, -1
    )


def protected_slots(layer, protected: torch.Tensor) -> torch.Tensor:
    """``[kv_heads, n]`` bool: the slots of ``layer`` that hold a protected token."""
    index = _slots(layer)[0]
    return (index >= 0) & protected[index.clamp_min(0)]


def _kept(ranked, must, held, cost, total: float, shared, per_head, cap=None, floor=0.0) -> dict:
    """What each layer keeps (:func:`rank_keep`: over all layers for a shared policy, with
    ``floor``, each layer its equal share of ``total`` otherwise); ``must`` ``[kv_heads, n]``
    per layer."""
    if not per_head:  # a slot holds the same token on every head
        must = {i: m.any(dim=0) for i, m in must.items()}
    if shared:
        return rank_keep(
            ranked, must, total, cost, per_head=per_head, held=held, cap=cap, floor=floor
        )
    out = {}
    share = total / len(ranked)
    for i in ranked:
        one = rank_keep(
            {i: ranked[i]},
            {i: must[i]},
            share,
            {i: cost[i]},
            per_head=per_head,
            held={i: held[i]},
            cap=cap,
        )
        out.update(one)
    return out


def kept_tokens(state: KVState, ranked, must, held, cost, total: float) -> dict:
    """One choice of tokens kept on every global layer: what a stock serving kernel (vLLM: one
    cache slot per token for all layers) holds exactly. A token's score is the largest of its
    entries' over the layers and KV heads, its cost the sum of its entries'.

    Raises:
        InvalidInputError: the global layers hold different tokens (a memory forgotten per
            layer or per head).
    """
    layers = list(ranked)
    first = state.layers[layers[0]]
    for i in layers:
        layer = state.layers[i]
        if is_headwise(layer) or not torch.equal(layer.token_index, first.token_index):
            raise InvalidInputError(
                "per_layer=False keeps the same tokens on every global layer, but this "
                f"memory's layer {i} holds other tokens than layer {layers[0]} (it forgot per "
                "layer or per head): load it with per_layer=True"
            )
    score = torch.stack([ranked[i].float().amax(dim=0) for i in layers]).amax(dim=0)
    need = torch.stack([m.reshape(-1, m.shape[-1]).any(dim=0) for m in must.values()]).any(dim=0)
    price = sum(cost[i] for i in layers)
    one = rank_keep({0: score[None]}, {0: need}, total, {0: price}, held={0: held[layers[0]][:1]})[
        0
    ]
    return dict.fromkeys(layers, one)


def _cut(layer, kept: torch.Tensor, scores: torch.Tensor | None):
    """``(layer, scores)`` keeping ``kept`` (``[n]`` for every head, or ``[kv_heads, n]``)."""
    if kept.ndim == 2:  # a packed layer (a file quantize held) is cut dense, as select cuts it
        out = keep_per_head(LayerKV.select(layer, slice(None)) if layer.packed else layer, kept)
        return out, None if scores is None else _scores_after(layer, out, scores)
    entries = kept.nonzero().flatten()
    return layer.select(entries), None if scores is None else scores[:, entries]


def _scores_after(old, new, scores: torch.Tensor) -> torch.Tensor:
    """The scores ``[kv_heads, n_old]`` of ``old``'s slots, moved to ``new``'s (a per-head cut
    of it): each head's slot takes the score of the same token's slot in ``old``
    (``-inf`` on padding)."""
    heads = scores.shape[0]
    old_index, new_index = _slots(old)[0], _slots(new)[0]
    size = int(max(int(old_index.max()), int(new_index.max()))) + 1
    table = torch.full((heads, size + 1), float("-inf"))
    rows = torch.arange(heads)[:, None].expand_as(old_index)
    held = old_index >= 0
    table[rows[held], old_index[held]] = scores[held].float()
    out = table.gather(1, torch.where(new_index >= 0, new_index, size))
    return out
