"""Forgetting under a budget: which entries a :class:`kvedit.Memory` drops when it would hold
more than it may, without knowing the next question.

The budget counts the entries of the global-attention layers (a sliding-window layer keeps its
last tokens by itself and is not counted), on average over those layers
(:func:`global_entries`); a byte budget is converted with the bytes one entry takes on all
global layers in bfloat16 (:func:`entry_bytes_bf16`), so a budget means the same on models
stored in other dtypes.

A round (:func:`forget`) scores every global layer's entries with the policy, keeps every
protected entry (the first :data:`SINK_TOKENS` tokens, the system message, the last ``recent``
messages, the ``protect`` spans) and the best-scored others up to the target, drops the rest
(all KV heads alike, so the bytes go down by exactly what is dropped), and runs the state's
last token again over what is left (its logits then follow the cache it has). The target is
each layer's for most policies (every global layer keeps the same entries' count); for the
policies in :data:`SHARED_POLICIES` it is shared by the global layers, as KVzip shares it:
their scores (attention probabilities) compare across layers, so the best-scored entries of all
layers together are kept and a layer the reconstruction reads broadly keeps more than one that
reads a few tokens. The state's history gets a ``forget`` step (not exact): a memory that
forgot is no longer a plain capture.

Policies (:data:`POLICIES`), each a score per entry, higher kept first:

==============  ===============================================================================
``window``      recency: the newest entries are kept (with the protected ones: StreamingLLM's
                sink tokens plus a window of the last messages)
``knorm``       minus the key's L2 norm (:mod:`kvedit.compress.scorers.knorm`)
``tova``        the last token's attention (:mod:`kvedit.compress.scorers.tova`)
``snapkv``      the attention of the state's own last tokens, a generic observation window
                (:mod:`kvedit.compress.scorers.snapkv` without a query)
``h2o``         attention accumulated over the whole text (not on sliding-window models)
``reconstruct`` the attention each entry gets while the model reads the context again after a
                "repeat the context" prompt (KVzip's idea;
                :mod:`kvedit.compress.scorers.reconstruct`), when that scorer is registered
==============  ===============================================================================

A compression scorer's per-head scores are averaged over the KV heads, but for the policies of
:data:`SHARED_POLICIES`, whose entry scores are their largest over the heads (KVzip's: an entry
one head needs is kept), then the largest over the entries of the same word
(:func:`kvedit.spans.word_index`: a code such as ``SZ-611.`` takes several tokens, and a code
with a digit forgotten is a wrong code), so a word is kept or forgotten whole.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .. import checks
from ..compress.scorers import SCORERS, make_scorer
from ..errors import InvalidInputError, SpanNotFoundError, UnsupportedModelError
from ..provenance import Step
from ..spans import as_span_list, word_index
from ..states.passes import recompute_last
from ..states.state import KVState

__all__ = [
    "DEFAULT_POLICY",
    "LOW_WATER",
    "SHARED_POLICIES",
    "Budget",
    "POLICIES",
    "SINK_TOKENS",
    "Round",
    "budget_from",
    "check_policy",
    "entry_bytes_bf16",
    "forget",
    "global_entries",
    "policy_scores",
]

SINK_TOKENS = 4
"""The first tokens every round keeps: attention sinks (StreamingLLM, arXiv:2309.17453) that
every later query attends to; dropping them degrades all that follows."""

LOW_WATER = 0.8
"""A round forgets down to this fraction of the budget, so it runs once every several messages
rather than at every message."""

POLICIES = ("window", "knorm", "tova", "snapkv", "h2o", "reconstruct")
"""The forgetting policies by name (module docstring)."""

DEFAULT_POLICY = "reconstruct"
"""``Memory(forget=)``'s default: on the facts task's tuning seed it kept the most (0.519 against
``reuse``'s 0.556; ``window`` 0.185, ``snapkv-first`` 0.148, ``tova`` 0.037), though its rounds
cost several times a message's own time (reports/memory/eval_memory.md, budget.md)."""

SHARED_POLICIES = ("reconstruct",)
"""Policies whose round shares the target among the global layers and keeps words whole (module
docstring): on the facts task's tuning seed, reconstruct kept the facts with the target shared
as KVzip shares it and lost them with the same count on every layer, and whole words kept more
of them on Gemma-3 (reports/memory/eval_memory.md)."""


@dataclass(frozen=True)
class Round:
    """One forgetting round: at which message, the policy, the global-layer entries before and
    after (:func:`global_entries`: on average over those layers), and its cost in seconds
    (scoring, dropping and the last token's rerun)."""

    at_message: int
    policy: str
    before: int
    after: int
    seconds: float


def global_entries(state: KVState) -> int:
    """The entries a global-attention layer of ``state`` holds on average, rounded up (every
    layer when the model has none): times :func:`entry_bytes_bf16`, at least the bytes the
    global layers hold in bfloat16."""
    sizes = [len(state.layers[i]) for i in state.counted_layers]
    return -(-sum(sizes) // len(sizes))


def entry_bytes_bf16(state: KVState) -> int:
    """Bytes one entry takes on all global layers together, keys and values in bfloat16."""
    layers = [state.layers[i] for i in state.counted_layers]
    return sum(2 * layer.kv_shape[1] * layer.kv_shape[3] * 2 for layer in layers)


def check_policy(policy: str, state: KVState) -> None:
    """Refuse a policy that does not exist or cannot serve the model, before any work."""
    if not isinstance(policy, str) or policy not in POLICIES:
        raise InvalidInputError(f"forget must be one of {list(POLICIES)}, not {policy!r}")
    if policy != "window" and policy not in SCORERS:
        raise InvalidInputError(f"forget={policy!r}: the scorer {policy!r} is not registered")
    if policy == "h2o" and any(layer.window is not None for layer in state.layers):
        raise UnsupportedModelError(
            "forget='h2o' cannot serve a model with sliding-window layers: they forget the "
            "tokens its scores re-read (use reconstruct, snapkv, tova, knorm or window)"
        )


def policy_scores(policy: str, state: KVState, layers: Sequence[int]) -> dict[int, torch.Tensor]:
    """``{layer: [n] scores}`` of each layer's entries under ``policy`` (higher kept first)."""
    if policy == "window":
        return {i: state.layers[i].token_index.float() for i in layers}
    scorer = make_scorer(policy)
    scores = scorer.score(state, list(layers))
    if policy in SHARED_POLICIES:  # KVzip: an entry some head needs is kept for all heads
        words = word_index(state.text, state.offsets)
        return {
            i: _word_max(scores[i].float().amax(dim=(0, 1)).cpu(), words, state, i) for i in layers
        }
    return {i: scores[i].float().mean(dim=(0, 1)).cpu() for i in layers}


def _word_max(
    scores: torch.Tensor, words: torch.Tensor, state: KVState, layer: int
) -> torch.Tensor:
    """``[n]`` scores of layer ``layer``'s entries, each the largest of the entries of its word
    (``words``: :func:`kvedit.spans.word_index` of the state's tokens) the layer holds."""
    index = state.layers[layer].token_index.cpu()
    held = index >= 0
    w = torch.where(held, words[index.clamp_min(0)], -1 - torch.arange(len(index)))
    w = torch.unique(w, return_inverse=True)[1]  # entries without a token: a word each
    best = torch.full((int(w.max()) + 1,), float("-inf")).scatter_reduce(0, w, scores, "amax")
    return best[w]


def forget(
    state: KVState,
    target: int,
    protected: torch.Tensor,
    policy: str,
    *,
    at_message: int = 0,
    scores: Callable[[str, KVState, Sequence[int]], dict[int, torch.Tensor]] = policy_scores,
) -> tuple[KVState, Round]:
    """``state`` with its global layers cut to ``target`` entries each (on average for the
    policies of :data:`SHARED_POLICIES`).

    Args:
        state: the memory's state (not modified).
        target: the entries each global layer keeps (on average over them for the
            policies of :data:`SHARED_POLICIES`).
        protected: ``BoolTensor[len(state)]``, the tokens no round drops.
        policy: one of :data:`POLICIES`.

    Raises:
        InvalidInputError: the protected entries alone exceed ``target``.
    """
    t0 = time.perf_counter()
    before = global_entries(state)
    chosen = state.counted_layers
    per_layer = scores(policy, state, chosen)
    keeps = {}
    for i in chosen:
        index = state.layers[i].token_index.cpu()
        keep = (index >= 0) & protected[index.clamp_min(0)]
        keep |= (index >= 0) & (index < SINK_TOKENS)
        keep |= index == len(state) - 1  # the last input: its logits are run again below
        keeps[i] = keep
    n_kept = max(int(k.sum()) for k in keeps.values())  # every layer holds the protected part
    if n_kept > target:
        raise InvalidInputError(
            f"the protected part holds {n_kept} entries, more than the {target} the budget "
            "leaves: raise the budget, or protect less (recent=, protect=)"
        )
    if policy in SHARED_POLICIES:
        _keep_best(keeps, per_layer, target)
    else:
        for i in chosen:
            _keep_best({i: keeps[i]}, per_layer, target)
    layers = list(state.layers)
    for i in chosen:
        layers[i] = layers[i].select(keeps[i].nonzero().flatten())
    out = state.replace(layers=layers).with_step(
        Step(
            "compression",
            "forget",
            {"policy": policy, "target": int(target), "before": int(before)},
            exact=False,
        )
    )
    out = recompute_last(out)
    return out, Round(at_message, policy, before, global_entries(out), time.perf_counter() - t0)


def _keep_best(
    keeps: dict[int, torch.Tensor], scores: dict[int, torch.Tensor], target: int
) -> None:
    """Mark (in place) the best-scored entries of the layers of ``keeps`` together, so that
    they hold ``target`` entries each on average: ``len(keeps) * target`` in all (one layer:
    its own ``target``)."""
    order = list(keeps)
    flat = torch.cat([scores[i].float().masked_fill(keeps[i], float("-inf")) for i in order])
    held = sum(int(keeps[i].sum()) for i in order)
    room = min(len(order) * target, len(flat)) - held
    if room <= 0:
        return
    chosen = torch.zeros(len(flat), dtype=torch.bool)
    chosen[torch.topk(flat, room).indices] = True
    start = 0
    for i in order:
        n = len(keeps[i])
        keeps[i] |= chosen[start : start + n]
        start += n


@dataclass(frozen=True)
class Budget:
    """How much a memory may hold and how it forgets (``Memory(max_tokens=, max_bytes=,
    forget=, recent=, protect=)``).

    Attributes:
        max_entries: the most entries a global layer holds on average (:func:`global_entries`).
        policy: one of :data:`POLICIES`.
        recent: the last messages never forgotten (the message being added is one of them).
        protect: spans of the memory's text never forgotten (as :func:`kvedit.compress.select`
            takes them); a span not (yet) in the text protects nothing.
    """

    max_entries: int
    policy: str = DEFAULT_POLICY
    recent: int = 2
    protect: tuple = ()

    def make_room(
        self,
        state: KVState,
        protected_ranges: Sequence[tuple[int, int]],
        n_new: int,
        at_message: int,
    ) -> tuple[KVState, Round | None]:
        """``state`` with room for ``n_new`` more entries per global layer (on average over
        them, :func:`global_entries`): unchanged when they fit, else forgotten down to
        :data:`LOW_WATER` of the budget less ``n_new``.

        ``protected_ranges``: token ranges ``[start, end)`` of ``state`` never forgotten (the
        system message, the recent messages). Raises :class:`~kvedit.errors.InvalidInputError`
        (before any work) when the protected part and the new entries alone exceed the budget.
        """
        protected = self.protected(state, protected_ranges)
        protected[: min(SINK_TOKENS, len(state))] = True
        if len(state):
            protected[-1] = True
        n_protected = int(protected.sum())
        if n_protected + n_new > self.max_entries:
            raise InvalidInputError(
                f"the budget is {self.max_entries} entries; the protected part (system "
                f"message, the last {self.recent} messages, protect= spans) holds "
                f"{n_protected} and this message adds {n_new}: raise max_tokens/max_bytes, or "
                "protect less"
            )
        if global_entries(state) + n_new <= self.max_entries:
            return state, None
        target = max(int(LOW_WATER * self.max_entries) - n_new, n_protected)
        return forget(state, target, protected, self.policy, at_message=at_message)

    def protected(
        self, state: KVState, protected_ranges: Sequence[tuple[int, int]]
    ) -> torch.Tensor:
        """``BoolTensor[len(state)]``: the tokens no round drops."""
        keep = torch.zeros(len(state), dtype=torch.bool)
        for start, end in protected_ranges:
            keep[start:end] = True
        for span in self.protect:
            try:
                keep[state.token_indices(span)] = True
            except SpanNotFoundError:
                continue
        return keep


def budget_from(
    state: KVState,
    max_tokens: int | None,
    max_bytes: int | None,
    forget: str,
    recent: int,
    protect,
) -> Budget | None:
    """The :class:`Budget` of ``Memory``'s keywords (None without ``max_tokens`` or
    ``max_bytes``), checked before any work; ``state`` is the memory's (empty) state."""
    check_policy(forget, state)
    recent = checks.count("recent", recent)
    if max_tokens is not None and max_bytes is not None:
        raise InvalidInputError("give max_tokens or max_bytes, not both")
    if max_bytes is not None:
        per_entry = entry_bytes_bf16(state)
        max_tokens = checks.count("max_bytes", max_bytes, minimum=1) // per_entry
        if max_tokens < 1:
            raise InvalidInputError(
                f"max_bytes={max_bytes} holds no entry: one takes {per_entry} bytes in bfloat16"
            )
    protect = () if protect is None else tuple(as_span_list(protect))
    if max_tokens is None:
        return None
    max_tokens = checks.count("max_tokens", max_tokens, minimum=1)
    return Budget(max_tokens, forget, recent, protect)
