"""Prefix reuse: continue from the longest stored prefix of a prompt and prefill only the rest.

``reuse(model, tokenizer, text, store)`` tokenizes ``text`` once (with the tokenizer's default
special tokens, as :func:`~kvedit.capture` does), asks the store for the longest stored prefix of
those token ids, and runs only the remaining ids on top of it. The remaining tokens are exactly
the full text's tokens after the prefix: they are never re-tokenized from a substring, so a
token that straddles the prefix boundary cannot change the result. The outcome is the state
``capture(model, tokenizer, text)`` would give, up to floating-point summation order.

The module also holds the small state builders the reuse layer shares: :func:`extend_ids`
(``KVState.extend`` from token ids), :func:`capture_passage` (a text cached on its own, without
special tokens) and :func:`cut_layers` (the cache of a state's first tokens).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import torch
from transformers import PreTrainedModel

from .compat import text_config
from .fingerprint import model_fingerprint, tokenizer_fingerprint
from .runtime import layer_windows
from .state import KVState, LayerKV, appended_layers, capture

if TYPE_CHECKING:
    from .store import KVStore


# -------------------------------------------------------------------- state builders


def encode(tokenizer, text: str, special_tokens: bool = True) -> tuple[list[int], torch.Tensor]:
    """``(token ids, offsets [n, 2])`` of ``text`` (special tokens as the tokenizer adds them)."""
    enc = tokenizer(text, add_special_tokens=special_tokens, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    # through numpy: torch.tensor on a list of pairs is ~5x slower (2 ms at 2K tokens)
    offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
    return ids, torch.from_numpy(offsets)


def empty_state(model: PreTrainedModel, tokenizer) -> KVState:
    """A state of no tokens: every layer holds ``[1, kv_heads, 0, head_dim]`` K/V.

    Extending it (:func:`extend_ids`) prefills from scratch through the same path as
    ``KVState.extend``.
    """
    cfg = text_config(model)
    param = next(model.parameters())
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    none = torch.empty(0, dtype=torch.long)
    layers = [
        LayerKV(
            keys=torch.empty(1, kv_heads, 0, head_dim, dtype=param.dtype, device=param.device),
            values=torch.empty(1, kv_heads, 0, head_dim, dtype=param.dtype, device=param.device),
            token_index=none,
            positions=none,
            window=window,
        )
        for window in layer_windows(model)
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
        last_logits=logits[-1].float(),
    )


def capture_passage(model: PreTrainedModel, tokenizer, text: str) -> KVState:
    """``text`` cached on its own, without special tokens, at positions ``0..n-1``.

    This is the passage convention of :func:`~kvedit.blend`: no BOS in front, so the entries
    can be moved after any other part. For tokenizers that add no special tokens (SmolLM2)
    this is exactly :func:`~kvedit.capture`.
    """
    ids, offsets = encode(tokenizer, text, special_tokens=False)
    if not ids:
        raise ValueError("capture_passage: the text tokenizes to nothing")
    return extend_ids(empty_state(model, tokenizer), ids, offsets, text)


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
    return state.replace(
        layers=layers,
        token_ids=state.token_ids[n_prefix:],
        offsets=(state.offsets[n_prefix:] - text_start).clamp_min(0),
        text=state.text[text_start:],
        position_ids=state.position_ids[n_prefix:],
    )


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


# -------------------------------------------------------------------- reuse


@dataclass
class ReuseReport:
    """What :func:`reuse` did.

    Attributes:
        tokens_reused: prompt tokens whose cache came from the store.
        tokens_computed: prompt tokens run through the model.
        seconds: wall time of the call, storing included.
        source: ``"memory"``, ``"disk"`` or None (nothing reused).
        key: store key of the returned state, when it is stored (None otherwise).
    """

    tokens_reused: int
    tokens_computed: int
    seconds: float
    source: str | None = None
    key: str | None = None

    @property
    def tokens(self) -> int:
        return self.tokens_reused + self.tokens_computed


def reuse(
    model: PreTrainedModel,
    tokenizer,
    text: str,
    store: KVStore,
    save: bool = True,
    ttl: float | None = None,
) -> tuple[KVState, ReuseReport]:
    """The state of ``text``, reusing the longest prefix of it that ``store`` holds.

    Args:
        model, tokenizer: the model to run (and whose fingerprints select stored entries).
        text: the whole prompt, tokenized with the tokenizer's default special tokens.
        store: a :class:`~kvedit.KVStore`.
        save: store the resulting state (when any token was computed), so later prompts can
            reuse it in turn.
        ttl: seconds the stored result lives (see :meth:`KVStore.put`).

    Returns:
        ``(state, report)``; the state is what ``capture(model, tokenizer, text)`` returns.
    """
    t0 = time.perf_counter()
    ids, offsets = encode(tokenizer, text)
    if not ids:
        raise ValueError("reuse: the text tokenizes to nothing")
    match = store.longest_prefix_ids(model, tokenizer, ids, offsets, text)
    n = match.n_tokens
    if match.state is None:
        state = capture(model, tokenizer, text)
    elif n < len(ids):
        state = extend_ids(match.state, ids[n:], offsets[n:], text)
    else:
        state = match.state.replace(text=text)
    key = match.key if n == len(ids) else None
    if save and n < len(ids):
        key = store.put(state, ttl=ttl)
    report = ReuseReport(
        tokens_reused=n,
        tokens_computed=len(ids) - n,
        seconds=time.perf_counter() - t0,
        source=match.source,
        key=key,
    )
    return state, report
