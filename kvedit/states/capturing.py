"""Building states by running the model: :func:`capture` (text) and :func:`capture_tokens` (ids),
and the small builders reuse, blending and the store share: :func:`encode` (ids and offsets),
:func:`empty_state`, :func:`extend_ids` (``KVState.extend`` from token ids),
:func:`capture_passage` (a text cached on its own, without special tokens), :func:`passage_after`
(the tokens after a prefix, as a passage) and :func:`cut_layers` (the cache of a state's first
tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch
from transformers import DynamicCache, PreTrainedModel

from .. import checks
from ..cache import LayerKV
from ..cache.adapter import CacheEntries
from ..compat import text_config
from ..errors import InvalidInputError
from ..fingerprint import model_fingerprint, tokenizer_fingerprint
from ..provenance import History, Step
from ..runtime import forward, layer_windows
from ..runtime import spec as model_spec
from ..spans import token_offsets
from .passes import appended_layers
from .state import KVState, LastInput

__all__ = [
    "appended_state",
    "capture",
    "capture_passage",
    "capture_tokens",
    "cut_layers",
    "empty_state",
    "encode",
    "extend_ids",
    "passage_after",
]


@torch.no_grad()
def capture(
    model: PreTrainedModel, tokenizer, text: str, *, max_positions: int | None = None
) -> KVState:
    """Run ``model`` over ``text`` (with the tokenizer's default special tokens) and keep its cache.

    Returns a :class:`KVState` whose continuation matches ``model.generate`` token for token.
    ``max_positions`` overrides the model's maximum positions (``max_position_embeddings``)
    for a model whose configuration understates its context (see
    :func:`kvedit.checks.context_fits`); the state keeps it (:attr:`KVState.max_positions`),
    and so does every state derived from it, for the checks of each later call.

    Raises:
        UnsupportedModelError: a cache kvedit cannot hold.
        InvalidInputError: the text is longer than the model's maximum positions, or than
            :data:`kvedit.checks.MAX_TOKENS_PER_CALL` (refused from its length in characters,
            before tokenizing, when that already decides it).
    """
    text = checks.text("text", text)
    checks.context_fits(model, n_chars=len(text), max_positions=max_positions)
    enc = tokenizer(text, return_offsets_mapping=True)
    checks.context_fits(model, n_tokens=len(enc["input_ids"]), max_positions=max_positions)
    offsets = torch.tensor(enc["offset_mapping"], dtype=torch.long).reshape(-1, 2)
    return _capture(model, tokenizer, list(enc["input_ids"]), text, offsets, max_positions)


def capture_tokens(
    model: PreTrainedModel,
    tokenizer,
    token_ids: Sequence[int],
    *,
    max_positions: int | None = None,
) -> KVState:
    """:func:`capture` of a token sequence as given (e.g. ``model.generate``'s ``input_ids``,
    special tokens included). ``state.text`` is the ids decoded with their special tokens, and
    each token's character range comes from :func:`kvedit.spans.token_offsets`.
    ``max_positions``: as for :func:`capture`; more ids than that raise
    :class:`~kvedit.errors.InvalidInputError` before anything is decoded or run."""
    if isinstance(token_ids, torch.Tensor):
        if token_ids.dim() == 2 and token_ids.shape[0] == 1:
            token_ids = token_ids[0]
        if token_ids.dim() != 1:
            raise InvalidInputError(
                f"capture_tokens takes one sequence ([n] or [1, n]), not {tuple(token_ids.shape)}"
            )
        token_ids = token_ids.tolist()
    if hasattr(token_ids, "__len__"):
        checks.context_fits(model, n_tokens=len(token_ids), max_positions=max_positions)
    ids = [checks.count("token id", t) for t in token_ids]
    checks.context_fits(model, n_tokens=len(ids), max_positions=max_positions)
    text, offsets = token_offsets(tokenizer, ids)
    return _capture(model, tokenizer, ids, text, offsets, max_positions)


def _capture(
    model, tokenizer, ids: list[int], text: str, offsets: torch.Tensor, max_positions
) -> KVState:
    windows = layer_windows(model)  # the gate: refuses what kvedit cannot run exactly
    if not ids:
        raise InvalidInputError("capture: the text tokenizes to nothing")
    device = next(model.parameters()).device
    input_ids = torch.tensor([ids], device=device)
    positions = torch.arange(len(ids), device=device)[None]
    cache = DynamicCache()  # every entry; sliding layers are trimmed to their window below
    logits = forward(model, input_ids, positions, cache, logits_to_keep=1)
    n = len(ids)
    index = torch.arange(n)
    layers = [
        LayerKV(cl.keys, cl.values, index.clone(), index.clone(), None, window).trimmed()
        for cl, window in zip(cache.layers, windows, strict=True)
    ]
    return KVState(
        layers=layers,
        token_ids=torch.tensor(ids, dtype=torch.long),
        offsets=offsets,
        text=text,
        position_ids=torch.arange(n),
        next_position=n,
        last_logits=logits[0, -1].float(),
        model_fingerprint=model_fingerprint(model),
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
        history=History.captured(layers[0].keys.dtype),
        last_input=LastInput(n - 1, n - 1),
        max_positions=max_positions,
        model=model,
        tokenizer=tokenizer,
    )


# -------------------------------------------------------------------- state builders


def encode(tokenizer, text: str, special_tokens: bool = True) -> tuple[list[int], torch.Tensor]:
    """``(token ids, offsets [n, 2])`` of ``text`` (special tokens as the tokenizer adds them)."""
    enc = tokenizer(text, add_special_tokens=special_tokens, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    # through numpy: torch.tensor on a list of pairs is ~5x slower (2 ms at 2K tokens)
    offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
    return ids, torch.from_numpy(offsets)


def empty_state(model: PreTrainedModel, tokenizer, *, max_positions: int | None = None) -> KVState:
    """A state of no tokens: every layer holds ``[1, kv_heads, 0, key_dim]`` keys and
    ``[1, kv_heads, 0, value_dim]`` values, shaped as the cache the model really makes (the
    gate's probe: GPT-NeoX without GQA, Falcon's one KV head, MLA's latent keys), not as the
    config's fields say.

    Extending it (:func:`extend_ids`) prefills from scratch through the same path as
    ``KVState.extend``, checked against ``max_positions`` (:attr:`KVState.max_positions`).
    """
    cfg = text_config(model)
    param = next(model.parameters())
    none = torch.empty(0, dtype=torch.long)
    kw = {"dtype": param.dtype, "device": param.device}
    layers = [
        LayerKV(
            keys=torch.empty(1, layer.kv_heads, 0, layer.key_dim, **kw),
            values=torch.empty(1, layer.kv_heads, 0, layer.value_dim, **kw),
            token_index=none,
            positions=none,
            window=layer.window,
        )
        for layer in model_spec(model).layers
    ]
    return KVState(
        layers=layers,
        token_ids=none,
        offsets=torch.empty(0, 2, dtype=torch.long),
        text="",
        position_ids=none,
        next_position=0,
        last_logits=torch.zeros(cfg.vocab_size, device=param.device),
        model_fingerprint=model_fingerprint(model),
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
        history=History.captured(param.dtype),
        max_positions=max_positions,
        model=model,
        tokenizer=tokenizer,
    )


@torch.no_grad()
def extend_ids(state: KVState, ids: Sequence[int], offsets: torch.Tensor, text: str) -> KVState:
    """``state`` followed by the tokens ``ids``: :meth:`KVState.extend` without tokenizing.

    Args:
        state: the state to continue (not modified).
        ids: token ids to run on top of it, at positions ``state.next_position`` onwards.
        offsets: ``[len(ids), 2]`` character range of each new token in ``text``.
        text: the text of the result (the state's text followed by the new tokens' text).
    """
    ids = [int(i) for i in ids]
    if not ids:
        return state.replace(text=text)
    logits, full_kv = state.run(ids, logits_to_keep=1)
    return appended_state(state, ids, full_kv, logits[-1], offsets, text)


def appended_state(
    state: KVState,
    ids: Sequence[int],
    full_kv: CacheEntries,
    last_logits: torch.Tensor,
    offsets: torch.Tensor,
    text: str,
) -> KVState:
    """``state`` followed by the tokens ``ids`` whose entries a forward pass already made:
    ``full_kv`` (:class:`~kvedit.cache.adapter.CacheEntries`, the state's entries then one per
    id, from :meth:`KVState.run` or a :class:`~kvedit.states.decoding.Decoder`),
    ``last_logits`` ``[vocab]`` the prediction after the last id, ``offsets`` ``[len(ids), 2]``
    and ``text`` as for :func:`extend_ids`. Nothing is run."""
    ids = [int(i) for i in ids]
    positions = torch.arange(state.next_position, state.next_position + len(ids))
    return state.replace(
        layers=appended_layers(
            state.layers, full_kv, ids, state.next_position, first_index=len(state)
        ),
        token_ids=torch.cat([state.token_ids, torch.tensor(ids, dtype=torch.long)]),
        offsets=torch.cat([state.offsets, offsets.reshape(-1, 2).to(torch.long)]),
        text=text,
        position_ids=torch.cat([state.position_ids, positions]),
        next_position=state.next_position + len(ids),
        last_logits=last_logits.float(),
        last_input=LastInput(len(state) + len(ids) - 1, state.next_position + len(ids) - 1),
    )


def capture_passage(
    model: PreTrainedModel, tokenizer, text: str, *, max_positions: int | None = None
) -> KVState:
    """``text`` cached on its own, without special tokens, at positions ``0..n-1``.

    This is the passage convention of :func:`~kvedit.blend`: no BOS in front, so the entries
    can be moved after any other part. For tokenizers that add no special tokens (SmolLM2)
    this is exactly :func:`~kvedit.capture` (``max_positions`` as it takes it).
    """
    ids, offsets = encode(tokenizer, text, special_tokens=False)
    if not ids:
        raise ValueError("capture_passage: the text tokenizes to nothing")
    empty = empty_state(model, tokenizer, max_positions=max_positions)
    return extend_ids(empty, ids, offsets, text)


def passage_after(state: KVState, n_prefix: int, text_start: int) -> KVState:
    """The tokens of ``state`` after its first ``n_prefix``, as a passage state.

    ``text_start`` is where the passage's text begins in ``state.text`` (the length of the
    prefix's text when the state is the prefix's state extended by the passage).

    The entries keep the keys and values they were computed with (so they have read the
    prefix) and their rotary positions (``n_prefix`` onwards); token indices, text and
    offsets start at the passage. This is how :func:`~kvedit.blend` reads a passage stored
    behind a shared prefix. The result is an edited state (positions do not start at 0), never
    stored as such.

    Raises:
        ValueError: ``n_prefix`` is not in ``[0, len(state))`` or ``text_start`` not in the text.
    """
    n = len(state)
    if not 0 <= n_prefix < n:
        raise ValueError(f"passage_after: n_prefix must be in [0, {n}), not {n_prefix}")
    if not 0 <= text_start <= len(state.text):
        raise ValueError(f"passage_after: text_start {text_start} is outside the state's text")
    layers = []
    for layer in state.layers:
        kept = layer.select((layer.token_index >= n_prefix).nonzero().flatten())
        layers.append(replace(kept, token_index=kept.token_index - n_prefix))
    last = state.last_input
    return state.replace(
        layers=layers,
        token_ids=state.token_ids[n_prefix:],
        offsets=(state.offsets[n_prefix:] - text_start).clamp_min(0),
        text=state.text[text_start:],
        position_ids=state.position_ids[n_prefix:],
        last_input=LastInput(last.token_index - n_prefix, last.position),
    ).with_step(Step("edit", "passage_after", {"n_prefix": n_prefix}))


def cut_layers(layers: Sequence[LayerKV], n_tokens: int) -> list[LayerKV]:
    """The layers of a plain capture, cut to the cache of its first ``n_tokens`` tokens.

    Keeps the entries of tokens ``< n_tokens``; a sliding-window layer then keeps the last
    ``window`` of them. Raises ValueError when a layer no longer holds a token the cut
    needs (a sliding-window layer of a longer state holds only its last tokens).
    """
    out = []
    for i, layer in enumerate(layers):
        start = 0 if layer.window is None else max(0, n_tokens - layer.window)
        keep = ((layer.token_index >= 0) & (layer.token_index < n_tokens)).nonzero().flatten()
        held = layer.token_index[keep]
        needed = torch.arange(start, n_tokens)
        if not torch.isin(needed, held).all():
            raise ValueError(
                f"layer {i} does not hold tokens {start}..{n_tokens - 1}: this state cannot be "
                f"cut to {n_tokens} tokens"
            )
        out.append(layer.select(keep).trimmed())
    return out
