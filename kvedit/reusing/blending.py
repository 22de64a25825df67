"""Non-prefix reuse: blend separately cached parts into one cache (CacheBlend-style).

``blend(model, tokenizer, parts, store, recompute=0.15)`` builds the cache of the parts' texts in
order, from stored caches of each part:

1. **Parts.** Part 0 is tokenized with the tokenizer's default special tokens (it starts the
   prompt, BOS included), every later part without them. Part 0 is the shared prefix (chat
   template, instruction); it is looked up in the store by its ids, or captured and stored.
   With ``context="prefix"`` (the default), each later part is cached as it reads right after
   that prefix, as in CacheBlend's and EPIC's setting (independent passages behind a shared
   instruction): its store entry is the plain capture of ``prefix ids + passage ids``, so the
   store key is a function of (model, tokenizer, prefix, passage), and the blend takes the
   passage's entries out of it (:func:`~kvedit.states.capturing.passage_after`). A missing entry is
   computed by running the passage on top of the prefix's state, and stored. Each stored
   entry repeats the prefix's cache (one whole state per entry, see :mod:`kvedit.store`); it
   also serves :func:`~kvedit.reuse` for prompts made of the prefix and that one passage.
   With ``context="alone"``, each later part is cached on its own (the passage convention of
   :func:`~kvedit.states.capturing.capture_passage`) and keyed by its ids alone: reusable behind any
   prefix, but its tokens never read an instruction and its first token is its own attention
   sink. With ``previous=TEXT`` (``context="prefix"`` only), every part after part 1 is cached
   behind the prefix *and* ``TEXT``, a neutral passage: it is cached as a later passage rather
   than as the first one after the instruction, so the blend does not hold many "first
   passages" that draw the attention only the true first passage gets (part 1 is still cached
   right after the prefix, which is exact). The store key then includes ``TEXT``. The blended
   token ids are the parts' ids concatenated, which can differ from tokenizing the joined text
   at part boundaries.
2. **Placing.** Every part was cached at some positions (``0..n_i-1`` alone, right after the
   prefix behind it); its keys are re-rotated to their positions in the blend, with each layer's own rotary
   frequencies (:mod:`kvedit.rope`). Values carry no position and are reused as they are.
3. **Selecting.** Each part's cache misses the other parts: tokens after part 0 never attended
   to the passages before them (nor to the prefix, with ``context="alone"``). As in CacheBlend (Yao et al., 2024), the tokens whose cache deviates
   most from a real prefill are found at one early layer and recomputed. kvedit runs the real
   forward over the whole blend up to the *deviation layer*, the first global layer after layer
   0 (layer 1 on Llama/Qwen2/SmolLM2; on Gemma-3 the first full-attention layer, because a
   sliding layer of a stored part holds only its last ``window`` tokens). Layer 0 cannot
   be used: its keys and values depend only on the token and its position, so after
   re-rotation they match exactly. The deviation of token ``t`` is
   ``|dK_t|^2 / mean |K|^2 + |dV_t|^2 / mean |V|^2`` over heads and dimensions at that layer.
   The ``ceil(recompute * n)`` tokens of largest deviation are selected; the last token always
   is (its logits start the continuation).
4. **Recomputing.** The selected tokens run through every layer on top of the blended cache,
   at their own positions. A selected token sees the reused entries of unselected earlier
   tokens and the fresh entries of selected earlier ones (never a stale entry of a selected
   token): a 4D mask per layer type, with the sliding window on sliding layers. The fresh
   entries then replace the reused ones.

``recompute=1.0`` selects every token, which is a full prefill of the blended ids (the mask
hides every reused entry). ``recompute=0`` is plain placement: nothing is recomputed and the
last logits are those of the last part as it was cached.

Rules (:mod:`kvedit.reusing.blend_rules`, one keyword each, off by default, composable):
``gradual`` narrows the recomputed set layer by layer (CacheBlend's gradual filtering),
``leading`` always recomputes the first tokens of every passage (EPIC's LegoLink), ``rescale``
biases the reused passage entries by ``ln(factor)`` nats for later queries (APE-style). All
three are exact at ``recompute=1.0``.

Sliding-window layers (Gemma-3): each stored part keeps the last ``window`` tokens of its
sliding layers, so the blend's sliding layers hold, for every part, its last tokens, which
always include the blend's last ``window`` tokens (all that the final state keeps there).
A recomputed token deep inside a part longer than the window sees, on sliding layers, only the
reused entries that part still holds plus the recomputed ones, a further approximation that
``recompute=1.0`` removes.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from ..cache import LayerKV
from ..checks import describe
from ..errors import InvalidInputError, InvalidTypeError, UnsupportedModelError
from ..fingerprint import model_fingerprint, tokenizer_fingerprint
from ..provenance import History, Origin, token_ranges
from ..rope import KeyMover, movers
from ..states.passes import recompute_last
from ..states.state import KVState, LastInput
from ..store import KVStore
from .blend_parts import PartReport, encode_parts, part_states

# blend calls the step through this module's name (tests/reusing/test_blend.py spies on it)
from .blend_recomputing import recompute_selected as _recompute
from .blend_rules import BlendRules
from .blend_selection import selection as _selection

BLEND_CONTEXTS = ("prefix", "alone")
"""What :func:`blend`'s later parts are cached after: the shared prefix (part 0), or nothing."""


@dataclass
class BlendReport:
    """What :func:`blend` reused and recomputed.

    Attributes:
        parts: one :class:`~kvedit.reusing.blend_parts.PartReport` per part, in order.
        tokens: tokens of the blend.
        tokens_reused: tokens whose cache came from the store and was kept as is.
        tokens_recomputed: tokens recomputed on top of the blend (the selected ones).
        tokens_computed: tokens of parts that were not stored and were prefilled alone.
        recompute: the requested fraction.
        context: what the later parts were cached after (``"prefix"`` or ``"alone"``).
        deviation_layer: the layer the selection was made at (None if nothing was selected
            by deviation: ``recompute`` 0 or 1).
        recomputed_tokens: ``LongTensor[tokens_recomputed]`` their indices, ascending.
        seconds: wall time.
        rules: the keywords of the rules given (:mod:`kvedit.reusing.blend_rules`), () for none.
        recomputed_per_layer: tokens recomputed at each layer: ``tokens_recomputed`` (every
            token recomputed at some layer) unless ``gradual`` narrowed them.
        tokens_rescaled: tokens whose reused entries ``rescale`` biased (on some layer).
        previous: the neutral passage later parts were cached behind, None when none.
    """

    parts: list[PartReport]
    tokens: int
    tokens_reused: int
    tokens_recomputed: int
    tokens_computed: int
    recompute: float
    context: str
    deviation_layer: int | None
    seconds: float
    recomputed_tokens: torch.Tensor = field(repr=False, default_factory=lambda: torch.empty(0))
    rules: tuple[str, ...] = ()
    recomputed_per_layer: list[int] = field(default_factory=list)
    tokens_rescaled: int = 0
    previous: str | None = None


@torch.no_grad()
def blend(
    model: PreTrainedModel,
    tokenizer,
    parts: Iterable[str],
    store: KVStore,
    recompute: float = 0.15,
    *,
    context: str = "prefix",
    gradual: float | None = None,
    leading: int | None = None,
    rescale: float | None = None,
    previous: str | None = None,
    max_positions: int | None = None,
) -> tuple[KVState, BlendReport]:
    """The cache of ``parts`` in order, from the parts' caches in ``store`` (see module doc).

    Args:
        model, tokenizer: the model; its fingerprints select the stored parts.
        parts: texts, in prompt order (part 0 with the tokenizer's special tokens): a list or
            any other ordered iterable (a generator is read once, before any work).
        store: where parts are looked up, and where missing parts are stored.
        recompute: fraction of the blend's tokens to recompute, in ``[0, 1]``.
        context: what each later part was cached after: ``"prefix"`` (part 0, the shared
            prefix; the default) or ``"alone"`` (nothing).
        gradual: CacheBlend's gradual filtering, a factor ``>= 1``: the deviation layer
            recomputes that many times the tokens, later layers narrow them down to
            ``ceil(recompute * n)`` at the last layer.
        leading: EPIC's LegoLink, a count ``>= 1``: the first ``leading`` tokens of every part
            after part 0 are recomputed, in addition to the ``recompute`` budget.
        rescale: an APE-style factor in ``(0, 1e4]``: reused passage entries get ``ln(rescale)``
            nats of stored bias (a ``rescale`` step in the history).
        previous: a neutral passage every part after part 1 is cached behind, between the
            prefix and it (``context="prefix"`` only; see the module doc). None: none.
        max_positions: the most positions the model attends to, for the length checks of the
            blend and of every later call on its state (:attr:`KVState.max_positions`); None:
            the model config's ``max_position_embeddings``.

    The rules (:mod:`kvedit.reusing.blend_rules`) are off when None (the default) and compose.

    Returns:
        ``(state, report)``: a state of ``"".join(parts)`` whose token ids are the parts'
        ids concatenated, ready for ``generate``/``extend``. Its history's origin is a
        ``"blend"`` (the parts' digests, ``recompute``, ``context`` and the recomputed
        tokens; the rules given, if any), never a capture: the store refuses it. The parts it
        reads from the store are plain captures (the store serves nothing else).
    """
    t0 = time.perf_counter()
    parts = _check_arguments(parts, recompute, context, previous)
    rules = BlendRules.from_values(gradual=gradual, leading=leading, rescale=rescale)
    layer_movers = movers(model)
    for mover in layer_movers:  # refuse before any work
        if mover.kind == "refused":
            raise UnsupportedModelError(f"blend cannot move cached keys: {mover.reason}")
    encoded, previous_passage = encode_parts(
        model, tokenizer, parts, previous, max_positions=max_positions
    )
    states, reports = part_states(
        model,
        tokenizer,
        parts,
        encoded,
        previous_passage,
        store,
        context,
        max_positions=max_positions,
    )

    starts = [0, *itertools.accumulate(len(s) for s in states)]
    layers = _placed_layers(states, starts[:-1], layer_movers)
    ids = torch.cat([s.token_ids for s in states])
    selected, narrowing, deviation_layer = _selection(model, ids, layers, starts, recompute, rules)

    if len(selected):
        extra = {} if narrowing is None else {"narrowing": narrowing}
        layers, last_logits = _recompute(model, layers, ids, selected, **extra)
    else:
        last_logits = states[-1].last_logits
    kept = narrowing.kept if narrowing is not None else [selected] * len(layers)
    rescaled = torch.empty(0, dtype=torch.long)
    if rules.rescale is not None:
        layers, rescaled = rules.rescale.apply(layers, kept, starts[1])
    settings = {"recompute": recompute, "context": context, "previous": previous}
    origin = _origin(states, selected, kept, rules, **settings)
    state = _blended_state(model, tokenizer, parts, states, layers, ids, last_logits, origin)
    if rules.rescale is not None:
        state = state.with_step(rules.rescale.step(rescaled))
        if len(rescaled):  # the first continuation token reads the rescaled entries
            state = recompute_last(state)
    return state, _report(
        states,
        reports,
        selected,
        kept,
        rules,
        t0=t0,
        deviation_layer=deviation_layer,
        n_rescaled=len(rescaled),
        **settings,
    )


def _origin(
    states: Sequence[KVState],
    selected: torch.Tensor,
    kept: Sequence[torch.Tensor],
    rules: BlendRules,
    *,
    recompute: float,
    context: str,
    previous: str | None,
) -> dict:
    """The parameters of a blend's ``"blend"`` origin."""
    return {
        "parts": [s.digest for s in states],
        "recompute": float(recompute),
        "context": context,
        "recomputed": token_ranges(selected),
        **rules.origin_params([len(k) for k in kept]),
        **({"previous": previous} if previous is not None else {}),
    }


def _report(
    states: Sequence[KVState],
    reports: list[PartReport],
    selected: torch.Tensor,
    kept: Sequence[torch.Tensor],
    rules: BlendRules,
    **settings,
) -> BlendReport:
    """What a blend of ``states`` did: the token counts, what the rules did, the time since
    ``settings["t0"]`` and the settings (``recompute``, ``context``, ``deviation_layer``,
    ``n_rescaled``, ``previous``)."""
    n = sum(len(s) for s in states)
    stored_tokens = sum(r.n_tokens for r in reports if r.source != "computed")
    is_stored = torch.cat(
        [torch.full((len(s),), r.source != "computed") for s, r in zip(states, reports)]
    )
    return BlendReport(
        parts=reports,
        tokens=n,
        tokens_reused=stored_tokens - int(is_stored[selected].sum()),
        tokens_recomputed=int(selected.numel()),
        tokens_computed=n - stored_tokens,
        recompute=float(settings["recompute"]),
        context=settings["context"],
        deviation_layer=settings["deviation_layer"],
        seconds=time.perf_counter() - settings["t0"],
        recomputed_tokens=selected,
        rules=rules.names,
        recomputed_per_layer=[len(k) for k in kept],
        tokens_rescaled=settings["n_rescaled"],
        previous=settings["previous"],
    )


# -------------------------------------------------------------------- arguments


def _check_arguments(
    parts: Iterable[str], recompute: float, context: str, previous: str | None
) -> list[str]:
    """``parts`` as a list (any ordered iterable, read once: a generator is fine). Refuse parts
    that are a str, unordered or not iterable, or not a non-empty run of strings, a
    ``recompute`` outside ``[0, 1]``, an unknown ``context``, and a ``previous`` that is
    empty or lacks a prefix."""
    if isinstance(parts, str | bytes | Set | Mapping) or not isinstance(parts, Iterable):
        raise InvalidTypeError(
            "blend: parts must be a non-empty list (or other ordered iterable) of strings, not "
            f"{describe(parts)}"
        )
    parts = list(parts)
    if not parts or not all(isinstance(p, str) for p in parts):
        raise InvalidInputError("blend: parts must be a non-empty list of strings")
    if not isinstance(recompute, (int, float)) or not 0.0 <= recompute <= 1.0:
        raise InvalidInputError(f"recompute must be a fraction in [0, 1], not {recompute!r}")
    if context not in BLEND_CONTEXTS:
        raise InvalidInputError(f"blend: context must be one of {BLEND_CONTEXTS}, not {context!r}")
    if previous is not None:
        if context != "prefix":
            raise InvalidInputError('blend: previous needs context="prefix"')
        if not isinstance(previous, str) or not previous.strip():
            raise InvalidInputError("blend: previous must be a non-empty passage text")
    return parts


def _blended_state(
    model: PreTrainedModel,
    tokenizer,
    parts: Sequence[str],
    states: Sequence[KVState],
    layers: Sequence[LayerKV],
    ids: torch.Tensor,
    last_logits: torch.Tensor,
    origin: dict,
) -> KVState:
    """The blend's state: ``layers`` trimmed, the parts' ids ``[n]`` and offsets concatenated,
    positions ``0..n-1``, a ``"blend"`` origin with ``origin``'s parameters."""
    n = len(ids)
    char_starts = [0]
    for text in parts:
        char_starts.append(char_starts[-1] + len(text))
    return KVState(
        layers=[layer.trimmed() for layer in layers],
        token_ids=ids,
        offsets=torch.cat([s.offsets + c for s, c in zip(states, char_starts, strict=False)]),
        text="".join(parts),
        position_ids=torch.arange(n),
        next_position=n,
        last_logits=last_logits,
        model_fingerprint=model_fingerprint(model),
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
        history=History(Origin("blend", origin)),
        last_input=LastInput(n - 1, n - 1),
        max_positions=states[0].max_positions,
        model=model,
        tokenizer=tokenizer,
    )


# -------------------------------------------------------------------- placing


def _placed_layers(
    states: Sequence[KVState], starts: Sequence[int], layer_movers: Sequence[KeyMover]
) -> list[LayerKV]:
    """Every part's entries at their blend positions, layer by layer (not yet trimmed)."""
    out = []
    for i, mover in enumerate(layer_movers):
        keys, values, index, positions = [], [], [], []
        for state, start in zip(states, starts, strict=True):
            layer = state.layers[i]
            new_positions = layer.token_index + start
            keys.append(mover.move(layer.keys, new_positions - layer.positions))
            values.append(layer.values)
            index.append(new_positions)
            positions.append(new_positions)
        out.append(
            LayerKV(
                keys=torch.cat(keys, dim=-2),
                values=torch.cat(values, dim=-2),
                token_index=torch.cat(index),
                positions=torch.cat(positions),
                window=states[0].layers[i].window,
            )
        )
    return out
